"""The gateway exporter: nginx access-log lines in, Prometheus text out; the real process over
real UDP and HTTP."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from llmstack.observability import config

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "images" / "gateway-exporter" / "gateway_exporter.py"
gateway_exporter = config.gateway_exporter()

# nginx ends these lines with a space.
STUB_STATUS = "Active connections: 3 \nserver accepts handled requests\n 10 10 42 \nReading: 0 Writing: 2 Waiting: 1 \n"


def log_line(**fields) -> str:
    entry = {
        "time": "2026-12-03T08:00:00+00:00",
        "request_id": "x",
        "key_owner": "alice",
        "method": "POST",
        "route": "/v1/chat/completions",
        "status": 200,
        "bytes_sent": 512,
        "request_length": 300,
        "request_time": 0.250,
        "upstream_status": "200",
        "upstream_connect_time": "0.001",
        "upstream_header_time": "0.010",
        "upstream_response_time": "0.248",
        "remote_addr": "10.0.0.1",
        "user_agent": "test",
    }
    entry.update(fields)
    return "<190>Dec  3 08:00:00 gateway: " + json.dumps(entry)


def sample(lines: list[str], prefix: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix)]
    assert values, f"no sample {prefix}"
    return sum(values)


def test_counts_requests_by_route_status_and_owner():
    metrics = gateway_exporter.GatewayMetrics()
    assert metrics.observe_line(log_line())
    assert metrics.observe_line(
        log_line(status=401, key_owner="", upstream_header_time="", upstream_response_time="", request_time=0.0)
    )
    assert metrics.observe_line(log_line(route="other", status=404, upstream_response_time="-"))
    assert metrics.observe_line(log_line(route="/" + "x" * 100, status=404, upstream_response_time="-"))
    first = metrics.exposition()
    # New label sets are exported at 0 first, so Prometheus' rate() sees their first step.
    assert sample(first, 'gateway_requests_total{route="other"') == 0
    lines = metrics.exposition()
    assert (
        sample(
            lines, 'gateway_requests_total{route="/v1/chat/completions",method="POST",status="200",key_owner="alice"}'
        )
        == 1
    )
    assert (
        sample(
            lines, 'gateway_requests_total{route="/v1/chat/completions",method="POST",status="401",key_owner="none"}'
        )
        == 1
    )
    # nginx names unknown paths "other"; a route name longer than nginx.conf's is folded there too.
    assert sample(lines, 'gateway_requests_total{route="other"') == 2


def test_known_label_sets_count_at_once():
    metrics = gateway_exporter.GatewayMetrics()
    metrics.observe_line(log_line())
    metrics.exposition()
    metrics.observe_line(log_line())
    metrics.observe_line(log_line())
    assert sample(metrics.exposition(), 'gateway_requests_total{route="/v1/chat/completions"') == 3


def test_added_latency_is_request_minus_upstream_time():
    metrics = gateway_exporter.GatewayMetrics()
    metrics.observe_line(log_line(request_time=0.250, upstream_response_time="0.248"))
    lines = metrics.exposition()
    assert abs(sample(lines, 'gateway_added_latency_seconds_sum{route="/v1/chat/completions"}') - 0.002) < 1e-9
    assert sample(lines, 'gateway_added_latency_seconds_bucket{route="/v1/chat/completions",le="0.0025"}') == 1
    assert sample(lines, 'gateway_added_latency_seconds_bucket{route="/v1/chat/completions",le="0.001"}') == 0
    assert sample(lines, 'gateway_upstream_header_duration_seconds_count{route="/v1/chat/completions"}') == 1


def test_several_upstream_tries_are_summed():
    assert gateway_exporter.upstream_seconds("0.004, 0.002") == 0.006
    assert gateway_exporter.upstream_seconds("0.5 : 0.25") == 0.75
    assert gateway_exporter.upstream_seconds("-") is None
    assert gateway_exporter.upstream_seconds("") is None


def test_garbage_is_counted_not_fatal():
    metrics = gateway_exporter.GatewayMetrics()
    assert not metrics.observe_line("<190>Dec  3 gateway: not json")
    assert not metrics.observe_line('{"route": "/v1/models"}')
    assert sample(metrics.exposition(), 'gateway_log_lines_total{result="invalid"}') == 2


def test_stub_status_is_parsed():
    figures = gateway_exporter.parse_stub_status(STUB_STATUS)
    assert figures == {
        "active": 3,
        "accepted": 10,
        "handled": 10,
        "requests": 42,
        "reading": 0,
        "writing": 2,
        "waiting": 1,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_process_receives_syslog_and_serves_metrics():
    http_port, syslog_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--listen-port",
            str(http_port),
            "--syslog-port",
            str(syslog_port),
            "--stub-status-url",
            "http://127.0.0.1:1/",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "exporter did not start"
                time.sleep(0.1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for _ in range(3):
                sender.sendto(log_line(status=429).encode(), ("127.0.0.1", syslog_port))
        deadline = time.monotonic() + 5
        while True:
            response = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=2)
            lines = response.read().decode().splitlines()
            if any(
                line.startswith("gateway_requests_total{") and 'status="429"' in line and line.endswith(" 3")
                for line in lines
            ):
                break
            assert time.monotonic() < deadline, "the syslog lines were not counted"
            time.sleep(0.1)
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "nginx_up 0" in lines  # nothing answers on the stub_status URL here
    finally:
        process.terminate()
        process.wait(timeout=5)


def test_bad_usage_is_one_line_and_exit_2():
    result = subprocess.run([sys.executable, str(SCRIPT), "--listen-port", "70000"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "must be a port number" in result.stderr


def gateway_locations() -> dict[str, str]:
    """nginx location -> the route name it logs, over the gateway's templates."""
    found = {}
    for path in (REPO_ROOT / "nginx" / "templates").rglob("*.template"):
        for location, body in re.findall(
            r"^ *location ([^@{\n][^{\n]*?) \{(.*?)\n *\}", path.read_text(), flags=re.DOTALL | re.MULTILINE
        ):
            route = re.search(r"set \$gateway_route (\S+);", body)
            found[location.strip()] = route.group(1) if route else ""
    return found


def test_the_route_allowlist_is_nginx_s_only():
    """Every location that proxies names its route for the access log; the exporter keeps no list."""
    locations = gateway_locations()
    api = {location: route for location, route in locations.items() if location.startswith("= /v1/")}
    assert len(api) == 3 and all(route == location.removeprefix("= ") for location, route in api.items()), api
    for location, route in locations.items():
        if location.startswith("= /v1/") or location.startswith("/"):
            assert route or location == "/", f"location {location} logs no route name"
    gateway = (REPO_ROOT / "nginx" / "templates" / "gateway.conf.template").read_text()
    assert re.search(r"^    set \$gateway_route other;", gateway, flags=re.MULTILINE), "the server-wide default"
    assert '"route":"$gateway_route"' in (REPO_ROOT / "nginx" / "nginx.conf").read_text()
    assert "/v1/" not in SCRIPT.read_text(), "the exporter must not keep its own route list"


def test_healthcheck_reports_the_running_exporter(tmp_path):
    http_port, syslog_port = free_port(), free_port()
    check = [sys.executable, str(SCRIPT), "--healthcheck", "--listen-port", str(http_port)]
    down = subprocess.run(check, capture_output=True, text=True, timeout=10)
    assert down.returncode == 1 and "unhealthy" in down.stderr and "Traceback" not in down.stderr
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--listen-port", str(http_port), "--syslog-port", str(syslog_port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(check, capture_output=True, timeout=10).returncode != 0:
            assert time.monotonic() < deadline, "the health check never passed"
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=5)


def test_the_port_is_defined_once():
    assert "default=METRICS_PORT" in SCRIPT.read_text()
    prometheus = (REPO_ROOT / "prometheus" / "prometheus.yml").read_text()
    assert f'"gateway-exporter:{gateway_exporter.METRICS_PORT}"' in prometheus
