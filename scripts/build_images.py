#!/usr/bin/env python3
"""Build every image the stack needs without a registry; the logic is in llmstack/images.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.images", "build_images")
