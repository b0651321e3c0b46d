"""Grafana dashboards and provisioning: the committed JSON is what generate.py makes, every
dashboard is well formed, and provisioning points at the right datasource uid and paths.
(No Grafana can run here; tests/integration/test_observability.py runs every panel query.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmstack.observability import config, dashboards, promql_checks, rules
from llmstack.observability.panel_queries import BELOW_FIRST_BUCKET, panel_queries

REPO_ROOT = Path(__file__).resolve().parents[2]
GRAFANA_DIR = REPO_ROOT / "grafana"
DASHBOARD_FILES = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
DATASOURCE_FILE = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDER_FILE = GRAFANA_DIR / "provisioning" / "dashboards" / "llm-stack.yaml"
# V0 names that vLLM's V1 engine no longer exports.
REMOVED_VLLM_METRICS = (
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:gpu_prefix_cache",
    "vllm:num_requests_swapped",
)


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def compose(name: str) -> dict:
    """A compose file's services, those of the files it includes too (compose/*.yaml)."""
    document = yaml.safe_load((REPO_ROOT / name).read_text())
    services = dict(document.get("services") or {})
    for included in document.get("include", []):
        services.update(compose(included["path"])["services"])
    return {"services": services}


def datasource_uid() -> str:
    return yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"][0]["uid"]


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_committed_json_is_what_the_generator_makes():
    result = subprocess.run(
        [sys.executable, str(GRAFANA_DIR / "dashboards" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_generator_help_and_bad_usage(tmp_path):
    script = str(GRAFANA_DIR / "dashboards" / "generate.py")
    assert subprocess.run([sys.executable, script, "--help"], capture_output=True).returncode == 0
    bad = subprocess.run([sys.executable, script, "--root", "/nonexistent"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("generate.py: error: --root") and "Traceback" not in bad.stderr
    (tmp_path / "prometheus").mkdir()
    (tmp_path / "grafana").mkdir()
    stale = subprocess.run([sys.executable, script, "--root", str(tmp_path), "--check"], capture_output=True, text=True)
    assert stale.returncode == 1 and "stale generated files: prometheus/rules/alerts.yml" in stale.stderr


def test_four_dashboards_with_fixed_unique_uids():
    uids = [load(path)["uid"] for path in DASHBOARD_FILES]
    assert len(DASHBOARD_FILES) == 4
    assert len(set(uids)) == len(uids)
    for path in DASHBOARD_FILES:
        assert load(path)["uid"] == path.stem, "the uid is the file name, so links stay stable"


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_dashboard_structure(path):
    dashboard = load(path)
    uid = datasource_uid()
    assert dashboard["title"] and dashboard["schemaVersion"] >= 36 and dashboard["editable"] is False
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for item in dashboard["panels"]:
        grid = item["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, item["title"]
    for item in panels(dashboard):
        assert item["title"] and item["description"], f"panel {item['id']} needs a title and a description"
        assert item["datasource"] == {"type": "prometheus", "uid": uid}, item["title"]
        assert item["targets"], item["title"]
        ref_ids = [t["refId"] for t in item["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), item["title"]
        for query in item["targets"]:
            assert query["datasource"]["uid"] == uid, item["title"]
            assert query["expr"].strip(), item["title"]
            assert query["expr"].count("(") == query["expr"].count(")"), query["expr"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_variables_are_scoped_through_a_vllm_metric(path):
    variables = {v["name"]: v for v in load(path)["templating"]["list"]}
    for name in ("model_name", "instance"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["definition"].startswith("label_values(vllm:"), variable["definition"]
        assert variable["datasource"]["uid"] == datasource_uid()
        assert variable["multi"] and variable["includeAll"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_vllm_queries_use_current_names_and_both_variables(path):
    for item in panels(load(path)):
        for query in item["targets"]:
            expr = query["expr"]
            for removed in REMOVED_VLLM_METRICS:
                assert removed not in expr, f"{item['title']}: removed metric {removed}"
            # vllm:time_per_output_token_seconds is gone; vllm:request_time_per_output_token_seconds replaced it.
            assert not re.search(r"(?<!request_)vllm:time_per_output_token_seconds", expr), item["title"]
            # Counters are read with rate()/increase() and end in _total.
            for counter in re.findall(r"(?:rate|increase)\((vllm:\w+)", expr):
                assert counter.endswith(("_total", "_bucket", "_sum", "_count")), f"{item['title']}: {counter}"
            # The router's series have no model_name; those per worker are filtered by replica.
            for name in set(re.findall(r"vllm_router_\w+", expr)) & router_per_worker_metrics():
                assert dashboards.ROUTER_REPLICA in expr, f"{item['title']}: {name} without the replica menu"
            vllm_expr = re.sub(r"vllm_router_\w+", "", expr)
            if "vllm:" in vllm_expr or "vllm_" in vllm_expr:
                assert "$instance" in expr, f"{item['title']}: vLLM query without $instance: {expr}"
                if "cache_config_info" not in expr:  # that info metric has no model_name label
                    assert "$model_name" in expr, f"{item['title']}: vLLM query without $model_name: {expr}"


def router_per_worker_metrics() -> set[str]:
    """The router's metrics that carry a worker label, from a page the real router served."""
    from test_prometheus_rules import recorded_router_samples

    return {s.name for s in recorded_router_samples() if "worker" in s.labels}


def recorded_names() -> set[str]:
    names = set()
    for path in (REPO_ROOT / "prometheus" / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names |= {rule["record"] for rule in group["rules"] if "record" in rule}
    return names


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_metric_a_panel_reads_is_exported_or_recorded(path):
    """A typo in a metric name (or a metric no exporter writes) would be a panel that is always
    empty; the names come from each exporter's code or its list in config.py."""
    known = config.source_metric_names() | recorded_names()
    dashboard = load(path)
    constants = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "constant"}
    for item in panels(dashboard):
        for query in item["targets"]:
            expr = promql_checks.fill_variables(query["expr"], constants)
            unknown = promql_checks.unknown_metrics(expr, known)
            assert not unknown, f"{item['title']}: unknown metric {sorted(unknown)} in {query['expr']}"


def test_the_metric_name_check_finds_a_typo():
    known = config.source_metric_names()
    assert promql_checks.unknown_metrics("sum(rate(gateway_prompt_tokens_total[1m]))", known) == set()
    assert promql_checks.unknown_metrics("sum(rate(gateway_prompt_token_total[1m]))", known) == {
        "gateway_prompt_token_total"
    }
    menu = promql_checks.fill_variables("sum(DCGM_FI_DEV_FB_USED) * $gpu_memory_utilization")
    assert promql_checks.unknown_metrics(menu, known) == set()


def test_gateway_dashboard_shows_tokens_top_keys_and_refusals_by_key():
    by_title = {p["title"]: p for p in panels(load(GRAFANA_DIR / "dashboards" / "llm-throughput-gateway.json"))}
    tokens = by_title["Tokens/s by key"]
    exprs = [t["expr"] for t in tokens["targets"]]
    assert [promql_checks.metric_names(promql_checks.fill_variables(e)) for e in exprs] == [
        {"gateway_prompt_tokens_total"},
        {"gateway_completion_tokens_total"},
    ]
    assert all(e.startswith("sum by (key_owner) (rate(") and "$__rate_interval" in e for e in exprs), exprs
    assert [t["legendFormat"] for t in tokens["targets"]] == ["{{key_owner}} prompt", "{{key_owner}} completion"]
    top = by_title["Top keys by tokens over the dashboard range"]
    (query,) = top["targets"]
    assert top["type"] in ("bargauge", "table") and query["instant"] is True and query["range"] is False
    assert query["expr"].startswith(f"topk({config.TOP_KEYS}, ") and query["expr"].count("[$__range]") == 2
    assert promql_checks.metric_names(promql_checks.fill_variables(query["expr"])) == {
        "gateway_prompt_tokens_total",
        "gateway_completion_tokens_total",
    }
    refusals = by_title["Refusals by reason"]
    (query,) = refusals["targets"]
    assert query["expr"] == "sum by (reason) (rate(gateway_refusals_total[$__rate_interval]))"
    assert query["legendFormat"] == "{{reason}}"


def test_kv_cache_usage_is_never_summed():
    dashboard = load(GRAFANA_DIR / "dashboards" / "llm-kv-cache.json")
    for item in panels(dashboard):
        for query in item["targets"]:
            assert not re.search(r"sum[^(]*\(\s*vllm:kv_cache_usage_perc", query["expr"]), query["expr"]


def test_latency_dashboard_shows_the_exact_mean_first_and_marked_quantiles():
    dashboard = load(GRAFANA_DIR / "dashboards" / "llm-latency.json")
    by_title = {p["title"]: p for p in panels(dashboard)}
    for histogram in config.QUANTILE_HISTOGRAMS:
        targets = by_title[histogram.title]["targets"]
        assert targets[0]["legendFormat"] == "mean", histogram.title
        assert "_sum" in targets[0]["expr"] and "_count" in targets[0]["expr"] and "/" in targets[0]["expr"]
        quantiles = [t["legendFormat"].split()[0] for t in targets if t["legendFormat"].startswith("p")]
        assert quantiles == ["p50", "p90", "p95", "p99"], histogram.title
    assert sum(p["type"] == "heatmap" for p in panels(dashboard)) == 2


def histogram_of(expr: str) -> str:
    """The histogram a histogram_quantile() reads, through a recording rule where it uses one."""
    recorded = {}
    for path in (REPO_ROOT / "prometheus" / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            recorded |= {rule["record"]: rule["expr"] for rule in group["rules"] if "record" in rule}
    names = promql_checks.metric_names(expr)
    sources = set()
    for name in names:
        sources |= promql_checks.metric_names(recorded[name]) if name in recorded else {name}
    (bucket,) = {name for name in sources if name.endswith("_bucket")}
    return bucket.removesuffix("_bucket")


def quantile_panels() -> list[tuple[dict, dict]]:
    found = []
    for path in DASHBOARD_FILES:
        for item in panels(load(path)):
            found += [(item, t) for t in item["targets"] if "histogram_quantile" in t["expr"]]
    return found


def test_every_quantile_line_is_hidden_below_its_first_bucket_and_says_so():
    """Checked against the buckets of each source (vLLM's, in config.py with its source file; the
    load generator's and the gateway exporter's, read from their code)."""
    buckets = config.histogram_buckets()
    assert len(quantile_panels()) >= 20
    for item, query in quantile_panels():
        first = buckets[histogram_of(promql_checks.fill_variables(query["expr"]))][0]
        match = BELOW_FIRST_BUCKET.match(query["expr"])
        assert match and float(match.group(2)) == first, f"{item['title']}: {query['expr']}"
        assert dashboards.duration_text(first) in query["legendFormat"], f"{item['title']}: {query['legendFormat']}"


def test_panels_of_histograms_too_coarse_for_a_gpu_lead_with_the_mean_and_point_to_the_client():
    coarse = [h for h in config.QUANTILE_HISTOGRAMS if not h.resolves_gpu_speed]
    assert {h.name for h in coarse} == {
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    }
    by_title = {p["title"]: p for p in panels(load(GRAFANA_DIR / "dashboards" / "llm-latency.json"))}
    for histogram in coarse:
        item = by_title[histogram.title]
        assert item["targets"][0]["legendFormat"] == "mean"
        assert "loadtest_" in item["description"] and dashboards.CLIENT_PANEL in item["description"]
    client = by_title[dashboards.CLIENT_PANEL]
    assert all(t["expr"].count("loadtest_") >= 1 for t in client["targets"])
    assert config.loadtest_buckets()[0] < min(h.gpu_seconds for h in coarse), "the client's buckets resolve GPU speed"


def test_the_resolution_check_fails_on_an_unmarked_quantile():
    unmarked = "histogram_quantile(0.5, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[5m])))"
    assert BELOW_FIRST_BUCKET.match(unmarked) is None
    assert histogram_of(unmarked) == "vllm:inter_token_latency_seconds"


def test_replicas_dashboard_shows_each_replica_and_the_routers_decisions():
    by_title = {p["title"]: p for p in panels(load(GRAFANA_DIR / "dashboards" / "llm-replicas-router.json"))}
    per_replica = {
        "KV cache usage per replica": {"vllm:kv_cache_usage_perc"},
        "Prefix cache hit rate per replica": {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"},
        "Requests running per replica": {"vllm:num_requests_running"},
        "Requests waiting per replica": {"vllm:num_requests_waiting"},
        "Finished requests per second per replica": {rules.FINISHED_RATE},
    }
    for title, names in per_replica.items():
        (query,) = by_title[title]["targets"]
        assert query["expr"].startswith(("max by (instance) (", "sum by (instance) (")), query["expr"]
        assert promql_checks.metric_names(promql_checks.fill_variables(query["expr"])) == names
        assert query["legendFormat"] == "{{instance}}"
    share = by_title["Share of the requests running and waiting"]
    assert [t["expr"] for t in share["targets"]] == [
        rules.replica_load_share(config.DASHBOARD_VLLM),
        rules.imbalance_share(config.DASHBOARD_VLLM),
    ]
    assert config.LOAD_IMBALANCE_FOR in share["description"] and "VLLMLoadImbalance" in share["description"]
    router = {
        "Requests routed per second, by replica and policy": {"vllm_router_policy_decisions_total"},
        "Replica health and circuit breaker (router's view)": {"vllm_router_worker_health", "vllm_router_cb_state"},
        "Prefix-routing decisions per second (cache_aware)": {"vllm_router_prefix_routing_decisions_total"},
        "Router retries and errors per second": {
            "vllm_router_retries_total",
            "vllm_router_retries_exhausted_total",
            "vllm_router_request_errors_total",
        },
    }
    for title, names in router.items():
        exprs = [promql_checks.fill_variables(t["expr"]) for t in by_title[title]["targets"]]
        assert set().union(*(promql_checks.metric_names(e) for e in exprs)) == names, title


def test_router_queries_empty_until_an_event_are_marked_optional():
    """The router makes a series at its first event: with no retry, error or cache_aware decision,
    the integration test must not count these panels as broken."""
    queries = {q.legend: q for q in panel_queries() if q.dashboard == "llm-replicas-router"}
    for legend in ("retry {{route}}", "retries exhausted {{route}}", "error {{error_type}}", "{{outcome}}"):
        assert queries[legend].optional, legend
    for legend in ("{{replica}} ({{policy}})", "{{replica}} healthy", "{{replica}} breaker", "{{instance}}"):
        assert not queries[legend].optional, legend


def test_alert_thresholds_in_dashboard_text_come_from_the_config():
    kv = {p["title"]: p for p in panels(load(GRAFANA_DIR / "dashboards" / "llm-kv-cache.json"))}
    gauge = kv["KV cache usage now (fullest replica)"]
    steps = gauge["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1]["value"] == config.KV_CACHE_FULL_RATIO
    assert dashboards.percent_text(config.KV_CACHE_FULL_RATIO) in gauge["description"]
    assert config.KV_CACHE_FULL_FOR in gauge["description"]


def test_slo_defaults_match_the_config():
    variables = {v["name"]: v for v in load(GRAFANA_DIR / "dashboards" / "llm-latency.json")["templating"]["list"]}
    assert float(variables["ttft_slo"]["query"]) == config.SLO_TTFT_P95_SECONDS
    assert float(variables["tpot_slo"]["query"]) == config.SLO_TPOT_SECONDS


def test_datasource_provisioning():
    (source,) = yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == config.DATASOURCE_UID
    assert source["url"] == "http://prometheus:9090/prometheus"
    assert source["editable"] is False
    assert source["jsonData"]["timeInterval"] == f"{config.SCRAPE_INTERVAL_SECONDS}s"


def test_dashboard_provider_is_read_only_and_points_at_the_mounted_json():
    (provider,) = yaml.safe_load(PROVIDER_FILE.read_text())["providers"]
    assert provider["type"] == "file"
    assert provider["allowUiUpdates"] is False and provider["disableDeletion"] is True
    grafana = compose("compose.yaml")["services"]["grafana"]
    mounts = dict(volume.rsplit(":", 1)[0].split(":", 1) for volume in grafana["volumes"] if volume.startswith("./"))
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent.as_posix() == provider["options"]["path"]
    assert (GRAFANA_DIR / "dashboards" / Path(home).name).is_file()


def test_grafana_and_prometheus_services():
    services = compose("compose.yaml")["services"]
    grafana, prometheus = services["grafana"], services["prometheus"]
    environment = grafana["environment"]
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert environment["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert environment["GF_SERVER_SERVE_FROM_SUB_PATH"] == "true"
    assert "grafana_admin_password" in grafana["secrets"]
    for name in ("grafana", "prometheus", "gateway-exporter", "dcgm-exporter"):
        service = services[name]
        assert "ports" not in service, f"{name} must be reached only through the gateway"
        assert ":" in service["image"] and not service["image"].endswith(":latest")
        assert "healthcheck" in service
    assert any(volume.startswith("prometheus-data:") for volume in prometheus["volumes"])
    assert "--web.external-url=/prometheus/" in prometheus["command"]
    airgap = compose("compose.airgap.yaml")["services"]
    assert airgap["grafana"]["profiles"] == ["grafana"]
    assert airgap["prometheus"]["build"]["dockerfile"] == "images/prometheus/Dockerfile"


def test_gateway_routes_protect_prometheus_and_resolve_late():
    routes = REPO_ROOT / "nginx" / "templates" / "routes"
    prometheus = (routes / "prometheus.conf.template").read_text()
    assert "auth_basic_user_file /run/secrets/prometheus_htpasswd;" in prometheus
    for name in ("prometheus", "grafana"):
        text = (routes / f"{name}.conf.template").read_text()
        # A variable in proxy_pass makes nginx resolve per request: the gateway starts without them.
        assert re.search(r"proxy_pass http://\$\w+;", text), name
        # Docker's DNS in compose, the cluster's in Kubernetes: both set by the deployment.
        assert "resolver ${GATEWAY_RESOLVER} " in text
        assert f"set ${name}_upstream {name}${{GATEWAY_SERVICE_DOMAIN}}:" in text


def test_gpu_panels_compute_from_dcgm_exporter_series(tmp_path):
    """No GPU here, so the GPU panels' queries run in promtool over series shaped like the DCGM
    exporter's (two GPUs, its labels, MiB), and must give bytes per GPU and the utilisation."""
    from test_prometheus_rules import promtool

    queries = {q.legend.split(",")[0]: q.expr for q in panel_queries() if "DCGM_" in q.expr}
    assert set(queries) == {"used", "total", "vLLM's limit (x $gpu_memory_utilization)", "GPU {{gpu}}"}, queries
    used, free, util = {"0": 120_000, "1": 1_000}, {"0": 23_771, "1": 142_771}, {"0": 87, "1": 3}
    labels = (
        'gpu="{gpu}",UUID="GPU-{gpu}",device="nvidia{gpu}",modelName="NVIDIA H200",job="dcgm",'
        'instance="dcgm-exporter:9400"'
    )
    series = [
        {"series": f"{name}{{{labels.format(gpu=gpu)}}}", "values": f"{values[gpu]}x10"}
        for name, values in (
            ("DCGM_FI_DEV_FB_USED", used),
            ("DCGM_FI_DEV_FB_FREE", free),
            ("DCGM_FI_DEV_GPU_UTIL", util),
        )
        for gpu in ("0", "1")
    ]
    expected = {
        "used": {gpu: used[gpu] * 1048576 for gpu in used},
        "total": {gpu: (used[gpu] + free[gpu]) * 1048576 for gpu in used},
        "vLLM's limit (x $gpu_memory_utilization)": {gpu: (used[gpu] + free[gpu]) * 1048576 * 0.85 for gpu in used},
    }
    tests = [
        {
            "expr": queries[name].replace("$gpu_memory_utilization", "0.85"),
            "eval_time": "5m",
            "exp_samples": [{"labels": f'{{gpu="{gpu}"}}', "value": value} for gpu, value in values.items()],
        }
        for name, values in expected.items()
    ]
    tests.append(
        {
            "expr": queries["GPU {{gpu}}"],
            "eval_time": "5m",
            "exp_samples": [
                {"labels": f"DCGM_FI_DEV_GPU_UTIL{{{labels.format(gpu=gpu)}}}", "value": value}
                for gpu, value in util.items()
            ],
        }
    )
    (tmp_path / "gpu_panels.test.yml").write_text(
        yaml.safe_dump(
            {"rule_files": [], "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}
        )
    )
    tmp_path.chmod(0o755)  # promtool runs as the image's non-root user
    (tmp_path / "gpu_panels.test.yml").chmod(0o644)
    result = promtool("test", "rules", "gpu_panels.test.yml", folder=tmp_path, workdir="")
    assert result.returncode == 0, result.stdout + result.stderr
