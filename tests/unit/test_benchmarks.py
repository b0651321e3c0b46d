"""The GPU-measurement tools: the bare-host launcher's settings read from the compose files, usage
errors, the one percentile in the benchmarks' tables, re-rendering a run, the generated doc tables."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmstack import composefile, docs
from llmstack.bench import gateway_overhead, gateway_vs_direct
from llmstack.cli import UsageError
from llmstack.stats import percentile

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text, environ, expected",
    [
        ("${MODEL:-Qwen/Qwen3-0.6B}", {}, "Qwen/Qwen3-0.6B"),
        ("${MODEL:-Qwen/Qwen3-0.6B}", {"MODEL": "/m"}, "/m"),
        ("${MODEL:-x}", {"MODEL": ""}, "x"),
        ("${MODEL-x}", {"MODEL": ""}, ""),
        ("${VLLM_EXTRA_ARGS:---enforce-eager}", {}, "--enforce-eager"),
        ("http://localhost:${GATEWAY_PORT:-8080}/grafana/", {}, "http://localhost:8080/grafana/"),
        ('--model "$$MODEL"', {"MODEL": "/m"}, '--model "$$MODEL"'),
    ],
)
def test_compose_interpolation(text, environ, expected):
    assert composefile.interpolate(text, environ) == expected


def test_required_variable_is_a_clear_error():
    with pytest.raises(UsageError, match="KEYS must be set: give a file"):
        composefile.interpolate("${KEYS:?give a file}", {})


def test_vllm_settings_come_from_compose_files_in_order():
    files = [Path("compose.yaml"), Path("compose.cpu.yaml")]
    gpu = composefile.service(files[:1], "vllm", {})
    assert gpu["environment"]["GPU_MEMORY_UTILIZATION"] == "0.85" and gpu["environment"]["MAX_MODEL_LEN"] == "4096"
    assert "--enable-prefix-caching" in gpu["command"][0] and '"$$MODEL"' in gpu["command"][0]
    # The CPU override (with compose's !reset tag) changes only defaults; the environment still wins.
    cpu = composefile.service(files, "vllm", {"MAX_MODEL_LEN": "2048"})
    assert cpu["command"] == gpu["command"]
    assert cpu["environment"]["LOAD_FORMAT"] == "dummy" and cpu["environment"]["MAX_MODEL_LEN"] == "2048"
    nginx = composefile.service(files[:1], "nginx", {"RATE_LIMIT_PER_KEY": "9r/s"})
    assert nginx["environment"]["RATE_LIMIT_PER_KEY"] == "9r/s"
    assert nginx["environment"]["MAX_CONCURRENT_REQUESTS_PER_KEY"] == "64"


def test_the_launcher_finds_ports_and_secrets_where_compose_writes_them():
    files = [Path("compose.yaml")]
    urls = {
        name: composefile.health_url(composefile.service(files, name, {})["healthcheck"])
        for name in ("vllm", "nginx", "gateway-exporter")
    }
    assert urls == {
        "vllm": "http://127.0.0.1:8000/health",
        "nginx": "http://127.0.0.1:8080/healthz",
        "gateway-exporter": "http://127.0.0.1:9113/healthz",
    }
    assert {"api_keys", "loadtest_api_key", "hf_token"} <= set(composefile.secret_names(files, {}))


def test_include_env_file_is_read_and_the_environment_wins(tmp_path):
    (tmp_path / "versions.env").write_text("TAG=1.0\nPORT=80\n")
    (tmp_path / "inner.yaml").write_text(
        "services:\n  web:\n    environment:\n      TAG: ${TAG}\n      PORT: ${PORT}\n"
    )
    (tmp_path / "outer.yaml").write_text("include:\n  - path: inner.yaml\n    env_file: [versions.env]\n")
    spec = composefile.service([tmp_path / "outer.yaml"], "web", {"PORT": "81"})
    assert spec["environment"] == {"TAG": "1.0", "PORT": "81"}


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / script), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("scripts/bare_host.py", ["start"], "start needs --model"),
        ("scripts/bare_host.py", ["restart"], "invalid choice"),
        (
            "benchmarks/gateway_vs_direct.py",
            ["--gateway", "g", "--direct", "d", "--levels", "1,x"],
            "comma-separated integers",
        ),
        ("benchmarks/gateway_vs_direct.py", ["--gateway", "g", "--direct", "d", "--max-tokens", "1"], "at least 2"),
        ("benchmarks/gateway_vs_direct.py", ["--gateway", "g", "--direct", "d", "--skip", "warp"], "unknown part"),
        (
            "benchmarks/gateway_vs_direct.py",
            ["--gateway", "g", "--direct", "d", "--api-key-file", "/nonexistent"],
            "no API key file",
        ),
        ("benchmarks/gateway_vs_direct.py", ["--render", "/nonexistent.json"], "--render takes"),
        ("benchmarks/loadtest_fidelity.py", ["--levels", "1,x"], "comma-separated integers"),
        ("benchmarks/loadtest_fidelity.py", ["--max-tokens", "1"], "at least 2"),
        ("benchmarks/loadtest_fidelity.py", ["--bogus"], "unrecognized arguments"),
        ("benchmarks/loadtest_fidelity.py", ["--vllm-url", "http://127.0.0.1:9"], "--vllm-url needs --vllm-log"),
        ("benchmarks/gateway_overhead.py", ["--api-key", "k", "--requests", "0"], "must be positive"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(script, args, message):
    result = run(script, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"{Path(script).name}: error: ")
    assert len(result.stderr.strip().splitlines()) == 1


def test_unreachable_server_is_exit_1(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    result = run(
        "benchmarks/gateway_vs_direct.py",
        "--gateway",
        "http://127.0.0.1:9",
        "--direct",
        "http://127.0.0.1:9",
        "--api-key-file",
        str(key),
        "--results",
        str(tmp_path),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("gateway_vs_direct.py: error: cannot read http://127.0.0.1:9/version")


def test_fidelity_against_an_unreachable_vllm_is_exit_1(tmp_path):
    result = run(
        "benchmarks/loadtest_fidelity.py",
        "--vllm-url",
        "http://127.0.0.1:9",
        "--vllm-log",
        str(tmp_path / "vllm.log"),
        "--levels",
        "1",
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "loadtest_fidelity.py: error: cannot read http://127.0.0.1:9/v1/models: [Errno 111] Connection refused"
    ]


def test_the_benchmarks_take_their_percentiles_from_llmstack_stats():
    """The one percentile: p90 of ten values is interpolated (12.1 here), in both benchmarks."""
    values_s = [0.001 * x for x in (5, 1, 9, 3, 7, 2, 8, 4, 6, 40)]
    records = [{"ok": "True", "ttft_s": str(v), "tpot_s": str(v / 10)} for v in values_s]
    summary = {"concurrency": {"rows": [{"throughput_tok_s": 1.0}], "vllm": {}}}
    figures = gateway_vs_direct.path_figures([summary], records)
    for q in (50, 90, 99):
        assert figures["ttft_ms"][f"p{q}"] == pytest.approx(percentile(values_s, q) * 1000)
    assert figures["ttft_ms"]["p90"] == pytest.approx(12.1)
    values_ms = [v * 1000 for v in values_s]
    overhead = gateway_overhead.summarize(
        {path: {"ttfb": values_ms, "ttft": values_ms} for path in ("gateway", "direct")}
    )
    assert overhead["gateway"]["ttft"]["p90_ms"] == pytest.approx(percentile(values_ms, 90)) == pytest.approx(12.1)
    assert overhead["added_by_gateway_ms"]["ttfb"]["p99_ms"] == 0


def test_render_the_committed_gpu_run(tmp_path):
    """docs/gpu-results/summary.md is what --render makes of the committed summary.json."""
    summary = tmp_path / "summary.json"
    summary.write_text((REPO_ROOT / "docs/gpu-results/summary.json").read_text())
    result = run("benchmarks/gateway_vs_direct.py", "--render", str(summary))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (REPO_ROOT / "docs/gpu-results/summary.md").read_text() + "\n"
    assert (tmp_path / "gateway_vs_direct.png").stat().st_size > 10_000
    data = json.loads(summary.read_text())
    # The sweep doubled the level until throughput stopped growing (at 128 in the committed run).
    levels = [row["concurrency"] for row in data["concurrency"]]
    assert levels == [2**i for i in range(len(levels))] and len(levels) >= 5
    # vLLM's own num_requests_running gauge reached every level up to 64 on both paths.
    for row in data["concurrency"]:
        if row["concurrency"] <= 64:
            assert row["direct"]["max_running_in_vllm"] == row["gateway"]["max_running_in_vllm"] == row["concurrency"]


def test_generated_doc_tables_match_their_result_files():
    assert docs.stale_blocks() == [], "run: python -m llmstack.docs"


def test_a_stale_generated_table_is_found(tmp_path):
    for name in (*docs.DOCUMENTS, docs.GPU_SUMMARY, docs.GPU_FIDELITY):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    results = json.loads((tmp_path / docs.GPU_SUMMARY).read_text())
    results["concurrency"][0]["direct"]["throughput_tok_s"] = 999.0
    (tmp_path / docs.GPU_SUMMARY).write_text(json.dumps(results))
    stale = docs.stale_blocks(tmp_path)
    assert "README.md: h200-short" in stale and "docs/gpu-results.md: h200-summary" in stale
    assert "docs/loadtest.md: h200-fidelity" not in stale
    # The README's table is the generated one: its first row is the summary's first level.
    assert "| 1 | 999 | 369 | 18.2 / 18.6 | 2.42 |" in docs.regenerate((tmp_path / "README.md").read_text(), tmp_path)
