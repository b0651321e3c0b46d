"""The Grafana dashboards, generated from config.py (generate.py writes the JSON under
grafana/dashboards/). Every vLLM query selects with $model_name and $instance; both variables take
their values from a vllm: metric, so other exporters' labels never appear in the menus.

Quantiles of a histogram are only as fine as its buckets: every quantile line is hidden while it
is at or below its histogram's first bucket (where histogram_quantile interpolates from nothing)
and its legend says so; the mean from _sum/_count is exact and is the main line.
"""

from __future__ import annotations

from typing import Any

from llmstack.observability import config, rules
from llmstack.observability.config import LatencyHistogram

DATASOURCE = {"type": "prometheus", "uid": config.DATASOURCE_UID}
SCHEMA_VERSION = 39
VLLM = config.DASHBOARD_VLLM
API_ROUTES = config.API_ROUTE_MATCHER
GRID_WIDTH = 24
Panel = dict[str, Any]


def duration_text(seconds: float) -> str:
    """0.01 -> '10 ms', 0.0005 -> '0.5 ms', 0.3 -> '300 ms', 2.5 -> '2.5 s'."""
    return f"{seconds * 1000:g} ms" if seconds < 1 else f"{seconds:g} s"


def percent_text(ratio: float) -> str:
    return f"{ratio * 100:g}%"


def resolution_legend(quantile: float, first_bucket: float, prefix: str = "") -> str:
    return f"{prefix}p{round(quantile * 100)} (hidden at or below the first bucket, {duration_text(first_bucket)})"


def quantile_expr(quantile: float, buckets: str, first_bucket: float) -> str:
    """A quantile line that only exists where the buckets resolve it."""
    return f"histogram_quantile({quantile}, {buckets}) > {first_bucket}"


# --- Building blocks --------------------------------------------------------------------------


def target(expr: str, legend: str = "", **extra) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto", "range": True, **extra}


def panel(
    kind: str,
    title: str,
    targets: list[dict],
    width: int,
    height: int,
    description: str,
    unit: str = "short",
    **options,
) -> dict:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [{"refId": chr(ord("A") + i), **t} for i, t in enumerate(targets)],
        "gridPos": {"w": width, "h": height},
        "fieldConfig": {
            "defaults": {"unit": unit, **options.pop("defaults", {})},
            "overrides": options.pop("overrides", []),
        },
        **options,
    }


def timeseries(
    title: str,
    targets: list[dict],
    description: str,
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    stack: bool = False,
    **options,
) -> dict:
    custom = {
        "lineWidth": 1,
        "fillOpacity": 20 if stack else 5,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none"},
    }
    defaults = {"custom": custom, **options.pop("defaults", {})}
    return panel(
        "timeseries",
        title,
        targets,
        width,
        height,
        description,
        unit,
        defaults=defaults,
        options={
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max", "lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        **options,
    )


def stat(
    title: str, targets: list[dict], description: str, unit: str = "short", width: int = 6, height: int = 5, **options
) -> dict:
    return panel(
        "stat",
        title,
        targets,
        width,
        height,
        description,
        unit,
        options={
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
        **options,
    )


def heatmap(title: str, metric: str, description: str) -> dict:
    # A rate, not increase(): $__rate_interval windows overlap from one cell to the next, so
    # increase() would count each observation in several cells.
    expr = f"sum by (le) (rate({metric}_bucket{{{VLLM}}}[$__rate_interval]))"
    return panel(
        "heatmap",
        title,
        [target(expr, "{{le}}", format="heatmap")],
        12,
        9,
        description,
        "s",
        options={
            "calculate": False,
            "yAxis": {"unit": "s"},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Spectral", "steps": 64},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"show": True, "yHistogram": True},
        },
    )


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": GRID_WIDTH, "h": 1}}


def color_override(name: str, color: str) -> dict:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}],
    }


def query_variable(name: str, label: str, query: str, multi: bool = True, hide: int = 0) -> dict:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "refresh": 2,
        "multi": multi,
        "includeAll": multi,
        "current": {},
        "options": [],
        "sort": 1,
        "hide": hide,
        "regex": "",
    }


def constant_variable(name: str, value: str) -> dict:
    return {
        "type": "constant",
        "name": name,
        "query": value,
        "hide": 2,
        "current": {"text": value, "value": value},
        "options": [{"text": value, "value": value, "selected": True}],
    }


VLLM_VARIABLES = [
    query_variable("model_name", "Model", "label_values(vllm:num_requests_running, model_name)"),
    query_variable(
        "instance", "vLLM replica", 'label_values(vllm:num_requests_running{model_name=~"$model_name"}, instance)'
    ),
]


def layout(panels: list[dict]) -> list[dict]:
    """Place panels left to right, wrapping at the grid's width; rows start a new line."""
    x = y = line_height = 0
    for index, item in enumerate(panels, start=1):
        item["id"] = index
        width, height = item["gridPos"]["w"], item["gridPos"]["h"]
        if item["type"] == "row" or x + width > GRID_WIDTH:
            y, x, line_height = y + line_height, 0, 0
        item["gridPos"].update(x=x, y=y)
        x += width
        line_height = max(line_height, height)
        if item["type"] == "row":
            y, x, line_height = y + height, 0, 0
    return panels


def dashboard(uid: str, title: str, description: str, panels: list[dict], variables: list[dict]) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["llm-stack"],
        "editable": False,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "timezone": "browser",
        "templating": {"list": variables},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["llm-stack"], "asDropdown": True, "title": "LLM stack"}],
        "panels": layout(panels),
    }


# --- Dashboard 1: KV cache and memory ---------------------------------------------------------


def kv_cache_dashboard() -> dict:
    kv_usage = f"vllm:kv_cache_usage_perc{{{VLLM}}}"
    # Newer vLLM releases also label kv_cache_size_tokens and kv_cache_memory_bytes; older ones
    # leave those columns empty, and the table computes blocks x block size either way.
    budget_table = target(
        "max by (instance, num_gpu_blocks, block_size, kv_cache_size_tokens, kv_cache_memory_bytes, "
        "cache_dtype, gpu_memory_utilization) "
        '(vllm:cache_config_info{instance=~"$instance"})',
        format="table",
        instant=True,
        range=False,
    )
    gpu_total = "sum by (gpu) (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) * 1048576"
    panels = [
        row("KV cache"),
        timeseries(
            "KV cache usage (max and mean over replicas)",
            [
                target(f"max({kv_usage})", "max over replicas"),
                target(f"avg({kv_usage})", "mean over replicas"),
            ],
            "Share of vLLM's KV cache blocks in use. Replicas each have their own cache, so usage is "
            "never summed: the fullest replica (max) decides when requests queue or are preempted.",
            "percentunit",
            width=16,
            defaults={"min": 0, "max": 1},
        ),
        panel(
            "gauge",
            "KV cache usage now (fullest replica)",
            [target(f"max({kv_usage})", "fullest replica")],
            8,
            8,
            f"Above {percent_text(config.KV_CACHE_FULL_RATIO)} for {config.KV_CACHE_FULL_FOR} "
            "fires VLLMKVCacheNearlyFull.",
            "percentunit",
            defaults={
                "min": 0,
                "max": 1,
                "thresholds": {
                    "mode": "absolute",
                    "steps": [
                        {"color": "green", "value": None},
                        {"color": "orange", "value": config.KV_CACHE_WARNING_RATIO},
                        {"color": "red", "value": config.KV_CACHE_FULL_RATIO},
                    ],
                },
            },
            options={
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "showThresholdMarkers": True,
            },
        ),
        panel(
            "table",
            "KV cache budget (vllm:cache_config_info)",
            [budget_table],
            24,
            5,
            "What vLLM allocated at start: blocks x tokens per block = tokens the cache holds "
            "across all running requests.",
            "none",
            transformations=[
                {"id": "labelsToFields", "options": {}},
                {
                    "id": "convertFieldType",
                    "options": {
                        "conversions": [
                            {"targetField": "num_gpu_blocks", "destinationType": "number"},
                            {"targetField": "block_size", "destinationType": "number"},
                            {"targetField": "kv_cache_size_tokens", "destinationType": "number"},
                            {"targetField": "kv_cache_memory_bytes", "destinationType": "number"},
                        ],
                        "fields": {},
                    },
                },
                {
                    "id": "calculateField",
                    "options": {
                        "mode": "binary",
                        "alias": "tokens (blocks x block size)",
                        "replaceFields": False,
                        "binary": {"left": "num_gpu_blocks", "operator": "*", "right": "block_size"},
                    },
                },
                {
                    "id": "organize",
                    "options": {
                        "excludeByName": {"Time": True, "Value": True},
                        "renameByName": {
                            "num_gpu_blocks": "blocks",
                            "block_size": "block size (tokens)",
                            "cache_dtype": "cache dtype",
                            "gpu_memory_utilization": "GPU memory fraction",
                        },
                    },
                },
            ],
        ),
        timeseries(
            "Prefix cache hit rate",
            [
                target(
                    f"sum(rate(vllm:prefix_cache_hits_total{{{VLLM}}}[$__rate_interval])) / "
                    f"sum(rate(vllm:prefix_cache_queries_total{{{VLLM}}}[$__rate_interval]))",
                    "hit rate (tokens)",
                ),
            ],
            "Prompt tokens found in the prefix cache / prompt tokens looked up. High means shared "
            "system prompts and multi-turn chats skip their prefill.",
            "percentunit",
            defaults={"min": 0, "max": 1},
        ),
        timeseries(
            "Preemptions per second",
            [
                target(
                    f"sum by (instance) (rate(vllm:num_preemptions_total{{{VLLM}}}[$__rate_interval]))", "{{instance}}"
                ),
            ],
            "Running requests evicted for lack of KV cache blocks (they recompute later). Any within "
            f"{config.PREEMPTION_WINDOW}, for {config.PREEMPTION_FOR}, fires VLLMPreemptionsRising.",
            "short",
        ),
        timeseries(
            "Requests running vs waiting",
            [
                target(f"sum(vllm:num_requests_running{{{VLLM}}})", "running"),
                target(f"sum(vllm:num_requests_waiting{{{VLLM}}})", "waiting"),
            ],
            "Requests in vLLM's running batch and in its queue, summed over replicas.",
            "short",
            width=24,
            overrides=[color_override("running", "green"), color_override("waiting", "orange")],
        ),
        row("GPU memory (GPU setup: NVIDIA DCGM exporter)"),
        timeseries(
            "GPU memory used vs total, with vLLM's share",
            [
                target("sum by (gpu) (DCGM_FI_DEV_FB_USED) * 1048576", "used, GPU {{gpu}}"),
                target(gpu_total, "total, GPU {{gpu}}"),
                target(
                    f"{gpu_total} * $gpu_memory_utilization", "vLLM's limit (x $gpu_memory_utilization), GPU {{gpu}}"
                ),
            ],
            "Frame buffer memory from DCGM. The dashed line is the total times vLLM's "
            "--gpu-memory-utilization (from vllm:cache_config_info): weights, activations and the KV "
            "cache stay below it.",
            "bytes",
            width=16,
            overrides=[
                {
                    "matcher": {"id": "byRegexp", "options": "vLLM's limit.*"},
                    "properties": [
                        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                        {"id": "custom.fillOpacity", "value": 0},
                    ],
                }
            ],
        ),
        timeseries(
            "GPU utilisation",
            [target("DCGM_FI_DEV_GPU_UTIL", "GPU {{gpu}}")],
            "Share of time a kernel was running (DCGM_FI_DEV_GPU_UTIL).",
            "percent",
            width=8,
            defaults={"min": 0, "max": 100},
        ),
    ]
    variables = [
        *VLLM_VARIABLES,
        query_variable(
            "gpu_memory_utilization",
            "vLLM GPU memory fraction",
            'label_values(vllm:cache_config_info{instance=~"$instance"}, gpu_memory_utilization)',
            multi=False,
            hide=2,
        ),
    ]
    return dashboard(
        "llm-kv-cache",
        "LLM stack: KV cache and memory",
        "vLLM's KV cache, prefix cache, preemptions and queue; GPU memory in the GPU setup.",
        panels,
        variables,
    )


# --- Dashboard 2: latency -----------------------------------------------------------------------


def mean_expr(histogram: LatencyHistogram) -> str:
    return f"sum({rules.sum_rate(histogram)}{{{VLLM}}}) / sum({rules.count_rate(histogram)}{{{VLLM}}})"


def quantile_targets(histogram: LatencyHistogram) -> list[dict]:
    """The exact mean (sum/count) first, then the quantiles where the buckets resolve them."""
    buckets = f"sum by (le) ({rules.bucket_rate(histogram)}{{{VLLM}}})"
    first = histogram.buckets[0]
    return [
        target(mean_expr(histogram), "mean"),
        *(target(quantile_expr(q, buckets, first), resolution_legend(q, first)) for q in config.QUANTILES),
    ]


def resolution_note(histogram: LatencyHistogram) -> str:
    """What the panel can show, from vLLM's buckets; and where to look when that is not enough."""
    shown = ", ".join(duration_text(b) for b in histogram.buckets[:4])
    note = (
        f" vLLM's buckets: {shown}, ...; a quantile is only known to within its bucket, and one inside "
        f"the first bucket (0-{duration_text(histogram.buckets[0])}) would be interpolated from nothing, "
        "so quantile lines are hidden there. The mean (_sum/_count) is exact: it is the main line."
    )
    if not histogram.resolves_gpu_speed:
        note += (
            f" On a GPU this is below the first bucket (H200: about {duration_text(histogram.gpu_seconds)}): "
            "read the mean here, and the distribution from the load generator's finer client-side "
            "histogram (loadtest_ metrics of the Locust workers, buckets from "
            f'{duration_text(config.loadtest_buckets()[0])}) in the panel "{CLIENT_PANEL}".'
        )
    return note


CLIENT_PANEL = "At GPU speed: the load generator's TPOT and chunk gaps (client side)"


def client_latency_targets(metric: str, label: str) -> list[dict]:
    """Mean and quantiles of a loadtest_ histogram (finer buckets than vLLM's)."""
    first = config.loadtest_buckets()[0]
    buckets = f"sum by (le) (rate(loadtest_{metric}_bucket[$__rate_interval]))"
    mean = f"sum(rate(loadtest_{metric}_sum[$__rate_interval])) / sum(rate(loadtest_{metric}_count[$__rate_interval]))"
    return [
        target(mean, f"{label} mean"),
        *(target(quantile_expr(q, buckets, first), resolution_legend(q, first, f"{label} ")) for q in (0.5, 0.9)),
    ]


def slo_share(metric: str, variable: str) -> str:
    # Requests at or under the objective / all requests. The objective is a bucket boundary, written
    # as Prometheus 3 normalises le values (0.5, 1.0), which is also how vLLM's client writes them.
    return (
        f'sum(rate(vllm:{metric}_bucket{{{VLLM}, le="${variable}"}}[$__rate_interval])) / '
        f"sum(rate(vllm:{metric}_count{{{VLLM}}}[$__rate_interval]))"
    )


def latency_dashboard() -> dict:
    mean_line = [
        {"matcher": {"id": "byName", "options": "mean"}, "properties": [{"id": "custom.lineWidth", "value": 3}]}
    ]
    descriptions = {
        config.TTFT: "From the request's arrival in vLLM to its first output token: queue + prefill. The "
        f"objective (p{round(config.TTFT_ALERT_QUANTILE * 100)} at "
        f"{duration_text(config.SLO_TTFT_P95_SECONDS)}; VLLMTTFTOverSLO fires after "
        f"{config.TTFT_OVER_SLO_FOR} above it) is the series {rules.SLO_TTFT_SERIES}.",
        config.ITL: "Gap between consecutive output tokens of a request, over every token.",
        config.TPOT: "Per request: decode time / (output tokens - 1).",
        config.E2E: "From arrival in vLLM to the last token (the gateway adds its own share; see the "
        "throughput and gateway dashboard).",
    }
    latency_panels = []
    for histogram, text in descriptions.items():
        targets = quantile_targets(histogram)
        overrides = list(mean_line)
        if histogram is config.TTFT:
            targets.append(target(f"max({rules.SLO_TTFT_SERIES})", "objective"))
            overrides.append(color_override("objective", "red"))
        latency_panels.append(
            timeseries(histogram.title, targets, text + resolution_note(histogram), "s", overrides=overrides)
        )
    panels = [
        row("Mean (exact) and percentiles where vLLM's buckets resolve them (1-minute windows)"),
        *latency_panels,
        timeseries(
            CLIENT_PANEL,
            [
                *client_latency_targets("time_per_output_token_seconds", "TPOT"),
                *client_latency_targets("inter_chunk_interval_seconds", "chunk gap"),
            ],
            "What the Locust workers measured (loadtest/metrics.py), with buckets from "
            f"{duration_text(config.loadtest_buckets()[0])}: at GPU speed (TPOT 1.6-2.3 ms on an H200) the "
            f"source to read, where vLLM's first bucket ({duration_text(config.VLLM_INTER_TOKEN_BUCKETS[0])}) "
            "holds every token. Only while a load test runs; the client's figures include the gateway "
            "and SSE framing.",
            "s",
            width=24,
        ),
        row("Distributions"),
        heatmap(
            "TTFT heatmap",
            "vllm:time_to_first_token_seconds",
            "Requests per second in each TTFT bucket (vLLM's histogram buckets).",
        ),
        heatmap(
            "Inter-token latency heatmap",
            "vllm:inter_token_latency_seconds",
            "Tokens per second in each inter-token-latency bucket. At GPU speed every token is in "
            f"the first bucket (0-{duration_text(config.VLLM_INTER_TOKEN_BUCKETS[0])}).",
        ),
        row("Where the time goes, and the objectives"),
        timeseries(
            "Mean queue / prefill / decode time per request",
            [target(mean_expr(histogram), histogram.title.split()[0].lower()) for histogram in config.PHASE_HISTOGRAMS],
            "Stacked: the parts of a request's time in vLLM. Queue time grows when the server is "
            "saturated; prefill with prompt length; decode with output length.",
            "s",
            stack=True,
        ),
        timeseries(
            "Share of requests inside the objectives",
            [
                target(slo_share(config.TTFT.name, "ttft_slo"), "TTFT <= $ttft_slo s"),
                target(slo_share(config.TPOT.name, "tpot_slo"), "TPOT <= $tpot_slo s"),
            ],
            "Requests whose TTFT (or TPOT) was within the objective, counted from vLLM's histogram "
            "buckets (each objective is a bucket boundary). The objectives are set in "
            "llmstack/observability/config.py.",
            "percentunit",
            defaults={"min": 0, "max": 1},
        ),
    ]
    variables = [
        *VLLM_VARIABLES,
        constant_variable("ttft_slo", str(config.SLO_TTFT_P95_SECONDS)),
        constant_variable("tpot_slo", str(config.SLO_TPOT_SECONDS)),
    ]
    return dashboard(
        "llm-latency",
        "LLM stack: latency",
        "TTFT, inter-token latency, TPOT and end-to-end latency from vLLM's histograms; the "
        "load generator's finer client-side view at GPU speed.",
        panels,
        variables,
    )


# --- Dashboard 3: throughput and gateway --------------------------------------------------------


def histogram_quantiles(
    metric: str, selector: str, label: str, first_bucket: float, quantiles: tuple[float, ...] = (0.5, 0.95, 0.99)
) -> list[dict]:
    buckets = f"sum by (le) (rate({metric}_bucket{{{selector}}}[$__rate_interval]))"
    return [
        target(quantile_expr(q, buckets, first_bucket), resolution_legend(q, first_bucket, f"{label} "))
        for q in quantiles
    ]


def gateway_quantiles(metric: str, label: str) -> list[dict]:
    first = config.gateway_exporter().GatewayMetrics.HISTOGRAMS[metric][1][0]
    return histogram_quantiles(metric, API_ROUTES, label, first)


KEY_TOKENS = {"prompt": "gateway_prompt_tokens_total", "completion": "gateway_completion_tokens_total"}
"""The gateway exporter's token counters, by key owner and model (from the usage of vLLM's answers)."""


def top_keys_expr(count: int = config.TOP_KEYS) -> str:
    """Prompt + completion tokens per key owner over the dashboard's range, the largest first.
    The exporter makes both counters of a key owner together, so the sum misses no key."""
    per_key = [f"sum by (key_owner) (increase({metric}[$__range]))" for metric in KEY_TOKENS.values()]
    return f"topk({count}, {' + '.join(per_key)})"


def usage_panels() -> list[dict]:
    """Tokens and refusals by API key, from the gateway exporter (tokens per key owner and
    model, from the usage of vLLM's answers; refusals by the gateway's reason)."""
    return [
        timeseries(
            "Tokens/s by key",
            [
                target(
                    f"sum by (key_owner) (rate({metric}[$__rate_interval]))",
                    f"{{{{key_owner}}}} {kind}",
                )
                for kind, metric in KEY_TOKENS.items()
            ],
            "Prompt and completion tokens per second, per API key's owner, counted by the gateway from "
            "the usage of each answer vLLM sent (streamed answers too, whether or not the client asked "
            "for usage). Over all keys they add up to vLLM's own token counters.",
            "short",
            width=16,
        ),
        panel(
            "bargauge",
            "Top keys by tokens over the dashboard range",
            [target(top_keys_expr(), "{{key_owner}}", format="table", instant=True, range=False)],
            8,
            8,
            f"The {config.TOP_KEYS} API keys' owners with the most prompt + completion tokens over the "
            "dashboard's time range.",
            "short",
            options={
                "orientation": "horizontal",
                "displayMode": "gradient",
                "showUnfilled": True,
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "/^Value$/", "values": True},
            },
            transformations=[
                {"id": "sortBy", "options": {"sort": [{"field": "Value", "desc": True}]}},
            ],
        ),
        timeseries(
            "Refusals by reason",
            [
                target(
                    "sum by (reason) (rate(gateway_refusals_total[$__rate_interval]))",
                    "{{reason}}",
                ),
            ],
            "Requests the gateway answered itself, vLLM never seeing them: missing or invalid key, a "
            "per-key cap (n, max_tokens, prompts, prompt size), a token budget (per minute, per day), "
            "sequences in flight, the request rate, a key in the query string, an invalid body.",
            "reqps",
            width=24,
            stack=True,
        ),
    ]


def throughput_dashboard() -> dict:
    status_colors = [
        color_override("200", "green"),
        color_override("401", "purple"),
        color_override("429", "orange"),
        {
            "matcher": {"id": "byRegexp", "options": config.SERVER_ERROR_STATUS},
            "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}],
        },
    ]
    panels = [
        row("Tokens"),
        timeseries(
            "Tokens per second",
            [
                target(f"sum({rules.TOKEN_RATES['prompt']}{{{VLLM}}})", "prompt tokens/s"),
                target(f"sum({rules.TOKEN_RATES['generation']}{{{VLLM}}})", "generated tokens/s"),
            ],
            "Prompt tokens prefilled and tokens generated per second, over the selected replicas.",
            "short",
        ),
        timeseries(
            "Finished requests per second, by reason",
            [
                target(f"sum by (finished_reason) ({rules.FINISHED_RATE}{{{VLLM}}})", "{{finished_reason}}"),
            ],
            "stop: the model ended; length: max_tokens reached; abort: the client went away.",
            "reqps",
        ),
        row("Gateway (nginx)"),
        timeseries(
            "API requests per second by status",
            [
                target(
                    f"sum by (status) (rate(gateway_requests_total{{{API_ROUTES}}}[$__rate_interval]))", "{{status}}"
                ),
            ],
            "Every request to /v1/* as the gateway answered it: 401 missing or bad API key, 429 rate "
            "or concurrency limit, 5xx vLLM unreachable or failing.",
            "reqps",
            stack=True,
            overrides=status_colors,
        ),
        stat(
            "Rejected and failed API requests in the time range",
            [
                target(
                    f"sum by (status) (increase(gateway_requests_total{{{API_ROUTES}, "
                    f'status=~"401|403|429|{config.SERVER_ERROR_STATUS}"}}[$__range]))',
                    "{{status}}",
                    instant=True,
                    range=False,
                ),
            ],
            "Counts over the dashboard's time range.",
            "short",
            width=12,
            overrides=status_colors,
        ),
        timeseries(
            "API requests per second by key owner",
            [
                target(
                    f"sum by (key_owner) (rate(gateway_requests_total{{{API_ROUTES}}}[$__rate_interval]))",
                    "{{key_owner}}",
                ),
            ],
            "Which API key's owner sends the traffic ('none': no valid key).",
            "reqps",
        ),
        timeseries(
            "Latency added by the gateway",
            gateway_quantiles("gateway_added_latency_seconds", "added"),
            "nginx's request time minus vLLM's response time, per proxied request: auth, limits and proxying.",
            "s",
        ),
        timeseries(
            "vLLM latency seen by the gateway",
            [
                *gateway_quantiles("gateway_upstream_header_duration_seconds", "headers"),
                *gateway_quantiles("gateway_upstream_response_duration_seconds", "full response"),
            ],
            "Upstream times from nginx's log: until vLLM's response headers, and until its last byte.",
            "s",
        ),
        timeseries(
            "Gateway connections",
            [
                target("nginx_connections_active", "active"),
                target("nginx_connections_writing", "writing (responses in flight)"),
                target("nginx_connections_waiting", "idle keep-alive"),
            ],
            "From nginx's stub_status page.",
            "short",
        ),
        row("Usage and refusals by API key (gateway)"),
        *usage_panels(),
        row("Load generator (while a Locust load test runs)"),
        timeseries(
            "TTFT: load generator (client) vs vLLM (server)",
            [
                *histogram_quantiles(
                    "loadtest_time_to_first_token_seconds", "", "client", config.loadtest_buckets()[0], (0.5, 0.95)
                ),
                *histogram_quantiles(
                    "vllm:time_to_first_token_seconds", VLLM, "server", config.TTFT.buckets[0], (0.5, 0.95)
                ),
            ],
            "The client's TTFT includes the gateway, the network and SSE framing; the gap to vLLM's "
            "own TTFT is what users feel beyond the model server.",
            "s",
            width=24,
        ),
    ]
    return dashboard(
        "llm-throughput-gateway",
        "LLM stack: throughput and gateway",
        "Token throughput, and the gateway's requests by status, key owner and latency; tokens and "
        "refusals by API key.",
        panels,
        VLLM_VARIABLES,
    )


# --- Dashboard 4: replicas and router -------------------------------------------------------------

ROUTER_REPLICA = 'replica=~"$instance"'
"""The router's per-worker series carry replica (the worker URL's host, added at scrape time), whose
values are the replicas' instance labels: the same menu filters both."""


def router_rate(metric: str, by: str, selector: str = "") -> str:
    series = f"{metric}{{{selector}}}" if selector else metric
    return f"sum by ({by}) (rate({series}[$__rate_interval]))"


def replicas_dashboard() -> dict:
    ratio = config.LOAD_IMBALANCE_RATIO
    panels = [
        row("Each replica (vLLM's own metrics)"),
        timeseries(
            "KV cache usage per replica",
            [target(f"max by (instance) (vllm:kv_cache_usage_perc{{{VLLM}}})", "{{instance}}")],
            "Each replica has a KV cache of its own. Above "
            f"{percent_text(config.KV_CACHE_FULL_RATIO)} for {config.KV_CACHE_FULL_FOR} fires "
            "VLLMKVCacheNearlyFull for that replica.",
            "percentunit",
            defaults={"min": 0, "max": 1},
        ),
        timeseries(
            "Prefix cache hit rate per replica",
            [
                target(
                    f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{VLLM}}}[$__rate_interval])) / "
                    f"sum by (instance) (rate(vllm:prefix_cache_queries_total{{{VLLM}}}[$__rate_interval]))",
                    "{{instance}}",
                )
            ],
            "Prompt tokens found in each replica's prefix cache / prompt tokens it looked up. Cache-aware "
            "routing sends a shared prefix to the replica that holds it, so its hit rate should exceed "
            "round robin's on the same traffic.",
            "percentunit",
            defaults={"min": 0, "max": 1},
        ),
        timeseries(
            "Requests running per replica",
            [target(f"sum by (instance) (vllm:num_requests_running{{{VLLM}}})", "{{instance}}")],
            "Requests in each replica's running batch.",
            "short",
        ),
        timeseries(
            "Requests waiting per replica",
            [target(f"sum by (instance) (vllm:num_requests_waiting{{{VLLM}}})", "{{instance}}")],
            "Requests in each replica's queue, not yet scheduled: one replica queuing while another has "
            "none is a routing problem, not a capacity one.",
            "short",
        ),
        timeseries(
            "Finished requests per second per replica",
            [target(f"sum by (instance) ({rules.FINISHED_RATE}{{{VLLM}}})", "{{instance}}")],
            "Requests each replica completed (any finish reason), from vLLM's own counter.",
            "reqps",
        ),
        timeseries(
            "Share of the requests running and waiting",
            [
                target(rules.replica_load_share(VLLM), "{{instance}}"),
                target(rules.imbalance_share(VLLM), "imbalance bound ({{model_name}})"),
            ],
            f"Each replica's share of its model's requests running + waiting (mean over "
            f"{config.LOAD_IMBALANCE_WINDOW}). Above the bound, a replica carries more than {ratio:g} times "
            f"the mean of the others; for {config.LOAD_IMBALANCE_FOR}, with at least "
            f"{config.LOAD_IMBALANCE_MIN_REQUESTS} requests in all, that fires VLLMLoadImbalance.",
            "percentunit",
            defaults={"min": 0, "max": 1},
            overrides=[
                {
                    "matcher": {"id": "byRegexp", "options": "imbalance bound.*"},
                    "properties": [
                        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                        {"id": "custom.fillOpacity", "value": 0},
                        {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                    ],
                }
            ],
        ),
        row("Router (vllm-router): its decisions and its view of the replicas"),
        timeseries(
            "Requests routed per second, by replica and policy",
            [
                target(
                    router_rate("vllm_router_policy_decisions_total", "replica, policy", ROUTER_REPLICA),
                    "{{replica}} ({{policy}})",
                )
            ],
            "The router's choices: one per attempt, so a retried request counts once per replica it was sent to.",
            "reqps",
            stack=True,
        ),
        timeseries(
            "Replica health and circuit breaker (router's view)",
            [
                target(
                    f"min by (replica) (vllm_router_worker_health{{{ROUTER_REPLICA}}})",
                    "{{replica}} healthy",
                ),
                target(
                    f"max by (replica) (vllm_router_cb_state{{{ROUTER_REPLICA}}})",
                    "{{replica}} breaker",
                ),
            ],
            "healthy: 1 while the router's health checks pass, 0 after --health-failure-threshold "
            "failures (the replica is out of rotation; VLLMReplicaDown). breaker: 0 closed, 1 open "
            "(failed requests: no traffic until --cb-timeout-duration-secs pass), 2 half open.",
            "short",
            defaults={"min": 0, "max": 2},
        ),
        timeseries(
            "Prefix-routing decisions per second (cache_aware)",
            [
                target(
                    router_rate("vllm_router_prefix_routing_decisions_total", "outcome"),
                    "{{outcome}}",
                )
            ],
            "Under the cache_aware policy, per request: prefix_hit (sent where the prefix is cached), "
            "prefix_miss, load_imbalance (sent to the least loaded replica instead), missing_tokens (the "
            "prompt could not be tokenized for the prefix tree). Empty under other policies.",
            "reqps",
            stack=True,
        ),
        timeseries(
            "Router retries and errors per second",
            [
                target(router_rate("vllm_router_retries_total", "route"), "retry {{route}}"),
                target(router_rate("vllm_router_retries_exhausted_total", "route"), "retries exhausted {{route}}"),
                target(router_rate("vllm_router_request_errors_total", "error_type"), "error {{error_type}}"),
            ],
            "A retry sends a failed attempt to a replica again (the next one the policy picks); retries "
            "exhausted and errors (e.g. no_available_workers) reach the client as a 5xx. Empty while "
            "nothing fails.",
            "reqps",
            overrides=[color_override("error no_available_workers", "red")],
        ),
    ]
    return dashboard(
        "llm-replicas-router",
        "LLM stack: replicas and router",
        "Each vLLM replica's KV cache, prefix hit rate, queue and requests, the load balance between "
        "them, and the router's decisions, health checks, retries and errors.",
        panels,
        VLLM_VARIABLES,
    )


DASHBOARDS = {
    "llm-kv-cache.json": kv_cache_dashboard,
    "llm-latency.json": latency_dashboard,
    "llm-throughput-gateway.json": throughput_dashboard,
    "llm-replicas-router.json": replicas_dashboard,
}
