"""The one config of the stack's monitoring: selectors, windows, thresholds, objectives, the
histogram buckets of each source, and where each alert's runbook is. rules.py and dashboards.py
read it; nothing else writes these values.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from functools import cache
from types import ModuleType

from llmstack import REPO_ROOT, replicas

# --- Scraping ----------------------------------------------------------------------------------
SCRAPE_INTERVAL_SECONDS = 5
"""Prometheus' one scrape interval; Grafana's datasource timeInterval is written from it too."""
RATE_WINDOW = "1m"
"""Window of the recording rules (12 scrapes): long enough for Prometheus 3's left-open ranges."""

DATASOURCE_UID = "llm-stack-prometheus"

# --- Replicas and the router ------------------------------------------------------------------
VLLM_JOB = "vllm"


def replica_services() -> tuple[str, ...]:
    """The compose service of each replica the stack can run (llmstack/replicas.py names them:
    vllm, vllm-2, ...); Prometheus looks each up by DNS, so one that is not running is simply no
    target, and each replica's instance label is its service name."""
    return tuple(replicas.replica_name(index) for index in range(replicas.MAX_REPLICAS))


VLLM_PORT = replicas.PORT
ROUTER_JOB = "router"
ROUTER_METRICS_PORT = 29000
"""vllm-router's --prometheus-port default (it binds 127.0.0.1 unless --prometheus-host says otherwise)."""
ROUTER_WORKER_PATTERN = r"https?://([^:/]+).*"
"""The router labels its series with the worker's URL (worker="http://vllm-2:8000"); Prometheus
copies the host into `replica`, the value the replica's own instance label has."""

# --- Selectors ---------------------------------------------------------------------------------
DASHBOARD_VLLM = 'model_name=~"$model_name", instance=~"$instance"'
"""Every vLLM query on a dashboard filters by the two menus (their values come from a vllm: metric)."""
API_ROUTE_MATCHER = 'route=~"/v1/.*"'
"""The gateway's API routes: nginx logs each allowlisted location's name (set $gateway_route)."""
SERVER_ERROR_STATUS = "5[0-9][0-9]"
"""A character class, not "5..": Prometheus 3's "." also matches a newline."""
SERVER_ERROR_MATCHER = f'status=~"{SERVER_ERROR_STATUS}"'

# --- Alert thresholds and windows ---------------------------------------------------------------
KV_CACHE_FULL_RATIO = 0.9
KV_CACHE_WARNING_RATIO = 0.75
"""Only a colour on the KV cache gauge (orange from here), no alert."""
KV_CACHE_FULL_FOR = "5m"
PREEMPTION_WINDOW = "5m"
PREEMPTION_FOR = "5m"
QUEUE_GROWTH_WINDOW = "5m"
QUEUE_GROWTH_FOR = "5m"
VLLM_DOWN_FOR = "1m"
TTFT_OVER_SLO_FOR = "10m"
GATEWAY_5XX_RATIO = 0.05
GATEWAY_5XX_WINDOW = "5m"
GATEWAY_5XX_FOR = "5m"
REPLICA_DOWN_FOR = VLLM_DOWN_FOR
ROUTER_DOWN_FOR = "1m"
LOAD_IMBALANCE_RATIO = 3.0
"""A replica carrying this many times the mean load (running + waiting) of the others is imbalanced."""
LOAD_IMBALANCE_MIN_REQUESTS = 8
"""Requests running + waiting over all replicas below which no imbalance is reported (idle noise)."""
LOAD_IMBALANCE_WINDOW = "2m"
LOAD_IMBALANCE_FOR = "10m"

# --- Usage by API key ----------------------------------------------------------------------------
TOP_KEYS = 10
"""Keys shown in the gateway dashboard's "Top keys by tokens" panel."""

# --- Objectives (each a bucket boundary of its vLLM histogram; a test checks) --------------------
SLO_TTFT_P95_SECONDS = 0.5
SLO_TPOT_SECONDS = 0.05

# --- Runbooks ------------------------------------------------------------------------------------
RUNBOOK_PAGE = "docs/runbook.md"
"""One page holds every alert's runbook, one heading each; alerts link to it with runbook_url (a
path in this repository: prefix it with where your copy is browsable if your alerts leave the host)."""


def runbook_url(alert: str) -> str:
    """docs/runbook.md#<alert in lower case>: the anchor a Markdown heading `## <Alert>` gets."""
    return f"{RUNBOOK_PAGE}#{alert.lower()}"


# --- Histogram buckets of each source ------------------------------------------------------------
# vLLM 0.32.0 (the CPU build this stack runs), vllm/v1/metrics/buckets.py: the families
# INTER_TOKEN_LATENCY_BUCKETS (inter-token latency and request time per output token),
# TIME_TO_FIRST_TOKEN_BUCKETS and REQUEST_LATENCY_BUCKETS (e2e, queue, prefill, decode, inference),
# used by vllm/v1/metrics/loggers.py. Not checked against vLLM 0.24.0 (the GPU image): check
# again when a vLLM version changes; --custom-histogram-buckets (vLLM 0.32) can make them finer.
# fmt: off
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)
VLLM_INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on


@dataclass(frozen=True)
class LatencyHistogram:
    """One of vLLM's latency histograms, and the fastest value it must show on a GPU."""

    name: str
    """The metric without the vllm: prefix and the _bucket/_sum/_count suffix."""
    title: str
    buckets: tuple[float, ...]
    gpu_seconds: float
    """What an H200 measures (docs/gpu-results.md): 12 ms TTFT, 1.6 ms TPOT, ~0.1 s for 50 tokens."""

    @property
    def resolves_gpu_speed(self) -> bool:
        """Whether a quantile at GPU speed lands above the first bucket, where it is not made up."""
        return self.buckets[0] < self.gpu_seconds


TTFT = LatencyHistogram("time_to_first_token_seconds", "Time to first token (TTFT)", VLLM_TTFT_BUCKETS, 0.012)
ITL = LatencyHistogram("inter_token_latency_seconds", "Inter-token latency (ITL)", VLLM_INTER_TOKEN_BUCKETS, 0.0016)
TPOT = LatencyHistogram(
    "request_time_per_output_token_seconds", "Time per output token (TPOT)", VLLM_INTER_TOKEN_BUCKETS, 0.0016
)
E2E = LatencyHistogram("e2e_request_latency_seconds", "End-to-end request latency", VLLM_REQUEST_LATENCY_BUCKETS, 0.1)
QUEUE = LatencyHistogram("request_queue_time_seconds", "Queue time", VLLM_REQUEST_LATENCY_BUCKETS, 0.0001)
PREFILL = LatencyHistogram("request_prefill_time_seconds", "Prefill time", VLLM_REQUEST_LATENCY_BUCKETS, 0.01)
DECODE = LatencyHistogram("request_decode_time_seconds", "Decode time", VLLM_REQUEST_LATENCY_BUCKETS, 0.1)
QUANTILE_HISTOGRAMS = (TTFT, ITL, TPOT, E2E)
"""Shown as quantiles and mean on the latency dashboard."""
PHASE_HISTOGRAMS = (QUEUE, PREFILL, DECODE)
"""Shown as means only (sum/count), stacked."""
QUANTILES = (0.5, 0.9, 0.95, 0.99)
TTFT_ALERT_QUANTILE = 0.95


@cache
def gateway_exporter() -> ModuleType:
    """images/gateway-exporter/gateway_exporter.py (standard library only, so it runs in any python
    image): the one place of its port and its histogram buckets."""
    path = REPO_ROOT / "images" / "gateway-exporter" / "gateway_exporter.py"
    spec = importlib.util.spec_from_file_location("gateway_exporter", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def histogram_buckets() -> dict[str, tuple[float, ...]]:
    """Bucket upper bounds of every histogram a rule or panel reads, by metric name (no suffix).

    The load generator's come from loadtest/metrics.py, the gateway's from its exporter."""
    exporter = gateway_exporter()
    found = {f"vllm:{h.name}": h.buckets for h in (*QUANTILE_HISTOGRAMS, *PHASE_HISTOGRAMS)}
    found.update({name: buckets for name, (_, buckets) in exporter.GatewayMetrics.HISTOGRAMS.items()})
    found.update(
        {
            f"loadtest_{name}": loadtest_buckets()
            for name in (
                "time_to_first_token_seconds",
                "time_per_output_token_seconds",
                "inter_chunk_interval_seconds",
                "e2e_request_latency_seconds",
            )
        }
    )
    return found


# --- Metric names that rules and panels may read, by source ----------------------------------------
VLLM_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:cache_config_info",
)
"""vLLM's own names (the V1 engine's, vLLM 0.32.0) besides its latency histograms above."""
# vllm-router 0.1.17 (PyPI wheel; src/metrics.rs of github.com/vllm-project/router): every name is
# in the wheel's vllm_router_rs.abi3.so, and prometheus/tests/recorded/vllm-router-0.1.17.metrics is
# a page the real 0.1.17 router served (its labels: worker is the worker's URL as given to
# --worker-urls). Most are made at the first event: retries and errors only after one, running
# requests and prefix-routing decisions only under cache_aware.
ROUTER_METRICS = (
    "vllm_router_requests_total",  # route
    "vllm_router_request_errors_total",  # route, error_type
    "vllm_router_retries_total",  # route
    "vllm_router_retries_exhausted_total",  # route
    "vllm_router_active_workers",
    "vllm_router_worker_health",  # worker: 1 healthy, 0 not (after --health-failure-threshold checks)
    "vllm_router_processed_requests_total",  # worker: every attempt sent, retried ones too
    "vllm_router_policy_decisions_total",  # policy, worker
    "vllm_router_prefix_routing_decisions_total",  # policy, stage, outcome (prefix_hit, prefix_miss, ...)
    "vllm_router_running_requests",  # worker
    "vllm_router_cb_state",  # worker: circuit breaker 0 closed, 1 open, 2 half open
    "vllm_router_cb_outcomes_total",  # worker, outcome (success, failure)
    "vllm_router_cb_state_transitions_total",  # worker, from, to
)
DCGM_METRICS = ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_UTIL")
PROMETHEUS_METRICS = ("up",)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def source_metric_names() -> set[str]:
    """Every metric name an exporter of the stack writes that a rule or panel may read: vLLM's,
    the router's, the gateway exporter's (declared in its code), the load generator's (read from
    its code), DCGM's and Prometheus' own. A name outside these and the recording rules is a typo or a
    metric nobody exports (tests/unit/test_dashboards.py and test_prometheus_rules.py check)."""
    histograms = {f"vllm:{h.name}" for h in (*QUANTILE_HISTOGRAMS, *PHASE_HISTOGRAMS)} | loadtest_histograms()
    names = {f"{name}{suffix}" for name in histograms for suffix in HISTOGRAM_SUFFIXES}
    names |= {f"{name}_total" for name in loadtest_counters()}
    names |= set(VLLM_METRICS) | set(ROUTER_METRICS) | set(DCGM_METRICS) | set(PROMETHEUS_METRICS)
    return names | gateway_exporter().GatewayMetrics.metric_names()


def _loadtest_metrics(kind: str) -> set[str]:
    """Names of the prometheus_client metrics of one kind (Histogram, Counter) that
    loadtest/metrics.py defines, read without importing Locust."""
    tree = ast.parse((REPO_ROOT / "loadtest" / "metrics.py").read_text())
    return {
        str(node.args[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == kind
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }


def loadtest_histograms() -> set[str]:
    return _loadtest_metrics("Histogram")


def loadtest_counters() -> set[str]:
    return _loadtest_metrics("Counter")


def loadtest_buckets() -> tuple[float, ...]:
    """_LATENCY_BUCKETS of loadtest/metrics.py, read without importing Locust (which patches the
    standard library when imported)."""
    tree = ast.parse((REPO_ROOT / "loadtest" / "metrics.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LATENCY_BUCKETS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError("loadtest/metrics.py has no _LATENCY_BUCKETS")
