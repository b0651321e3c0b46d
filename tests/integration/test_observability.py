"""Prometheus and the dashboards against the real CPU stack: real traffic through the gateway
(streaming, non-streaming, rejected), then every panel query of every dashboard, variables filled
in, must run on the real Prometheus and return data. Grafana itself cannot run on this machine."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from llmstack.observability import panel_queries

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "results"

REQUIRED_JOBS = {"vllm", "gateway", "loadtest", "prometheus"}
COMPLETED_REQUESTS = 12


def prometheus_client(stack) -> panel_queries.Prometheus:
    return panel_queries.Prometheus(stack.url("/prometheus"), "admin", stack.passwords["prometheus"])


def wait_for(description: str, check, timeout: float = 120, interval: float = 2.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {description} (last: {last!r})")


def scalar(prometheus, expr: str) -> float:
    result = prometheus.get("/api/v1/query", {"query": expr})["result"]
    return float(result[0]["value"][1]) if result else 0.0


@pytest.fixture(scope="module")
def traffic(stack):
    """Real requests through the gateway; returns how many of each kind were sent."""
    model = requests.get(stack.url("/v1/models"), headers=stack.auth("alice"), timeout=30).json()["data"][0]["id"]
    sent = {"ok": 0, "unauthorized": 0, "rate_limited": 0}
    prompt = "Describe the dashboards of an LLM gateway. " * 4
    for index in range(COMPLETED_REQUESTS):
        body = {
            "model": model,
            "max_tokens": 24,
            "stream": index % 2 == 0,
            "messages": [{"role": "user", "content": prompt + str(index % 3)}],
        }
        with requests.post(
            stack.url("/v1/chat/completions"), json=body, headers=stack.auth("alice"), stream=True, timeout=120
        ) as response:
            assert response.status_code == 200, response.text
            for _ in response.iter_lines():
                pass
        sent["ok"] += 1
    completion = requests.post(
        stack.url("/v1/completions"),
        headers=stack.auth("bob"),
        timeout=120,
        json={"model": model, "prompt": prompt, "max_tokens": 16},
    )
    assert completion.status_code == 200, completion.text
    sent["ok"] += 1
    for headers in ({}, {"Authorization": "Bearer sk-not-a-key"}):
        response = requests.post(
            stack.url("/v1/chat/completions"),
            headers=headers,
            timeout=30,
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert response.status_code == 401
        sent["unauthorized"] += 1
    # More GETs at once than the "burst" key's rate and burst allow: some answered 429.
    session = requests.Session()
    for _ in range(80):
        if session.get(stack.url("/v1/models"), headers=stack.auth("burst"), timeout=30).status_code == 429:
            sent["rate_limited"] += 1
    assert sent["rate_limited"] > 0, "the burst never reached the rate limit"
    # A short load test from Locust's web UI: the dashboards' client-side panels need its metrics.
    stats = stack.locust_swarm(["StreamingChatUser"], users=2, seconds=15)
    sent["loadtest"] = next(entry["num_requests"] for entry in stats["stats"] if entry["name"] == "Aggregated")
    sent["finished_at"] = time.time()
    return sent


def test_prometheus_is_behind_basic_auth(stack):
    url = stack.url("/prometheus/api/v1/status/buildinfo")
    assert requests.get(url, timeout=10).status_code == 401
    assert requests.get(url, auth=("admin", "wrong"), timeout=10).status_code == 401
    response = requests.get(url, auth=("admin", stack.passwords["prometheus"]), timeout=10)
    assert response.status_code == 200 and response.json()["status"] == "success"


def test_grafana_route_answers_even_without_grafana(stack):
    # The CPU path runs no Grafana (no image without a registry): the gateway says so in JSON.
    response = requests.get(stack.url("/grafana/"), timeout=10)
    if response.status_code == 503:
        assert response.json()["error"]["code"] == "grafana_unavailable"
    else:
        assert response.status_code in (200, 302)


def test_all_scrape_targets_are_up(stack, traffic):
    prometheus = prometheus_client(stack)

    def targets_up():
        active = prometheus.get("/api/v1/targets", {"state": "active"})["activeTargets"]
        jobs = {target["labels"]["job"] for target in active}
        healthy = all(target["health"] == "up" for target in active)
        return active if healthy and jobs >= REQUIRED_JOBS else None

    active = wait_for("every scrape target up", targets_up, timeout=90)
    # Each replica is its own target, named after its compose service (the name the router uses).
    replicas = {target["labels"]["instance"] for target in active if target["labels"]["job"] == "vllm"}
    assert replicas == set(stack.replicas), replicas
    print("\nscrape targets: " + ", ".join(f"{t['labels']['job']}/{t['labels']['instance']}" for t in active))


def test_gateway_metrics_count_the_traffic_by_status(stack, traffic):
    prometheus = prometheus_client(stack)
    wait_for(
        "the gateway's 401s and 429s in Prometheus",
        lambda: (
            scalar(prometheus, 'sum(gateway_requests_total{status="401"})') >= traffic["unauthorized"]
            and scalar(prometheus, 'sum(gateway_requests_total{status="429"})') >= traffic["rate_limited"]
        ),
    )
    ok = scalar(prometheus, 'sum(gateway_requests_total{route=~"/v1/(chat/)?completions", status="200"})')
    assert ok >= traffic["ok"]
    assert scalar(prometheus, "sum(gateway_added_latency_seconds_count)") >= traffic["ok"]


def test_every_panel_query_returns_data(stack, traffic):
    prometheus = prometheus_client(stack)
    # vLLM counted every request, and the 1m recording rules have been evaluated over them.
    wait_for(
        "vLLM's requests in Prometheus",
        lambda: scalar(prometheus, "sum(vllm:e2e_request_latency_seconds_count)") >= traffic["ok"],
    )
    wait_for(
        "the load test's client-side TTFTs in Prometheus",
        lambda: scalar(prometheus, "sum(loadtest_time_to_first_token_seconds_count)") > 0,
    )
    wait_for(
        "the recording rules",
        lambda: scalar(prometheus, "count(instance_model_name:vllm_generation_tokens:rate1m > 0)") > 0,
    )
    results = panel_queries.run_all(prometheus, minutes=10)
    errors = [f"{q.dashboard} / {q.panel} [{q.ref_id}]: {q.error}\n    {q.expr}" for q in results if q.error]
    # A quantile line hidden at or below its first bucket is empty on purpose: run_all checked
    # that the unfiltered quantile had data, all of it inside that bucket.
    empty = [
        f"{q.dashboard} / {q.panel} [{q.ref_id}]: no data\n    {q.expr}"
        for q in results
        if not q.error and not q.has_data and not q.optional and not q.below_first_bucket
    ]
    summary = {}
    for q in results:
        entry = summary.setdefault(
            q.dashboard,
            {"queries": 0, "with_data": 0, "optional_without_data": [], "below_first_bucket": [], "panels": []},
        )
        entry["queries"] += 1
        entry["with_data"] += q.has_data
        if q.panel not in entry["panels"]:
            entry["panels"].append(q.panel)
        if q.below_first_bucket:
            entry["below_first_bucket"].append(f"{q.panel} [{q.ref_id}]")
        if q.optional and not q.has_data:
            entry["optional_without_data"].append(f"{q.panel} [{q.ref_id}] (needs {q.optional})")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "observability-panel-queries.json").write_text(json.dumps(summary, indent=2) + "\n")
    print()
    for name, entry in summary.items():
        print(
            f"{name}: {entry['with_data']}/{entry['queries']} panel queries returned data; "
            f"optional, no data here: {len(entry['optional_without_data'])}"
        )
    assert not errors, "queries Prometheus rejected:\n" + "\n".join(errors)
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert sum(entry["with_data"] for entry in summary.values()) > 0


@pytest.mark.destructive
def test_prometheus_data_survives_a_restart(stack, traffic):
    """The TSDB lives in a named volume: what was scraped before a restart is still there after."""
    prometheus = prometheus_client(stack)
    # A moment of the traffic: later tests may have restarted vLLM, whose counters start again.
    expr, moment = "sum(vllm:e2e_request_latency_seconds_count)", traffic["finished_at"]
    before = prometheus.get("/api/v1/query", {"query": expr, "time": moment})["result"]
    assert before and float(before[0]["value"][1]) >= traffic["ok"]
    stack.compose_command("restart", "prometheus", timeout=180)

    def answered_again():
        try:
            return prometheus.get("/api/v1/query", {"query": expr, "time": moment})["result"]
        except panel_queries.PrometheusError:
            return None

    assert wait_for("Prometheus answering after its restart", answered_again, timeout=120) == before
