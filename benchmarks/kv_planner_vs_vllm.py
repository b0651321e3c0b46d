#!/usr/bin/env python3
"""The KV planner's figures against vLLM's own (--help); the code is llmstack.kv.vllm_compare."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.kv.vllm_compare", "kv_planner_vs_vllm.py")
