"""The GPU-measurement tools: the bare-host launcher's settings read from the compose files, usage
errors, the one percentile in the benchmarks' tables, re-rendering a run, the generated doc tables."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmstack import composefile, docs
from llmstack.bench import gateway_overhead, gateway_vs_direct, noisy_neighbour
from llmstack.cli import UsageError
from llmstack.stats import percentile
from llmstack.vllm import HostVllm, StackError

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
        ("benchmarks/loadtest_fidelity.py", ["--levels", "8,16,8"], "8 more than once"),
        ("benchmarks/loadtest_fidelity.py", ["--max-tokens", "1"], "at least 2"),
        ("benchmarks/loadtest_fidelity.py", ["--bogus"], "unrecognized arguments"),
        ("benchmarks/loadtest_fidelity.py", ["--vllm-url", "http://127.0.0.1:9"], "--vllm-url needs --vllm-log"),
        ("benchmarks/gateway_overhead.py", ["--levels", "1,x"], "comma-separated integers"),
        ("benchmarks/gateway_overhead.py", ["--repeats", "0"], "--repeats must be at least 1"),
        ("benchmarks/gateway_overhead.py", ["--api-key-file", "/nonexistent"], "--api-key-file /nonexistent"),
        ("benchmarks/noisy_neighbour.py", ["--key-a-file", "/nonexistent", "--key-b-file", "/x"], "no such file"),
        ("benchmarks/noisy_neighbour.py", ["--key-b-file", "/x"], "--key-a-file"),
        ("benchmarks/noisy_neighbour.py", ["--render", "/nonexistent.json"], "--render /nonexistent.json: "),
        ("benchmarks/cpu_placement.py", ["--config", "VLLM_CPU_REPLICAS"], "NAME=VALUE"),
        ("benchmarks/cpu_placement.py", ["--config", "A=1,b=2"], "NAME=VALUE"),
        ("benchmarks/cpu_placement.py", ["--rounds", "0"], "--rounds must be at least 1"),
        ("benchmarks/cpu_placement.py", ["--requests", "0"], "--requests must be at least 1"),  # packet_timing's
        ("benchmarks/hop_timing.py", ["--vllm-url", "http://127.0.0.1:9"], "needs the compose stack"),
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
    # vllm bench serve's per-request TTFTs (seconds); a failed request (error text, TTFT 0) is left out.
    run = gateway_overhead.run_figures({"ttfts": [*values_s, 0.0], "errors": [""] * 10 + ["boom"]})
    assert run["ttft_ms"]["p99"] == pytest.approx(percentile(values_s, 99) * 1000)
    assert run["ttft_ms"]["p50"] == pytest.approx(5.5) and len(run["ttfts_ms"]) == 10


# --- the gateway-overhead benchmark (vllm bench serve) --------------------------------------------------


def test_overhead_runs_alternate_abba_and_the_first_path_alternates_by_level():
    assert gateway_overhead.run_order(2, 0) == [(0, "gateway"), (0, "direct"), (1, "direct"), (1, "gateway")]
    assert gateway_overhead.run_order(1, 1) == [(0, "direct"), (0, "gateway")]


def test_overhead_shim_keeps_the_key_out_of_the_command_line():
    runs = [{"name": "overhead-c1-r1-gateway", "options": ["--base-url", "http://nginx:8080"], "file": "/tmp/x.json"}]
    code = gateway_overhead.shim("sk-secret", runs, 0.5)
    compile(code, "shim", "exec")
    assert "or_vllm_cpu" in code  # the vllm-cpu patch of loadtest_fidelity's shim
    assert "os.environ[\"OPENAI_API_KEY\"] = 'sk-secret'" in code
    assert "sk-secret" not in repr(runs[0]["options"]) and gateway_overhead.MARKER in code


def test_overhead_tags_each_run_by_user_agent_and_uses_fresh_prompts():
    args = gateway_overhead.parse_args(["--min-prompts", "10", "--prompts-per-client", "2"])
    args.model, args.tokenizer = "m", "/t"
    options = gateway_overhead.bench_options(args, "http://nginx:8080", 8, 42, "run-7", "/tmp/run-7.json")
    assert options[options.index("--header") + 1] == "User-Agent=run-7"
    assert options[options.index("--seed") + 1] == "42" and options[options.index("--num-prompts") + 1] == "16"
    assert options[options.index("--max-concurrency") + 1] == "8" and "--save-detailed" in options
    assert gateway_overhead.prompts_for(1, args) == 10


def log_line(request_time: str, upstream: str, header: str, uri: str = "/v1/completions", status: int = 200) -> dict:
    return {
        "uri": uri,
        "status": status,
        "request_time": request_time,
        "upstream_response_time": upstream,
        "upstream_header_time": header,
    }


def test_nginx_own_time_is_request_time_minus_upstream_time():
    lines = [
        log_line("0.105", "0.104", "0.010"),
        log_line("0.050", "0.050", "0.009"),
        log_line("0.200", "0.100, 0.097", "0.005, 0.004"),  # two upstreams tried: their sum
        log_line("0.001", "", "", uri="/v1/models"),  # not a completion
        log_line("0.000", "", "", status=429),  # refused: no upstream time
    ]
    times = gateway_overhead.nginx_times(lines)
    assert times["own_ms"]["n"] == 3
    assert times["own_ms"]["max"] == pytest.approx(3.0) and times["own_ms"]["p50"] == pytest.approx(1.0)
    assert times["upstream_header_ms"]["p50"] == pytest.approx(9.0)
    assert times["statuses"] == {"200": 4, "429": 1}


def overhead_run(p50: float, p99: float, tok_s: float) -> dict:
    return {"ttft_ms": {"p50": p50, "p99": p99}, "output_tok_s": tok_s, "failed": 0, "ttfts_ms": [p50, p99]}


def test_overhead_level_pairs_each_gateway_run_with_its_direct_run():
    runs = {
        "gateway": [overhead_run(10.5, 20, 990), overhead_run(11.0, 21, 1000), overhead_run(10.0, 30, 1010)],
        "direct": [overhead_run(10.0, 19, 1000), overhead_run(10.0, 20, 1000), overhead_run(10.5, 26, 1000)],
    }
    row = gateway_overhead.level_summary(8, runs, [log_line("0.011", "0.010", "0.002")])
    added = row["added_ttft_p50_ms"]
    assert added["per_repeat"] == pytest.approx([0.5, 1.0, -0.5]) and added["mean"] == pytest.approx(1 / 3)
    assert added["min"] == pytest.approx(-0.5) and added["max"] == pytest.approx(1.0)
    # The medians differ by 0.5 ms, less than the 1 ms range of the gateway's repeats: no difference.
    assert added["median_difference"] == pytest.approx(0.5) and added["larger_than_spread"] is False
    assert row["tok_s_ratio"]["per_repeat"] == pytest.approx([0.99, 1.0, 1.01])
    assert row["tok_s_ratio"]["overall"] == pytest.approx(1.0)
    assert row["nginx"]["own_ms"]["p50"] == pytest.approx(1.0)
    targets = {t["target"]: t for t in gateway_overhead.target_rows([row])}
    assert targets["added TTFT p50 <= 1 ms"]["verdict"] == "met"
    assert targets["added TTFT p99 <= 3 ms"]["verdict"] == "met"  # (1 + 1 + 4) / 3 = 2 ms
    assert targets["gateway tok/s >= 0.99 x direct"]["value"] == pytest.approx(1.0)
    summary = {
        "environment": {"date": "d", "bench_where": "here"},
        "settings": {"model": "m", "input_len": 1, "output_len": 2, "repeats": 3},
        "levels": [row],
        "targets": gateway_overhead.target_rows([row]),
    }
    assert "| 8 |" in gateway_overhead.render(summary)


# --- the noisy-neighbour benchmark ----------------------------------------------------------------------


def test_noisy_neighbour_phases_alternate_idle_and_attack():
    plan = noisy_neighbour.phase_plan(3, idle_s=10, attack_s=20, ramp_s=5, settle_s=4)
    assert [(p.kind, p.repeat) for p in plan] == [
        ("idle", 1),
        ("attack", 1),
        ("settle", 1),
        ("idle", 2),
        ("attack", 2),
        ("settle", 2),
        ("idle", 3),
        ("attack", 3),
    ]
    assert plan[1].start == 10 and plan[1].count_from == 15 and plan[3].start == 34
    assert noisy_neighbour.phase_index(plan, 12) == 1 and noisy_neighbour.phase_index(plan, plan[-1].end) is None
    assert all(a.end == b.start for a, b in itertools.pairwise(plan))


def test_noisy_neighbour_caps_come_from_the_compose_files_and_the_environment():
    nginx = composefile.service([Path("compose.yaml")], "nginx", {})["environment"]
    caps = noisy_neighbour.gateway_caps({"MAX_N_PER_REQUEST": "3"})
    assert caps["n"] == 3 and caps["clients"] == int(nginx["MAX_CONCURRENT_REQUESTS_PER_KEY"])
    assert caps["max_tokens"] == int(nginx["MAX_TOKENS_PER_REQUEST"])


def test_each_over_cap_probe_is_over_its_own_cap_only():
    caps = {"n": 8, "max_tokens": 4096, "prompts": 16, "prompt_bytes": 1000}
    bodies = noisy_neighbour.over_cap_bodies("m", caps)
    assert bodies["n"][1]["n"] == 9 and bodies["max_tokens"][1]["max_tokens"] == 4097
    assert len(bodies["prompts"][1]["prompt"]) == 17 and bodies["prompts"][0] == "/v1/completions"
    assert len(json.dumps(bodies["prompt_bytes"][1]["messages"])) > 1000
    for cap, (_, body) in bodies.items():
        assert body.get("n", 1) <= 8 or cap == "n"
        assert body["max_tokens"] <= 4096 or cap == "max_tokens"
    assert set(noisy_neighbour.over_cap_bodies("m", caps | {"prompt_bytes": 0})) == {"n", "max_tokens", "prompts"}


def test_a_refusal_is_read_from_the_raw_answer():
    status, retry = noisy_neighbour.parse_head(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nX: y")
    assert (status, retry) == (429, 1.0)
    body = b'{"error":{"message":"n is 9","type":"invalid_request_error","code":"n_cap"}}'
    assert noisy_neighbour.error_code(body) == "n_cap"
    assert noisy_neighbour.error_code(b'{"object":"error","type":"BadRequestError","code":400}') == "BadRequestError"
    refused = noisy_neighbour.RawResult(status=429, code="sequences_in_flight")
    assert noisy_neighbour.outcome(refused) == "429 sequences_in_flight"
    assert noisy_neighbour.outcome(noisy_neighbour.RawResult(error="ConnectionRefusedError")) == "connection error"
    assert noisy_neighbour.outcome(noisy_neighbour.RawResult(cut=True)) == "cut before the answer began"


def test_noisy_neighbour_summary_counts_only_the_measured_part_of_each_phase():
    plan = noisy_neighbour.phase_plan(2, idle_s=10, attack_s=10, ramp_s=2, settle_s=2)
    b = []
    for index, phase in enumerate(plan):
        for t in range(int(phase.start), int(phase.end)):
            slow = phase.kind == "attack"
            b.append({"phase": index, "t": t + 0.5, "ttft_ms": 30.0 if slow else 10.0, "error": None})
    b.append({"phase": 1, "t": 10.5, "ttft_ms": 900.0, "error": None})  # in the ramp: not counted
    b.append({"phase": 2, "t": 20.5, "ttft_ms": 900.0, "error": "HTTP 429"})  # settling: not counted
    a = [
        {
            "phase": 1,
            "kind": "/v1/completions",
            "outcome": "accepted",
            "status": 200,
            "code": "",
            "events": 5,
            "cut": True,
        },
        {
            "phase": 1,
            "kind": "/v1/completions",
            "outcome": "429 sequences_in_flight",
            "status": 429,
            "code": "sequences_in_flight",
            "events": 0,
            "cut": False,
        },
        {
            "phase": 4,
            "kind": "over_cap:n",
            "outcome": "400 n_cap",
            "status": 400,
            "code": "n_cap",
            "events": 0,
            "cut": False,
        },
        {"phase": 4, "kind": "over_cap:n", "outcome": "accepted", "status": 200, "code": "", "events": 0, "cut": False},
    ]
    summary = noisy_neighbour.summarize(plan, b, a, [])
    first = summary["repeats"][0]
    assert first["idle_p50_ms"] == 10 and first["attack_p50_ms"] == 30 and first["ratio_p50"] == pytest.approx(3)
    assert first["attack_requests"] == 8 and first["idle_errors"] == first["attack_errors"] == 0
    assert first["a_accepted"] == 1 and first["a_refused"] == 1
    overall = summary["overall"]
    assert overall["ratio_p50"]["mean"] == pytest.approx(3) and overall["p50_difference_ms"]["larger_than_spread"]
    assert overall["a"]["over_cap"]["n"] == {"sent": 2, "refused_400": 1, "accepted": 1}
    verdicts = {t["target"]: t["verdict"] for t in overall["targets"]}
    assert verdicts == {
        "B's TTFT p50 under attack <= 2x idle": "MISSED",
        "no errors for B": "met",
        "A's over-cap requests never reach vLLM": "MISSED",
    }
    summary |= {
        "environment": {"model": "m", "gateway": "g", "date": "d"},
        "attack": {"clients": 2, "n": 8, "prompts": 16, "prompt_tokens": 100, "max_tokens": 10},
        "settings": {"b_rate": 2, "b_max_tokens": 24},
    }
    text = noisy_neighbour.render(summary)
    assert (
        "| 1 | 10.0 / 30.0 | 3.00x |" in text and "| over the n cap: 400 n_cap / sent (accepted) | 1 / 2 (1) |" in text
    )


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
    for name in {*docs.DOCUMENTS, *(generator.source for generator in docs.GENERATORS.values())}:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if (REPO_ROOT / name).is_dir():  # a folder of result files, read as a list
            shutil.copytree(REPO_ROOT / name, tmp_path / name)
        else:
            shutil.copy(REPO_ROOT / name, tmp_path / name)
    results = json.loads((tmp_path / docs.GPU_SUMMARY).read_text())
    results["concurrency"][0]["direct"]["throughput_tok_s"] = 999.0
    (tmp_path / docs.GPU_SUMMARY).write_text(json.dumps(results))
    stale = docs.stale_blocks(tmp_path)
    assert "README.md: h200-short" in stale and "docs/gpu-results.md: h200-summary" in stale
    assert "docs/gpu-results.md: h200-fidelity" not in stale
    # A folder source: one sweep changed makes its block stale, and only that one.
    sweep = tmp_path / "docs/loadtest/goodput-h100-sweeps/sweep-1.json"
    summary = json.loads(sweep.read_text())
    summary["goodput"]["goodput_rps"] = 144.0
    sweep.write_text(json.dumps(summary))
    assert "docs/loadtest.md: goodput-h100-sweeps" in docs.stale_blocks(tmp_path)
    assert "docs/loadtest.md: goodput-h100" not in docs.stale_blocks(tmp_path)
    # The README's table is the generated one: its first row is the summary's first level.
    assert "| 1 | 999 (348–361) | 369 (345–392) | 18.2 / 18.6 | 2.42 |" in docs.regenerate(
        (tmp_path / "README.md").read_text(), tmp_path
    )


@pytest.mark.parametrize(
    "text",
    [
        # A dot in the name once left a block empty and --check passing.
        "x\n<!-- generated: table-0.5 from docs/a.json by `python -m llmstack.docs`; do not edit -->\n"
        "<!-- end generated: table-0.5 -->\n",
        "x\n<!-- end generated: h200-short -->\n",  # an end whose start was deleted
        "x\n<!--Generated: h200-short from docs/gpu-results/summary.json -->\n",  # another spelling
    ],
)
def test_a_malformed_generated_marker_is_an_error_not_skipped(text):
    with pytest.raises(StackError, match="line 2: a generated block's marker is malformed"):
        docs.regenerate(text)


def test_host_environment_names_the_machine():
    from llmstack.bench import host_environment

    env = host_environment()
    assert {"date", "client_python", "client_cpus", "kernel"} <= env.keys()
    assert env["kernel"] and env["date"].endswith("+00:00")
    assert "\n" not in env.get("gpu", "")  # one line, also with several GPUs


def test_soak_checks_judge_every_container_but_prometheus():
    from llmstack.bench import soak

    samples = [{"t": i, "mib": {"vllm": 100.0, "nginx": 20.0, "prometheus": 30.0 + i}} for i in range(20)]
    run = {
        "client": {"200": 5, "429": 2},
        "gateway": {"200": 5, "429": 2},
        "vllm_finished": 5,
        "memory_samples": samples,
    }
    judged = soak.evaluate(run, 0.10)
    assert judged["passed"] and judged["memory_growth"]["prometheus"]["growth"] > 0.10
    leaking = [{"t": i, "mib": {"vllm": 100.0 + 5 * i, "nginx": 20.0}} for i in range(20)]
    assert not soak.evaluate(run | {"memory_samples": leaking}, 0.10)["checks"]["no_memory_growth"]
    lost = soak.evaluate(run | {"vllm_finished": 4}, 0.10)
    assert not lost["checks"]["gateway_200_equals_vllm_finished"]
    broken = soak.evaluate(run | {"client": {"200": 5, "bad 502": 1}}, 0.10)
    assert not broken["checks"]["only_200_or_retryable"]
    assert soak.to_mib("1.5GiB") == 1536 and soak.to_mib("512KiB") == 0.5


def test_fidelity_repeats_summarize_with_spread_and_targets():
    from llmstack.bench import loadtest_fidelity

    runs = [
        {
            "concurrency": 8,
            "harness_throughput_tok_s": harness_tps,
            "bench_throughput_tok_s": bench_tps,
            "harness_ttft_p50_ms": 31.0 + i,
            "bench_ttft_p50_ms": 30.0 + i,
            "harness_tpot_ms": 2.5,
            "bench_tpot_ms": 2.0,
            "harness_ttft_ms": 33.0,
            "bench_ttft_ms": 32.0,
            "vllm_hist_ttft_ms": 25.0,
            "loader_processes": 1,
        }
        for i, (harness_tps, bench_tps) in enumerate([(1000, 1010), (1020, 990), (980, 1000)])
    ]
    level = loadtest_fidelity.summarize_level(8, runs)
    tps = level["compared"]["output tok/s"]
    assert tps["harness_vs_bench_pct"] == pytest.approx(0.0) and not tps["beyond_spread"] and tps["met"]
    ttft = level["compared"]["TTFT p50 ms"]
    # +1 ms on 31 ms is +3.2 %, inside the repeats' 2 ms range: within the target, and "none".
    assert ttft["harness_vs_bench_pct"] == pytest.approx(100 / 31) and not ttft["beyond_spread"] and ttft["met"]
    tpot = level["compared"]["TPOT mean ms"]
    assert tpot["harness_vs_bench_pct"] == pytest.approx(25.0) and tpot["beyond_spread"] and not tpot["met"]
    table = loadtest_fidelity.repeats_table({"levels": [level]})
    assert "1,000 (980–1,020)" in table and "+25.0% missed" in table and "+0.0% ~ met" in table


def test_fidelity_pairs_each_repeat_so_a_drift_does_not_hide_a_difference():
    from llmstack.bench import loadtest_fidelity
    from llmstack.stats import paired_difference

    # The server sped up over the run (both sides alike); within each repeat the harness is 5 % lower.
    runs = [
        {
            "concurrency": 64,
            "harness_throughput_tok_s": 0.95 * bench_tps,
            "bench_throughput_tok_s": bench_tps,
            "vllm_hist_tpot_ms": hist_tpot,
            "bench_vllm_tpot_ms": 3.0,
        }
        for bench_tps, hist_tpot in ((10_000, 2.9), (12_000, 3.1), (14_000, 3.0))
    ]
    level = loadtest_fidelity.summarize_level(64, runs)
    assert not level["compared"]["output tok/s"]["beyond_spread"]  # each side's range is 4,000 tok/s
    paired = level["paired"]["output tok/s"]
    assert paired["harness_vs_bench_pct"]["p50"] == pytest.approx(-5.0) and paired["beyond_spread"]
    assert not paired["met"]  # 3 % target
    server = level["paired"]["vLLM hist TPOT mean ms"]
    assert server["harness_vs_bench_pct"]["min"] < 0 < server["harness_vs_bench_pct"]["max"]
    assert not server["beyond_spread"] and server["met"] is None
    table = loadtest_fidelity.paired_table({"levels": [level], "runs": runs})
    assert "-5.0% (-5.0 to -5.0) missed" in table and "+0.0% (-3.3 to +3.3) ~" in table
    # A summary stored without paired figures gets them from its runs.
    assert loadtest_fidelity.paired_table({"levels": [{"concurrency": 64, "repeats": 3}], "runs": runs}) == table
    assert paired_difference([]) == (paired_difference([])[0], False) and paired_difference([(0.0, 1.0)])[0].n == 0


def test_fidelity_gives_vllm_bench_serve_the_harness_prompt_and_sampling(tmp_path):
    from llmstack import sse
    from llmstack.bench import loadtest_fidelity

    args = loadtest_fidelity.parse_args(["--levels", "4"])
    options = loadtest_fidelity.bench_options("http://vllm:8000", args, 4, "m", "m")
    body = sse.build_body(sse.COMPLETIONS, "m", "p", None, 8, stream=True)
    # Without --temperature, vllm bench serve leaves sampling to the model's default (random).
    assert options[options.index("--temperature") + 1] == str(body["temperature"]) == "0"
    assert options[options.index("--max-concurrency") + 1] == "4" and "--ignore-eos" in options and body["ignore_eos"]
    # The harness's prompt, as it is: a custom dataset that the shim writes where vLLM's Python runs.
    assert options[options.index("--dataset-name") + 1] == "custom" and "--skip-chat-template" in options
    dataset = tmp_path / "prompt.jsonl"
    prompt = 'Say "ARGUMENTS"\nthen stop'
    shim = loadtest_fidelity.BENCH_SHIM.replace("ARGUMENTS", repr((["vllm", "bench", "serve"], str(dataset), prompt)))
    argv = sys.argv
    try:
        run_part = shim.removeprefix(loadtest_fidelity.VLLM_CPU_PATCH)
        exec(run_part[: run_part.index("from vllm")], {"sys": sys})  # not the version patch
        assert sys.argv == ["vllm", "bench", "serve"]
    finally:
        sys.argv = argv
    assert [json.loads(line) for line in dataset.read_text().splitlines()] == [{"prompt": prompt}]


def test_fidelity_server_view_counts_requests_in_flight_by_littles_law():
    from llmstack.bench import loadtest_fidelity

    # 1,000 tok/s of 50-token requests = 20 requests/s; each lasts 100 + 49 * 2 = 198 ms: 3.96 in flight.
    run = {"concurrency": 4, "harness_throughput_tok_s": 1000.0, "harness_ttft_ms": 100.0, "harness_tpot_ms": 2.0}
    assert loadtest_fidelity.mean_in_flight(run, "harness", 50) == pytest.approx(3.96)
    assert loadtest_fidelity.mean_in_flight(run, "bench", 50) is None
    runs = [
        run | {"bench_throughput_tok_s": 1000.0 + 10 * i, "bench_ttft_ms": 100.0, "bench_tpot_ms": 2.0}
        for i in range(3)
    ]
    table = loadtest_fidelity.server_view_table({"settings": {"levels": [4], "max_tokens": 50}, "runs": runs})
    assert table.endswith("| 4 | 4.0 (4.0–4.0) | 4.0 (4.0–4.0) |")
    # A figure no run has is no column: vLLM's histograms here, and the TCP counters of runs on the
    # compose stack (or in older files); runs with them get them.
    assert "vLLM hist" not in table and "SYN" not in table
    counted = [run | {"harness_syn_retrans": 0, "bench_syn_retrans": 2 * i} for i, run in enumerate(runs)]
    table = loadtest_fidelity.server_view_table({"settings": {"levels": [4], "max_tokens": 50}, "runs": counted})
    assert "SYN retransmissions, bench run" in table and "| 0 (0–0) | 2 (0–4) |" in table
    assert "listen queue" not in table
    quartered = [run | {"harness_in_flight_by_quarter": [4.0, 4.0, 4.0, 2.0]} for run in runs]
    table = loadtest_fidelity.server_view_table({"settings": {"levels": [4], "max_tokens": 50}, "runs": quartered})
    assert "harness in flight, last quarter" in table and "bench in flight, first quarter" not in table
    waves = [run | {"bench_ttft_first_wave_and_later_ms": [900.0, 300.0]} for run in runs]
    table = loadtest_fidelity.server_view_table({"settings": {"levels": [4], "max_tokens": 50}, "runs": waves})
    assert "bench TTFT mean ms, each client's first request" in table and "| 900 (900–900) | 300 (300–300) |" in table


def test_fidelity_ttft_deciles_are_medians_over_the_repeats():
    from llmstack.bench import loadtest_fidelity

    runs = [
        {"concurrency": 512, "harness_ttft_deciles_ms": [float(10 * q + i) for q in range(1, 10)]} for i in range(3)
    ]
    data = {"settings": {"levels": [512]}, "runs": runs}
    table = loadtest_fidelity.ttft_deciles_table(data)
    assert "| 512 | harness | 11 | 21 | 31 | 41 | 51 | 61 | 71 | 81 | 91 |" in table
    assert "vllm bench serve" not in table  # older files have no deciles: no row


def test_fidelity_reads_bench_serves_requests_from_its_detailed_result():
    from llmstack.bench import loadtest_fidelity

    # Two requests at once for 1 s, then a failed one (no TTFT) that does not count.
    detailed = {
        "start_times": [10.0, 10.0, 10.5],
        "ttfts": [0.25, 0.5, 0.0],
        "itls": [[0.25, 0.5], [0.5], []],
        "errors": ["", "", "timeout"],
    }
    assert loadtest_fidelity.bench_intervals(loadtest_fidelity.bench_requests(detailed)) == [(10.0, 11.0), (10.0, 11.0)]
    assert loadtest_fidelity.bench_intervals(loadtest_fidelity.bench_requests({})) == []


def test_fidelity_reads_the_kernels_tcp_counters_and_merges_results(tmp_path):
    from llmstack.bench import loadtest_fidelity

    netstat = (
        "TcpExt: SyncookiesSent ListenOverflows TCPSynRetrans\nTcpExt: 0 3 7\n"
        "IpExt: InNoRoutes ListenOverflows\nIpExt: 1 99\n"
    )
    assert loadtest_fidelity.parse_tcp_counters(netstat) == {"syn_retrans": 7, "listen_overflows": 3}
    # A line out of step (here a stray one first) costs nothing: each names line pairs with the next.
    snmp = (
        "stray\nIp: Forwarding InReceives\nIp: 1 500\n"
        "Tcp: RtoAlgorithm MaxConn ActiveOpens PassiveOpens InSegs OutSegs\nTcp: 1 -1 40 41 900 880\n"
    )
    assert loadtest_fidelity.parse_tcp_counters(netstat, snmp) == {
        "syn_retrans": 7,
        "listen_overflows": 3,
        "connections_accepted": 41,
        "tcp_segments": 880,
    }
    assert loadtest_fidelity.parse_tcp_counters("", "garbage: a b\n") == {}
    # Read where vLLM is (HostVllm: this host); an unreadable /proc/net leaves the counters out.
    here = HostVllm("http://127.0.0.1:8000", tmp_path / "vllm.log")
    assert set(loadtest_fidelity.tcp_counters(here)) == set(loadtest_fidelity.TCP_COUNTERS)  # this Linux host's

    class Unreadable:
        def read_file(self, path):
            raise StackError(f"cannot read {path}")

    assert loadtest_fidelity.tcp_counters(Unreadable()) == {}  # type: ignore[arg-type]
    assert loadtest_fidelity.tcp_delta({"syn_retrans": 3, "gone": 1}, {"syn_retrans": 5}) == {"syn_retrans": 2}

    def result(levels: list[int], **settings: int) -> dict:
        return {
            "environment": {"levels": levels},
            "settings": {"levels": levels, "max_tokens": 50, "requests_per_client": 4, "repeats": 3} | settings,
            "runs": [{"concurrency": level} for level in levels],
            "levels": [{"concurrency": level} for level in levels],
        }

    merged = loadtest_fidelity.merge_results([result([256, 512]), result([1, 8])])
    assert merged["settings"]["levels"] == [1, 8, 256, 512]
    assert [run["concurrency"] for run in merged["runs"]] == [1, 8, 256, 512]
    assert merged["environment"] == {"levels": [256, 512]} and len(merged["levels"]) == 4
    for parts, message in (
        ([result([1]), result([8], max_tokens=80)], "max_tokens"),
        ([result([1]), result([8], requests_per_client=12)], "requests_per_client"),
        ([result([1, 8]), result([8])], "more than one result"),
        ([], "no results"),
    ):
        with pytest.raises(ValueError, match=message):
            loadtest_fidelity.merge_results(parts)


def test_fidelity_splits_the_servers_ttft_into_its_phases():
    from llmstack.bench import loadtest_fidelity
    from llmstack.promtext import Snapshot

    def page(requests: int, ttft: float, queue: float, prefill: float, steps: int, cpu: float, tokens: int) -> str:
        lines = []
        for name, total, count in (
            ("vllm:time_to_first_token_seconds", ttft, requests),
            ("vllm:request_queue_time_seconds", queue, requests),
            ("vllm:request_prefill_time_seconds", prefill, requests),
            ("vllm:iteration_tokens_total", tokens + 14 * requests, steps),
        ):
            lines += [f"# TYPE {name} histogram", f'{name}_bucket{{le="+Inf"}} {count}']
            lines += [f"{name}_sum {total}", f"{name}_count {count}"]
        lines += ["# TYPE vllm:generation_tokens_total counter", f"vllm:generation_tokens_total {tokens}"]
        lines += ["# TYPE process_cpu_seconds_total counter", f"process_cpu_seconds_total {cpu}"]
        return "\n".join(lines) + "\n"

    before = Snapshot.from_text(page(10, 1.0, 0.2, 0.3, 100, 50.0, 500))
    after = Snapshot.from_text(page(20, 2.0, 0.5, 0.5, 150, 52.0, 1000))
    phases = loadtest_fidelity.server_phases(before, after)
    assert phases["queue_ms"] == pytest.approx(30.0) and phases["prefill_ms"] == pytest.approx(20.0)
    assert phases["api_server_ms"] == pytest.approx(50.0)  # 100 ms of TTFT less queue and prefill
    assert phases["tokens_per_step"] == pytest.approx((500 + 140) / 50)
    assert phases["api_server_cpu_ms_per_token"] == pytest.approx(2000 / 500)
    # No requests between the snapshots, no process collector: no figures, no error.
    idle = loadtest_fidelity.server_phases(before, Snapshot.from_text(page(10, 1.0, 0.2, 0.3, 100, 50.0, 500)))
    assert idle == {
        "ttft_ms": None,
        "queue_ms": None,
        "prefill_ms": None,
        "api_server_ms": None,
        "tokens_per_step": None,
        "api_server_cpu_ms_per_token": None,
    }
    run = {
        "concurrency": 8,
        **{
            f"{side}_server_{key}": 1.0
            for side in ("harness", "bench")
            for _, key, _ in loadtest_fidelity.SERVER_PHASES
        },
    }
    run["harness_server_ttft_ms"] = 9.0
    del run["bench_server_queue_ms"]
    table = loadtest_fidelity.server_phases_table({"settings": {"levels": [8]}, "runs": [run]})
    assert "| 8 | harness | 9.0 | 1.0 |" in table and "| 8 | bench | 1.0 | - |" in table


def test_fidelity_compares_settings_by_what_each_clients_runs_cost_the_server():
    from llmstack.bench import loadtest_fidelity

    def run(repeat: int, harness_tok_s: float) -> dict:
        return {
            "concurrency": 512,
            "repeat": repeat,
            "harness_throughput_tok_s": harness_tok_s,
            "bench_throughput_tok_s": 1000.0,
            "harness_requests": 100,
            "bench_completed": 100,
            "harness_connections_accepted": 126,
            "bench_connections_accepted": 100,
            "harness_server_api_server_cpu_ms_per_token": 0.9,
            "bench_server_api_server_cpu_ms_per_token": 0.5,
        }

    data = {"settings": {"levels": [512]}, "runs": [run(0, 900.0), run(1, 950.0), run(2, 920.0)]}
    table = loadtest_fidelity.settings_paired_table([("interval 0.05", data)])
    row = table.splitlines()[2]
    assert row.startswith("| interval 0.05 | 512 | 3 | -8.0% (-10.0 to -5.0) missed |")
    assert row.endswith("| 0.900 (0.900–0.900) | 0.500 (0.500–0.500) | 1.26 (1.26–1.26) | 1.00 (1.00–1.00) |")
    assert loadtest_fidelity.per_request({"bench_connections_accepted": 3}, "bench", "connections_accepted") is None
    failed_two = {"harness_requests": 10, "harness_failures": 2, "harness_connections_accepted": 4}
    assert loadtest_fidelity.per_request(failed_two, "harness", "connections_accepted") == 0.5
    for interval in ("0", "-1", "nan", "inf"):
        with pytest.raises(UsageError, match="positive number of seconds"):
            loadtest_fidelity.parse_args(["--running-sample-interval", interval])


def test_fidelity_keeps_each_finished_repeat_when_a_command_is_stopped(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from llmstack.bench import loadtest_fidelity

    def harness(target, args, level):
        if level == 64:
            raise KeyboardInterrupt  # as a time limit's signal, in the second level's first repeat
        check = {
            "client_ttft_mean_ms": 30.0,
            "client_tpot_mean_ms": 2.0,
            "vllm_ttft_mean_ms": 25.0,
            "vllm_tpot_mean_ms": 1.9,
        }
        return {"row": {"throughput_tok_s": 900.0}, "check": check, "loader_processes": 1, "prompt": "p"}

    monkeypatch.setattr(loadtest_fidelity, "harness_level", harness)
    monkeypatch.setattr(loadtest_fidelity, "bench_serve", lambda *_: {"throughput_tok_s": 1000.0, "ttft_ms": 29.0})
    monkeypatch.setattr(loadtest_fidelity, "snapshot", lambda _stack: loadtest_fidelity.Snapshot())
    monkeypatch.setattr(loadtest_fidelity, "metrics_read_cost", lambda _target: {"reads": 50})
    output = tmp_path / "result.json"
    args = loadtest_fidelity.parse_args(["--levels", "8,64", "--output", str(output)])
    with pytest.raises(KeyboardInterrupt):
        loadtest_fidelity.measure_repeats(
            SimpleNamespace(on_loopback=False, in_compose=False, stack=None), args, "m", "m"
        )
    kept = json.loads(output.read_text())
    assert kept["complete"] is False and kept["settings"]["levels"] == [8] and len(kept["runs"]) == 3
    assert kept["settings"]["levels_asked"] == [8, 64] and not list(tmp_path.glob(".*.partial"))
    assert loadtest_fidelity.merge_results([kept])["complete"] is False
    assert [level["concurrency"] for level in kept["levels"]] == [8] and kept["levels"][0]["repeats"] == 3
    # A stopped command's file reads as any other: its finished level merges and renders.
    assert "| 8 | 1 |" in loadtest_fidelity.repeats_table(loadtest_fidelity.merge_results([kept]))


def test_fidelity_against_the_server_takes_each_clients_excess_over_its_own_histogram():
    from llmstack.bench import loadtest_fidelity

    # The server slowed by 30 % in the harness's half of one repeat: the harness against bench says
    # +30 %, each client against vLLM's record of its own requests says what the client adds.
    runs = [
        {
            "concurrency": 8,
            "harness_ttft_ms": 26.0 * slow,
            "vllm_hist_ttft_ms": 20.0 * slow,
            "bench_ttft_ms": 26.5,
            "bench_vllm_ttft_ms": 20.0,
            "harness_tpot_ms": 2.04 * slow,
            "vllm_hist_tpot_ms": 2.0 * slow,
            "bench_tpot_ms": 2.02,
            "bench_vllm_tpot_ms": 2.0,
        }
        for slow in (1.0, 1.3, 1.0)
    ]
    assert loadtest_fidelity.over_server(
        runs[1], "harness", "TPOT mean ms", "vLLM hist TPOT mean ms", True
    ) == pytest.approx(2.0)
    assert loadtest_fidelity.over_server(
        runs[1], "bench", "TTFT mean ms", "vLLM hist TTFT mean ms", False
    ) == pytest.approx(6.5)
    assert (
        loadtest_fidelity.over_server(
            {"harness_tpot_ms": 2.0}, "harness", "TPOT mean ms", "vLLM hist TPOT mean ms", True
        )
        is None
    )
    table = loadtest_fidelity.against_server_table({"settings": {"levels": [8]}, "runs": runs})
    # TTFT: the harness adds 6.0 ms (7.8 in the slow repeat), bench 6.5: both ways, so "~".
    assert "| 8 | 3 | +6.00 (+6.00 to +7.80) | +6.50 (+6.50 to +6.50) | -0.50 (-0.50 to +1.30) ~ |" in table
    # TPOT: +2.0 % against +1.0 % in every repeat: a difference of one point, the same way each time.
    assert table.endswith("| +2.0 (+2.0 to +2.0) | +1.0 (+1.0 to +1.0) | +1.0 (+1.0 to +1.0) |")
    assert loadtest_fidelity.signed_range({"p50": None}, True, 1) == "-"
    by_repeat = loadtest_fidelity.runs_by_command_table(
        [("a.json", {"runs": [run | {"repeat": i, "order": ["harness", "bench"]} for i, run in enumerate(runs)]})], 8
    )
    # The slow repeat: the client's TPOT against bench's moved with vLLM's histogram over its requests.
    assert "| a.json | 2 | harness | - | +31.3% | +30.0% | +27.5% | +30.0% |" in by_repeat


def test_fidelity_settings_table_gives_the_harness_ttft_against_vllms_as_a_ratio_with_the_target():
    from llmstack.bench import loadtest_fidelity

    def runs(ttft: float) -> dict:
        run = {"concurrency": 1, "harness_ttft_ms": ttft, "vllm_hist_ttft_ms": 10.0, "bench_ttft_ms": 12.0}
        run |= {"bench_vllm_ttft_ms": 10.0, "harness_tpot_ms": 2.0, "vllm_hist_tpot_ms": 2.5}
        return {"settings": {"levels": [1]}, "runs": [run, run | {"harness_ttft_ms": ttft + 2.0}]}

    table = loadtest_fidelity.settings_table([("fast", runs(11.0)), ("slow", runs(80.0))])
    fast = (
        "| fast | 1 | 2 | 12.00 (11.00–13.00) | 10.00 (10.00–10.00) | 1.20x (1.10x–1.30x) | met | 1.20x (1.20x–1.20x) |"
    )
    assert fast in table
    assert "| slow | 1 | 2 | 81.00 (80.00–82.00) | 10.00 (10.00–10.00) | 8.10x (8.00x–8.20x) | missed |" in table
    assert table.endswith("| -20.0 (-20.0 to -20.0) |") and "target <= 1.25x" in table


def test_fidelity_results_of_one_level_pool_their_repeats_and_the_connections_table_keeps_run_order():
    from llmstack.bench import loadtest_fidelity

    def result(level: int, ttfts: list[float], first_wave: list[float]) -> dict:
        runs = [
            {
                "concurrency": level,
                "harness_ttft_ms": ttft,
                "bench_ttft_ms": 100.0,
                "harness_ttft_first_wave_and_later_ms": [first, ttft],
                "bench_ttft_first_wave_and_later_ms": [100.0, 100.0],
            }
            for ttft, first in zip(ttfts, first_wave, strict=True)
        ]
        summary = loadtest_fidelity.summarize_level(level, runs)
        settings = {"levels": [level], "max_tokens": 50, "requests_per_client": 4, "repeats": len(runs)}
        return {"environment": {}, "settings": settings, "runs": runs, "levels": [summary]}

    low, first, again = (
        result(8, [20.0] * 3, [25.0] * 3),
        result(512, [1, 2, 3], [9] * 3),
        result(512, [4, 5, 6], [1] * 3),
    )
    merged = loadtest_fidelity.merge_results([first, low, again], pool_levels=True)
    assert merged["settings"]["levels"] == [8, 512]
    assert [entry["concurrency"] for entry in merged["levels"]] == [8, 512]
    pooled = merged["levels"][1]
    assert pooled["repeats"] == 6 and pooled["harness_ttft_ms"]["min"] == 1 and pooled["harness_ttft_ms"]["max"] == 6
    assert merged["levels"][0] == low["levels"][0]  # a level of one result keeps its summary
    assert merged["settings"]["repeats"] == 3
    # Pooled, the commands may differ in repeats; each level counts its own.
    longer = result(8, [30.0] * 6, [35.0] * 6)
    pooled_8 = loadtest_fidelity.merge_results([low, longer], pool_levels=True)
    assert pooled_8["settings"]["repeats"] is None and pooled_8["levels"][0]["repeats"] == 9
    with pytest.raises(ValueError, match="repeats"):
        loadtest_fidelity.merge_results([low, result(512, [1.0] * 6, [1.0] * 6)])

    by_command = loadtest_fidelity.paired_by_command_table([("a.json", first), ("b.json", low), ("c.json", again)], 512)
    rows = [line.split(" | ") for line in by_command.splitlines()[2:]]
    assert [(row[0].lstrip("| "), row[1]) for row in rows] == [("a.json", "3"), ("c.json", "3")]  # b has no 512

    table = loadtest_fidelity.connections_table([("1-old.json", first), ("2-new.json", again)], "old")
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [row[1] for row in rows] == ["with its first request", "at the user's start"]
    assert [row[2] for row in rows] == ["9 (9–9)", "1 (1–1)"]  # each client's first request, harness


def test_cpu_placement_sets_the_env_files_settings_and_puts_them_back(tmp_path):
    from llmstack.bench import cpu_placement

    env = tmp_path / ".env"
    original = "COMPOSE_FILE=x\nVLLM_CPU_REPLICAS=\nMODEL=m\n"
    env.write_text(original)
    before = cpu_placement.set_settings(env, {"VLLM_CPU_REPLICAS": "", "VLLM_CPU_RESERVED_CORES": ""})
    assert before == {"VLLM_CPU_REPLICAS": "VLLM_CPU_REPLICAS=", "VLLM_CPU_RESERVED_CORES": None}
    cpu_placement.set_settings(env, {"VLLM_CPU_REPLICAS": "1", "VLLM_CPU_RESERVED_CORES": "1"})
    assert env.read_text() == "COMPOSE_FILE=x\nVLLM_CPU_REPLICAS=1\nMODEL=m\nVLLM_CPU_RESERVED_CORES=1\n"
    cpu_placement.restore(env, before)
    assert env.read_text() == original


def test_cpu_placement_table_gives_each_configs_median_ratio_against_the_target():
    from llmstack.bench import cpu_placement

    def run(config: str, round_number: int, vllm: float, client: float) -> dict:
        means = {"vllm": vllm, "wire": client - 1, "client": client}
        summary = {"ttft_means_ms": means}
        return {"config": config, "round": round_number, "summary": summary, "client_ttft_p50_ms": 9.0}

    data = {"runs": [run("R=2", 1, 10, 30), run("R=1", 1, 10, 12), run("R=2", 2, 10, 50), run("R=1", 2, 10, 11)]}
    text = cpu_placement.table(data)
    assert "| R=1 | 2 | 1.15x (1.10-1.20) | met |" in text
    assert "| R=2 | 2 | 4.00x (3.00-5.00) | MISSED |" in text
    assert text.index("| R=2 | 2 |") < text.index("| R=1 | 2 |")  # the configs in the order run
