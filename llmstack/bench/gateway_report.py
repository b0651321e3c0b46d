"""The gateway-vs-direct report: markdown tables, target verdicts and the chart, from a run's
summary.json (written by llmstack.bench.gateway_vs_direct; `gateway_vs_direct.py --render` redraws
a finished run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmstack.cli import UsageError, load_pyplot, save_chart
from llmstack.stats import spread

PATHS = ("gateway", "direct")
TARGETS = {"added_ttft_p50_ms": 1.0, "added_ttft_p99_ms": 3.0, "throughput_ratio": 0.99, "fidelity_pct": 5.0}


def fmt(value: float | None, digits: int = 1, sign: bool = False) -> str:
    """A figure for a table: thousands separated, sign shown when asked, "-" for none."""
    if value is None:
        return "-"
    return f"{value:+,.{digits}f}" if sign else f"{value:,.{digits}f}"


def median_range(cell: dict, digits: int = 1, show: Callable[[float], str] | None = None) -> str:
    """A figure over repeats (a Spread as a dict): "median (min–max)", the median alone for one."""
    show = show or (lambda value: fmt(value, digits))
    if cell.get("p50") is None:
        return "-"
    if cell.get("n", 2) < 2:
        return show(cell["p50"])
    return f"{show(cell['p50'])} ({show(cell['min'])}–{show(cell['max'])})"


def median_range_of(values: list[float], digits: int = 1, show: Callable[[float], str] | None = None) -> str:
    """median_range of raw per-repeat values (rather than a stored Spread)."""
    return median_range(spread(values).as_dict(), digits, show)


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def verdict(value: float | None, target: float, higher_is_better: bool = False) -> str:
    if value is None:
        return "-"
    ok = value >= target if higher_is_better else abs(value) <= target
    return "met" if ok else "MISSED"


def both_paths(row: dict, metric: str, stat: str, digits: int) -> str:
    """ "direct / gateway" for one statistic of one level."""
    return " / ".join(fmt((row[path][metric] or {}).get(stat), digits) for path in ("direct", "gateway"))


def render(summary: dict) -> str:
    env = summary["environment"]
    parts = [
        f"# Gateway vs direct: {env.get('model')} on {env.get('gpu', 'this host')}",
        f"vLLM {env.get('vllm_version')}, Locust {env.get('locust_version')}, client Python "
        f"{env.get('client_python')} on {env.get('client_cpus')} CPUs, {env.get('date')}.",
    ]
    rows = summary.get("concurrency") or []
    if rows:
        parts.append(
            "## Concurrency (the lab's table, both paths)\n"
            + md_table(
                [
                    "Concurrency",
                    "Direct tok/s",
                    "Gateway tok/s",
                    "Ratio",
                    "Avg TPS/request (direct)",
                    "TTFT p50 direct / gateway (ms)",
                    "TTFT p99 direct / gateway (ms)",
                    "Added p50 (ms)",
                    "Added p99 (ms)",
                    "TPOT p50 direct / gateway (ms)",
                    "Client CPU %",
                ],
                [
                    [
                        str(r["concurrency"]),
                        fmt(r["direct"]["throughput_tok_s"], 0),
                        fmt(r["gateway"]["throughput_tok_s"], 0),
                        fmt(r.get("throughput_ratio"), 3),
                        fmt(r["direct"]["avg_tps_per_request"], 0),
                        both_paths(r, "ttft_ms", "p50", 2),
                        both_paths(r, "ttft_ms", "p99", 2),
                        fmt(r.get("added_ttft_p50_ms"), 2),
                        fmt(r.get("added_ttft_p99_ms"), 2),
                        both_paths(r, "tpot_ms", "p50", 3),
                        fmt(max(r["direct"]["client_cpu_pct"] or 0, r["gateway"]["client_cpu_pct"] or 0), 0),
                    ]
                    for r in rows
                ],
            )
        )
        parts.append(
            "## Harness fidelity (client means vs vLLM's histograms, same requests)\n"
            + md_table(
                ["Concurrency", "Path", "TTFT client / vLLM (ms)", "TTFT diff", "TPOT client / vLLM (ms)", "TPOT diff"],
                [
                    [
                        str(r["concurrency"]),
                        path,
                        f"{fmt(r[path]['client_ttft_mean_ms'], 2)} / {fmt(r[path]['vllm_ttft_mean_ms'], 2)}",
                        f"{fmt(r[path]['ttft_fidelity_pct'], 1)}%",
                        f"{fmt(r[path]['client_tpot_mean_ms'], 3)} / {fmt(r[path]['vllm_tpot_mean_ms'], 3)}",
                        f"{fmt(r[path]['tpot_fidelity_pct'], 1)}%",
                    ]
                    for r in rows
                    for path in PATHS
                ],
            )
        )
    if summary.get("targets"):
        parts.append(
            "## Targets\n"
            + md_table(
                ["Target", "Worst level", "Value", "Verdict"],
                [[t["target"], str(t["level"]), t["value"], t["verdict"]] for t in summary["targets"]],
            )
        )
    if summary.get("streaming"):
        s = summary["streaming"]
        parts.append(
            "## Streaming (medians of single streamed requests)\n"
            + md_table(
                [
                    "Path",
                    "TTFT (ms)",
                    "Decode (ms)",
                    "Output tokens",
                    "Avg interval (ms)",
                    "Tokens/s",
                    "TTFT / interval",
                ],
                [
                    [
                        path,
                        fmt(s[path]["ttft_ms"], 2),
                        fmt(s[path]["decode_ms"], 1),
                        fmt(s[path]["output_tokens"], 0),
                        fmt(s[path]["avg_interval_ms"], 3),
                        fmt(s[path]["tokens_per_s"], 0),
                        fmt(s[path]["ttft_interval_ratio"], 1),
                    ]
                    for path in PATHS
                ],
            )
        )
    if summary.get("prefix"):
        p = summary["prefix"]
        parts.append(
            "## Prefix caching (TTFT p50)\n"
            + md_table(
                [
                    "Path",
                    "Prompt tokens",
                    "Unique prefix (ms)",
                    "Shared prefix (ms)",
                    "Reduction",
                    "vLLM hit rate (shared)",
                ],
                [
                    [
                        path,
                        fmt(p[path]["prompt_tokens"], 0),
                        fmt(p[path]["ttft_unique_p50_ms"], 2),
                        fmt(p[path]["ttft_shared_p50_ms"], 2),
                        f"{fmt(p[path]['reduction_pct'], 0)}%",
                        f"{fmt(p[path]['hit_rate_shared'] * 100, 0)}%",
                    ]
                    for path in PATHS
                ],
            )
        )
    if summary.get("latency"):
        lines = []
        for path in PATHS:
            result = summary["latency"][path]
            if "error" in result:
                lines.append([path, "error: " + result["error"], "", "", "", "", ""])
                continue
            for prompt in result.get("results", []) + result.get("sweep", []):
                lines.append(
                    [
                        path,
                        prompt.get("label", "?"),
                        fmt(prompt.get("input_tokens"), 0),
                        fmt(prompt.get("output_tokens"), 0),
                        fmt(nested(prompt, "ttft_ms"), 2),
                        fmt(nested(prompt, "tpot_ms"), 3),
                        fmt(nested(prompt, "total_ms"), 1),
                    ]
                )
        parts.append(
            "## Single-request latency (medians)\n"
            + md_table(
                ["Path", "Prompt", "Input tokens", "Output tokens", "TTFT (ms)", "TPOT (ms)", "Total (ms)"], lines
            )
        )
    if summary.get("memory"):
        parts.append(
            "## Memory report and KV planner (vLLM's own figures beside them)\n" + memory_table(summary["memory"])
        )
    return "\n\n".join(parts) + "\n"


def memory_table(memory: dict) -> str:
    report = memory.get("memory_report") or {}
    rows = []
    if "error" in report:
        rows.append(["memory report", "-", report["error"]])
    else:
        weights, kv = report.get("weights") or {}, report.get("kv_cache") or {}
        rows += [
            [
                "model weights (GiB)",
                fmt(weights.get("theoretical_gib"), 3) + " theoretical "
                f"({fmt(weights.get('parameters'), 0)} parameters)",
                fmt(weights.get("measured_gib"), 2) + " logged",
            ],
            [
                "KV cache pool",
                f"{fmt(kv.get('bytes_per_token'), 0)} B/token",
                f"{fmt(kv.get('gib'), 2)} GiB, {fmt(kv.get('tokens'), 0)} tokens",
            ],
            ["CUDA graph pool (GiB)", "-", fmt(report.get("cuda_graph_gib"), 2)],
            ["max concurrency at max_model_len", "-", fmt(report.get("max_concurrency"), 2)],
        ]
    for key, label in (
        ("kv_planner_from_log", "planner from vLLM's KV space"),
        ("kv_planner_predicted", "planner from GPU size x utilisation"),
    ):
        check = (memory.get(key) or {}).get("cross_check") or {}
        if check:
            rows.append(
                [
                    label + " (tokens)",
                    f"{fmt(check.get('predicted_tokens'), 0)} ({check.get('basis')})",
                    f"{fmt(check.get('reported_tokens'), 0)} reported, "
                    f"{fmt(check.get('difference_percent'), 3)}% apart",
                ]
            )
        elif (memory.get(key) or {}).get("error"):
            rows.append([label, "-", memory[key]["error"]])
    return md_table(["What", "Computed", "vLLM"], rows)


def nested(entry: dict, key: str) -> float | None:
    value = entry.get(key)
    if isinstance(value, dict):
        return value.get("median")
    return value


def target_rows(rows: list[dict]) -> list[dict]:
    out = []
    checks = [
        ("added TTFT p50 <= 1 ms", "added_ttft_p50_ms", TARGETS["added_ttft_p50_ms"], False, 2, ""),
        ("added TTFT p99 <= 3 ms", "added_ttft_p99_ms", TARGETS["added_ttft_p99_ms"], False, 2, ""),
        ("gateway tok/s >= 0.99 x direct", "throughput_ratio", TARGETS["throughput_ratio"], True, 3, ""),
    ]
    for label, key, target, higher, digits, _ in checks:
        values = [(r[key], r["concurrency"]) for r in rows if r.get(key) is not None]
        if not values:
            continue
        worst = min(values) if higher else max(values)
        out.append(
            {
                "target": label,
                "level": worst[1],
                "value": fmt(worst[0], digits),
                "verdict": verdict(worst[0], target, higher),
            }
        )
    for label, key in (
        ("harness TTFT within 5% of vLLM", "ttft_fidelity_pct"),
        ("harness TPOT within 5% of vLLM", "tpot_fidelity_pct"),
    ):
        fidelity = [
            (abs(r["direct"][key]), r["concurrency"], r["direct"][key])
            for r in rows
            if r["direct"].get(key) is not None
        ]
        if fidelity:
            size, level, signed = max(fidelity)
            out.append(
                {
                    "target": label + " (direct path)",
                    "level": level,
                    "value": f"{signed:+.1f}%",
                    "verdict": verdict(size, TARGETS["fidelity_pct"]),
                }
            )
    return out


def charts(out_dir: Path, rows: list[dict]) -> list[str]:
    """Throughput and added TTFT per level; none where matplotlib is missing (the tables suffice)."""
    try:
        plt = load_pyplot()
    except UsageError:
        return []
    levels = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path, marker in (("direct", "o"), ("gateway", "s")):
        left.plot(levels, [r[path]["throughput_tok_s"] for r in rows], marker=marker, label=path)
    left.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s", title="Throughput")
    left.set_xticks(levels, [str(x) for x in levels])
    left.legend()
    left.grid(alpha=0.3)
    right.axhline(TARGETS["added_ttft_p50_ms"], color="tab:blue", linestyle=":", label="p50 target")
    right.axhline(TARGETS["added_ttft_p99_ms"], color="tab:orange", linestyle=":", label="p99 target")
    right.plot(levels, [r.get("added_ttft_p50_ms") for r in rows], marker="o", color="tab:blue", label="added p50")
    right.plot(levels, [r.get("added_ttft_p99_ms") for r in rows], marker="s", color="tab:orange", label="added p99")
    right.set(xscale="log", xlabel="concurrent clients", ylabel="ms", title="TTFT added by the gateway")
    right.set_xticks(levels, [str(x) for x in levels])
    right.legend()
    right.grid(alpha=0.3)
    save_chart(plt, fig, out_dir / "gateway_vs_direct.png")
    return ["gateway_vs_direct.png"]
