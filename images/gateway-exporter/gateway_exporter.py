#!/usr/bin/env python3
"""Prometheus metrics for the nginx gateway, from its JSON access log and its stub_status page.

nginx sends every access-log line (the gateway_json format of nginx/nginx.conf) to this process
over syslog (UDP); this turns them into counters and histograms: requests by route (the name of the
allowlisted nginx location that answered, or "other": nginx sets it, so no list is kept here), status and
key owner, total request time, vLLM's (upstream) time to headers and to the last byte, and the
time the gateway itself adds. At each scrape it also reads nginx's stub_status page for the
connection gauges (named as the official nginx-prometheus-exporter names them).
Standard library only, so it runs unchanged in the official python image and in Debian's python3.
`--healthcheck` is the container's health check: it asks this exporter's own /healthz.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import socket
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

METRICS_PORT = 9113
"""The one place of this port: prometheus.yml is generated from it (llmstack/observability/rules.py)."""
SYSLOG_PORT = 5140
# nginx logs a fixed route name per location; a longer value is not from nginx.conf.
MAX_ROUTE_LENGTH = 64
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
ADDED_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def route_label(route: str) -> str:
    return route if 0 < len(route) <= MAX_ROUTE_LENGTH else "other"


def upstream_seconds(value: str) -> float | None:
    """nginx writes "-" or "" when no upstream answered, and "a, b" (or "a : b") when it tried
    several; the time spent upstream is their sum."""
    total, seen = 0.0, False
    for part in value.replace(":", ",").split(","):
        part = part.strip()
        if part and part != "-":
            total += float(part)
            seen = True
    return total if seen else None


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


def format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1
        self.total += value
        self.count += 1

    def samples(self, name: str, labels: dict[str, str]) -> list[str]:
        lines = [
            f"{name}_bucket{format_labels({**labels, 'le': format_value(bound)})} {count}"
            for bound, count in zip(self.buckets, self.counts, strict=True)
        ]
        lines.append(f"{name}_bucket{format_labels({**labels, 'le': '+Inf'})} {self.count}")
        lines.append(f"{name}_sum{format_labels(labels)} {format_value(self.total)}")
        lines.append(f"{name}_count{format_labels(labels)} {self.count}")
        return lines


class GatewayMetrics:
    """The gateway's counters and histograms; fed one access-log entry at a time."""

    HISTOGRAMS: ClassVar[dict[str, tuple[str, tuple[float, ...]]]] = {
        "gateway_request_duration_seconds": (
            "Time from the first byte of the request to the last byte of the response.",
            REQUEST_BUCKETS,
        ),
        "gateway_upstream_header_duration_seconds": (
            "Time until vLLM's response headers arrived (upstream_header_time).",
            REQUEST_BUCKETS,
        ),
        "gateway_upstream_response_duration_seconds": (
            "Time until vLLM's last byte arrived (upstream_response_time).",
            REQUEST_BUCKETS,
        ),
        "gateway_added_latency_seconds": (
            "Request time minus upstream response time: what the gateway adds to a proxied request.",
            ADDED_LATENCY_BUCKETS,
        ),
    }

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str, str, str], int] = {}
        # A counter that first appears with a value above zero loses that first step in
        # Prometheus' rate() and increase(): a burst of 429s would never show. A new label set is
        # therefore exported at 0 once, and its counts join at the following scrape.
        self.pending_requests: dict[tuple[str, str, str, str], int] = {}
        self.response_bytes: dict[str, float] = {}
        self.histograms: dict[str, dict[str, Histogram]] = {name: {} for name in self.HISTOGRAMS}
        self.log_lines = {"parsed": 0, "invalid": 0}

    def observe_line(self, line: str) -> bool:
        """Count one access-log line (a syslog datagram or the bare JSON); False if unusable."""
        start = line.find("{")
        try:
            entry = json.loads(line[start:]) if start >= 0 else None
            if not isinstance(entry, dict):
                raise ValueError("not a JSON object")
            self.observe(entry)
        except (ValueError, KeyError, TypeError):
            with self.lock:
                self.log_lines["invalid"] += 1
            return False
        return True

    def observe(self, entry: dict) -> None:
        route = route_label(str(entry["route"]))
        status = str(int(entry["status"]))
        method = str(entry.get("method") or "-")[:10]
        owner = str(entry.get("key_owner") or "") or "none"
        request_time = float(entry["request_time"])
        header_time = upstream_seconds(str(entry.get("upstream_header_time", "")))
        response_time = upstream_seconds(str(entry.get("upstream_response_time", "")))
        with self.lock:
            key = (route, method, status, owner)
            if key in self.requests:
                self.requests[key] += 1
            else:
                self.pending_requests[key] = self.pending_requests.get(key, 0) + 1
            self.response_bytes[route] = self.response_bytes.get(route, 0) + float(entry.get("bytes_sent", 0))
            self._histogram("gateway_request_duration_seconds", route).observe(request_time)
            if header_time is not None:
                self._histogram("gateway_upstream_header_duration_seconds", route).observe(header_time)
            if response_time is not None:
                self._histogram("gateway_upstream_response_duration_seconds", route).observe(response_time)
                self._histogram("gateway_added_latency_seconds", route).observe(max(0.0, request_time - response_time))
            self.log_lines["parsed"] += 1

    def _histogram(self, name: str, route: str) -> Histogram:
        per_route = self.histograms[name]
        if route not in per_route:
            per_route[route] = Histogram(self.HISTOGRAMS[name][1])
        return per_route[route]

    def exposition(self) -> list[str]:
        with self.lock:
            lines = [
                "# HELP gateway_requests_total Requests answered by the gateway, from its access log.",
                "# TYPE gateway_requests_total counter",
            ]
            shown = {**self.requests, **{key: 0 for key in self.pending_requests}}
            for (route, method, status, owner), count in sorted(shown.items()):
                labels = {"route": route, "method": method, "status": status, "key_owner": owner}
                lines.append(f"gateway_requests_total{format_labels(labels)} {count}")
            self.requests.update(self.pending_requests)
            self.pending_requests.clear()
            lines += [
                "# HELP gateway_response_bytes_total Bytes sent to clients.",
                "# TYPE gateway_response_bytes_total counter",
            ]
            for route, total in sorted(self.response_bytes.items()):
                lines.append(f"gateway_response_bytes_total{format_labels({'route': route})} {format_value(total)}")
            for name, (help_text, _) in self.HISTOGRAMS.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
                for route, histogram in sorted(self.histograms[name].items()):
                    lines += histogram.samples(name, {"route": route})
            lines += [
                "# HELP gateway_log_lines_total Access-log lines received, by whether they parsed.",
                "# TYPE gateway_log_lines_total counter",
            ]
            for result, count in sorted(self.log_lines.items()):
                lines.append(f"gateway_log_lines_total{format_labels({'result': result})} {count}")
        return lines


def parse_stub_status(text: str) -> dict[str, float]:
    """nginx's stub_status page -> its figures (the format is fixed since nginx 1.1)."""
    lines = text.strip().splitlines()
    if len(lines) < 4 or not lines[0].startswith("Active connections:"):
        raise ValueError("not an nginx stub_status page")
    accepted, handled, requests = (float(v) for v in lines[2].split())
    fields = lines[3].split()
    return {
        "active": float(lines[0].split(":")[1]),
        "accepted": accepted,
        "handled": handled,
        "requests": requests,
        "reading": float(fields[1]),
        "writing": float(fields[3]),
        "waiting": float(fields[5]),
    }


def stub_status_exposition(url: str) -> list[str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            figures = parse_stub_status(response.read().decode())
    except (OSError, ValueError, urllib.error.URLError):
        figures = None
    lines = [
        "# HELP nginx_up Whether the last read of nginx's stub_status page worked.",
        "# TYPE nginx_up gauge",
        f"nginx_up {0 if figures is None else 1}",
    ]
    if figures is None:
        return lines
    for state in ("active", "reading", "writing", "waiting"):
        lines += [f"# TYPE nginx_connections_{state} gauge", f"nginx_connections_{state} {figures[state]}"]
    for counter in ("accepted", "handled"):
        lines += [
            f"# TYPE nginx_connections_{counter}_total counter",
            f"nginx_connections_{counter}_total {figures[counter]}",
        ]
    lines += ["# TYPE nginx_http_requests_total counter", f"nginx_http_requests_total {figures['requests']}"]
    return lines


def make_handler(metrics: GatewayMetrics, stub_status_url: str):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                lines = metrics.exposition() + stub_status_exposition(stub_status_url)
                self.reply(200, "\n".join(lines) + "\n", CONTENT_TYPE)
            elif self.path == "/healthz":
                self.reply(200, "ok\n", "text/plain")
            else:
                self.reply(404, "not found: try /metrics\n", "text/plain")

        def reply(self, code: int, body: str, content_type: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:
            # Prometheus scrapes every few seconds; its requests are not news.
            pass

    return Handler


def receive_syslog(sock: socket.socket, metrics: GatewayMetrics) -> None:
    while True:
        datagram, _ = sock.recvfrom(65535)
        metrics.observe_line(datagram.decode("utf-8", errors="replace"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument(
        "--listen-port", type=int, default=METRICS_PORT, help=f"HTTP port for /metrics (default {METRICS_PORT})"
    )
    parser.add_argument(
        "--syslog-port",
        type=int,
        default=SYSLOG_PORT,
        help=f"UDP port nginx sends its access log to (default {SYSLOG_PORT})",
    )
    parser.add_argument(
        "--stub-status-url",
        default="http://nginx:8081/stub_status",
        help="nginx's stub_status page (default http://nginx:8081/stub_status)",
    )
    parser.add_argument(
        "--healthcheck",
        action="store_true",
        help="check the exporter listening on --listen-port and exit 0 (healthy) or 1",
    )
    args = parser.parse_args(argv)
    for name in ("listen_port", "syslog_port"):
        if not 0 < getattr(args, name) < 65536:
            parser.error(f"--{name.replace('_', '-')} must be a port number (1-65535)")
    return args


def healthcheck(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return 0 if response.status == 200 else 1
    except OSError as err:
        print(f"gateway_exporter: unhealthy: {err}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.healthcheck:
        return healthcheck(args.listen_port)
    metrics = GatewayMetrics()
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", args.syslog_port))
        server = ThreadingHTTPServer(("0.0.0.0", args.listen_port), make_handler(metrics, args.stub_status_url))
    except OSError as err:
        print(f"gateway_exporter: cannot listen: {err.strerror}", file=sys.stderr)
        return 1
    threading.Thread(target=receive_syslog, args=(sock, metrics), daemon=True).start()
    print(
        f"gateway_exporter: syslog on udp/{args.syslog_port}, metrics on http://0.0.0.0:{args.listen_port}/metrics, "
        f"stub_status from {args.stub_status_url}",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
