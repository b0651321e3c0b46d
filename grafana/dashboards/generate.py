#!/usr/bin/env python3
"""Write the Prometheus rules and Grafana dashboards from the config (llmstack.observability.generate)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from llmstack.entry import run_module

run_module("llmstack.observability.generate", "generate.py")
