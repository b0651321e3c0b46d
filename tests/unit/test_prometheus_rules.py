"""Prometheus config and rules: promtool checks and the alert unit tests, run in the Prometheus
image the air-gapped path builds (Debian's prometheus 2.42; no promtool needed on the host)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO_ROOT / "prometheus"
RULES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
ALERT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))
RECORD_NAME = re.compile(r"^[a-z_]+:[a-z0-9_]+(:[a-z0-9_]+)?$")


def prometheus_image() -> str:
    airgap = yaml.safe_load((REPO_ROOT / "compose.airgap.yaml").read_text())
    return airgap["services"]["prometheus"]["image"]


def promtool(*args: str, folder: Path = PROMETHEUS_DIR, workdir: str = "tests") -> subprocess.CompletedProcess:
    """promtool in the air-gapped Prometheus image, with `folder` mounted at /etc/prometheus."""
    command = ["docker", "run", "--rm", "--network", "none",
               "-v", f"{folder}:/etc/prometheus:ro", "-w", f"/etc/prometheus/{workdir}",
               "--entrypoint", "promtool", prometheus_image(), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def alert_rules() -> dict[str, dict]:
    alerts = {}
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    alerts[rule["alert"]] = rule
    return alerts


def test_config_is_valid():
    # check config also loads every rule file that rule_files names.
    result = promtool("check", "config", "/etc/prometheus/prometheus.yml")
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


@pytest.mark.parametrize("name", sorted(alert_rules()))
def test_alert_has_runbook_summary_and_severity(name):
    rule = alert_rules()[name]
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert len(rule["annotations"]["runbook"]) > 80, "the runbook should say what to check first"
    assert rule["annotations"]["summary"]
    assert rule.get("for"), "alerts wait for a sustained condition"


def test_required_alerts_exist():
    alerts = alert_rules()
    expressions = {name: rule["expr"] for name, rule in alerts.items()}
    assert 'up{job="vllm"}' in expressions["VLLMDown"]
    assert "vllm:kv_cache_usage_perc" in expressions["VLLMKVCacheNearlyFull"] and "0.9" in expressions["VLLMKVCacheNearlyFull"]
    assert "vllm:num_preemptions_total" in expressions["VLLMPreemptionsRising"]
    assert "vllm:num_requests_waiting" in expressions["VLLMWaitingQueueGrowing"]
    assert 'status=~"5.."' in expressions["GatewayHigh5xxRatio"]
    assert "llm_stack:slo_ttft_p95_seconds" in expressions["VLLMTTFTOverSLO"]


def test_recording_rules_follow_the_naming_convention():
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    assert RECORD_NAME.match(rule["record"]), f"{path.name}: {rule['record']} is not level:metric[:operation]"


def test_scrape_interval_is_one_setting():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert "scrape_interval" in config["global"]
    for job in config["scrape_configs"]:
        assert "scrape_interval" not in job, f"job {job['job_name']} overrides the global scrape_interval"


def test_scrape_jobs_cover_the_stack():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"vllm", "gateway", "prometheus", "dcgm"} <= set(jobs)
    # Every vLLM replica, by DNS, with a readable instance label.
    assert jobs["vllm"]["dns_sd_configs"][0]["names"] == ["vllm"]
    assert any(r.get("target_label") == "instance" for r in jobs["vllm"]["relabel_configs"])
