"""Alerts reach a person: Prometheus sends its alerts to Alertmanager, which silences the ones a
vLLM outage causes and notifies the webhook set in .env. End to end: every vLLM replica stopped, the
VLLMDown alert arrives at a test webhook receiver on the stack's backend network; the replicas started
again, the resolved notice arrives."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from test_observability import prometheus_client, wait_for

from llmstack.cli import StackError

RECEIVER_PORT = 9099
# The test receiver: one JSON line on stdout per notification Alertmanager posts.
RECEIVER = f"""
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        sys.stdout.write(body.decode().replace("\\n", " ") + "\\n")
        sys.stdout.flush()
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("", {RECEIVER_PORT}), Handler).serve_forever()
"""
# Short timings for the test only (the shipped ones are alertmanager/alertmanager.yml's): the
# rules' own `for:` (VLLMDown: 1m) is kept.
FAST = {"ALERT_GROUP_WAIT": "1s", "ALERT_GROUP_INTERVAL": "5s", "ALERT_REPEAT_INTERVAL": "1h"}


def amtool(stack, *args: str) -> str:
    return stack.exec("alertmanager", "amtool", "--alertmanager.url=http://127.0.0.1:9093", *args)


def alertmanager_api(stack, path: str):
    return json.loads(stack.exec("alertmanager", "wget", "-q", "-O", "-", f"http://127.0.0.1:9093/api/v2/{path}"))


def vllm_answers(stack) -> bool:
    """Some replica serves (VLLMDown is about all of them)."""
    for replica in stack.replicas:
        try:
            stack.replica(replica).get("/health")
        except StackError:
            continue
        return True
    return False


def recreate_alertmanager(stack, settings: dict[str, str]) -> None:
    """Alertmanager started again with these settings over the stack's own (the shell's
    environment wins over compose's env file), nothing else touched."""
    command = [*stack.compose.compose_command_property, "up", "-d", "--no-deps", "--no-build", "--wait"]
    subprocess.run(
        [*command, "--pull", "never", "alertmanager"],
        cwd=stack.compose.context,
        env={**stack.environment(), **settings},
        capture_output=True,
        text=True,
        check=True,
        timeout=180,
    )


def test_prometheus_sends_its_alerts_to_alertmanager(stack):
    prometheus = prometheus_client(stack)

    def discovered():
        found = prometheus.get("/api/v1/alertmanagers", {})["activeAlertmanagers"]
        return [am["url"] for am in found]

    urls = wait_for("Prometheus to find Alertmanager", discovered, timeout=60)
    assert urls == ["http://alertmanager:9093/api/v2/alerts"]


def test_a_replica_down_silences_the_alerts_it_causes(stack):
    """Alerts posted by hand, with an instance of their own (nothing real is affected): the KV
    cache alert of the replica that is down and the latency alert are inhibited; another
    replica's KV cache alert is not."""
    down = f"vllm-inhibition-test-{uuid.uuid4().hex[:6]}"
    other = f"{down}-other"
    end = (datetime.now(UTC) + timedelta(minutes=3)).strftime("%Y-%m-%dT%H:%M:%SZ")
    amtool(stack, "alert", "add", "alertname=VLLMReplicaDown", f"instance={down}", "severity=warning", f"--end={end}")
    for labels in (
        ["alertname=VLLMKVCacheNearlyFull", f"instance={down}", "model_name=inhibition-test"],
        ["alertname=VLLMKVCacheNearlyFull", f"instance={other}", "model_name=inhibition-test"],
        ["alertname=VLLMTTFTOverSLO", "model_name=inhibition-test"],
    ):
        amtool(stack, "alert", "add", *labels, "severity=warning", f"--end={end}")

    def states():
        alerts = alertmanager_api(stack, "alerts?filter=model_name%3D%22inhibition-test%22")
        found = {(a["labels"]["alertname"], a["labels"].get("instance", "")): a["status"] for a in alerts}
        return found if len(found) == 3 and any(s["inhibitedBy"] for s in found.values()) else None

    found = wait_for("Alertmanager to apply the inhibition", states, timeout=30, interval=1)
    assert found[("VLLMKVCacheNearlyFull", down)]["state"] == "suppressed"
    assert found[("VLLMKVCacheNearlyFull", down)]["inhibitedBy"]
    assert found[("VLLMTTFTOverSLO", "")]["state"] == "suppressed"
    assert found[("VLLMKVCacheNearlyFull", other)]["state"] == "active"
    assert not found[("VLLMKVCacheNearlyFull", other)]["inhibitedBy"]


@pytest.mark.destructive
def test_vllm_down_alert_and_its_resolution_reach_the_webhook(stack):
    exporter = json.loads(stack.compose_command("ps", "--format", "json", "gateway-exporter").stdout.splitlines()[0])
    receiver = f"{stack.project}-alert-receiver"
    run = ["docker", "run", "-d", "--rm", "--name", receiver, "--user", "65534:65534"]
    network = ["--network", f"{stack.project}_backend", "--network-alias", "alert-receiver"]
    subprocess.run(
        [*run, *network, exporter["Image"], "python3", "-c", RECEIVER],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )

    def notifications(status: str) -> list[dict]:
        lines = subprocess.run(["docker", "logs", receiver], capture_output=True, text=True, timeout=30).stdout
        return [
            alert
            for line in lines.splitlines()
            if line.startswith("{")
            for alert in json.loads(line)["alerts"]
            if alert["labels"]["alertname"] == "VLLMDown" and alert["status"] == status
        ]

    try:
        recreate_alertmanager(stack, {"ALERT_WEBHOOK_URL": f"http://alert-receiver:{RECEIVER_PORT}/alerts", **FAST})
        assert not notifications("firing")
        stopped = time.monotonic()
        # Every replica: with one left, the router serves and the alert is VLLMReplicaDown.
        stack.compose_command("kill", *stack.replicas)
        fired = wait_for("the VLLMDown notification", lambda: notifications("firing"), timeout=240, interval=3)
        fired_after = time.monotonic() - stopped
        assert fired[0]["labels"]["severity"] == "critical"
        assert fired[0]["annotations"]["runbook_url"].endswith("#vllmdown")

        started = time.monotonic()
        stack.compose_command("start", *stack.replicas)
        resolved = wait_for("the resolved notice", lambda: notifications("resolved"), timeout=480, interval=3)
        resolved_after = time.monotonic() - started
        # Resolved means serving again: not a new container that is still loading its model.
        assert vllm_answers(stack), f"resolved {resolved_after:.0f}s after the start, before vLLM answers"
        assert resolved[0]["endsAt"] > resolved[0]["startsAt"]
        # One outage, one alert: the start did not turn it into another one (a new instance).
        assert {json.dumps(a["labels"], sort_keys=True) for a in fired + resolved} == {
            json.dumps(fired[0]["labels"], sort_keys=True)
        }
        print(
            f"\nVLLMDown reached the webhook {fired_after:.0f}s after vLLM stopped (the rule's for: 1m); "
            f"resolved {resolved_after:.0f}s after vLLM was started again (its model load included)"
        )
    finally:
        subprocess.run(["docker", "rm", "-f", receiver], capture_output=True, timeout=60)
        # vLLM serving again for any test after this one.
        stack.compose_command("start", *stack.replicas, check=False)
        recreate_alertmanager(stack, {})
