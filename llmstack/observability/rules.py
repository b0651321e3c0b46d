"""The Prometheus side, generated from config.py: recording and alert rules, the objectives, the
scrape config, and Grafana's datasource (it states the same scrape interval).

Only recording rules that a dashboard panel or an alert reads are made; tests/unit/
test_prometheus_rules.py parses every expression and fails on one nobody uses.
"""

from __future__ import annotations

from typing import Any

from llmstack.observability import config
from llmstack.observability.config import LatencyHistogram

Rule = dict[str, Any]


def rate_rule(metric: str, suffix: str, by: str) -> Rule:
    """instance_model_name[_le]:vllm_<metric>_<suffix>:rate1m, summed per replica and model."""
    level = by.replace(", ", "_")
    return {
        "record": f"{level}:vllm_{metric}_{suffix}:rate{config.RATE_WINDOW}",
        "expr": f"sum by ({by}) (rate(vllm:{metric}_{suffix}[{config.RATE_WINDOW}]))",
    }


def bucket_rate(histogram: LatencyHistogram) -> str:
    return f"instance_model_name_le:vllm_{histogram.name}_bucket:rate{config.RATE_WINDOW}"


def sum_rate(histogram: LatencyHistogram) -> str:
    return f"instance_model_name:vllm_{histogram.name}_sum:rate{config.RATE_WINDOW}"


def count_rate(histogram: LatencyHistogram) -> str:
    return f"instance_model_name:vllm_{histogram.name}_count:rate{config.RATE_WINDOW}"


def quantile_record(histogram: LatencyHistogram, quantile: float) -> str:
    return f"model_name:vllm_{histogram.name}:p{round(quantile * 100)}_{config.RATE_WINDOW}"


TTFT_ALERT_SERIES = quantile_record(config.TTFT, config.TTFT_ALERT_QUANTILE)
SLO_TTFT_SERIES = "llm_stack:slo_ttft_p95_seconds"
TOKEN_RATES = {
    "prompt": "instance_model_name:vllm_prompt_tokens:rate1m",
    "generation": "instance_model_name:vllm_generation_tokens:rate1m",
}
FINISHED_RATE = "instance_model_name_finished_reason:vllm_request_success:rate1m"


def recording_groups() -> list[dict]:
    latency = []
    for histogram in config.QUANTILE_HISTOGRAMS:
        latency.append(rate_rule(histogram.name, "bucket", "instance, model_name, le"))
    for histogram in (*config.QUANTILE_HISTOGRAMS, *config.PHASE_HISTOGRAMS):
        latency += [
            rate_rule(histogram.name, "sum", "instance, model_name"),
            rate_rule(histogram.name, "count", "instance, model_name"),
        ]
    window = config.RATE_WINDOW
    return [
        {"name": "vllm_latency_rates", "rules": latency},
        {
            "name": "vllm_latency_quantiles",
            "rules": [
                {
                    "record": TTFT_ALERT_SERIES,
                    "expr": f"histogram_quantile({config.TTFT_ALERT_QUANTILE}, sum by (model_name, le) "
                    f"({bucket_rate(config.TTFT)}))",
                }
            ],
        },
        {
            "name": "vllm_throughput",
            "rules": [
                {
                    "record": TOKEN_RATES["prompt"],
                    "expr": f"sum by (instance, model_name) (rate(vllm:prompt_tokens_total[{window}]))",
                },
                {
                    "record": TOKEN_RATES["generation"],
                    "expr": f"sum by (instance, model_name) (rate(vllm:generation_tokens_total[{window}]))",
                },
                {
                    "record": FINISHED_RATE,
                    "expr": "sum by (instance, model_name, finished_reason) "
                    f"(rate(vllm:request_success_total[{window}]))",
                },
            ],
        },
    ]


def slo_groups() -> list[dict]:
    return [
        {
            "name": "llm_stack_slo",
            "rules": [{"record": SLO_TTFT_SERIES, "expr": f"vector({config.SLO_TTFT_P95_SECONDS})"}],
        }
    ]


def alert(name: str, expr: str, duration: str, severity: str, summary: str) -> Rule:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "runbook_url": config.runbook_url(name)},
    }


def alert_groups() -> list[dict]:
    c = config
    api = c.API_ROUTE_MATCHER
    vllm_up = f'up{{job="{c.VLLM_JOB}"}}'
    return [
        {
            "name": "vllm",
            "rules": [
                # No replica answering is one alert without an instance label, whether the
                # containers are stopped (gone from DNS: no target at all) or starting (a target,
                # down while the model loads): a restart does not resolve it before vLLM serves.
                # While others answer, a replica that is down is an alert of its own.
                alert(
                    "VLLMDown",
                    f"absent({vllm_up} == 1) or ({vllm_up} == 0 and on() (count({vllm_up} == 1) > 0))",
                    c.VLLM_DOWN_FOR,
                    "critical",
                    'vLLM {{ or $labels.instance "(every replica)" }} is not answering /metrics',
                ),
                alert(
                    "VLLMKVCacheNearlyFull",
                    f"max by (instance, model_name) (vllm:kv_cache_usage_perc) > {c.KV_CACHE_FULL_RATIO}",
                    c.KV_CACHE_FULL_FOR,
                    "warning",
                    "KV cache of {{ $labels.model_name }} on {{ $labels.instance }} is "
                    "{{ $value | humanizePercentage }} full",
                ),
                alert(
                    "VLLMPreemptionsRising",
                    f"sum by (instance, model_name) (increase(vllm:num_preemptions_total[{c.PREEMPTION_WINDOW}])) > 0",
                    c.PREEMPTION_FOR,
                    "warning",
                    f"vLLM {{{{ $labels.instance }}}} preempted {{{{ $value | humanize }}}} requests in "
                    f"{c.PREEMPTION_WINDOW}",
                ),
                alert(
                    "VLLMWaitingQueueGrowing",
                    f"(sum by (instance, model_name) (vllm:num_requests_waiting) > 0) and "
                    f"(sum by (instance, model_name) (delta(vllm:num_requests_waiting[{c.QUEUE_GROWTH_WINDOW}])) > 0)",
                    c.QUEUE_GROWTH_FOR,
                    "warning",
                    f"{{{{ $value }}}} requests waiting on {{{{ $labels.instance }}}}, more than "
                    f"{c.QUEUE_GROWTH_WINDOW} ago",
                ),
                alert(
                    "VLLMTTFTOverSLO",
                    f"{TTFT_ALERT_SERIES} > on() group_left() {SLO_TTFT_SERIES}",
                    c.TTFT_OVER_SLO_FOR,
                    "warning",
                    f"TTFT p{round(c.TTFT_ALERT_QUANTILE * 100)} of {{{{ $labels.model_name }}}} is "
                    f"{{{{ $value | humanizeDuration }}}}, over the objective",
                ),
            ],
        },
        {
            "name": "gateway",
            "rules": [
                alert(
                    "GatewayHigh5xxRatio",
                    f"sum(rate(gateway_requests_total{{{api}, {c.SERVER_ERROR_MATCHER}}}[{c.GATEWAY_5XX_WINDOW}])) / "
                    f"sum(rate(gateway_requests_total{{{api}}}[{c.GATEWAY_5XX_WINDOW}])) > {c.GATEWAY_5XX_RATIO}",
                    c.GATEWAY_5XX_FOR,
                    "critical",
                    "{{ $value | humanizePercentage }} of API requests end in a 5xx at the gateway",
                ),
            ],
        },
    ]


RULE_FILES = {"alerts.yml": alert_groups, "recording.yml": recording_groups, "slo.yml": slo_groups}

PROMETHEUS_YML = """\
# Prometheus for the LLM stack. Works unchanged with the official image (prom/prometheus v3) and
# with Debian's prometheus (the air-gapped build); prometheus/README.md says how v3 is checked.
# Every target is on the compose network "backend"; nothing here is published.
global:
  scrape_interval: {scrape_interval}
  scrape_timeout: {scrape_timeout}
  evaluation_interval: {scrape_interval}

rule_files:
  - /etc/prometheus/rules/*.yml

# Firing and resolved alerts go to Alertmanager (alertmanager/), on the same network; it notifies
# the receivers set in .env.
alerting:
  alertmanagers:
    - static_configs:
        - targets: ["alertmanager:9093"]

scrape_configs:
  # Every vLLM replica: "vllm" resolves to one address per container (docker compose --scale).
  # instance becomes "vllm@<container address>" so the dashboards' instance menu says what it is.
  - job_name: {vllm_job}
    dns_sd_configs:
      - names: [vllm]
        type: A
        port: 8000
        refresh_interval: 15s
    relabel_configs:
      - source_labels: [__address__]
        regex: "(.+):8000"
        target_label: instance
        replacement: "vllm@$1"

  # The gateway: requests by route/status/key owner and latencies from nginx's access log, plus
  # nginx's connection counters (images/gateway-exporter/gateway_exporter.py, whose port this is).
  - job_name: gateway
    static_configs:
      - targets: ["gateway-exporter:{exporter_port}"]
        labels:
          instance: gateway

  # The load generator's client-side view (TTFT, TPOT, E2E as the client saw them), from every
  # Locust worker; no target when the load test is not running.
  - job_name: loadtest
    dns_sd_configs:
      - names: [locust-worker]
        type: A
        port: 9646
        refresh_interval: 15s
    relabel_configs:
      - source_labels: [__address__]
        regex: "(.+):9646"
        target_label: instance
        replacement: "locust-worker@$1"

  - job_name: prometheus
    metrics_path: /prometheus/metrics
    static_configs:
      - targets: ["localhost:9090"]
        labels:
          instance: prometheus

  # GPU setup only: NVIDIA's DCGM exporter (GPU memory used/free, utilisation). Found by DNS, so
  # on a machine without it (the CPU path) there is simply no target rather than a target down.
  - job_name: dcgm
    dns_sd_configs:
      - names: [dcgm-exporter]
        type: A
        port: 9400
        refresh_interval: 30s
    relabel_configs:
      - source_labels: [__address__]
        regex: "(.+):9400"
        target_label: instance
        replacement: "dcgm@$1"
"""

DATASOURCE_YAML = """\
# The stack's Prometheus, with a fixed uid: every dashboard panel names it by this uid.
apiVersion: 1
datasources:
  - name: Prometheus
    uid: {uid}
    type: prometheus
    access: proxy
    # Prometheus serves under /prometheus/ (its --web.external-url), on the internal network.
    url: http://prometheus:9090/prometheus
    isDefault: true
    editable: false
    jsonData:
      # Prometheus' scrape interval, so that $__rate_interval always spans at least four scrapes.
      timeInterval: {scrape_interval}
      httpMethod: POST
      prometheusType: Prometheus
"""


def prometheus_yml() -> str:
    return PROMETHEUS_YML.format(
        scrape_interval=f"{config.SCRAPE_INTERVAL_SECONDS}s",
        scrape_timeout=f"{config.SCRAPE_INTERVAL_SECONDS - 1}s",
        vllm_job=config.VLLM_JOB,
        exporter_port=config.gateway_exporter().METRICS_PORT,
    )


def datasource_yaml() -> str:
    return DATASOURCE_YAML.format(uid=config.DATASOURCE_UID, scrape_interval=f"{config.SCRAPE_INTERVAL_SECONDS}s")
