"""The soak benchmark's short version (benchmarks/soak.py; the 30-minute run is in docs/soak/):
offered load at twice the stack's capacity through the gateway, over HTTPS, for 3 minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_three_minutes_at_twice_capacity_lose_nothing(stack, tmp_path):
    key_file = tmp_path / "soak_key"
    key_file.write_text(stack.keys["soak"] + "\n")
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "soak.py"),
        "--gateway",
        f"https://localhost:{stack.https_port}",
        "--ca-file",
        str(stack.workdir / "secrets" / "tls_certificate"),
        "--key-file",
        str(key_file),
        "--minutes",
        "3",
        "--probe-seconds",
        "10",
        "--memory-interval",
        "5",
        "--project-name",
        stack.project,
        *(arg for name in stack.compose_files for arg in ("-f", name)),
        "--env-file",
        str(stack.env_file),
        "--output",
        str(tmp_path / "soak.json"),
        "--json",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    print(json.dumps(summary, indent=2))
    assert summary["client"].get("200", 0) > 0
    assert summary["checks"] == {name: True for name in summary["checks"]}, summary
    assert result.returncode == 0
