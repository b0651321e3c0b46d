#!/usr/bin/env python3
"""How a running vLLM's memory is composed: llmstack/lab/memory_report.py (see --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.lab.memory_report", "memory_report.py")
