"""The GPU-measurement tools: settings read from compose.yaml, usage errors, re-rendering a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import bare_stack  # noqa: E402


@pytest.mark.parametrize("text, environ, expected", [
    ("${MODEL:-Qwen/Qwen3-0.6B}", {}, "Qwen/Qwen3-0.6B"),
    ("${MODEL:-Qwen/Qwen3-0.6B}", {"MODEL": "/m"}, "/m"),
    ("${MODEL:-x}", {"MODEL": ""}, "x"),
    ("${MODEL-x}", {"MODEL": ""}, ""),
    ("${VLLM_EXTRA_ARGS:---enforce-eager}", {}, "--enforce-eager"),
    ("http://localhost:${GATEWAY_PORT:-8080}/grafana/", {}, "http://localhost:8080/grafana/"),
])
def test_compose_interpolation(text, environ, expected):
    assert bare_stack.interpolate(text, environ) == expected


def test_required_variable_is_a_clear_error():
    with pytest.raises(bare_stack.BareStackError, match="KEYS must be set: give a file"):
        bare_stack.interpolate("${KEYS:?give a file}", {})


def test_vllm_settings_come_from_compose_files_in_order():
    files = [Path("compose.yaml"), Path("compose.cpu.yaml")]
    gpu_env, command = bare_stack.service_settings(files[:1], "vllm", {})
    assert gpu_env["GPU_MEMORY_UTILIZATION"] == "0.85" and gpu_env["MAX_MODEL_LEN"] == "4096"
    assert "--enable-prefix-caching" in command[0] and '"$$MODEL"' in command[0]
    # The CPU override (with compose's !reset tag) changes only defaults; the environment still wins.
    cpu_env, cpu_command = bare_stack.service_settings(files, "vllm", {"MAX_MODEL_LEN": "2048"})
    assert cpu_command == command
    assert cpu_env["LOAD_FORMAT"] == "dummy" and cpu_env["MAX_MODEL_LEN"] == "2048"
    nginx_env, _ = bare_stack.service_settings(files[:1], "nginx", {"RATE_LIMIT_PER_KEY": "9r/s"})
    assert nginx_env["RATE_LIMIT_PER_KEY"] == "9r/s" and nginx_env["MAX_CONCURRENT_REQUESTS_PER_KEY"] == "64"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / script), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script, args, message", [
    ("bare_stack.py", ["start"], "start needs --model"),
    ("bare_stack.py", ["restart"], "invalid choice"),
    ("gateway_vs_direct.py", ["--gateway", "g", "--direct", "d", "--levels", "1,x"], "comma-separated integers"),
    ("gateway_vs_direct.py", ["--gateway", "g", "--direct", "d", "--max-tokens", "1"], "at least 2"),
    ("gateway_vs_direct.py", ["--gateway", "g", "--direct", "d", "--skip", "warp"], "unknown part"),
    ("gateway_vs_direct.py", ["--gateway", "g", "--direct", "d", "--api-key-file", "/nonexistent"], "no API key file"),
    ("gateway_vs_direct.py", ["--render", "/nonexistent.json"], "--render takes"),
    ("loadtest_fidelity.py", ["--levels", "1,x"], "comma-separated integers"),
    ("loadtest_fidelity.py", ["--max-tokens", "1"], "at least 2"),
    ("loadtest_fidelity.py", ["--bogus"], "unrecognized arguments"),
])
def test_usage_errors_are_one_line_and_exit_2(script, args, message):
    result = run(script, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unreachable_server_is_exit_1(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    result = run("gateway_vs_direct.py", "--gateway", "http://127.0.0.1:9", "--direct", "http://127.0.0.1:9",
                 "--api-key-file", str(key), "--results", str(tmp_path))
    assert result.returncode == 1 and "does not answer" in result.stderr and "Traceback" not in result.stderr


def test_fidelity_against_an_unreachable_vllm_is_exit_1():
    result = run("loadtest_fidelity.py", "--direct", "http://127.0.0.1:9", "--levels", "1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["loadtest_fidelity: cannot read http://127.0.0.1:9/v1/models: "
                                                  "<urlopen error [Errno 111] Connection refused>"]


def test_render_the_committed_gpu_run(tmp_path):
    """docs/gpu-results/summary.md is what --render makes of the committed summary.json."""
    summary = tmp_path / "summary.json"
    summary.write_text((REPO_ROOT / "docs/gpu-results/summary.json").read_text())
    result = run("gateway_vs_direct.py", "--render", str(summary))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (REPO_ROOT / "docs/gpu-results/summary.md").read_text() + "\n"
    assert (tmp_path / "gateway_vs_direct.png").stat().st_size > 10_000
    data = json.loads(summary.read_text())
    # The sweep doubled the level until throughput stopped growing (at 128 in the committed run).
    levels = [row["concurrency"] for row in data["concurrency"]]
    assert levels == [2 ** i for i in range(len(levels))] and len(levels) >= 5
    # vLLM's own num_requests_running gauge reached every level up to 64 on both paths.
    for row in data["concurrency"]:
        if row["concurrency"] <= 64:
            assert row["direct"]["max_running_in_vllm"] == row["gateway"]["max_running_in_vllm"] == row["concurrency"]
