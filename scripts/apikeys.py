#!/usr/bin/env python3
"""Create, revoke and list the gateway's API keys: llmstack/apikeys.py (see --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmstack.entry import run_module

run_module("llmstack.apikeys", "apikeys.py")
