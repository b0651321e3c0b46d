"""Prometheus config and rules: generated from llmstack/observability/config.py and not stale,
promtool checks and the alert unit tests (run in the locally built Prometheus image: no promtool
needed on the host), every recording rule used, and every expression valid on Prometheus 3."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from llmstack.observability import config, promql_checks, rules
from llmstack.observability.generate import generated_files

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO_ROOT / "prometheus"
RULES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
ALERT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))
DASHBOARD_FILES = sorted((REPO_ROOT / "grafana" / "dashboards").glob("*.json"))
RECORD_NAME = re.compile(r"^[a-z_]+:[a-z0-9_]+(:[a-z0-9_]+)?$")
RUNBOOK = REPO_ROOT / config.RUNBOOK_PAGE


def prometheus_image() -> str:
    from llmstack.versions import local_images

    return local_images()["prometheus"]


def promtool(*args: str, folder: Path = PROMETHEUS_DIR, workdir: str = "tests") -> subprocess.CompletedProcess:
    """promtool in the air-gapped Prometheus image, with `folder` mounted at /etc/prometheus."""
    command = [
        "docker",
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        f"{folder}:/etc/prometheus:ro",
        "-w",
        f"/etc/prometheus/{workdir}",
        "--entrypoint",
        "promtool",
        prometheus_image(),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def rule_entries() -> list[dict]:
    return [rule for path in RULES for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def alert_rules() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in rule_entries() if "alert" in rule}


def dashboard_expressions() -> list[str]:
    import json

    from llmstack.observability.panel_queries import panel_queries

    dashboards = {path.stem: json.loads(path.read_text()) for path in DASHBOARD_FILES}
    constants = {
        path.stem: {v["name"]: v["query"] for v in board["templating"]["list"] if v["type"] == "constant"}
        for path, board in zip(DASHBOARD_FILES, dashboards.values(), strict=True)
    }
    return [promql_checks.fill_variables(q.expr, constants[q.dashboard]) for q in panel_queries(dashboards)]


def test_generated_files_are_not_stale():
    stale = [
        str(path.relative_to(REPO_ROOT))
        for path, text in generated_files().items()
        if not path.exists() or path.read_text() != text
    ]
    assert not stale, f"run python3 grafana/dashboards/generate.py: {stale}"


def test_the_config_changes_the_rules():
    # The generator reads the config, not a copy of its values.
    before = {rule.get("alert"): rule["expr"] for group in rules.alert_groups() for rule in group["rules"]}
    original = config.KV_CACHE_FULL_RATIO
    try:
        config.KV_CACHE_FULL_RATIO = 0.8
        after = {rule.get("alert"): rule["expr"] for group in rules.alert_groups() for rule in group["rules"]}
    finally:
        config.KV_CACHE_FULL_RATIO = original
    assert before["VLLMKVCacheNearlyFull"].endswith("> 0.9") and after["VLLMKVCacheNearlyFull"].endswith("> 0.8")


@pytest.mark.parametrize("config_file", ["prometheus.yml", "kubernetes.yml"])
def test_config_is_valid(config_file):
    # check config also loads every rule file that rule_files names. kubernetes.yml: deploy/kubernetes's.
    result = promtool("check", "config", f"/etc/prometheus/{config_file}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_files_are_valid():
    result = promtool("check", "rules", *(f"/etc/prometheus/rules/{path.name}" for path in RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass():
    assert ALERT_TESTS, "no promtool test files in prometheus/tests"
    result = promtool("test", "rules", *(path.name for path in ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case():
    firing, quiet = set(), set()
    for path in ALERT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = set(alert_rules())
    assert alerts, "no alert rules found"
    assert not alerts - firing, f"alerts without a firing test: {sorted(alerts - firing)}"
    assert not alerts - quiet, f"alerts without a not-firing test: {sorted(alerts - quiet)}"
    assert not (firing | quiet) - alerts, f"tests for unknown alerts: {sorted((firing | quiet) - alerts)}"


def markdown_anchors(text: str) -> set[str]:
    """The anchors Markdown renderers give headings: lower case, spaces to dashes, punctuation dropped."""
    return {
        re.sub(r"[^a-z0-9 _-]", "", title.strip().lower()).replace(" ", "-")
        for title in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    }


@pytest.mark.parametrize("name", sorted(alert_rules()))
def test_alert_links_its_runbook_section(name):
    rule = alert_rules()[name]
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"]
    assert rule.get("for"), "alerts wait for a sustained condition"
    page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
    assert page == config.RUNBOOK_PAGE and anchor in markdown_anchors(RUNBOOK.read_text()), rule["annotations"]
    assert set(rule["annotations"]) == {"summary", "runbook_url"}, "the prose lives in the runbook page only"


def test_runbook_prose_is_written_once():
    """No sentence of the runbook page is repeated in the rules or in the promtool tests."""
    sentences = [s.strip() for s in re.split(r"(?<=[.:])\s+", " ".join(RUNBOOK.read_text().split())) if len(s) > 60]
    assert len(sentences) > 10
    for path in (*RULES, *ALERT_TESTS):
        text = " ".join(path.read_text().split())
        repeated = [s for s in sentences if s in text]
        assert not repeated, f"{path.name} repeats the runbook: {repeated[:2]}"


def test_required_alerts_exist():
    expressions = {name: rule["expr"] for name, rule in alert_rules().items()}
    assert 'up{job="vllm"}' in expressions["VLLMDown"]
    replica_down = promql_checks.metric_names(expressions["VLLMReplicaDown"])
    assert replica_down == {"up", "vllm_router_worker_health"}, replica_down
    assert 'count(up{job="vllm"} == 1) > 0' in expressions["VLLMReplicaDown"], "only while another serves"
    assert rules.REPLICA_LOAD in expressions["VLLMLoadImbalance"]
    assert f"{config.LOAD_IMBALANCE_RATIO} / " in expressions["VLLMLoadImbalance"]
    assert expressions["VLLMLoadImbalance"].endswith(f">= {config.LOAD_IMBALANCE_MIN_REQUESTS})")
    assert expressions["RouterDown"] == 'up{job="router"} == 0'
    assert expressions["VLLMKVCacheNearlyFull"].endswith(f"vllm:kv_cache_usage_perc) > {config.KV_CACHE_FULL_RATIO}")
    assert "vllm:num_preemptions_total" in expressions["VLLMPreemptionsRising"]
    assert "vllm:num_requests_waiting" in expressions["VLLMWaitingQueueGrowing"]
    assert 'status=~"5[0-9][0-9]"' in expressions["GatewayHigh5xxRatio"]
    assert expressions["GatewayHigh5xxRatio"].endswith(f"> {config.GATEWAY_5XX_RATIO}")
    assert rules.SLO_TTFT_SERIES in expressions["VLLMTTFTOverSLO"]


def test_recording_rules_follow_the_naming_convention():
    for rule in rule_entries():
        if "record" in rule:
            assert RECORD_NAME.match(rule["record"]), f"{rule['record']} is not level:metric[:operation]"


def test_every_recording_rule_is_read_by_a_panel_or_a_rule():
    """Parsed, not searched: a name counts only where an expression selects it."""
    recorded = {rule["record"] for rule in rule_entries() if "record" in rule}
    read: set[str] = set()
    for expr in [rule["expr"] for rule in rule_entries()] + dashboard_expressions():
        read |= promql_checks.metric_names(expr)
    assert not recorded - read, f"recording rules nobody reads: {sorted(recorded - read)}"
    missing = {name for name in read if ":" in name and not name.startswith("vllm:")} - recorded
    assert not missing, f"expressions read recording rules that do not exist: {sorted(missing)}"


def test_every_metric_a_rule_reads_is_exported_or_recorded():
    known = config.source_metric_names() | {rule["record"] for rule in rule_entries() if "record" in rule}
    unknown = {
        rule.get("record") or rule["alert"]: promql_checks.unknown_metrics(rule["expr"], known)
        for rule in rule_entries()
    }
    unknown = {name: found for name, found in unknown.items() if found}
    assert not unknown, unknown


def test_every_expression_is_valid_on_prometheus_3():
    expressions = [rule["expr"] for rule in rule_entries()] + dashboard_expressions()
    problems = {expr: promql_checks.pitfalls(expr) for expr in expressions}
    problems = {expr: found for expr, found in problems.items() if found}
    assert not problems, "\n".join(f"{expr}\n    {found}" for expr, found in problems.items())
    config_problems = promql_checks.config_pitfalls(yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text()))
    assert not config_problems, config_problems


@pytest.mark.parametrize(
    ("expr", "finding"),
    [
        ('rate(x_bucket{le="1"}[1m])', 'le="1" is "1.0"'),
        ('rate(x_bucket{le=~"1(\\\\.0)?"}[1m])', "regex on le"),
        ('x{quantile="0.5"} + x{le="+Inf"}', None),
        ('rate(x{status=~"5.."}[1m])', "also matches a newline"),
        ('rate(x{route=~"/v1/.*", s=~"5[0-9][0-9]|a\\\\.b"}[1m])', None),
        ("rate(x[10s])", "shorter than 4 scrapes"),
        ("max_over_time(x[1m:5s])", None),
        ("holt_winters(x[5m], 0.5, 0.5)", "not valid PromQL 3"),
        ("double_exponential_smoothing(x[5m], 0.5, 0.5)", "experimental"),
    ],
)
def test_the_prometheus_3_checker_finds_each_pitfall(expr, finding):
    found = " / ".join(promql_checks.pitfalls(expr))
    assert (finding in found) if finding else not found, found


def test_the_config_checker_finds_renamed_keys_and_portless_targets():
    problems = promql_checks.config_pitfalls(
        {
            "global": {"scrape_classic_histograms": True},
            "scrape_configs": [{"job_name": "a", "static_configs": [{"targets": ["host"]}]}],
        }
    )
    assert len(problems) == 2 and "always_scrape_classic_histograms" in problems[0] and "no port" in problems[1]


def test_scrape_jobs_cover_the_stack_and_use_the_exporters_port():
    prometheus = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert prometheus["global"]["scrape_interval"] == f"{config.SCRAPE_INTERVAL_SECONDS}s"
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert {"vllm", "router", "gateway", "prometheus", "dcgm"} <= set(jobs)
    for job in jobs.values():
        assert "scrape_interval" not in job, f"job {job['job_name']} overrides the global scrape_interval"
    (replicas,) = jobs["vllm"]["dns_sd_configs"]
    assert replicas["names"] == list(config.replica_services()) and replicas["port"] == config.VLLM_PORT
    assert jobs["vllm"]["relabel_configs"] == [{"source_labels": ["__meta_dns_name"], "target_label": "instance"}]
    assert jobs["router"]["static_configs"][0]["targets"] == [f"router:{config.ROUTER_METRICS_PORT}"]
    (worker,) = jobs["router"]["metric_relabel_configs"]
    assert worker == {"source_labels": ["worker"], "regex": config.ROUTER_WORKER_PATTERN, "target_label": "replica"}
    assert jobs["gateway"]["static_configs"][0]["targets"] == [
        f"gateway-exporter:{config.gateway_exporter().METRICS_PORT}"
    ]


def test_objectives_are_bucket_boundaries():
    assert config.SLO_TTFT_P95_SECONDS in config.TTFT.buckets
    assert config.SLO_TPOT_SECONDS in config.TPOT.buckets


def recorded_router_samples() -> list:
    """A /metrics page of the router release versions.env pins (record one when it changes)."""
    from llmstack import promtext
    from llmstack.versions import read_versions

    version = read_versions()["VLLM_ROUTER_VERSION"]
    return promtext.parse((PROMETHEUS_DIR / "tests" / "recorded" / f"vllm-router-{version}.metrics").read_text())


def test_router_metric_names_and_labels_are_the_real_routers():
    """config.ROUTER_METRICS against a page the real vllm-router 0.1.17 served, with the labels the
    rules and panels read (worker becomes replica at scrape time)."""
    labels: dict[str, set[str]] = {}
    for sample in recorded_router_samples():
        labels.setdefault(sample.name, set()).update(sample.labels)
    missing = set(config.ROUTER_METRICS) - set(labels)
    assert not missing, f"not on the recorded page: {sorted(missing)}"
    for name in ("vllm_router_worker_health", "vllm_router_cb_state", "vllm_router_policy_decisions_total"):
        assert "worker" in labels[name], name
    assert {"policy", "worker"} <= labels["vllm_router_policy_decisions_total"]
    assert "outcome" in labels["vllm_router_prefix_routing_decisions_total"]
    assert "route" in labels["vllm_router_retries_total"] & labels["vllm_router_retries_exhausted_total"]
    assert "error_type" in labels["vllm_router_request_errors_total"]


@pytest.mark.parametrize(
    ("worker", "replica"),
    [
        ("http://vllm:8000", "vllm"),
        ("http://vllm-2:8000", "vllm-2"),
        ("https://vllm-8:8000/", "vllm-8"),
        ("http://vllm-3", "vllm-3"),
    ],
)
def test_the_routers_worker_url_becomes_the_replicas_instance_name(worker, replica):
    # Prometheus anchors relabel regexes at both ends, as fullmatch does (RE2 and re agree here).
    match = re.fullmatch(config.ROUTER_WORKER_PATTERN, worker)
    assert match and match.expand(r"\1") == replica
    assert replica in config.replica_services()


def test_prometheus_looks_up_every_replica_the_stack_can_run():
    from llmstack import replicas

    names = config.replica_services()
    assert names[:3] == ("vllm", "vllm-2", "vllm-3") and len(names) == replicas.MAX_REPLICAS
    for name in names:
        # The URL the router is given for this replica names it back as its instance label.
        match = re.fullmatch(config.ROUTER_WORKER_PATTERN, replicas.Replica(name).url)
        assert match and match.group(1) == name


def test_every_recorded_worker_gets_a_replica_label():
    workers = {s.labels["worker"] for s in recorded_router_samples() if "worker" in s.labels}
    assert workers and all(re.fullmatch(config.ROUTER_WORKER_PATTERN, w) for w in workers), workers
