"""What the gateway adds: vLLM's own client (`vllm bench serve`) through the gateway and straight to vLLM, interleaved.

For each level of concurrent clients (--levels, default 1, 8, 64, 256), --repeats runs per path in
ABBA order (gateway, direct; direct, gateway; ...), each one `vllm bench serve` of
max(--min-prompts, level x --prompts-per-client) random prompts of --input-len tokens,
--output-len tokens each (ignore_eos), all sent at once and capped at the level's concurrency,
with a seed of its own (no run reuses another's prompts from the prefix cache). Per level:
  added TTFT    p50 and p99 of the gateway's run minus its paired direct run's (per-request TTFTs
                from `vllm bench serve --save-detailed`, percentiles from llmstack.stats): the
                mean over repeats, min and max, and whether the difference is larger than the
                spread of either path's repeats (llmstack.stats.difference);
  tok/s ratio   output tokens/s through the gateway over direct, per repeat and over all;
  nginx's time  from its JSON access log, over exactly the gateway runs' requests (each run sends
                its own User-Agent): request_time minus upstream_response_time (nginx's own work,
                njs included) and upstream_header_time, p50/p99/max in ms (nginx logs whole ms).
Targets: added TTFT <= 1 ms p50 and <= 3 ms p99, tok/s >= 0.99x direct.

Two places to run it:
  the compose stack (default): `vllm bench serve` inside the vLLM container, to
      http://127.0.0.1:8000 (direct) and http://nginx:8080 (the gateway, on the backend network);
      nginx's log from `docker compose logs nginx` (-p, -f, --env-file as for docker compose);
  a bare host (--vllm-url, --gateway-url, --nginx-log; scripts/bare_host.py): here, with this
      Python, which must import vllm.
The gateway key (--api-key-file) reaches `vllm bench serve` as OPENAI_API_KEY. The gateway's
limits must not bind: start the stack with RATE_LIMIT_PER_KEY=100000r/s RATE_LIMIT_BURST=100000
MAX_CONCURRENT_REQUESTS_PER_KEY=4096 and give the key `sequences=0` (scripts/apikeys.py set).

  python3 benchmarks/gateway_overhead.py --api-key-file secrets/loadtest_api_key --output results/overhead.json
  python3 benchmarks/gateway_overhead.py --vllm-url http://127.0.0.1:8000 --gateway-url http://127.0.0.1:8080 \\
      --nginx-log /tmp/llm-stack/nginx.log --api-key-file /run/secrets/loadtest_api_key
  python3 benchmarks/gateway_overhead.py --render results/overhead.json   # tables and chart again
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmstack.bench import host_environment
from llmstack.bench.gateway_report import TARGETS, fmt, md_table
from llmstack.bench.loadtest_fidelity import VLLM_CPU_PATCH
from llmstack.cli import (
    StackError,
    UsageError,
    add_output_arguments,
    load_pyplot,
    main_exit,
    parse_levels,
    parser_from_doc,
    progress,
    render_saved_run,
    results_path,
    save_chart,
    write_json,
)
from llmstack.stats import difference, spread
from llmstack.vllm import VLLM_PORT, ComposeStack, HostVllm, served_model

PROG = "gateway_overhead.py"
PATHS = ("gateway", "direct")
MARKER = "@@GATEWAY-OVERHEAD@@"
ROUTE = "/v1/completions"
# The scalar figures kept from each `vllm bench serve` result, beside its per-request lists.
KEPT = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "output_throughput")
# Runs of one level in one Python process (one import of vLLM), each with its own result file.
SHIM_LOOP = """
import json, os, time
os.environ["OPENAI_API_KEY"] = __KEY__
from vllm.entrypoints.cli.main import main
kept = []
for run in __RUNS__:
    sys.argv = ["vllm", "bench", "serve"] + run["options"]
    started = time.time()
    try:
        main()
    except SystemExit as exit:
        if exit.code not in (0, None):
            raise
    with open(run["file"]) as handle:
        data = json.load(handle)
    entry = {key: data.get(key) for key in __KEPT__}
    entry.update(ttfts=data.get("ttfts"), errors=data.get("errors"), output_lens=data.get("output_lens"))
    entry.update(name=run["name"], wall_start=started, wall_end=time.time())
    kept.append(entry)
    time.sleep(__PAUSE__)
sys.stdout.write("\\n__MARKER__" + json.dumps(kept) + "\\n")
"""


def shim(key: str, runs: list[dict], pause: float) -> str:
    """Python for vLLM's interpreter: VLLM_CPU_PATCH, then every run of a level."""
    loop = (
        SHIM_LOOP.replace("__KEY__", repr(key))
        .replace("__RUNS__", repr(runs))
        .replace("__KEPT__", repr(KEPT))
        .replace("__PAUSE__", repr(pause))
        .replace("__MARKER__", MARKER)
    )
    return VLLM_CPU_PATCH + loop


def run_order(repeats: int, level_index: int) -> list[tuple[int, str]]:
    """(repeat, path) in ABBA order; the first path alternates from level to level too."""
    order = []
    for repeat in range(repeats):
        paths = PATHS if (repeat + level_index) % 2 == 0 else PATHS[::-1]
        order += [(repeat, path) for path in paths]
    return order


def prompts_for(level: int, args: argparse.Namespace) -> int:
    return max(args.min_prompts, level * args.prompts_per_client)


def bench_options(args: argparse.Namespace, url: str, level: int, seed: int, name: str, file: str) -> list[str]:
    return [
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        ROUTE,
        "--model",
        args.model,
        "--tokenizer",
        args.tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(prompts_for(level, args)),
        "--max-concurrency",
        str(level),
        "--request-rate",
        "inf",
        "--num-warmups",
        str(min(level, args.max_warmups)),
        "--seed",
        str(seed),
        "--header",
        f"User-Agent={name}",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(Path(file).parent),
        "--result-filename",
        Path(file).name,
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
    ]


# --- figures ----------------------------------------------------------------------------------------


def run_figures(result: dict) -> dict:
    """One `vllm bench serve` run: TTFT spread (ms) of its successful requests, tokens/s, failures."""
    errors = result.get("errors") or []
    ttfts = result.get("ttfts") or []
    ok = [t * 1000 for t, e in zip(ttfts, errors or [""] * len(ttfts), strict=False) if not e and t]
    figures = spread(ok)
    return {
        "name": result.get("name"),
        "requests": len(ttfts),
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "ttft_ms": {"p50": figures.p50, "p99": figures.p99, "mean": figures.mean, "max": figures.max},
        "output_tok_s": result.get("output_throughput"),
        "duration_s": result.get("duration"),
        "ttfts_ms": ok,
    }


def nginx_times(lines: list[dict]) -> dict:
    """nginx's own time (request_time - upstream_response_time) and upstream_header_time, in ms, over
    proxied completions; statuses of every line."""
    own, header = [], []
    statuses: dict[str, int] = {}
    for line in lines:
        statuses[str(line.get("status"))] = statuses.get(str(line.get("status")), 0) + 1
        if line.get("uri") != ROUTE and line.get("route") != ROUTE:
            continue
        try:
            request = float(line["request_time"])
            # Several upstreams tried: "0.010, 0.020"; their sum is the time spent upstream.
            upstream = sum(float(x) for x in str(line["upstream_response_time"]).split(",") if x.strip() != "-")
            upstream_header = sum(float(x) for x in str(line["upstream_header_time"]).split(",") if x.strip() != "-")
        except (KeyError, ValueError):
            continue
        own.append((request - upstream) * 1000)
        header.append(upstream_header * 1000)

    def figures(values: list[float]) -> dict:
        s = spread(values)
        return {"n": s.n, "mean": s.mean, "p50": s.p50, "p99": s.p99, "max": s.max}

    return {"own_ms": figures(own), "upstream_header_ms": figures(header), "statuses": statuses}


def paired(rows: list[tuple[dict, dict]], key: str) -> dict:
    """gateway minus direct, one value per repeat: mean, min, max."""
    values = [
        g["ttft_ms"][key] - d["ttft_ms"][key]
        for g, d in rows
        if g["ttft_ms"][key] is not None and d["ttft_ms"][key] is not None
    ]
    s = spread(values)
    return {"mean": s.mean, "min": s.min, "max": s.max, "per_repeat": values}


def level_summary(level: int, runs: dict[str, list[dict]], nginx_lines: list[dict]) -> dict:
    """One level's figures from its runs (per path, in repeat order) and the gateway runs' log lines."""
    pairs = list(zip(runs["gateway"], runs["direct"], strict=True))
    row: dict[str, Any] = {"clients": level}
    for path in PATHS:
        pooled = spread([t for run in runs[path] for t in run["ttfts_ms"]])
        row[path] = {
            "runs": [{k: v for k, v in run.items() if k != "ttfts_ms"} for run in runs[path]],
            "ttft_p50_ms": pooled.p50,
            "ttft_p99_ms": pooled.p99,
            "output_tok_s": spread([run["output_tok_s"] or 0 for run in runs[path]]).mean,
            "failed": sum(run["failed"] or 0 for run in runs[path]),
        }
    for stat in ("p50", "p99"):
        row[f"added_ttft_{stat}_ms"] = paired(pairs, stat)
        delta, larger = difference(
            [d["ttft_ms"][stat] for d in runs["direct"] if d["ttft_ms"][stat] is not None],
            [g["ttft_ms"][stat] for g in runs["gateway"] if g["ttft_ms"][stat] is not None],
        )
        row[f"added_ttft_{stat}_ms"]["median_difference"] = delta
        row[f"added_ttft_{stat}_ms"]["larger_than_spread"] = larger
    ratios = [g["output_tok_s"] / d["output_tok_s"] for g, d in pairs if g["output_tok_s"] and d["output_tok_s"]]
    r = spread(ratios)
    row["tok_s_ratio"] = {
        "overall": row["gateway"]["output_tok_s"] / row["direct"]["output_tok_s"]
        if row["direct"]["output_tok_s"]
        else None,
        "mean": r.mean,
        "min": r.min,
        "max": r.max,
        "per_repeat": ratios,
    }
    row["nginx"] = nginx_times(nginx_lines)
    return row


def target_rows(levels: list[dict]) -> list[dict]:
    """Each target at its worst level (mean over repeats)."""
    out = []
    for label, key, target, higher in (
        ("added TTFT p50 <= 1 ms", "added_ttft_p50_ms", TARGETS["added_ttft_p50_ms"], False),
        ("added TTFT p99 <= 3 ms", "added_ttft_p99_ms", TARGETS["added_ttft_p99_ms"], False),
        ("gateway tok/s >= 0.99 x direct", "tok_s_ratio", TARGETS["throughput_ratio"], True),
    ):
        values = [(row[key]["mean"], row["clients"]) for row in levels if row[key].get("mean") is not None]
        if not values:
            continue
        # Worst: the largest added latency (signed: a negative one is no cost), the smallest ratio.
        value, level = min(values) if higher else max(values)
        ok = value >= target if higher else value <= target
        out.append(
            {
                "target": label,
                "worst_level": level,
                "value": round(value, 3),
                "verdict": "met" if ok else "MISSED",
            }
        )
    return out


# --- report -----------------------------------------------------------------------------------------


def with_range(entry: dict, digits: int = 2, sign: bool = True) -> str:
    """mean (min to max) over repeats."""
    if entry.get("mean") is None:
        return "-"
    return (
        f"{fmt(entry['mean'], digits, sign)} ({fmt(entry['min'], digits, sign)} to {fmt(entry['max'], digits, sign)})"
    )


def markdown_table(summary: dict) -> str:
    """Per level: TTFT of both paths, the gateway's added TTFT and tok/s ratio with their spread over
    repeats, and nginx's own time: docs/gateway-policy.md's table."""
    rows = []
    for row in summary["levels"]:
        nginx = row["nginx"]
        rows.append(
            [
                str(row["clients"]),
                str(row.get("prompts_per_run", "-")),
                f"{fmt(row['direct']['ttft_p50_ms'], 2)} / {fmt(row['gateway']['ttft_p50_ms'], 2)}",
                with_range(row["added_ttft_p50_ms"]) + ("" if row["added_ttft_p50_ms"]["larger_than_spread"] else " ~"),
                f"{fmt(row['direct']['ttft_p99_ms'], 2)} / {fmt(row['gateway']['ttft_p99_ms'], 2)}",
                with_range(row["added_ttft_p99_ms"]) + ("" if row["added_ttft_p99_ms"]["larger_than_spread"] else " ~"),
                f"{fmt(row['direct']['output_tok_s'], 0)} / {fmt(row['gateway']['output_tok_s'], 0)}",
                with_range(row["tok_s_ratio"], 3, sign=False),
                " / ".join(fmt(nginx["own_ms"][stat], 0) for stat in ("p50", "p99", "max")),
                f"{fmt(nginx['upstream_header_ms']['p50'], 0)} / {fmt(nginx['upstream_header_ms']['p99'], 0)}",
                f"{row['direct']['failed']} / {row['gateway']['failed']}",
            ]
        )
    return md_table(
        [
            "Clients",
            "Prompts per run",
            "TTFT p50 direct / gateway (ms)",
            "Added p50 (ms)",
            "TTFT p99 direct / gateway (ms)",
            "Added p99 (ms)",
            "Output tok/s direct / gateway",
            "Ratio",
            "nginx own p50 / p99 / max (ms)",
            "Upstream header p50 / p99 (ms)",
            "Failed direct / gateway",
        ],
        rows,
    )


def targets_table(summary: dict) -> str:
    return md_table(
        ["Target", "Worst level (clients)", "Value (mean over repeats)", "Verdict"],
        [[t["target"], str(t["worst_level"]), str(t["value"]), t["verdict"]] for t in summary["targets"]],
    )


def render(summary: dict) -> str:
    env, s = summary["environment"], summary["settings"]
    head = (
        f"# Gateway overhead: `vllm bench serve` {env.get('bench_where')}, {env.get('date')}\n\n"
        f"Model {s['model']}, random prompts of {s['input_len']} tokens, {s['output_len']} output tokens, "
        f"{s['repeats']} runs per path and level (ABBA). Added figures: mean over repeats (min to max); "
        "~ marks a difference no larger than the spread between repeats."
    )
    return "\n\n".join([head, markdown_table(summary), targets_table(summary)]) + "\n"


def chart(summary: dict, path: Path) -> None:
    plt = load_pyplot()
    levels = [row["clients"] for row in summary["levels"]]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    for stat, color, target in (("p50", "tab:blue", 1.0), ("p99", "tab:orange", 3.0)):
        entries = [row[f"added_ttft_{stat}_ms"] for row in summary["levels"]]
        means = [e["mean"] for e in entries]
        low = [e["mean"] - e["min"] if e["mean"] is not None else 0 for e in entries]
        high = [e["max"] - e["mean"] if e["mean"] is not None else 0 for e in entries]
        left.errorbar(levels, means, yerr=[low, high], marker="o", capsize=4, color=color, label=f"added {stat}")
        left.axhline(target, color=color, ls=":", label=f"{stat} target")
    left.axhline(0, color="gray", lw=0.8)
    left.set(xscale="log", xlabel="concurrent clients", ylabel="ms", title="TTFT added by the gateway (range: repeats)")
    left.set_yscale("symlog", linthresh=3)
    left.set_xticks(levels, [str(x) for x in levels])
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    ratios = [row["tok_s_ratio"] for row in summary["levels"]]
    middle.errorbar(
        levels,
        [r["mean"] for r in ratios],
        yerr=[[r["mean"] - r["min"] for r in ratios], [r["max"] - r["mean"] for r in ratios]],
        marker="s",
        capsize=4,
    )
    middle.axhline(TARGETS["throughput_ratio"], color="tab:red", ls=":", label="0.99 target")
    middle.axhline(1.0, color="gray", lw=0.8)
    middle.set(xscale="log", xlabel="concurrent clients", title="Output tok/s, gateway / direct")
    middle.set_xticks(levels, [str(x) for x in levels])
    middle.legend(fontsize=8)
    middle.grid(alpha=0.3)
    for key, marker, label in (("p50", "o", "own p50"), ("p99", "^", "own p99"), ("max", "x", "own max")):
        right.plot(levels, [row["nginx"]["own_ms"][key] for row in summary["levels"]], marker=marker, label=label)
    right.plot(
        levels,
        [row["nginx"]["upstream_header_ms"]["p50"] for row in summary["levels"]],
        marker="s",
        ls="--",
        label="upstream header p50",
    )
    right.set(xscale="log", xlabel="concurrent clients", ylabel="ms", title="nginx's access log")
    right.set_xticks(levels, [str(x) for x in levels])
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    save_chart(plt, fig, path)


# --- the run ----------------------------------------------------------------------------------------


class Where:
    """Where `vllm bench serve` runs, the URLs it uses there, and nginx's log."""

    def __init__(self, args: argparse.Namespace):
        if args.vllm_url:
            if not args.gateway_url or not args.nginx_log:
                raise UsageError("--vllm-url needs --gateway-url and --nginx-log (a bare host)")
            self.stack: ComposeStack | HostVllm = HostVllm(args.vllm_url.rstrip("/"), Path(os.devnull))
            self.urls = {"direct": args.vllm_url.rstrip("/"), "gateway": args.gateway_url.rstrip("/")}
            self.nginx_log: Path | None = Path(args.nginx_log)
            self.description = "on this host"
            self.nginx_stack = None
        else:
            files = [f for item in (args.compose_file or []) for f in item.split(":") if f]
            self.stack = ComposeStack(args.project_name, files, args.env_file)
            self.nginx_stack = ComposeStack(args.project_name, files, args.env_file, service="nginx")
            self.urls = {
                "direct": f"http://127.0.0.1:{VLLM_PORT}",
                "gateway": (args.gateway_url or "http://nginx:8080").rstrip("/"),
            }
            self.nginx_log = None
            self.description = "in the vLLM container"

    def nginx_lines(self) -> list[dict]:
        if self.nginx_log is not None:
            try:
                text = self.nginx_log.read_text(errors="replace")
            except OSError as err:
                raise StackError(f"cannot read nginx's log {self.nginx_log}: {err.strerror}") from err
        else:
            assert self.nginx_stack is not None
            text = self.nginx_stack.logs()
        lines = []
        for raw in text.splitlines():
            raw = raw.strip()
            if raw.startswith("{"):
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    continue
        return lines


def measure(args: argparse.Namespace, where: Where, key: str) -> list[dict]:
    stamp = datetime.now(UTC).strftime("%H%M%S")
    levels = []
    for index, level in enumerate(args.levels):
        order = run_order(args.repeats, index)
        runs: list[dict[str, Any]] = []
        for number, (repeat, path) in enumerate(order):
            name = f"overhead-{stamp}-c{level}-r{repeat + 1}-{path}"
            file = f"/tmp/{name}.json"
            seed = args.seed + index * 1000 + number
            runs.append(
                {
                    "name": name,
                    "path": path,
                    "repeat": repeat,
                    "file": file,
                    "options": bench_options(args, where.urls[path], level, seed, name, file),
                }
            )
        progress(
            f"{level} clients: {len(runs)} runs of {prompts_for(level, args)} prompts ({' '.join(p for _, p in order)})"
        )
        code = shim(key, [{k: r[k] for k in ("name", "options", "file")} for r in runs], args.pause)
        output = where.stack.python(code, timeout=args.level_timeout)
        if MARKER not in output:
            raise StackError(f"`vllm bench serve` gave no result at {level} clients: {output.strip()[-300:]}")
        results = {r["name"]: r for r in json.loads(output.split(MARKER)[-1])}
        by_path: dict[str, list[dict]] = {path: [] for path in PATHS}
        for run in sorted(runs, key=lambda r: r["repeat"]):
            by_path[run["path"]].append(run_figures(results[run["name"]]))
        gateway_names = {r["name"] for r in runs if r["path"] == "gateway"}
        lines = [line for line in where.nginx_lines() if line.get("user_agent") in gateway_names]
        row = level_summary(level, by_path, lines)
        row["prompts_per_run"] = prompts_for(level, args)
        levels.append(row)
        progress(
            f"{level} clients: added TTFT p50 {with_range(row['added_ttft_p50_ms'])} ms, "
            f"p99 {with_range(row['added_ttft_p99_ms'])} ms, tok/s ratio {with_range(row['tok_s_ratio'], 3, False)}, "
            f"nginx own p99 {fmt(row['nginx']['own_ms']['p99'], 0)} ms over {row['nginx']['own_ms']['n']} lines"
        )
    return levels


def add_api_key_argument(parser: argparse.ArgumentParser, what: str = "the gateway key") -> None:
    """--api-key-file, defaulting to the load generator's key as compose mounts it (LOADTEST_API_KEY_FILE)."""
    parser.add_argument(
        "--api-key-file",
        default=os.environ.get("LOADTEST_API_KEY_FILE", "secrets/loadtest_api_key"),
        help=f"{what} (default: %(default)s)",
    )


def read_key(path: str) -> str:
    try:
        keys = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as err:
        raise UsageError(f"--api-key-file {path}: {err.strerror}") from None
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key")
    return keys[0]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    add_api_key_argument(parser)
    parser.add_argument("--levels", default="1,8,64,256", help="concurrent clients (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per path and level (default: %(default)s)")
    parser.add_argument("--prompts-per-client", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--min-prompts", type=int, default=100, help="at least this many per run (default: 100)")
    parser.add_argument("--max-warmups", type=int, default=16, help="warm-up requests per run: min(level, this)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between runs (default: %(default)s)")
    parser.add_argument("--level-timeout", type=float, default=1800, help="seconds for one level's runs")
    parser.add_argument("--model", help="served model name (default: vLLM's /v1/models)")
    parser.add_argument("--tokenizer", help="tokenizer path as vLLM's Python sees it (default: the model's root)")
    parser.add_argument("--vllm-url", help="vLLM's URL on a bare host (then --gateway-url and --nginx-log)")
    parser.add_argument("--gateway-url", help="the gateway's URL (default in the compose stack: http://nginx:8080)")
    parser.add_argument("--nginx-log", help="nginx's access log file (a bare host: /tmp/llm-stack/nginx.log)")
    parser.add_argument("--project-name", "-p", default=os.environ.get("COMPOSE_PROJECT_NAME"))
    parser.add_argument("--compose-file", "-f", action="append", help="compose file(s), as for docker compose")
    parser.add_argument("--env-file", help="compose env file (default: .env)")
    add_output_arguments(parser, "gateway_overhead")
    args = parser.parse_args(argv)
    args.levels = parse_levels(args.levels)
    for name in ("repeats", "prompts_per_client", "min_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_warmups < 0 or args.pause < 0:
        raise UsageError("--max-warmups and --pause must not be negative")
    if args.output_len < 2:
        raise UsageError("--output-len must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rendered = render_saved_run(argv, chart, render)
    if rendered is not None:
        return rendered
    args = parse_args(argv)
    key = read_key(args.api_key_file)
    where = Where(args)
    model = served_model(where.stack)
    args.model = args.model or model["id"]
    args.tokenizer = args.tokenizer or model.get("root") or model["id"]
    started = time.perf_counter()
    levels = measure(args, where, key)
    summary = {
        "environment": {
            **host_environment(),
            "bench_where": where.description,
            "urls": where.urls,
            "max_model_len": model.get("max_model_len"),
            "duration_s": round(time.perf_counter() - started, 1),
        },
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("api_key_file", "json", "output", "chart", "no_chart")
        },
        "levels": levels,
        "targets": target_rows(levels),
    }
    output = args.output or results_path("gateway_overhead.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    write_json(output, summary)
    if not args.no_chart:
        chart(summary, args.chart or output.with_suffix(".png"))
    print(json.dumps(summary, indent=2) if args.json else render(summary), end="")
    progress(f"wrote {output}")
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
