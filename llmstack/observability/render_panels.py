"""Render the dashboards' panels from real Prometheus data with matplotlib (one PNG per dashboard).

Grafana cannot run on every machine (none on the CI machine), so this draws what each panel's
queries return, through the same code the integration test uses (panel_queries.py). The
pictures are labelled as renderings, not Grafana screenshots. Prometheus is reached through the
gateway with basic auth, e.g.:

  python3 grafana/render_panels.py --url http://localhost:8080/prometheus --user admin \
      --password-file secrets/prometheus_password --minutes 15 --out-dir grafana/images
"""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from llmstack import REPO_ROOT
from llmstack.cli import StackError, UsageError, load_pyplot, parser_from_doc
from llmstack.observability import panel_queries

PROG = "render_panels.py"

UNIT_SCALE = {
    "percentunit": (100, "%"),
    "percent": (1, "%"),
    "s": (1000, "ms"),
    "bytes": (1 / 2**30, "GiB"),
    "reqps": (1, "req/s"),
}


def series_label(legend: str, metric: dict) -> str:
    if legend in ("", "__auto"):
        return ",".join(f"{k}={v}" for k, v in metric.items() if k != "__name__") or "value"
    for key, value in metric.items():
        legend = legend.replace("{{" + key + "}}", value)
    return legend


def draw_panel(axis, title: str, panel_type: str, unit: str, queries: list) -> int:
    """Draw one panel; returns how many of its queries had data."""
    from matplotlib import dates, ticker

    scale, suffix = UNIT_SCALE.get(unit, (1, ""))
    with_data = sum(q.has_data for q in queries)
    axis.set_title(title if len(title) <= 48 else title[:46] + "...", fontsize=9, loc="left")
    if panel_type == "heatmap":
        draw_heatmap(axis, queries[0])
    elif panel_type == "table":
        lines = []
        for query in queries:
            for series in query.result:
                lines += [f"{k}: {v}" for k, v in sorted(series["metric"].items()) if k != "__name__"]
        axis.axis("off")
        axis.text(
            0.02,
            0.95,
            "\n".join(lines) or "no data here",
            va="top",
            fontsize=8,
            family="monospace",
            transform=axis.transAxes,
        )
    elif panel_type in ("stat", "gauge", "bargauge"):
        shown_values = []
        for query in queries:
            for series in query.result:
                value = float((series.get("value") or series["values"][-1])[1])
                shown_values.append((series_label(query.legend, series["metric"]), value))
        if panel_type == "bargauge":  # largest first, as the panel's sortBy transformation shows them
            shown_values.sort(key=lambda item: -item[1] if math.isfinite(item[1]) else math.inf)
        lines = [
            f"{label}: {value * scale:.3g}{suffix}" if math.isfinite(value) else f"{label}: -"
            for label, value in shown_values
        ]
        axis.axis("off")
        axis.text(
            0.02,
            0.95,
            "\n".join(lines[:8]) or "no data here",
            va="top",
            fontsize=8,
            family="monospace",
            transform=axis.transAxes,
        )
    else:
        for query in queries:
            for series in query.result:
                points = [
                    (datetime.fromtimestamp(t), float(v) * scale)
                    for t, v in series.get("values", [])
                    if math.isfinite(float(v))
                ]
                if points:
                    times, values = zip(*points, strict=True)
                    axis.plot(times, values, linewidth=1, label=series_label(query.legend, series["metric"])[:40])
        if with_data:
            axis.legend(fontsize=6, loc="upper left")
        else:
            reason = queries[0].optional or (
                "every quantile at or below the first bucket"
                if all(q.below_first_bucket or q.has_data for q in queries)
                else "no samples"
            )
            axis.text(
                0.5,
                0.5,
                "no data here\n(" + reason + ")",
                ha="center",
                va="center",
                fontsize=8,
                transform=axis.transAxes,
            )
        axis.set_ylabel(suffix, fontsize=7)
        axis.tick_params(labelsize=6)
        if with_data:
            axis.xaxis.set_major_locator(ticker.MaxNLocator(5))
            axis.xaxis.set_major_formatter(dates.DateFormatter("%H:%M"))
        else:
            axis.set_xticks([])
            axis.set_yticks([])
    return with_data


def draw_heatmap(axis, query) -> None:
    rows = []
    for series in query.result:
        bound = series["metric"].get("le", "+Inf")
        rows.append((math.inf if bound == "+Inf" else float(bound), [float(v) for _, v in series["values"]]))
    if not rows:
        axis.text(0.5, 0.5, "no data here", ha="center", va="center", transform=axis.transAxes)
        return
    rows.sort()
    width = min(len(values) for _, values in rows)
    # Buckets are cumulative: differences give the count inside each bucket.
    cells = [[rows[i][1][t] - (rows[i - 1][1][t] if i else 0) for t in range(width)] for i in range(len(rows))]
    axis.imshow(cells, aspect="auto", origin="lower", cmap="inferno", interpolation="nearest")
    axis.set_yticks(range(len(rows)), [f"{b * 1000:g}ms" if math.isfinite(b) else "+Inf" for b, _ in rows], fontsize=5)
    axis.set_xticks([])
    axis.set_xlabel("time", fontsize=7)


def render(results: list, out_dir: Path, minutes: float) -> dict[str, dict]:
    plt = load_pyplot()
    summary: dict[str, dict[str, Any]] = {}
    for name, dashboard in panel_queries.load_dashboards().items():
        panels = [p for p in dashboard["panels"] if p["type"] != "row"]
        columns = 3
        rows = math.ceil(len(panels) / columns)
        figure, axes = plt.subplots(rows, columns, figsize=(16, 3.4 * rows), squeeze=False)
        with_data = total = 0
        for axis, panel in zip(axes.flat, panels, strict=False):
            queries = [q for q in results if q.dashboard == name and q.panel == panel["title"]]
            unit = panel["fieldConfig"]["defaults"].get("unit", "short")
            with_data += draw_panel(axis, panel["title"], panel["type"], unit, queries)
            total += len(queries)
        for axis in list(axes.flat)[len(panels) :]:
            axis.axis("off")
        figure.suptitle(
            f"{dashboard['title']} — rendered with matplotlib from real Prometheus data "
            f"(last {minutes:g} min), not a Grafana screenshot",
            fontsize=11,
        )
        figure.tight_layout(rect=(0, 0, 1, 0.97))
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=80)
        plt.close(figure)
        summary[name] = {"png": str(path), "queries": total, "with_data": with_data}
        print(f"  {name}: {with_data}/{total} queries with data -> {path}", file=sys.stderr)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--url", required=True, help="Prometheus base URL, e.g. http://localhost:8080/prometheus")
    parser.add_argument("--user", help="basic-auth user for the gateway's /prometheus/ route")
    parser.add_argument("--password-file", type=Path, help="file holding that user's password")
    parser.add_argument("--minutes", type=float, default=15, help="time range to draw (default 15)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "grafana" / "images")
    parser.add_argument("--json", action="store_true", help="print the per-dashboard counts as JSON")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        raise UsageError("--minutes must be positive")
    if args.password_file and not args.password_file.is_file():
        raise UsageError(f"--password-file {args.password_file}: no such file")
    password = args.password_file.read_text().strip() if args.password_file else None
    load_pyplot()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    prometheus = panel_queries.Prometheus(args.url, args.user, password)
    try:
        prometheus.get("/api/v1/status/buildinfo", {})
        print(f"Running every panel query over the last {args.minutes:g} min ...", file=sys.stderr)
        results = panel_queries.run_all(prometheus, minutes=args.minutes)
    except panel_queries.PrometheusError as err:
        raise StackError(str(err)) from err
    summary = render(results, args.out_dir, args.minutes)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0
