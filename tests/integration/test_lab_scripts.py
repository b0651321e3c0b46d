"""The lab scripts (memory report, KV planner cross-check, latency, preemption) run as a user runs
them, against the real CPU stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from stack import Stack

from llmstack.vllm import cache_config_labels

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Small enough that a burst of long requests cannot all fit: 24 blocks of 128 tokens on the CPU build,
# with max_model_len 2048 so that one full-length request still fits (vLLM refuses to start otherwise).
SMALL_CACHE_SETTINGS = {
    "MAX_MODEL_LEN": "2048",
    "VLLM_EXTRA_ARGS": "--num-gpu-blocks-override 24",
    "MAX_CONCURRENT_REQUESTS_PER_KEY": "64",
    # One replica: preemption.py reads the preemptions of the `vllm` service, and the burst must
    # all reach that one cache.
    "VLLM_CPU_REPLICAS": "1",
    # A preempted or queued stream can get no byte for longer than the test stacks' 8 s.
    "UPSTREAM_STREAM_IDLE_TIMEOUT": "120s",
}


def run_script(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
    )


def stack_options(stack: Stack) -> list[str]:
    options = ["--project-name", stack.project, "--env-file", str(stack.env_file)]
    for name in stack.compose.compose_file_name:
        options += ["--compose-file", name]
    return options


def cache_config(stack: Stack) -> dict[str, str]:
    return cache_config_labels(stack.vllm.metrics())


def test_memory_report(stack, tmp_path):
    chart = tmp_path / "memory.png"
    result = run_script(
        "memory_report.py", *stack_options(stack), "--json", "--output", str(tmp_path / "m.json"), "--chart", str(chart)
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    labels = cache_config(stack)
    env = dict(line.split("=", 1) for line in stack.exec("vllm", "env").splitlines() if "=" in line)
    assert report["device"] == "CPU"
    assert report["served_model"] == env["SERVED_MODEL_NAME"]
    assert report["kv_cache"]["gib"] == pytest.approx(float(env["VLLM_CPU_KVCACHE_SPACE"]))
    assert report["kv_cache"]["tokens"] == float(labels["kv_cache_size_tokens"])
    assert report["kv_cache"]["num_blocks"] * report["kv_cache"]["block_size"] == float(labels["kv_cache_size_tokens"])
    assert report["max_concurrency"] == pytest.approx(float(labels["kv_cache_max_concurrency"]))
    assert report["weights"]["parameters_source"] == "transformers on the meta device"
    assert report["weights"]["theoretical_gib"] > 0
    assert chart.read_bytes()[:8] == PNG_MAGIC
    human = run_script("memory_report.py", *stack_options(stack), "--no-chart", "--output", str(tmp_path / "h.json"))
    assert human.returncode == 0 and "KV cache pool" in human.stdout and "Model weights (theoretical)" in human.stdout


def test_kv_planner_predicts_what_vllm_reports(stack, tmp_path):
    result = run_script(
        "kv_planner.py", "--check-stack", *stack_options(stack), "--json", "--output", str(tmp_path / "check.json")
    )
    assert result.returncode == 0, result.stderr
    check = json.loads(result.stdout)["cross_check"]
    assert check["reported_tokens"] == int(float(cache_config(stack)["kv_cache_size_tokens"]))
    # Full attention only, KV space given in whole GiB: the prediction is exact.
    assert check["predicted_tokens"] == check["reported_tokens"]
    assert check["difference_tokens"] == 0

    # The same from the served model's config.json copied out, as a user plans before deploying.
    config = tmp_path / "config.json"
    config.write_text(stack.exec("vllm", "cat", "/opt/models/tiny-qwen3/config.json"))
    space = stack.exec("vllm", "printenv", "VLLM_CPU_KVCACHE_SPACE").strip()
    planned = run_script(
        "kv_planner.py", str(config), "--kv-space-gib", space, "--json", "--output", str(tmp_path / "plan.json")
    )
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["rows"][0]["tokens"] == check["reported_tokens"]


def test_latency(stack, tmp_path):
    chart = tmp_path / "latency.png"
    result = run_script(
        "latency.py",
        "--base-url",
        stack.base_url,
        "--api-key",
        stack.keys["alice"],
        "--runs",
        "3",
        "--warmup",
        "1",
        "--max-tokens",
        "20",
        "--sweep",
        "1,8",
        "--json",
        "--output",
        str(tmp_path / "l.json"),
        "--chart",
        str(chart),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    short, long = report["results"]
    assert (short["label"], long["label"]) == ("Short", "Long")
    assert long["input_tokens"] > short["input_tokens"] > 0
    for row in report["results"] + report["sweep"]:
        assert row["runs"] == 3 and row["output_tokens"] == 20  # ignore_eos: exactly max_tokens
        assert 0 < row["ttft_ms"]["min"] <= row["ttft_ms"]["p50"] <= row["ttft_ms"]["max"]
        assert row["total_ms"]["p50"] >= row["ttft_ms"]["p50"]
    assert [s["input_tokens"] for s in report["sweep"]] == sorted(s["input_tokens"] for s in report["sweep"])
    assert chart.read_bytes()[:8] == PNG_MAGIC
    assert "[DONE]" not in result.stderr and "Short: run 3/3" in result.stderr  # progress on stderr


def test_lab_scripts_fail_cleanly(stack, tmp_path):
    wrong_key = run_script("latency.py", "--base-url", stack.base_url, "--api-key", "sk-wrong", "--runs", "1")
    assert wrong_key.returncode == 1
    assert "401" in wrong_key.stderr and len(wrong_key.stderr.strip().splitlines()) == 1
    no_stack = run_script(
        "memory_report.py", "--project-name", f"{stack.project}-absent", "--env-file", str(stack.env_file), "--no-chart"
    )
    assert no_stack.returncode == 1 and len(no_stack.stderr.strip().splitlines()) <= 4
    assert "Traceback" not in no_stack.stderr
    bad_args = run_script("latency.py", "--runs", "0")
    assert bad_args.returncode == 2 and "Traceback" not in bad_args.stderr


@pytest.fixture(scope="module")
def small_cache_stack(tmp_path_factory):
    """The CPU stack with a deliberately small KV cache; vLLM and the gateway only."""
    stack = Stack(
        tmp_path_factory.mktemp("small-cache-stack"),
        extra_settings=SMALL_CACHE_SETTINGS,
        services=["vllm", "nginx"],
        name="llmstack-preempt",
    )
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_preemption_when_concurrency_exceeds_the_kv_cache(small_cache_stack, tmp_path):
    stack = small_cache_stack
    labels = cache_config(stack)
    assert labels["num_gpu_blocks_override"] == "24"
    before = stack.vllm_metric("vllm:num_preemptions_total")
    result = run_script(
        "preemption.py",
        "--base-url",
        stack.base_url,
        "--api-key",
        stack.keys["alice"],
        *stack_options(stack),
        "--concurrency",
        "12",
        "--prompt-repeats",
        "4",
        "--max-tokens",
        "400",
        "--baseline-runs",
        "2",
        "--json",
        "--output",
        str(tmp_path / "p.json"),
        "--chart",
        str(tmp_path / "p.png"),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["demand_tokens"] > report["kv_capacity_tokens"]
    assert report["completed"] == 12 and report["failed"] == 0
    assert all(r["output_tokens"] == 400 for r in report["burst"])
    assert report["preemptions"] > 0
    assert stack.vllm_metric("vllm:num_preemptions_total") - before == report["preemptions"]
    # Requests waited for KV blocks: vLLM's own queue-time histogram says so (the sampled gauge,
    # max_waiting, can miss a queue on two busy cores).
    assert report["mean_queue_seconds"] > 0.1
    assert report["burst_ttft_ms"]["p50"] > report["baseline_ttft_ms"]["p50"]
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
