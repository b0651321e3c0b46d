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

REPO_ROOT = Path(__file__).resolve().parents[2]
GRAFANA_DIR = REPO_ROOT / "grafana"
DASHBOARD_FILES = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
DATASOURCE_FILE = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDER_FILE = GRAFANA_DIR / "provisioning" / "dashboards" / "llm-stack.yaml"
# V0 names that vLLM's V1 engine no longer exports.
REMOVED_VLLM_METRICS = ("vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:gpu_prefix_cache",
                        "vllm:num_requests_swapped")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def compose(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / name).read_text())


def datasource_uid() -> str:
    return yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"][0]["uid"]


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_committed_json_is_what_the_generator_makes():
    result = subprocess.run([sys.executable, str(GRAFANA_DIR / "dashboards" / "generate.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_generator_help_and_bad_usage():
    script = str(GRAFANA_DIR / "dashboards" / "generate.py")
    assert subprocess.run([sys.executable, script, "--help"], capture_output=True).returncode == 0
    bad = subprocess.run([sys.executable, script, "--out-dir", "/nonexistent"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_three_dashboards_with_fixed_unique_uids():
    uids = [load(path)["uid"] for path in DASHBOARD_FILES]
    assert len(DASHBOARD_FILES) == 3
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
            if "vllm:" in expr or "vllm_" in expr:
                assert "$instance" in expr, f"{item['title']}: vLLM query without $instance: {expr}"
                if "cache_config_info" not in expr:  # that info metric has no model_name label
                    assert "$model_name" in expr, f"{item['title']}: vLLM query without $model_name: {expr}"


def test_kv_cache_usage_is_never_summed():
    dashboard = load(GRAFANA_DIR / "dashboards" / "llm-kv-cache.json")
    for item in panels(dashboard):
        for query in item["targets"]:
            assert not re.search(r"sum[^(]*\(\s*vllm:kv_cache_usage_perc", query["expr"]), query["expr"]


def test_recording_rules_used_by_dashboards_exist():
    recorded = set()
    for path in (REPO_ROOT / "prometheus" / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            recorded |= {rule["record"] for rule in group["rules"] if "record" in rule}
    for path in DASHBOARD_FILES:
        for item in panels(load(path)):
            for query in item["targets"]:
                for name in re.findall(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b|\bllm_stack:\w+", query["expr"]):
                    assert name in recorded, f"{path.name} / {item['title']}: no recording rule {name}"


def test_latency_dashboard_shows_quantiles_and_true_mean():
    dashboard = load(GRAFANA_DIR / "dashboards" / "llm-latency.json")
    by_title = {p["title"]: p for p in panels(dashboard)}
    for title in ("Time to first token (TTFT)", "Inter-token latency (ITL)", "Time per output token (TPOT)",
                  "End-to-end request latency"):
        legends = {t["legendFormat"] for t in by_title[title]["targets"]}
        assert {"p50", "p90", "p95", "p99", "mean"} <= legends, title
        mean = next(t["expr"] for t in by_title[title]["targets"] if t["legendFormat"] == "mean")
        assert "_sum" in mean and "_count" in mean and "/" in mean
    assert sum(p["type"] == "heatmap" for p in panels(dashboard)) == 2


def test_slo_defaults_match_the_prometheus_rules():
    slo_text = (REPO_ROOT / "prometheus" / "rules" / "slo.yml").read_text()
    variables = {v["name"]: v for v in load(GRAFANA_DIR / "dashboards" / "llm-latency.json")["templating"]["list"]}
    assert f"llm_stack:slo_ttft_p95_seconds\n        expr: vector({variables['ttft_slo']['query']})" in slo_text
    assert f"llm_stack:slo_tpot_seconds\n        expr: vector({variables['tpot_slo']['query']})" in slo_text


def test_datasource_provisioning():
    config = yaml.safe_load(DATASOURCE_FILE.read_text())
    (source,) = config["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "llm-stack-prometheus"
    assert source["url"] == "http://prometheus:9090/prometheus"
    assert source["editable"] is False
    scrape_interval = yaml.safe_load((REPO_ROOT / "prometheus" / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape_interval


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
        assert "resolver 127.0.0.11" in text


def test_gpu_panels_compute_from_dcgm_exporter_series(tmp_path):
    """No GPU here, so the GPU panels' queries run in promtool over series shaped like the DCGM
    exporter's (two GPUs, its labels, MiB), and must give bytes per GPU and the utilisation."""
    from test_prometheus_rules import promtool

    sys.path.insert(0, str(GRAFANA_DIR))
    import panel_queries

    queries = {q.legend.split(",")[0]: q.expr for q in panel_queries.panel_queries() if "DCGM_" in q.expr}
    assert set(queries) == {"used", "total", "vLLM's limit (x $gpu_memory_utilization)", "GPU {{gpu}}"}, queries
    used, free, util = {"0": 120_000, "1": 1_000}, {"0": 23_771, "1": 142_771}, {"0": 87, "1": 3}
    labels = 'gpu="{gpu}",UUID="GPU-{gpu}",device="nvidia{gpu}",modelName="NVIDIA H200",job="dcgm",instance="dcgm-exporter:9400"'
    series = [{"series": f"{name}{{{labels.format(gpu=gpu)}}}", "values": f"{values[gpu]}x10"}
              for name, values in (("DCGM_FI_DEV_FB_USED", used), ("DCGM_FI_DEV_FB_FREE", free),
                                   ("DCGM_FI_DEV_GPU_UTIL", util)) for gpu in ("0", "1")]
    expected = {
        "used": {gpu: used[gpu] * 1048576 for gpu in used},
        "total": {gpu: (used[gpu] + free[gpu]) * 1048576 for gpu in used},
        "vLLM's limit (x $gpu_memory_utilization)": {gpu: (used[gpu] + free[gpu]) * 1048576 * 0.85 for gpu in used},
    }
    tests = [{"expr": queries[name].replace("$gpu_memory_utilization", "0.85"), "eval_time": "5m",
              "exp_samples": [{"labels": f'{{gpu="{gpu}"}}', "value": value} for gpu, value in values.items()]}
             for name, values in expected.items()]
    tests.append({"expr": queries["GPU {{gpu}}"], "eval_time": "5m",
                  "exp_samples": [{"labels": f"DCGM_FI_DEV_GPU_UTIL{{{labels.format(gpu=gpu)}}}", "value": value}
                                  for gpu, value in util.items()]})
    (tmp_path / "gpu_panels.test.yml").write_text(yaml.safe_dump(
        {"rule_files": [], "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}))
    tmp_path.chmod(0o755)  # promtool runs as the image's non-root user
    (tmp_path / "gpu_panels.test.yml").chmod(0o644)
    result = promtool("test", "rules", "gpu_panels.test.yml", folder=tmp_path, workdir="")
    assert result.returncode == 0, result.stdout + result.stderr
