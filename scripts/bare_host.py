#!/usr/bin/env python3
"""Thin entry point: the stack on a host without Docker; the launcher lives in llmstack/launch.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.launch", "bare_host.py")
