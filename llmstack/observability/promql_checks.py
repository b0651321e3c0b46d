"""Checks that every rule and dashboard expression means the same on Prometheus 3 (shipped:
prom/prometheus v3) as on the Prometheus 2 that runs here (Debian's 2.42/2.53, where promtool tests
run). Expressions are parsed with promql-parser (a PromQL 3 grammar: functions Prometheus 3 removed,
such as holt_winters, do not parse). What Prometheus 3 changed, from its migration guide
(prometheus.io/docs/prometheus/latest/migration/), and what is checked:

- `le` and `quantile` label values are normalised to floats ("1" becomes "1.0"): matchers on them
  must be exact and in float form; a regex on them is refused.
- Regex `.` also matches a newline: `.` only in `.*` / `.+` (anything), otherwise a class or `\\.`.
- Range selectors are left-open (the sample at the window's start is dropped): every range and
  subquery window spans at least four scrape intervals.
- holt_winters became double_exponential_smoothing behind a feature flag: experimental functions
  are refused (the parser knows which).
- UTF-8 metric and label names: only legacy names ([a-zA-Z_:][a-zA-Z0-9_:]*), valid on both.

Beside these, `unknown_metrics` finds a metric name that no exporter of the stack writes and no
recording rule records (config.source_metric_names() lists the exporters' names).
- Config: `scrape_classic_histograms` is now `always_scrape_classic_histograms`; targets keep the
  port they are given (no default port is added); Alertmanager API v1 is gone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import promql_parser

from llmstack.observability import config

LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
NORMALISED_LABELS = ("le", "quantile")
MIN_SCRAPES_PER_WINDOW = 4
GRAFANA_BUILTINS = {
    "__rate_interval": f"{MIN_SCRAPES_PER_WINDOW * config.SCRAPE_INTERVAL_SECONDS}s",
    "__interval": f"{config.SCRAPE_INTERVAL_SECONDS}s",
    "__range": "1h",
}
GRAFANA_VARIABLE = re.compile(r"\$\{?(\w+)\}?")
MENU_PLACEHOLDER = "variable"
"""What fill_variables puts in place of a menu: a word, so it parses wherever the menu's value may
stand (a number after `*` reads as a metric name of that word)."""
REMOVED_CONFIG_KEYS = {"scrape_classic_histograms": "renamed always_scrape_classic_histograms in Prometheus 3"}


def float_label(value: str) -> str:
    """A le/quantile value as Prometheus 3 normalises it: 1 -> 1.0, +Inf stays."""
    number = float(value)
    return "+Inf" if math.isinf(number) and number > 0 else repr(number)


def fill_variables(expr: str, constants: dict[str, str] | None = None) -> str:
    """A dashboard expression with Grafana's variables replaced: constants by their value,
    built-ins by what Grafana sends, menus (regex values) by a plain word."""
    values = {**GRAFANA_BUILTINS, **(constants or {})}
    return GRAFANA_VARIABLE.sub(lambda m: values.get(m.group(1), MENU_PLACEHOLDER), expr)


def nodes(expr: str) -> Iterator[Any]:
    """Every node of the parsed expression, depth first; ValueError where it is not PromQL 3."""
    found: list[Any] = []
    promql_parser.walk(promql_parser.parse(expr), found.append)
    return iter(found)


def metric_names(expr: str) -> set[str]:
    names = set()
    for node in nodes(expr):
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            names |= {m.value for m in node.matchers.matchers if m.name == "__name__"}
    return names


def unknown_metrics(expr: str, known: set[str]) -> set[str]:
    """Metric names `expr` reads that are not in `known` (a filled-in menu is not a metric)."""
    return metric_names(expr) - known - {MENU_PLACEHOLDER}


def regex_dot_problem(pattern: str) -> bool:
    """True for a `.` that is not escaped and not part of `.*` / `.+`."""
    return bool(re.search(r"(?<!\\)\.(?![*+])", pattern))


def pitfalls(expr: str, scrape_interval_seconds: float = config.SCRAPE_INTERVAL_SECONDS) -> list[str]:
    """What in `expr` is invalid on Prometheus 3 or would mean something else there."""
    try:
        parsed = list(nodes(expr))
    except ValueError as err:
        return [f"not valid PromQL 3: {err}"]
    problems = []
    shortest = timedelta(seconds=MIN_SCRAPES_PER_WINDOW * scrape_interval_seconds)
    for node in parsed:
        if isinstance(node, promql_parser.Call) and node.func.experimental:
            problems.append(f"{node.func.name}() is experimental in Prometheus 3 (needs a feature flag)")
        window = (
            getattr(node, "range", None)
            if isinstance(node, promql_parser.MatrixSelector | promql_parser.SubqueryExpr)
            else None
        )
        if window is not None and window < shortest:
            problems.append(
                f"window {node.range} is shorter than {MIN_SCRAPES_PER_WINDOW} scrapes: "
                "Prometheus 3's left-open ranges leave too few samples"
            )
        if not isinstance(node, promql_parser.VectorSelector):
            continue
        if node.name and not LEGACY_NAME.match(node.name):
            problems.append(f"metric name {node.name!r} is not a legacy name")
        for matcher in node.matchers.matchers:
            if not LEGACY_NAME.match(matcher.name):
                problems.append(f"label name {matcher.name!r} is not a legacy name")
            regex = matcher.op in (promql_parser.MatchOp.Re, promql_parser.MatchOp.NotRe)
            if matcher.name in NORMALISED_LABELS:
                if regex:
                    problems.append(f"regex on {matcher.name}: Prometheus 3 normalises its values; match one exactly")
                elif matcher.value != float_label(matcher.value):
                    problems.append(
                        f'{matcher.name}="{matcher.value}" is "{float_label(matcher.value)}" on Prometheus 3'
                    )
            elif regex and regex_dot_problem(matcher.value):
                problems.append(
                    f'{matcher.name}=~"{matcher.value}": "." also matches a newline on Prometheus 3; '
                    'use a class or "\\."'
                )
    return problems


def config_pitfalls(prometheus_config: dict) -> list[str]:
    """What in a parsed prometheus.yml Prometheus 3 reads differently."""
    problems = []

    def visit(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in REMOVED_CONFIG_KEYS:
                    problems.append(f"{where}{key}: {REMOVED_CONFIG_KEYS[key]}")
                if key == "api_version" and item == "v1":
                    problems.append(f"{where}api_version v1: Alertmanager API v1 is gone in Prometheus 3")
                visit(item, f"{where}{key}.")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                visit(item, f"{where}{index}.")

    visit(prometheus_config, "")
    for job in prometheus_config.get("scrape_configs", []):
        for static in job.get("static_configs", []):
            problems += [
                f"job {job['job_name']}: target {target} has no port (Prometheus 3 adds none)"
                for target in static.get("targets", [])
                if not re.search(r":\d+$", target)
            ]
    return problems
