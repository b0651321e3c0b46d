#!/usr/bin/env python3
"""KV cache capacity planner (scripts/kv_planner.py --help); the code is llmstack.kv.cli."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.kv.cli", "kv_planner.py")
