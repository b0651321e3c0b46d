"""The lab's experiments through the gateway AND straight to vLLM, interleaved, on one server.

What the gateway costs (added TTFT p50/p99, tokens/s through it over direct, per concurrency
level) and how faithful the load harness is (its TTFT and TPOT means against vLLM's own
histograms over the same requests), with the lab's tables for both paths:
  concurrency  loadtest.experiments, one level at a time, the two paths in ABBA order; levels
               double from 1 until vLLM's throughput stops growing (or --levels);
  streaming    TTFT, inter-token interval, tokens/s of single streamed requests;
  prefix       TTFT with and without a shared system prompt;
  latency      scripts/latency.py (short and long prompt, medians);
  memory       scripts/memory_report.py and scripts/kv_planner.py --check-stack (vLLM only).
Run it where both URLs answer: on a host running vLLM and nginx without Docker (started by
scripts/bare_host.py), or in the stack's network:
  docker compose logs --no-log-prefix vllm > results/vllm.log
  docker compose run --rm -T -v "$PWD:/work" -w /work locust-master python benchmarks/gateway_vs_direct.py \\
      --gateway http://nginx:8080 --direct http://vllm:8000 --vllm-log results/vllm.log
Writes summary.json, summary.md (the tables for docs/, llmstack.bench.gateway_report) and PNG charts
to --results/gateway-vs-direct-<time>/; `gateway_vs_direct.py --render <run>/summary.json` redraws the
tables and chart of a finished run.
The gateway's per-key limits must not bind: raise RATE_LIMIT_PER_KEY and
MAX_CONCURRENT_REQUESTS_PER_KEY for the key you use (docs/gpu-results.md).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from llmstack import REPO_ROOT
from llmstack.bench import host_environment
from llmstack.bench.gateway_overhead import add_api_key_argument
from llmstack.bench.gateway_report import PATHS, charts, render, target_rows
from llmstack.cli import StackError, UsageError, add_json_argument, main_exit, parse_levels, parser_from_doc, progress
from llmstack.stats import spread
from llmstack.vllm import HostVllm, served_model

PROG = "gateway_vs_direct.py"
GROWTH_TO_CONTINUE = 1.05  # stop doubling once vLLM's throughput grows by less than 5%


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--gateway", required=True, help="the gateway's URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--direct", required=True, help="vLLM's own URL, e.g. http://127.0.0.1:8000")
    add_api_key_argument(parser, "the gateway key(s), one a line")
    parser.add_argument("--vllm-log", help="vLLM's output since its start, for the memory report (optional)")
    parser.add_argument(
        "--vllm-metrics-url",
        help="vLLM's /metrics for the cross-checks (default: DIRECT/metrics). With several replicas behind "
        "the gateway, a name that resolves to all of them, e.g. http://vllm-replicas:8000/metrics (summed)",
    )
    parser.add_argument(
        "--levels",
        help="concurrency levels, comma-separated (default: 1, 2, 4, ... "
        "until throughput stops growing, at most --max-level)",
    )
    parser.add_argument("--max-level", type=int, default=512)
    parser.add_argument(
        "--requests-per-client",
        type=int,
        default=4,
        help="requests each client sends per level and run (default: %(default)s)",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=100,
        help="at least this many requests per level and run, for p99 (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs per path and level; the order alternates (ABBA) (default: %(default)s)",
    )
    parser.add_argument("--max-tokens", type=int, default=50, help="output tokens per request (the lab's 50)")
    parser.add_argument("--streaming-requests", type=int, default=20)
    parser.add_argument("--prefix-requests", type=int, default=20)
    parser.add_argument("--latency-runs", type=int, default=10)
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to leave out: concurrency,streaming,prefix,latency,memory"
    )
    parser.add_argument("--results", default="results", help="parent folder of the run's folder")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    for name in (
        "max_level",
        "requests_per_client",
        "min_requests",
        "repeats",
        "max_tokens",
        "streaming_requests",
        "prefix_requests",
        "latency_runs",
    ):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < 2:
        raise UsageError("--max-tokens must be at least 2 (TPOT needs two tokens)")
    if args.levels:
        args.levels = parse_levels(args.levels)
    args.skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    unknown = args.skip - {"concurrency", "streaming", "prefix", "latency", "memory"}
    if unknown:
        raise UsageError(f"--skip: unknown part(s) {', '.join(sorted(unknown))}")
    if not Path(args.api_key_file).is_file():
        raise UsageError(f"no API key file at {args.api_key_file} (--api-key-file)")
    args.gateway, args.direct = args.gateway.rstrip("/"), args.direct.rstrip("/")
    return args


def first_key(path: str) -> str:
    keys = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not keys:
        raise UsageError(f"{path} holds no key")
    return keys[0]


def http_get(url: str, key: str | None = None, timeout: float = 10) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()
    except (urllib.error.URLError, OSError) as err:
        raise StackError(f"{url} does not answer: {getattr(err, 'reason', err)}") from err


def environment(args: argparse.Namespace, key: str) -> dict:
    """Hardware and versions, for the report."""
    info = host_environment()
    vllm = HostVllm(args.direct, Path(args.vllm_log or os.devnull))
    info["vllm_version"] = json.loads(vllm.get("/version")).get("version")
    status, _, body = http_get(args.gateway + "/v1/models", key)
    if status != 200:
        raise StackError(f"the gateway answers /v1/models with {status}: {body[:200]!r}")
    info["model"] = json.loads(body)["data"][0]["id"]
    model = served_model(vllm)
    info["model_root"], info["max_model_len"] = model.get("root"), model.get("max_model_len")
    # Its version from the metadata: importing locust would gevent-patch this process, after
    # requests (llmstack.sse) has imported ssl, and break it.
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["locust_version"] = importlib.metadata.version("locust")
    return info


# --- running the harness ---------------------------------------------------------------------------


class Harness:
    def __init__(self, args: argparse.Namespace, out_dir: Path):
        self.args, self.out_dir, self.count = args, out_dir, 0

    def experiments(self, path: str, *options: str) -> tuple[dict, list[dict]]:
        """One loadtest.experiments run against one path: its summary and its per-request records."""
        self.count += 1
        results = self.out_dir / "runs" / f"{self.count:03d}-{path}"
        host = self.args.gateway if path == "gateway" else self.args.direct
        command = [
            sys.executable,
            "-m",
            "loadtest.experiments",
            "--json",
            "--no-charts",
            "--host",
            host,
            "--api-key-file",
            self.args.api_key_file,
            "--vllm-metrics-url",
            self.args.vllm_metrics_url or self.args.direct + "/metrics",
            "--results",
            str(results),
            *options,
        ]
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600)
        if result.returncode not in (0, 1) or not result.stdout.strip().startswith("{"):
            raise StackError(
                f"loadtest.experiments failed against {path} (exit {result.returncode}): {result.stderr.strip()[-600:]}"
            )
        summary = json.loads(result.stdout)
        with open(Path(summary["results_dir"]) / "records.csv") as handle:
            records = list(csv.DictReader(handle))
        return summary, records

    def script(self, name: str, *options: str, timeout: float = 1800) -> dict:
        command = [sys.executable, str(REPO_ROOT / "scripts" / name), "--json", *options]
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            return {"error": (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]}
        return json.loads(result.stdout)


def floats(records: list[dict], column: str) -> list[float]:
    return [float(r[column]) for r in records if r["ok"] == "True" and r[column] not in ("", "None")]


def pct_diff(client: float | None, server: float | None) -> float | None:
    return (client - server) / server * 100 if client is not None and server else None


def latency_ms(values: list[float]) -> dict | None:
    """p50/p90/p99 in ms of values in seconds (llmstack.stats, as every table)."""
    if not values:
        return None
    figures = spread(values).scaled(1000)
    return {"p50": figures.p50, "p90": figures.p90, "p99": figures.p99}


def path_figures(summaries: list[dict], records: list[dict]) -> dict:
    """One path's figures at one level, over its runs: loadtest.experiments summaries and the
    rows of their records.csv."""
    step_rows = [s["concurrency"]["rows"][0] for s in summaries]
    checks = [s["concurrency"]["vllm"] for s in summaries]
    ttft, tpot = floats(records, "ttft_s"), floats(records, "tpot_s")
    figures = {
        "requests": len(records),
        "failures": sum(r["ok"] != "True" for r in records),
        "throughput_tok_s": statistics.fmean(s.get("throughput_tok_s") or 0 for s in step_rows),
        "throughput_runs": [s.get("throughput_tok_s") for s in step_rows],
        "avg_tps_per_request": statistics.fmean(s.get("avg_tps_per_request") or 0 for s in step_rows),
        "total_time_s": statistics.fmean(s.get("total_time_s") or 0 for s in step_rows),
        "ttft_ms": latency_ms(ttft),
        "tpot_ms": latency_ms(tpot),
        "client_ttft_mean_ms": statistics.fmean(ttft) * 1000 if ttft else None,
        "client_tpot_mean_ms": statistics.fmean(tpot) * 1000 if tpot else None,
        "vllm_ttft_mean_ms": mean_of(checks, "vllm_ttft_mean_ms"),
        "vllm_tpot_mean_ms": mean_of(checks, "vllm_tpot_mean_ms"),
        "max_running_in_vllm": max((s.get("max_running_in_vllm") or 0 for s in step_rows), default=None),
        "client_cpu_pct": max((s.get("client_cpu_pct") or 0 for s in step_rows), default=None),
    }
    figures["ttft_fidelity_pct"] = pct_diff(figures["client_ttft_mean_ms"], figures["vllm_ttft_mean_ms"])
    figures["tpot_fidelity_pct"] = pct_diff(figures["client_tpot_mean_ms"], figures["vllm_tpot_mean_ms"])
    return figures


def concurrency(args: argparse.Namespace, harness: Harness) -> list[dict]:
    rows, previous_direct = [], None
    levels = args.levels or [2**i for i in range(int(math.log2(args.max_level)) + 1)]
    for index, level in enumerate(levels):
        per_client = max(args.requests_per_client, math.ceil(args.min_requests / level))
        runs: dict[str, list[tuple[dict, list[dict]]]] = {path: [] for path in PATHS}
        for repeat in range(args.repeats):
            order = PATHS if (index + repeat) % 2 == 0 else PATHS[::-1]
            for path in order:
                progress(
                    f"concurrency {level}: {path}, run {repeat + 1}/{args.repeats} ({per_client * level} requests)"
                )
                summary, records = harness.experiments(
                    path,
                    "concurrency",
                    "--levels",
                    str(level),
                    "--requests-per-client",
                    str(per_client),
                    "--max-tokens",
                    str(args.max_tokens),
                )
                runs[path].append((summary, [r for r in records if r["kind"] != "warmup" and r["step"] == str(level)]))
        row = {"concurrency": level, "requests_per_client": per_client}
        for path in PATHS:
            row[path] = path_figures([s for s, _ in runs[path]], [r for _, rs in runs[path] for r in rs])
        gateway, direct = row["gateway"], row["direct"]
        if gateway["ttft_ms"] and direct["ttft_ms"]:
            row["added_ttft_p50_ms"] = gateway["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"]
            row["added_ttft_p99_ms"] = gateway["ttft_ms"]["p99"] - direct["ttft_ms"]["p99"]
        if direct["throughput_tok_s"]:
            row["throughput_ratio"] = gateway["throughput_tok_s"] / direct["throughput_tok_s"]
        rows.append(row)
        progress(
            f"concurrency {level}: {direct['throughput_tok_s']:.0f} tok/s direct, "
            f"{gateway['throughput_tok_s']:.0f} through the gateway"
        )
        if (
            args.levels is None
            and previous_direct
            and direct["throughput_tok_s"] < previous_direct * GROWTH_TO_CONTINUE
        ):
            progress(f"throughput grew by less than {GROWTH_TO_CONTINUE - 1:.0%} from the last level: stopping")
            break
        previous_direct = direct["throughput_tok_s"]
    return rows


def mean_of(checks: list[dict], key: str) -> float | None:
    """Mean of per-run means, weighted by the requests vLLM counted in each run."""
    pairs = [(c[key], c.get("vllm_requests") or 0) for c in checks if c.get(key) is not None]
    weight = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / weight if weight else None


def paired(args: argparse.Namespace, harness: Harness, label: str, *options: str) -> dict:
    """One experiment on both paths, in ABBA order over two runs each."""
    out: dict[str, list[dict]] = {path: [] for path in PATHS}
    for repeat in range(2):
        for path in PATHS if repeat == 0 else PATHS[::-1]:
            progress(f"{label}: {path}, run {repeat + 1}/2")
            summary, _ = harness.experiments(path, *options)
            out[path].append(summary)
    return out


def streaming_summary(runs: dict) -> dict:
    result = {}
    for path, summaries in runs.items():
        rows = [row for s in summaries for row in s["streaming"]["rows"] if row["ok"]]
        # The figures the experiments give medians of (loadtest.results), over every run's rows.
        keys = summaries[0]["streaming"]["median"].keys()
        result[path] = {key: spread([row[key] for row in rows if row.get(key) is not None]).p50 for key in keys}
        result[path]["requests"] = len(rows)
    return result


def prefix_summary(runs: dict) -> dict:
    result = {}
    for path, summaries in runs.items():
        unique = [s["prefix"]["phases"]["unique"] for s in summaries]
        shared = [s["prefix"]["phases"]["shared"] for s in summaries]
        result[path] = {
            "prompt_tokens": unique[0].get("prompt_tokens"),
            "ttft_unique_p50_ms": spread(p["ttft_ms"]["p50"] for p in unique).p50,
            "ttft_shared_p50_ms": spread(p["ttft_ms"]["p50"] for p in shared).p50,
            "hit_rate_shared": statistics.fmean(p["vllm_prefix_cache_hit_rate"] or 0 for p in shared),
        }
        result[path]["reduction_pct"] = (
            1 - result[path]["ttft_shared_p50_ms"] / result[path]["ttft_unique_p50_ms"]
        ) * 100
    return result


# --- report ----------------------------------------------------------------------------------------


def gpu_memory_gib(gpu: str) -> float | None:
    """'NVIDIA H200, 143771 MiB, 580.159.04' -> 140.4"""
    for part in gpu.split(","):
        if part.strip().endswith("MiB"):
            return float(part.strip()[:-3]) / 1024
    return None


def rerender(summary_file: Path) -> str:
    """A finished run's summary.md and chart again, from its summary.json."""
    summary = json.loads(summary_file.read_text())
    charts(summary_file.parent, summary.get("concurrency") or [])
    text = render(summary)
    (summary_file.parent / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--render"]:
        argv = sys.argv[1:]
    if argv and argv[0] == "--render":
        if len(argv) != 2 or not Path(argv[1]).is_file():
            raise UsageError("--render takes the path of a run's summary.json")
        print(rerender(Path(argv[1])))
        return 0
    args = parse_args(argv)
    key = first_key(args.api_key_file)
    out_dir = Path(args.results) / f"gateway-vs-direct-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "environment": environment(args, key),
        "settings": {k: v for k, v in vars(args).items() if k not in ("skip",)} | {"skip": sorted(args.skip)},
    }
    harness = Harness(args, out_dir)
    started = time.perf_counter()

    def save() -> None:
        """After every part, so a run cut short still leaves what it measured."""
        summary["duration_s"] = time.perf_counter() - started
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        (out_dir / "summary.md").write_text(render(summary))

    if "concurrency" not in args.skip:
        summary["concurrency"] = concurrency(args, harness)
        summary["targets"] = target_rows(summary["concurrency"])
        save()
    if "streaming" not in args.skip:
        summary["streaming"] = streaming_summary(
            paired(args, harness, "streaming", "streaming", "--streaming-requests", str(args.streaming_requests))
        )
        save()
    if "prefix" not in args.skip:
        summary["prefix"] = prefix_summary(
            paired(args, harness, "prefix caching", "prefix", "--prefix-requests", str(args.prefix_requests))
        )
        save()
    if "latency" not in args.skip:
        summary["latency"] = {}
        for path in PATHS:
            progress(f"single-request latency: {path}")
            url = args.gateway if path == "gateway" else args.direct
            summary["latency"][path] = harness.script(
                "latency.py",
                "--base-url",
                url,
                "--api-key",
                key,
                "--runs",
                str(args.latency_runs),
                "--output",
                str(out_dir / f"latency-{path}.json"),
                "--chart",
                str(out_dir / f"latency-{path}.png"),
            )
        save()
    if "memory" not in args.skip and args.vllm_log:
        progress("memory report and KV planner cross-check")
        stack = ["--vllm-url", args.direct, "--vllm-log", args.vllm_log]
        summary["memory"] = {
            "memory_report": harness.script(
                "memory_report.py",
                *stack,
                "--output",
                str(out_dir / "memory.json"),
                "--chart",
                str(out_dir / "memory.png"),
            ),
            "kv_planner_from_log": harness.script(
                "kv_planner.py", "--check-stack", *stack, "--output", str(out_dir / "kv_planner_log.json"), "--no-chart"
            ),
        }
        env = summary["environment"]
        gpu_gib = gpu_memory_gib(env.get("gpu", ""))
        if gpu_gib and env.get("model_root") and Path(env["model_root"]).is_dir():
            # The planner's own prediction (GPU size x utilisation minus its overhead estimates) vs vLLM.
            summary["memory"]["kv_planner_predicted"] = harness.script(
                "kv_planner.py",
                env["model_root"],
                "--gpu-memory-gib",
                f"{gpu_gib:.2f}",
                "--max-model-len",
                str(env.get("max_model_len") or 4096),
                "--check-stack",
                *stack,
                "--output",
                str(out_dir / "kv_planner.json"),
                "--chart",
                str(out_dir / "kv_planner.png"),
            )
    summary["charts"] = charts(out_dir, summary.get("concurrency") or [])
    save()
    print(json.dumps(summary, indent=2, default=str) if args.json else render(summary))
    progress(f"files: {out_dir}/ (summary.json, summary.md, gateway_vs_direct.png, runs/)")
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
