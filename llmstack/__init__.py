"""Shared logic of the llm-stack: one definition per concept.

The thin entry points in scripts/, benchmarks/, loadtest/ and grafana/ call into this package:
statistics (stats), Prometheus text (promtext), the SSE timing client (sse), reaching vLLM and the
stack (vllm), command-line conventions (cli), the stack's secrets (secrets), and the pinned
versions (versions).
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
