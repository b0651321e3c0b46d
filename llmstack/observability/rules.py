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
REPLICA_LOAD = f"instance_model_name:vllm_num_requests_running_waiting:avg_over_time_{config.LOAD_IMBALANCE_WINDOW}"
"""Requests running + waiting per replica, averaged so that a burst is not an imbalance."""


def replica_load_share(selector: str = "") -> str:
    """Each replica's share of its model's requests running + waiting."""
    load = f"{REPLICA_LOAD}{{{selector}}}" if selector else REPLICA_LOAD
    return f"{load} / on(model_name) group_left() sum by (model_name) ({load})"


def imbalance_share(selector: str = "") -> str:
    """The share above which a replica carries LOAD_IMBALANCE_RATIO times the mean of the others:
    x > r * (total - x) / (n - 1) is x / total > r / (n - 1 + r). With one replica it is 1 (never)."""
    load = f"{REPLICA_LOAD}{{{selector}}}" if selector else REPLICA_LOAD
    r = config.LOAD_IMBALANCE_RATIO
    return f"{r} / (count by (model_name) ({load}) - 1 + {r})"


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
        {
            "name": "vllm_replicas",
            "rules": [
                {
                    "record": REPLICA_LOAD,
                    "expr": " + ".join(
                        f"sum by (instance, model_name) "
                        f"(avg_over_time(vllm:num_requests_{state}[{config.LOAD_IMBALANCE_WINDOW}]))"
                        for state in ("running", "waiting")
                    ),
                }
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
    # The router's health checks also see a replica whose container is stopped (gone from DNS, so
    # no scrape target) or whose engine died while /metrics still answers.
    router_health = (
        f'label_replace(vllm_router_worker_health{{job="{c.ROUTER_JOB}"}}, "instance", "$1", "replica", "(.+)")'
    )
    load = REPLICA_LOAD
    return [
        {
            "name": "vllm",
            "rules": [
                # No replica answering, whether the containers are stopped (gone from DNS: no
                # target at all) or starting (a target, down while the model loads): a restart does
                # not resolve it before vLLM serves.
                alert(
                    "VLLMDown",
                    f"absent({vllm_up} == 1)",
                    c.VLLM_DOWN_FOR,
                    "critical",
                    "No vLLM replica is answering /metrics",
                ),
                # One replica out of rotation while another serves: capacity is down, the API is not.
                alert(
                    "VLLMReplicaDown",
                    f"(min by (instance) ({router_health}) == 0 or min by (instance) ({vllm_up}) == 0) "
                    f"and on() (count({vllm_up} == 1) > 0)",
                    c.REPLICA_DOWN_FOR,
                    "warning",
                    "vLLM replica {{ $labels.instance }} is out of rotation while others serve",
                ),
                alert(
                    "VLLMLoadImbalance",
                    f"({replica_load_share()} > on(model_name) group_left() ({imbalance_share()})) "
                    f"and on(model_name) (sum by (model_name) ({load}) >= {c.LOAD_IMBALANCE_MIN_REQUESTS})",
                    c.LOAD_IMBALANCE_FOR,
                    "warning",
                    "{{ $labels.instance }} carries {{ $value | humanizePercentage }} of the requests running "
                    "and waiting for {{ $labels.model_name }}",
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
                    f"vLLM replica {{{{ $labels.instance }}}} preempted {{{{ $value | humanize }}}} requests in "
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
            "name": "router",
            "rules": [
                alert(
                    "RouterDown",
                    f'up{{job="{c.ROUTER_JOB}"}} == 0',
                    c.ROUTER_DOWN_FOR,
                    "critical",
                    "The router is not answering /metrics: the gateway cannot reach any replica",
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
  # Every vLLM replica: the compose services {first_replica} to {last_replica}, each looked up by its
  # name (a name with no container is no target). instance is the service name: stable across
  # restarts, and the name the router's worker URLs hold. One container per service: two
  # containers of a service scaled with --scale would be two targets with one instance label,
  # whose series clash.
  - job_name: {vllm_job}
    dns_sd_configs:
      - names: [{replicas}]
        type: A
        port: {vllm_port}
        refresh_interval: 15s
    relabel_configs:
      - source_labels: [__meta_dns_name]
        target_label: instance

  # vllm-router: requests per worker and policy, prefix-routing decisions, retries, errors and its
  # health view of each replica. Its series name a replica by URL (worker="http://vllm-2:8000");
  # replica="vllm-2" is added, the replica's own instance label.
  - job_name: {router_job}
    static_configs:
      - targets: ["router:{router_port}"]
        labels:
          instance: router
    metric_relabel_configs:
      - source_labels: [worker]
        regex: "{worker_pattern}"
        target_label: replica

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

# deploy/kubernetes: the same file but for the vLLM job, whose replicas are pods found through the
# Kubernetes API (the router's worker URLs hold pod IPs there, so instance is the pod IP).
KUBERNETES_HEADER = """\
# Prometheus for the LLM stack on Kubernetes (deploy/kubernetes): prometheus.yml with the vLLM
# replicas found as pods through the Kubernetes API instead of by compose service name. The other
# targets are Services named as the compose services; a test keeps the rest equal to prometheus.yml.
"""

KUBERNETES_VLLM_JOB = """\
  # Every vLLM replica: the pods of the vllm StatefulSet in Prometheus' own namespace (Kubernetes
  # service discovery, role pod), on their API port. instance is the pod IP, which is what the
  # router's worker URLs hold there (worker="http://10.1.2.3:{vllm_port}"); namespace and pod name the pod
  # (prometheus-adapter maps them to the pod for the autoscaler).
  - job_name: {vllm_job}
    kubernetes_sd_configs:
      - role: pod
        namespaces:
          own_namespace: true
        selectors:
          - role: pod
            label: app.kubernetes.io/name={vllm_job}
    relabel_configs:
      - source_labels: [__meta_kubernetes_pod_container_port_number]
        regex: "{vllm_port}"
        action: keep
      - source_labels: [__meta_kubernetes_pod_ip]
        target_label: instance
      - source_labels: [__meta_kubernetes_namespace]
        target_label: namespace
      - source_labels: [__meta_kubernetes_pod_name]
        target_label: pod

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
        replicas=", ".join(config.replica_services()),
        first_replica=config.replica_services()[0],
        last_replica=config.replica_services()[-1],
        vllm_port=config.VLLM_PORT,
        router_job=config.ROUTER_JOB,
        router_port=config.ROUTER_METRICS_PORT,
        worker_pattern=config.ROUTER_WORKER_PATTERN,
        exporter_port=config.gateway_exporter().METRICS_PORT,
    )


def datasource_yaml() -> str:
    return DATASOURCE_YAML.format(uid=config.DATASOURCE_UID, scrape_interval=f"{config.SCRAPE_INTERVAL_SECONDS}s")


def prometheus_kubernetes_yml() -> str:
    """prometheus.yml for deploy/kubernetes: its header and vLLM job replaced, everything else equal."""
    text = prometheus_yml()
    start = text.index("  # Every vLLM replica:")
    end = text.index("  # vllm-router:")
    job = KUBERNETES_VLLM_JOB.format(vllm_job=config.VLLM_JOB, vllm_port=config.VLLM_PORT)
    body = text[text.index("global:") : start] + job + text[end:]
    return KUBERNETES_HEADER + body
