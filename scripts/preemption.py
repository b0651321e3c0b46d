#!/usr/bin/env python3
"""A burst beyond the KV cache: queueing, preemption, TTFT: llmstack/lab/preemption.py (see --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.lab.preemption", "preemption.py")
