"""Where each request's figures go: Locust's statistics, Prometheus, and an in-process record list.

Locust buckets response times to whole milliseconds below 100 ms (locust.stats.bucket_response_time),
which would turn a 1.6 ms token interval into 2 ms. Its docs allow replacing that function; ours keeps
three significant figures down to 0.01 ms, so the web UI's percentiles stay exact at GPU speeds.
The headless tables never use Locust's buckets: they are computed from the raw records.
"""

from __future__ import annotations

import os

import locust.stats
from locust import events
from prometheus_client import Counter, Histogram, start_http_server

from llmstack.sse import RequestRecord
from loadtest.buckets import precise_bucket

# Locust entries: request_type (the web UI's "Type" column) for each client-side measurement.
TTFT = "TTFT"
TPOT = "TPOT"
CHUNK_GAP = "ITL"
E2E = "E2E"

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_LABELS = ("endpoint", "kind")
PROM_TTFT = Histogram(
    "loadtest_time_to_first_token_seconds",
    "Client-side TTFT: request sent to first chunk with text.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
)
PROM_TPOT = Histogram(
    "loadtest_time_per_output_token_seconds",
    "Client-side (E2E - TTFT) / (output tokens - 1).",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
)
PROM_GAP = Histogram(
    "loadtest_inter_chunk_interval_seconds",
    "Client-side gap between consecutive chunks with text.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
)
PROM_E2E = Histogram(
    "loadtest_e2e_request_latency_seconds",
    "Client-side request latency, to the last byte.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
)
PROM_REQUESTS = Counter("loadtest_requests", "Requests sent by the load generator.", (*_LABELS, "outcome"))
PROM_TOKENS = Counter("loadtest_output_tokens", "Output tokens received (server's usage).", _LABELS)

RECORDS: list[RequestRecord] = []
# Only the experiments keep every record (for their tables); a long web-UI run must not grow memory.
KEEP_RECORDS = False
_exporter_started = False


def install_precise_buckets() -> None:
    locust.stats.bucket_response_time = precise_bucket


def start_exporter() -> None:
    """Serve /metrics on LOADTEST_METRICS_PORT (default 9646) once per process; 0 turns it off."""
    global _exporter_started
    port = int(os.environ.get("LOADTEST_METRICS_PORT", "9646"))
    if _exporter_started or port == 0:
        return
    try:
        start_http_server(port)
    except OSError:
        return  # another process in this container serves it already (e.g. master beside a worker)
    _exporter_started = True


def entry_name(record: RequestRecord) -> str:
    name = record.endpoint + (" stream" if record.streamed else "")
    if record.tag:
        name += f" {record.tag}"
    if record.step is not None:
        name += f" [c={record.step}]"
    return name


def publish(record: RequestRecord) -> None:
    """Report one finished request everywhere: Locust entries, Prometheus, the record list."""
    if KEEP_RECORDS:
        RECORDS.append(record)
    labels = (record.endpoint, record.kind)
    name = entry_name(record)
    PROM_REQUESTS.labels(*labels, "ok" if record.ok else "error").inc()
    exception = RuntimeError(record.error) if record.error else None
    fire = events.request.fire
    fire(
        request_type=E2E,
        name=name,
        response_time=record.e2e * 1000,
        response_length=record.output_tokens,
        exception=exception,
        context={},
    )
    if not record.ok:
        return
    PROM_E2E.labels(*labels).observe(record.e2e)
    PROM_TOKENS.labels(*labels).inc(record.output_tokens)
    if not record.streamed:
        return
    if record.ttft is not None:
        PROM_TTFT.labels(*labels).observe(record.ttft)
        fire(
            request_type=TTFT,
            name=name,
            response_time=record.ttft * 1000,
            response_length=0,
            exception=None,
            context={},
        )
    if record.tpot is not None:
        PROM_TPOT.labels(*labels).observe(record.tpot)
        fire(
            request_type=TPOT,
            name=name,
            response_time=record.tpot * 1000,
            response_length=0,
            exception=None,
            context={},
        )
    for gap in record.chunk_gaps:
        PROM_GAP.labels(*labels).observe(gap)
        fire(
            request_type=CHUNK_GAP,
            name=name,
            response_time=gap * 1000,
            response_length=0,
            exception=None,
            context={},
        )
