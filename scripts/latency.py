#!/usr/bin/env python3
"""Single-request latency (TTFT, TPOT) through the API: llmstack/lab/latency.py (see --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.lab.latency", "latency.py")
