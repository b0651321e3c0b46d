"""Run the dashboards' panel queries against Prometheus the way Grafana would: variables filled in
from their label_values() queries, $__rate_interval and $__range replaced, range or instant.

Used by tests/integration/test_observability.py (every query of every dashboard must return data)
and by render_panels.py (the README's renderings).
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from llmstack import REPO_ROOT

DASHBOARD_DIR = REPO_ROOT / "grafana" / "dashboards"
# Metrics only some setups have; a query made only of them may return nothing elsewhere. (The load
# generator's loadtest_ metrics are not optional: the integration test runs a load test first.)
# The router makes a series at its first event, so these exist only after one.
OPTIONAL_SOURCES = {
    "DCGM_": "GPU setup (NVIDIA DCGM exporter)",
    "vllm_router_prefix_routing_decisions": "the router's cache_aware policy",
    "vllm_router_retries": "a retry at the router",
    "vllm_router_request_errors": "an error at the router",
}
REGEX_SPECIALS = re.compile(r"([\\^$*+?.()|{}\[\]])")
# dashboards.quantile_expr: a quantile line hidden at or below its histogram's first bucket.
BELOW_FIRST_BUCKET = re.compile(r"^(histogram_quantile\(.*\)) > ([0-9.e+-]+)$")


class PrometheusError(Exception):
    """Prometheus refused a query or could not be reached; the message says which."""


class Prometheus:
    def __init__(self, base_url: str, user: str | None = None, password: str | None = None, timeout: float = 20):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = {}
        if user is not None:
            token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"

    def get(self, path: str, params: dict | list) -> Any:
        url = f"{self.base_url}{path}?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = json.loads(response.read().decode())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise PrometheusError(f"HTTP {err.code} for {path}: {detail}") from err
        except (OSError, ValueError) as err:
            raise PrometheusError(f"{path}: {err}") from err
        if body.get("status") != "success":
            raise PrometheusError(f"{path}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def label_values(self, label: str, match: str) -> list[str]:
        return sorted(self.get(f"/api/v1/label/{label}/values", [("match[]", match)]))

    def query(self, expr: str, instant: bool, start: float, end: float, step: float) -> list[dict]:
        if instant:
            return self.get("/api/v1/query", {"query": expr, "time": end})["result"]
        return self.get("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step})["result"]


@dataclass
class PanelQuery:
    dashboard: str
    panel: str
    panel_type: str
    ref_id: str
    legend: str
    expr: str
    instant: bool
    optional: str | None
    result: list[dict] = field(default_factory=list)
    error: str | None = None
    below_first_bucket: bool = False
    """No data because every value was at or below the histogram's first bucket (checked by
    running the quantile unfiltered): hidden on purpose, not missing."""

    @property
    def first_bucket(self) -> float | None:
        match = BELOW_FIRST_BUCKET.match(self.expr)
        return float(match.group(2)) if match else None

    @property
    def has_data(self) -> bool:
        """True when some series has a finite value (NaN from an empty histogram window is no data)."""
        for series in self.result:
            values = series.get("values") or ([series["value"]] if "value" in series else [])
            if any(math.isfinite(float(value)) for _, value in values):
                return True
        return False


def load_dashboards() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))}


def optional_reason(expr: str) -> str | None:
    """Why a query may be empty here: every metric it names comes from an optional exporter."""
    names = set(re.findall(r"[A-Za-z_][\w:]*", re.sub(r'"[^"]*"', "", expr)))
    optional = {n: reason for n in names for prefix, reason in OPTIONAL_SOURCES.items() if n.startswith(prefix)}
    always = [n for n in names - set(optional) if "vllm" in n or n.startswith(("gateway_", "nginx_", "llm_stack"))]
    if optional and not always:
        return sorted(optional.values())[0]
    return None


def substitute(text: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):
        text = text.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return text


def variable_values(dashboard: dict, prometheus: Prometheus) -> dict[str, str]:
    """What Grafana puts in place of each variable with its default selection ("All" for the
    multi-value ones: a regex of every value, escaped as Grafana escapes it)."""
    values: dict[str, str] = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "constant":
            values[variable["name"]] = variable["query"]
            continue
        definition = substitute(variable["definition"], values)
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
        if not match:
            raise PrometheusError(f"variable {variable['name']}: unsupported query {definition}")
        found = prometheus.label_values(match.group(2), match.group(1))
        if not found:
            raise PrometheusError(f"variable {variable['name']}: {definition} found no values")
        if variable.get("multi") or variable.get("includeAll"):
            values[variable["name"]] = "(" + "|".join(REGEX_SPECIALS.sub(r"\\\\\1", v) for v in found) + ")"
        else:
            values[variable["name"]] = found[0]
    return values


def panel_queries(dashboards: dict[str, dict] | None = None) -> list[PanelQuery]:
    queries = []
    for name, dashboard in (dashboards or load_dashboards()).items():
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                queries.append(
                    PanelQuery(
                        name,
                        panel["title"],
                        panel["type"],
                        target["refId"],
                        target.get("legendFormat", ""),
                        target["expr"],
                        bool(target.get("instant")),
                        optional_reason(target["expr"]),
                    )
                )
    return queries


def run_all(
    prometheus: Prometheus, minutes: float = 15, step: float = 5, scrape_interval: float = 5
) -> list[PanelQuery]:
    """Every panel query of every dashboard over the last `minutes`, as Grafana would send it."""
    end = time.time()
    start = end - minutes * 60
    # Grafana: $__rate_interval = max($__interval + scrape interval, 4 x scrape interval).
    rate_interval = f"{int(max(step + scrape_interval, 4 * scrape_interval))}s"
    builtins = {"__rate_interval": rate_interval, "__interval": f"{int(step)}s", "__range": f"{int(minutes * 60)}s"}
    dashboards = load_dashboards()
    results = []
    for name, dashboard in dashboards.items():
        try:
            values = {**builtins, **variable_values(dashboard, prometheus)}
        except PrometheusError as err:
            values = None
            variable_error = str(err)
        for query in panel_queries({name: dashboard}):
            if values is None:
                query.error = variable_error
            else:
                query.expr = substitute(query.expr, values)
                query.legend = substitute(query.legend, values)
                try:
                    query.result = prometheus.query(query.expr, query.instant, start, end, step)
                    floor = query.first_bucket
                    if floor is not None and not query.has_data:
                        unfiltered = PanelQuery(
                            **{
                                **query.__dict__,
                                "result": prometheus.query(
                                    BELOW_FIRST_BUCKET.sub(r"\1", query.expr), query.instant, start, end, step
                                ),
                            }
                        )
                        query.below_first_bucket = unfiltered.has_data and all(
                            float(value) <= floor
                            for series in unfiltered.result
                            for _, value in series.get("values", [])
                            if math.isfinite(float(value))
                        )
                except PrometheusError as err:
                    query.error = str(err)
            results.append(query)
    return results
