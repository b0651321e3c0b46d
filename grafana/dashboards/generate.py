#!/usr/bin/env python3
"""Write the Grafana dashboards (JSON, committed) from the definitions in this file.

Edit a panel here, run `python3 grafana/dashboards/generate.py`, commit both. `--check` exits 1
when the committed JSON differs from what this file makes (tests/unit/test_dashboards.py runs it).
Every query selects vLLM series with $model_name and $instance; both variables take their values
from a vllm: metric, so other exporters' labels never appear in the menus. The SLO defaults come
from prometheus/rules/slo.yml, the one place they are set.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DASHBOARD_DIR = Path(__file__).resolve().parent
REPO_ROOT = DASHBOARD_DIR.parent.parent
SLO_RULES = REPO_ROOT / "prometheus" / "rules" / "slo.yml"
DATASOURCE = {"type": "prometheus", "uid": "llm-stack-prometheus"}
SCHEMA_VERSION = 39
VLLM = 'model_name=~"$model_name", instance=~"$instance"'
API_ROUTES = 'route=~"/v1/.*"'
QUANTILES = ("0.5", "0.9", "0.95", "0.99")
GRID_WIDTH = 24


def slo_defaults() -> dict[str, str]:
    """{'ttft_p95_seconds': '0.5', 'tpot_seconds': '0.05'} from the vector(...) rules in slo.yml."""
    found = dict(re.findall(r"record: llm_stack:slo_(\w+)\s+expr: vector\(([0-9.]+)\)", SLO_RULES.read_text()))
    if set(found) != {"ttft_p95_seconds", "tpot_seconds"}:
        raise SystemExit(f"generate.py: {SLO_RULES} must define llm_stack:slo_ttft_p95_seconds and "
                         "llm_stack:slo_tpot_seconds as vector(<seconds>)")
    return found


# --- Building blocks --------------------------------------------------------------------------


def target(expr: str, legend: str = "", **extra) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto", "range": True,
            **extra}


def panel(kind: str, title: str, targets: list[dict], width: int, height: int, description: str,
          unit: str = "short", **options) -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": DATASOURCE,
            "targets": [{"refId": chr(ord("A") + i), **t} for i, t in enumerate(targets)],
            "gridPos": {"w": width, "h": height},
            "fieldConfig": {"defaults": {"unit": unit, **options.pop("defaults", {})},
                            "overrides": options.pop("overrides", [])},
            **options}


def timeseries(title: str, targets: list[dict], description: str, unit: str = "short", width: int = 12,
               height: int = 8, stack: bool = False, **options) -> dict:
    custom = {"lineWidth": 1, "fillOpacity": 20 if stack else 5, "showPoints": "never",
              "spanNulls": False, "stacking": {"mode": "normal" if stack else "none"}}
    defaults = {"custom": custom, **options.pop("defaults", {})}
    return panel("timeseries", title, targets, width, height, description, unit, defaults=defaults,
                 options={"legend": {"displayMode": "table", "placement": "bottom",
                                     "calcs": ["mean", "max", "lastNotNull"]},
                          "tooltip": {"mode": "multi", "sort": "desc"}}, **options)


def stat(title: str, targets: list[dict], description: str, unit: str = "short", width: int = 6,
         height: int = 5, **options) -> dict:
    return panel("stat", title, targets, width, height, description, unit,
                 options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "colorMode": "value", "graphMode": "area", "textMode": "auto"}, **options)


def heatmap(title: str, metric: str, description: str) -> dict:
    # A rate, not increase(): $__rate_interval windows overlap from one cell to the next, so
    # increase() would count each observation in several cells.
    expr = f"sum by (le) (rate({metric}_bucket{{{VLLM}}}[$__rate_interval]))"
    return panel("heatmap", title, [target(expr, "{{le}}", format="heatmap")], 12, 9, description, "s",
                 options={"calculate": False, "yAxis": {"unit": "s"}, "cellGap": 1,
                          "color": {"mode": "scheme", "scheme": "Spectral", "steps": 64},
                          "rowsFrame": {"layout": "auto"}, "tooltip": {"show": True, "yHistogram": True}})


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": GRID_WIDTH, "h": 1}}


def color_override(name: str, color: str) -> dict:
    return {"matcher": {"id": "byName", "options": name},
            "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}]}


def query_variable(name: str, label: str, query: str, multi: bool = True, hide: int = 0) -> dict:
    return {"type": "query", "name": name, "label": label, "datasource": DATASOURCE,
            "definition": query, "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery",
                                           "qryType": 1},
            "refresh": 2, "multi": multi, "includeAll": multi, "current": {}, "options": [],
            "sort": 1, "hide": hide, "regex": ""}


def constant_variable(name: str, value: str) -> dict:
    return {"type": "constant", "name": name, "query": value, "hide": 2,
            "current": {"text": value, "value": value}, "options": [{"text": value, "value": value, "selected": True}]}


VLLM_VARIABLES = [
    query_variable("model_name", "Model", "label_values(vllm:num_requests_running, model_name)"),
    query_variable("instance", "vLLM replica",
                   'label_values(vllm:num_requests_running{model_name=~"$model_name"}, instance)'),
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
    return {"uid": uid, "title": title, "description": description, "tags": ["llm-stack"],
            "editable": False, "graphTooltip": 1, "schemaVersion": SCHEMA_VERSION, "version": 1,
            "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "timezone": "browser",
            "templating": {"list": variables}, "annotations": {"list": []},
            "links": [{"type": "dashboards", "tags": ["llm-stack"], "asDropdown": True, "title": "LLM stack"}],
            "panels": layout(panels)}


# --- Dashboard 1: KV cache and memory ---------------------------------------------------------


def kv_cache_dashboard() -> dict:
    kv_usage = f"vllm:kv_cache_usage_perc{{{VLLM}}}"
    # Newer vLLM releases also label kv_cache_size_tokens and kv_cache_memory_bytes; older ones
    # leave those columns empty, and the table computes blocks x block size either way.
    budget_table = target('max by (instance, num_gpu_blocks, block_size, kv_cache_size_tokens, kv_cache_memory_bytes, '
                          'cache_dtype, gpu_memory_utilization) '
                          f'(vllm:cache_config_info{{instance=~"$instance"}})', format="table", instant=True,
                          range=False)
    gpu_total = "sum by (gpu) (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) * 1048576"
    panels = [
        row("KV cache"),
        timeseries("KV cache usage (max and mean over replicas)", [
            target(f"max({kv_usage})", "max over replicas"),
            target(f"avg({kv_usage})", "mean over replicas"),
        ], "Share of vLLM's KV cache blocks in use. Replicas each have their own cache, so usage is "
           "never summed: the fullest replica (max) decides when requests queue or are preempted.",
           "percentunit", width=16, defaults={"min": 0, "max": 1}),
        panel("gauge", "KV cache usage now (fullest replica)", [target(f"max({kv_usage})", "fullest replica")],
              8, 8, "Above 90% for 5 minutes fires VLLMKVCacheNearlyFull.", "percentunit",
              defaults={"min": 0, "max": 1, "thresholds": {"mode": "absolute", "steps": [
                  {"color": "green", "value": None}, {"color": "orange", "value": 0.75},
                  {"color": "red", "value": 0.9}]}},
              options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                       "showThresholdMarkers": True}),
        panel("table", "KV cache budget (vllm:cache_config_info)", [budget_table], 24, 5,
              "What vLLM allocated at start: blocks x tokens per block = tokens the cache holds "
              "across all running requests.", "none",
              transformations=[
                  {"id": "labelsToFields", "options": {}},
                  {"id": "convertFieldType", "options": {"conversions": [
                      {"targetField": "num_gpu_blocks", "destinationType": "number"},
                      {"targetField": "block_size", "destinationType": "number"},
                      {"targetField": "kv_cache_size_tokens", "destinationType": "number"},
                      {"targetField": "kv_cache_memory_bytes", "destinationType": "number"}], "fields": {}}},
                  {"id": "calculateField", "options": {
                      "mode": "binary", "alias": "tokens (blocks x block size)", "replaceFields": False,
                      "binary": {"left": "num_gpu_blocks", "operator": "*", "right": "block_size"}}},
                  {"id": "organize", "options": {
                      "excludeByName": {"Time": True, "Value": True},
                      "renameByName": {"num_gpu_blocks": "blocks", "block_size": "block size (tokens)",
                                       "cache_dtype": "cache dtype",
                                       "gpu_memory_utilization": "GPU memory fraction"}}}]),
        timeseries("Prefix cache hit rate", [
            target(f"sum(rate(vllm:prefix_cache_hits_total{{{VLLM}}}[$__rate_interval])) / "
                   f"sum(rate(vllm:prefix_cache_queries_total{{{VLLM}}}[$__rate_interval]))", "hit rate (tokens)"),
        ], "Prompt tokens found in the prefix cache / prompt tokens looked up. High means shared "
           "system prompts and multi-turn chats skip their prefill.", "percentunit",
            defaults={"min": 0, "max": 1}),
        timeseries("Preemptions per second", [
            target(f"sum by (instance) (rate(vllm:num_preemptions_total{{{VLLM}}}[$__rate_interval]))",
                   "{{instance}}"),
        ], "Running requests evicted for lack of KV cache blocks (they recompute later). Anything "
           "above zero for 5 minutes fires VLLMPreemptionsRising.", "short"),
        timeseries("Requests running vs waiting", [
            target(f"sum(vllm:num_requests_running{{{VLLM}}})", "running"),
            target(f"sum(vllm:num_requests_waiting{{{VLLM}}})", "waiting"),
        ], "Requests in vLLM's running batch and in its queue, summed over replicas.", "short", width=24,
            overrides=[color_override("running", "green"), color_override("waiting", "orange")]),
        row("GPU memory (GPU setup: NVIDIA DCGM exporter)"),
        timeseries("GPU memory used vs total, with vLLM's share", [
            target("sum by (gpu) (DCGM_FI_DEV_FB_USED) * 1048576", "used, GPU {{gpu}}"),
            target(gpu_total, "total, GPU {{gpu}}"),
            target(f"{gpu_total} * $gpu_memory_utilization", "vLLM's limit (x $gpu_memory_utilization), GPU {{gpu}}"),
        ], "Frame buffer memory from DCGM. The dashed line is the total times vLLM's "
           "--gpu-memory-utilization (from vllm:cache_config_info): weights, activations and the KV "
           "cache stay below it.", "bytes", width=16,
            overrides=[{"matcher": {"id": "byRegexp", "options": "vLLM's limit.*"},
                        "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                       {"id": "custom.fillOpacity", "value": 0}]}]),
        timeseries("GPU utilisation", [target("DCGM_FI_DEV_GPU_UTIL", "GPU {{gpu}}")],
                   "Share of time a kernel was running (DCGM_FI_DEV_GPU_UTIL).", "percent", width=8,
                   defaults={"min": 0, "max": 100}),
    ]
    variables = VLLM_VARIABLES + [query_variable(
        "gpu_memory_utilization", "vLLM GPU memory fraction",
        'label_values(vllm:cache_config_info{instance=~"$instance"}, gpu_memory_utilization)', multi=False, hide=2)]
    return dashboard("llm-kv-cache", "LLM stack: KV cache and memory",
                     "vLLM's KV cache, prefix cache, preemptions and queue; GPU memory in the GPU setup.",
                     panels, variables)


# --- Dashboard 2: latency -----------------------------------------------------------------------


def quantile_targets(metric: str) -> list[dict]:
    """p50/p90/p95/p99 and the true mean, from the 1m recording rules (prometheus/rules/recording.yml)."""
    buckets = f"instance_model_name_le:vllm_{metric}_bucket:rate1m{{{VLLM}}}"
    targets = [target(f"histogram_quantile({q}, sum by (le) ({buckets}))", f"p{round(float(q) * 100)}")
               for q in QUANTILES]
    targets.append(target(f"sum(instance_model_name:vllm_{metric}_sum:rate1m{{{VLLM}}}) / "
                          f"sum(instance_model_name:vllm_{metric}_count:rate1m{{{VLLM}}})", "mean"))
    return targets


def slo_share(metric: str, variable: str) -> str:
    # Requests at or under the objective / all requests. The objective is a bucket boundary;
    # "(\\.0)?" matches it whether Prometheus wrote le="1" or le="1.0".
    return (f'sum(rate(vllm:{metric}_bucket{{{VLLM}, le=~"${variable}(\\\\.0)?"}}[$__rate_interval])) / '
            f"sum(rate(vllm:{metric}_count{{{VLLM}}}[$__rate_interval]))")


def latency_dashboard() -> dict:
    slo = slo_defaults()
    phases = [("request_queue_time_seconds", "queue"), ("request_prefill_time_seconds", "prefill"),
              ("request_decode_time_seconds", "decode")]
    mean_dash = [{"matcher": {"id": "byName", "options": "mean"},
                  "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                 {"id": "custom.lineWidth", "value": 2}]}]
    panels = [
        row("Percentiles (1-minute windows) and the true mean"),
        timeseries("Time to first token (TTFT)", [
            *quantile_targets("time_to_first_token_seconds"),
            target("max(llm_stack:slo_ttft_p95_seconds)", "objective (p95)"),
        ], "From the request's arrival in vLLM to its first output token: queue + prefill. The "
           "objective is llm_stack:slo_ttft_p95_seconds (prometheus/rules/slo.yml).", "s",
            overrides=mean_dash + [color_override("objective (p95)", "red")]),
        timeseries("Inter-token latency (ITL)", quantile_targets("inter_token_latency_seconds"),
                   "Gap between consecutive output tokens of a request, over every token.", "s",
                   overrides=mean_dash),
        timeseries("Time per output token (TPOT)", quantile_targets("request_time_per_output_token_seconds"),
                   "Per request: decode time / (output tokens - 1).", "s", overrides=mean_dash),
        timeseries("End-to-end request latency", quantile_targets("e2e_request_latency_seconds"),
                   "From arrival in vLLM to the last token (the gateway adds its own share; see the "
                   "throughput and gateway dashboard).", "s", overrides=mean_dash),
        row("Distributions"),
        heatmap("TTFT heatmap", "vllm:time_to_first_token_seconds",
                "Requests per second in each TTFT bucket (vLLM's histogram buckets)."),
        heatmap("Inter-token latency heatmap", "vllm:inter_token_latency_seconds",
                "Tokens per second in each inter-token-latency bucket."),
        row("Where the time goes, and the objectives"),
        timeseries("Mean queue / prefill / decode time per request", [
            target(f"sum(instance_model_name:vllm_{metric}_sum:rate1m{{{VLLM}}}) / "
                   f"sum(instance_model_name:vllm_{metric}_count:rate1m{{{VLLM}}})", label)
            for metric, label in phases
        ], "Stacked: the parts of a request's time in vLLM. Queue time grows when the server is "
           "saturated; prefill with prompt length; decode with output length.", "s", stack=True),
        timeseries("Share of requests inside the objectives", [
            target(slo_share("time_to_first_token_seconds", "ttft_slo"), "TTFT <= $ttft_slo s"),
            target(slo_share("request_time_per_output_token_seconds", "tpot_slo"), "TPOT <= $tpot_slo s"),
        ], "Requests whose TTFT (or TPOT) was within the objective, counted from vLLM's histogram "
           "buckets. The objectives are in prometheus/rules/slo.yml.", "percentunit",
            defaults={"min": 0, "max": 1}),
    ]
    variables = VLLM_VARIABLES + [constant_variable("ttft_slo", slo["ttft_p95_seconds"]),
                                  constant_variable("tpot_slo", slo["tpot_seconds"])]
    return dashboard("llm-latency", "LLM stack: latency",
                     "TTFT, inter-token latency, TPOT and end-to-end latency from vLLM's histograms.",
                     panels, variables)


# --- Dashboard 3: throughput and gateway --------------------------------------------------------


def gateway_quantiles(metric: str, label: str) -> list[dict]:
    return [target(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{API_ROUTES}}}[$__rate_interval])))",
                   f"{label} p{round(float(q) * 100)}") for q in ("0.5", "0.95", "0.99")]


def throughput_dashboard() -> dict:
    status_colors = [color_override("200", "green"), color_override("401", "purple"),
                     color_override("429", "orange"),
                     {"matcher": {"id": "byRegexp", "options": "5.."},
                      "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}]
    client_ttft = "loadtest_time_to_first_token_seconds_bucket"
    panels = [
        row("Tokens"),
        timeseries("Tokens per second", [
            target(f"sum(instance_model_name:vllm_prompt_tokens:rate1m{{{VLLM}}})", "prompt tokens/s"),
            target(f"sum(instance_model_name:vllm_generation_tokens:rate1m{{{VLLM}}})", "generated tokens/s"),
        ], "Prompt tokens prefilled and tokens generated per second, over the selected replicas.", "short"),
        timeseries("Finished requests per second, by reason", [
            target(f"sum by (finished_reason) (instance_model_name_finished_reason:vllm_request_success:rate1m{{{VLLM}}})",
                   "{{finished_reason}}"),
        ], "stop: the model ended; length: max_tokens reached; abort: the client went away.", "reqps"),
        row("Gateway (nginx)"),
        timeseries("API requests per second by status", [
            target(f"sum by (status) (rate(gateway_requests_total{{{API_ROUTES}}}[$__rate_interval]))", "{{status}}"),
        ], "Every request to /v1/* as the gateway answered it: 401 missing or bad API key, 429 rate "
           "or concurrency limit, 5xx vLLM unreachable or failing.", "reqps", stack=True,
            overrides=status_colors),
        stat("Rejected and failed API requests in the time range", [
            target(f'sum by (status) (increase(gateway_requests_total{{{API_ROUTES}, status=~"401|403|429|5.."}}[$__range]))',
                   "{{status}}", instant=True, range=False),
        ], "Counts over the dashboard's time range.", "short", width=12, overrides=status_colors),
        timeseries("API requests per second by key owner", [
            target(f"sum by (key_owner) (rate(gateway_requests_total{{{API_ROUTES}}}[$__rate_interval]))",
                   "{{key_owner}}"),
        ], "Which API key's owner sends the traffic ('none': no valid key).", "reqps"),
        timeseries("Latency added by the gateway", gateway_quantiles("gateway_added_latency_seconds", "added"),
                   "nginx's request time minus vLLM's response time, per proxied request: auth, "
                   "limits and proxying.", "s"),
        timeseries("vLLM latency seen by the gateway", [
            *gateway_quantiles("gateway_upstream_header_duration_seconds", "headers"),
            *gateway_quantiles("gateway_upstream_response_duration_seconds", "full response"),
        ], "Upstream times from nginx's log: until vLLM's response headers, and until its last byte.", "s"),
        timeseries("Gateway connections", [
            target("nginx_connections_active", "active"),
            target("nginx_connections_writing", "writing (responses in flight)"),
            target("nginx_connections_waiting", "idle keep-alive"),
        ], "From nginx's stub_status page.", "short"),
        row("Load generator (while a Locust load test runs)"),
        timeseries("TTFT: load generator (client) vs vLLM (server)", [
            target(f"histogram_quantile(0.95, sum by (le) (rate({client_ttft}[$__rate_interval])))", "client p95"),
            target(f"histogram_quantile(0.5, sum by (le) (rate({client_ttft}[$__rate_interval])))", "client p50"),
            target(f"histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{{VLLM}}}[$__rate_interval])))",
                   "server p95"),
            target(f"histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{{VLLM}}}[$__rate_interval])))",
                   "server p50"),
        ], "The client's TTFT includes the gateway, the network and SSE framing; the gap to vLLM's "
           "own TTFT is what users feel beyond the model server.", "s", width=24),
    ]
    return dashboard("llm-throughput-gateway", "LLM stack: throughput and gateway",
                     "Token throughput, and the gateway's requests by status, key owner and latency.",
                     panels, VLLM_VARIABLES)


DASHBOARDS = {
    "llm-kv-cache.json": kv_cache_dashboard,
    "llm-latency.json": latency_dashboard,
    "llm-throughput-gateway.json": throughput_dashboard,
}


def render(build) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed dashboard differs from what this file makes")
    parser.add_argument("--out-dir", type=Path, default=DASHBOARD_DIR,
                        help="where the JSON files go (default: this folder)")
    args = parser.parse_args(argv)
    if not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir}: no such folder")
    stale = []
    for name, build in DASHBOARDS.items():
        path = args.out_dir / name
        text = render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}", file=sys.stderr)
    if stale:
        print(f"generate.py: stale dashboard JSON: {', '.join(stale)}; run python3 grafana/dashboards/generate.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
