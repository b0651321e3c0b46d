#!/usr/bin/env python3
"""Render the dashboards' panels from real Prometheus data (llmstack.observability.render_panels)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.observability.render_panels", "render_panels.py")
