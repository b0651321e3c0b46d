#!/usr/bin/env python3
"""Prometheus metrics for the nginx gateway, from its JSON access log and its stub_status page.

nginx sends every access-log line (the gateway_json format of nginx/nginx.conf) to this process
over syslog (UDP); this turns them into counters and histograms: requests by route (the name of the
allowlisted nginx location that answered, or "other": nginx sets it, so no list is kept here), method,
status and key owner; prompt and completion tokens by key owner and model (from the answer's usage);
refusals by key owner and reason; total request time, vLLM's (upstream) time to headers and to the
last byte, and the time the gateway itself adds. At each scrape it also reads nginx's stub_status
page for the connection gauges (named as the official nginx-prometheus-exporter names them).

Every label value a client can influence is bounded: a method outside the standard ones, a route or
model name of an unexpected shape or length, and an unknown refusal reason are each counted as "other".
Standard library only, so it runs unchanged in the official python image and in Debian's python3.
`--healthcheck` is the container's health check: it asks this exporter's own /healthz.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
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
OTHER = "other"
"""The one value every unexpected label value folds into."""
NONE = "none"
"""The label value for an empty field (no valid key, no model in the answer)."""
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
"""nginx logs the client's method as sent; any other name (they are the client's to invent) is "other"."""
# nginx logs a fixed route name per location (a path, "{id}" for a path parameter); a longer value,
# or one of another shape, is not from nginx.conf.
MAX_ROUTE_LENGTH = 64
ROUTE_SHAPE = re.compile(r"/[A-Za-z0-9_./{}-]*")
# The served model's name, from vLLM's answer: bounded by vLLM, checked here all the same.
MAX_MODEL_LENGTH = 128
MODEL_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]*")
MAX_MODELS = 32
"""Distinct model names kept as labels; later ones count as "other"."""
REFUSAL_REASONS = frozenset(
    {
        # nginx/njs/gateway.js and templates/gateway.conf.template set these in the log's "refusal".
        "missing_api_key",
        "invalid_api_key",
        "n_cap",
        "max_tokens_cap",
        "prompts_cap",
        "prompt_size_cap",
        "invalid_body",
        "tokens_per_minute",
        "tokens_per_day",
        "sequences_in_flight",
        "sequences_cap",
        "rate_limited",
        "credentials_in_query",
        "method_not_allowed",
        "model_not_found",
        "model_unavailable",
    }
)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
ADDED_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def route_label(route: str) -> str:
    return route if len(route) <= MAX_ROUTE_LENGTH and ROUTE_SHAPE.fullmatch(route) else OTHER


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else OTHER


def refusal_label(refusal: str) -> str | None:
    """None when the gateway let the request through ("")."""
    if not refusal:
        return None
    return refusal if refusal in REFUSAL_REASONS else OTHER


def model_shape_label(model: str) -> str:
    if not model:
        return NONE
    return model if len(model) <= MAX_MODEL_LENGTH and MODEL_SHAPE.fullmatch(model) else OTHER


def token_count(value: object) -> int | None:
    """A usage field of the log: decimal digits, or "" when the answer carried no usage."""
    text = str(value) if value is not None else ""
    return int(text) if text.isascii() and text.isdigit() else None


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


class Counter:
    """A counter family. A counter that first appears with a value above zero loses that first
    step in Prometheus' rate() and increase() (a burst of 429s would never show), so a new label
    set is exported at 0 once, and its counts join at the following scrape."""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...]):
        self.name = name
        self.help_text = help_text
        self.labels = labels
        self.values: dict[tuple[str, ...], float] = {}
        self.pending: dict[tuple[str, ...], float] = {}

    def inc(self, label_values: tuple[str, ...], amount: float = 1) -> None:
        if label_values in self.values:
            self.values[label_values] += amount
        else:
            self.pending[label_values] = self.pending.get(label_values, 0) + amount

    def samples(self) -> list[str]:
        """The exposition lines; label sets new since the last call are shown at 0 this once."""
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} counter"]
        shown = {**self.values, **{key: 0.0 for key in self.pending}}
        for key, value in sorted(shown.items()):
            labels = dict(zip(self.labels, key, strict=True))
            lines.append(f"{self.name}{format_labels(labels)} {format_count(value)}")
        self.values.update(self.pending)
        self.pending.clear()
        return lines


def format_count(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else format_value(value)


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

    COUNTERS: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {
        "gateway_requests_total": (
            "Requests answered by the gateway, from its access log.",
            ("route", "method", "status", "key_owner"),
        ),
        "gateway_refusals_total": (
            "Requests the gateway refused itself (vLLM never saw them), by the refusal's reason.",
            ("key_owner", "reason"),
        ),
        "gateway_prompt_tokens_total": (
            "Prompt tokens of answered requests, from the usage of vLLM's answer (streamed or not).",
            ("key_owner", "model"),
        ),
        "gateway_completion_tokens_total": (
            "Completion tokens of answered requests, from the usage of vLLM's answer (streamed or not).",
            ("key_owner", "model"),
        ),
        "gateway_response_bytes_total": ("Bytes sent to clients.", ("route",)),
    }
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
    LOG_LINES = "gateway_log_lines_total"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters = {name: Counter(name, text, labels) for name, (text, labels) in self.COUNTERS.items()}
        self.histograms: dict[str, dict[str, Histogram]] = {name: {} for name in self.HISTOGRAMS}
        self.models: set[str] = set()
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

    def model_label(self, model: str) -> str:
        """The model's name as a label: its shape checked, and at most MAX_MODELS distinct names
        (call with the lock held)."""
        label = model_shape_label(model)
        if label in (NONE, OTHER) or label in self.models:
            return label
        if len(self.models) >= MAX_MODELS:
            return OTHER
        self.models.add(label)
        return label

    def observe(self, entry: dict) -> None:
        route = route_label(str(entry["route"]))
        status = str(int(entry["status"]))
        method = method_label(str(entry.get("method") or ""))
        owner = str(entry.get("key_owner") or "") or NONE
        request_time = float(entry["request_time"])
        header_time = upstream_seconds(str(entry.get("upstream_header_time", "")))
        response_time = upstream_seconds(str(entry.get("upstream_response_time", "")))
        bytes_sent = float(entry.get("bytes_sent", 0))
        reason = refusal_label(str(entry.get("refusal") or ""))
        prompt = token_count(entry.get("prompt_tokens"))
        completion = token_count(entry.get("completion_tokens"))
        with self.lock:
            self.counters["gateway_requests_total"].inc((route, method, status, owner))
            self.counters["gateway_response_bytes_total"].inc((route,), bytes_sent)
            if reason is not None:
                self.counters["gateway_refusals_total"].inc((owner, reason))
            if prompt is not None or completion is not None:
                # Both series appear together, so a panel may add one to the other.
                model = self.model_label(str(entry.get("model") or ""))
                self.counters["gateway_prompt_tokens_total"].inc((owner, model), prompt or 0)
                self.counters["gateway_completion_tokens_total"].inc((owner, model), completion or 0)
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

    @classmethod
    def metric_names(cls) -> set[str]:
        """Every sample name this exporter can write (histograms with their suffixes), for the
        checks of the dashboards and rules (llmstack/observability)."""
        names = set(cls.COUNTERS) | {cls.LOG_LINES} | set(STUB_STATUS_METRICS)
        names |= {f"{name}{suffix}" for name in cls.HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
        return names

    def exposition(self) -> list[str]:
        with self.lock:
            lines = []
            for counter in self.counters.values():
                lines += counter.samples()
            for name, (help_text, _) in self.HISTOGRAMS.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
                for route, histogram in sorted(self.histograms[name].items()):
                    lines += histogram.samples(name, {"route": route})
            lines += [
                f"# HELP {self.LOG_LINES} Access-log lines received, by whether they parsed.",
                f"# TYPE {self.LOG_LINES} counter",
            ]
            for result, count in sorted(self.log_lines.items()):
                lines.append(f"{self.LOG_LINES}{format_labels({'result': result})} {count}")
        return lines


STUB_STATUS_GAUGES = ("active", "reading", "writing", "waiting")
STUB_STATUS_COUNTERS = ("accepted", "handled")
STUB_STATUS_METRICS = (
    "nginx_up",
    *(f"nginx_connections_{state}" for state in STUB_STATUS_GAUGES),
    *(f"nginx_connections_{counter}_total" for counter in STUB_STATUS_COUNTERS),
    "nginx_http_requests_total",
)
"""What stub_status_exposition writes, named as the official nginx-prometheus-exporter names them."""


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
    for state in STUB_STATUS_GAUGES:
        lines += [f"# TYPE nginx_connections_{state} gauge", f"nginx_connections_{state} {figures[state]}"]
    for counter in STUB_STATUS_COUNTERS:
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
