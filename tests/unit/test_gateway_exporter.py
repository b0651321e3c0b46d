"""The gateway exporter: nginx access-log lines in, Prometheus text out; the real process over
real UDP and HTTP."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "images" / "gateway-exporter" / "gateway_exporter.py"
spec = importlib.util.spec_from_file_location("gateway_exporter", SCRIPT)
gateway_exporter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gateway_exporter)

STUB_STATUS = """Active connections: 3 
server accepts handled requests
 10 10 42 
Reading: 0 Writing: 2 Waiting: 1 
"""


def log_line(**fields) -> str:
    entry = {"time": "2026-12-03T08:00:00+00:00", "request_id": "x", "key_owner": "alice", "method": "POST",
             "route": "/v1/chat/completions", "status": 200, "bytes_sent": 512, "request_length": 300,
             "request_time": 0.250, "upstream_status": "200", "upstream_connect_time": "0.001",
             "upstream_header_time": "0.010", "upstream_response_time": "0.248", "remote_addr": "10.0.0.1",
             "user_agent": "test"}
    entry.update(fields)
    return "<190>Dec  3 08:00:00 gateway: " + json.dumps(entry)


def sample(lines: list[str], prefix: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix)]
    assert values, f"no sample {prefix}"
    return sum(values)


def test_counts_requests_by_route_status_and_owner():
    metrics = gateway_exporter.GatewayMetrics()
    assert metrics.observe_line(log_line())
    assert metrics.observe_line(log_line(status=401, key_owner="", upstream_header_time="",
                                         upstream_response_time="", request_time=0.0))
    assert metrics.observe_line(log_line(route="/wp-admin/../etc", status=404, upstream_response_time="-"))
    first = metrics.exposition()
    # New label sets are exported at 0 first, so Prometheus' rate() sees their first step.
    assert sample(first, 'gateway_requests_total{route="other"') == 0
    lines = metrics.exposition()
    assert sample(lines, 'gateway_requests_total{route="/v1/chat/completions",method="POST",status="200",key_owner="alice"}') == 1
    assert sample(lines, 'gateway_requests_total{route="/v1/chat/completions",method="POST",status="401",key_owner="none"}') == 1
    # Unknown paths fold into one label value.
    assert sample(lines, 'gateway_requests_total{route="other"') == 1


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
    assert figures == {"active": 3, "accepted": 10, "handled": 10, "requests": 42, "reading": 0,
                       "writing": 2, "waiting": 1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_process_receives_syslog_and_serves_metrics():
    http_port, syslog_port = free_port(), free_port()
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--listen-port", str(http_port),
                                "--syslog-port", str(syslog_port), "--stub-status-url", "http://127.0.0.1:1/"],
                               stderr=subprocess.PIPE, text=True)
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
            if any(line.startswith('gateway_requests_total{') and 'status="429"' in line and line.endswith(" 3")
                   for line in lines):
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
