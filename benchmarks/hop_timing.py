#!/usr/bin/env python3
"""Thin entry point: the benchmark lives in llmstack/bench/hop_timing.py (its --help says what it measures)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.bench.hop_timing", "hop_timing.py")
