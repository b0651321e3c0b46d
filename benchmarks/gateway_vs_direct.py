#!/usr/bin/env python3
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
benchmarks/bare_stack.py), or in the stack's network:
  docker compose logs --no-log-prefix vllm > results/vllm.log
  docker compose run --rm -T -v "$PWD:/work" -w /work locust-master python benchmarks/gateway_vs_direct.py \\
      --gateway http://nginx:8080 --direct http://vllm:8000 --vllm-log results/vllm.log
Writes summary.json, summary.md (the tables for docs/) and PNG charts to --results/gateway-vs-direct-<time>/;
`gateway_vs_direct.py --render <run>/summary.json` redraws the tables and chart of a finished run.
The gateway's per-key limits must not bind: raise RATE_LIMIT_PER_KEY and
MAX_CONCURRENT_REQUESTS_PER_KEY for the key you use (docs/gpu-results.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PATHS = ("gateway", "direct")
GROWTH_TO_CONTINUE = 1.05  # stop doubling once vLLM's throughput grows by less than 5%
TARGETS = {"added_ttft_p50_ms": 1.0, "added_ttft_p99_ms": 3.0, "throughput_ratio": 0.99, "fidelity_pct": 5.0}


class BenchmarkError(Exception):
    pass


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="gateway_vs_direct.py", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", required=True, help="the gateway's URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--direct", required=True, help="vLLM's own URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key-file", default=os.environ.get("LOADTEST_API_KEY_FILE", "secrets/loadtest_api_key"),
                        help="the gateway key(s), one a line (default: %(default)s)")
    parser.add_argument("--vllm-log", help="vLLM's output since its start, for the memory report (optional)")
    parser.add_argument("--levels", help="concurrency levels, comma-separated (default: 1, 2, 4, ... "
                                         "until throughput stops growing, at most --max-level)")
    parser.add_argument("--max-level", type=int, default=512)
    parser.add_argument("--requests-per-client", type=int, default=4,
                        help="requests each client sends per level and run (default: %(default)s)")
    parser.add_argument("--min-requests", type=int, default=100,
                        help="at least this many requests per level and run, for p99 (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per path and level; the order alternates (ABBA) (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=50, help="output tokens per request (the lab's 50)")
    parser.add_argument("--streaming-requests", type=int, default=20)
    parser.add_argument("--prefix-requests", type=int, default=20)
    parser.add_argument("--latency-runs", type=int, default=10)
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: "
                                                   "concurrency,streaming,prefix,latency,memory")
    parser.add_argument("--results", default="results", help="parent folder of the run's folder")
    parser.add_argument("--json", action="store_true", help="print summary.json instead of the tables")
    args = parser.parse_args(argv)
    for name in ("max_level", "requests_per_client", "min_requests", "repeats", "max_tokens",
                 "streaming_requests", "prefix_requests", "latency_runs"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < 2:
        raise UsageError("--max-tokens must be at least 2 (TPOT needs two tokens)")
    if args.levels:
        try:
            args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--levels must be comma-separated integers, not {args.levels!r}") from None
        if not args.levels or min(args.levels) < 1:
            raise UsageError("--levels must be positive integers")
    args.skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    unknown = args.skip - {"concurrency", "streaming", "prefix", "latency", "memory"}
    if unknown:
        raise UsageError(f"--skip: unknown part(s) {', '.join(sorted(unknown))}")
    if not Path(args.api_key_file).is_file():
        raise UsageError(f"no API key file at {args.api_key_file} (--api-key-file)")
    args.gateway, args.direct = args.gateway.rstrip("/"), args.direct.rstrip("/")
    return args


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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
        raise BenchmarkError(f"{url} does not answer: {getattr(err, 'reason', err)}") from err


def environment(args: argparse.Namespace, key: str) -> dict:
    """Hardware and versions, for the report."""
    info: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "client_python": platform.python_version(), "client_cpus": os.cpu_count()}
    status, _, body = http_get(args.direct + "/version")
    if status == 200:
        info["vllm_version"] = json.loads(body).get("version")
    status, headers, body = http_get(args.gateway + "/v1/models", key)
    if status != 200:
        raise BenchmarkError(f"the gateway answers /v1/models with {status}: {body[:200]!r}")
    info["model"] = json.loads(body)["data"][0]["id"]
    status, _, body = http_get(args.direct + "/v1/models")
    if status != 200:
        raise BenchmarkError(f"vLLM answers /v1/models with {status}")
    model = json.loads(body)["data"][0]
    info["model_root"], info["max_model_len"] = model.get("root"), model.get("max_model_len")
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if gpu.returncode == 0:
            info["gpu"] = gpu.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import locust
        info["locust_version"] = locust.__version__
    except ImportError:
        pass
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
        command = [sys.executable, "-m", "loadtest.experiments", "--json", "--no-charts", "--host", host,
                   "--api-key-file", self.args.api_key_file, "--vllm-metrics-url", self.args.direct + "/metrics",
                   "--results", str(results), *options]
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600)
        if result.returncode not in (0, 1) or not result.stdout.strip().startswith("{"):
            raise BenchmarkError(f"loadtest.experiments failed against {path} (exit {result.returncode}): "
                                 f"{result.stderr.strip()[-600:]}")
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


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def floats(records: list[dict], column: str) -> list[float]:
    return [float(r[column]) for r in records if r["ok"] == "True" and r[column] not in ("", "None")]


def pct_diff(client: float | None, server: float | None) -> float | None:
    return (client - server) / server * 100 if client is not None and server else None


def concurrency(args: argparse.Namespace, harness: Harness) -> list[dict]:
    rows, previous_direct = [], None
    levels = args.levels or [2 ** i for i in range(int(math.log2(args.max_level)) + 1)]
    for index, level in enumerate(levels):
        per_client = max(args.requests_per_client, math.ceil(args.min_requests / level))
        runs = {path: [] for path in PATHS}
        for repeat in range(args.repeats):
            order = PATHS if (index + repeat) % 2 == 0 else PATHS[::-1]
            for path in order:
                progress(f"concurrency {level}: {path}, run {repeat + 1}/{args.repeats} "
                         f"({per_client * level} requests)")
                summary, records = harness.experiments(
                    path, "concurrency", "--levels", str(level), "--requests-per-client", str(per_client),
                    "--max-tokens", str(args.max_tokens))
                runs[path].append((summary, [r for r in records if r["kind"] != "warmup" and r["step"] == str(level)]))
        row = {"concurrency": level, "requests_per_client": per_client}
        for path in PATHS:
            summaries = [s for s, _ in runs[path]]
            records = [r for _, rs in runs[path] for r in rs]
            step_rows = [s["concurrency"]["rows"][0] for s in summaries]
            checks = [s["concurrency"]["vllm"] for s in summaries]
            ttft, tpot = floats(records, "ttft_s"), floats(records, "tpot_s")
            row[path] = {
                "requests": len(records), "failures": sum(r["ok"] != "True" for r in records),
                "throughput_tok_s": statistics.fmean(s.get("throughput_tok_s") or 0 for s in step_rows),
                "throughput_runs": [s.get("throughput_tok_s") for s in step_rows],
                "avg_tps_per_request": statistics.fmean(s.get("avg_tps_per_request") or 0 for s in step_rows),
                "total_time_s": statistics.fmean(s.get("total_time_s") or 0 for s in step_rows),
                "ttft_ms": {q: percentile(ttft, p) * 1000 for q, p in (("p50", .5), ("p90", .9), ("p99", .99))}
                if ttft else None,
                "tpot_ms": {q: percentile(tpot, p) * 1000 for q, p in (("p50", .5), ("p90", .9), ("p99", .99))}
                if tpot else None,
                "client_ttft_mean_ms": statistics.fmean(ttft) * 1000 if ttft else None,
                "client_tpot_mean_ms": statistics.fmean(tpot) * 1000 if tpot else None,
                "vllm_ttft_mean_ms": mean_of(checks, "vllm_ttft_mean_ms"),
                "vllm_tpot_mean_ms": mean_of(checks, "vllm_tpot_mean_ms"),
                "max_running_in_vllm": max((s.get("max_running_in_vllm") or 0 for s in step_rows), default=None),
                "client_cpu_pct": max((s.get("client_cpu_pct") or 0 for s in step_rows), default=None),
            }
            row[path]["ttft_fidelity_pct"] = pct_diff(row[path]["client_ttft_mean_ms"], row[path]["vllm_ttft_mean_ms"])
            row[path]["tpot_fidelity_pct"] = pct_diff(row[path]["client_tpot_mean_ms"], row[path]["vllm_tpot_mean_ms"])
        gateway, direct = row["gateway"], row["direct"]
        if gateway["ttft_ms"] and direct["ttft_ms"]:
            row["added_ttft_p50_ms"] = gateway["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"]
            row["added_ttft_p99_ms"] = gateway["ttft_ms"]["p99"] - direct["ttft_ms"]["p99"]
        if direct["throughput_tok_s"]:
            row["throughput_ratio"] = gateway["throughput_tok_s"] / direct["throughput_tok_s"]
        rows.append(row)
        progress(f"concurrency {level}: {direct['throughput_tok_s']:.0f} tok/s direct, "
                 f"{gateway['throughput_tok_s']:.0f} through the gateway")
        if args.levels is None and previous_direct and direct["throughput_tok_s"] < previous_direct * GROWTH_TO_CONTINUE:
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
    out = {path: [] for path in PATHS}
    for repeat in range(2):
        for path in (PATHS if repeat == 0 else PATHS[::-1]):
            progress(f"{label}: {path}, run {repeat + 1}/2")
            summary, _ = harness.experiments(path, *options)
            out[path].append(summary)
    return out


def streaming_summary(runs: dict) -> dict:
    result = {}
    for path, summaries in runs.items():
        rows = [row for s in summaries for row in s["streaming"]["rows"] if row["ok"]]
        result[path] = {key: statistics.median(row[key] for row in rows if row.get(key) is not None)
                        for key in ("ttft_ms", "decode_ms", "output_tokens", "avg_interval_ms", "tpot_ms",
                                    "tokens_per_s", "ttft_interval_ratio", "e2e_ms")}
        result[path]["requests"] = len(rows)
    return result


def prefix_summary(runs: dict) -> dict:
    result = {}
    for path, summaries in runs.items():
        unique = [s["prefix"]["phases"]["unique"] for s in summaries]
        shared = [s["prefix"]["phases"]["shared"] for s in summaries]
        result[path] = {
            "prompt_tokens": unique[0].get("prompt_tokens"),
            "ttft_unique_p50_ms": statistics.median(p["ttft_ms"]["p50"] for p in unique),
            "ttft_shared_p50_ms": statistics.median(p["ttft_ms"]["p50"] for p in shared),
            "hit_rate_shared": statistics.fmean(p["vllm_prefix_cache_hit_rate"] or 0 for p in shared),
        }
        result[path]["reduction_pct"] = (1 - result[path]["ttft_shared_p50_ms"]
                                         / result[path]["ttft_unique_p50_ms"]) * 100
    return result


# --- report ----------------------------------------------------------------------------------------

def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def verdict(value: float | None, target: float, higher_is_better: bool = False) -> str:
    if value is None:
        return "-"
    ok = value >= target if higher_is_better else abs(value) <= target
    return "met" if ok else "MISSED"


def render(summary: dict) -> str:
    env = summary["environment"]
    parts = [f"# Gateway vs direct: {env.get('model')} on {env.get('gpu', 'this host')}",
             f"vLLM {env.get('vllm_version')}, Locust {env.get('locust_version')}, client Python "
             f"{env.get('client_python')} on {env.get('client_cpus')} CPUs, {env.get('date')}."]
    rows = summary.get("concurrency") or []
    if rows:
        parts.append("## Concurrency (the lab's table, both paths)\n" + md_table(
            ["Concurrency", "Direct tok/s", "Gateway tok/s", "Ratio", "Avg TPS/request (direct)",
             "TTFT p50 direct / gateway (ms)", "TTFT p99 direct / gateway (ms)", "Added p50 (ms)",
             "Added p99 (ms)", "TPOT p50 direct / gateway (ms)", "Client CPU %"],
            [[str(r["concurrency"]), fmt(r["direct"]["throughput_tok_s"], 0), fmt(r["gateway"]["throughput_tok_s"], 0),
              fmt(r.get("throughput_ratio"), 3), fmt(r["direct"]["avg_tps_per_request"], 0),
              f"{fmt((r['direct']['ttft_ms'] or {}).get('p50'), 2)} / {fmt((r['gateway']['ttft_ms'] or {}).get('p50'), 2)}",
              f"{fmt((r['direct']['ttft_ms'] or {}).get('p99'), 2)} / {fmt((r['gateway']['ttft_ms'] or {}).get('p99'), 2)}",
              fmt(r.get("added_ttft_p50_ms"), 2), fmt(r.get("added_ttft_p99_ms"), 2),
              f"{fmt((r['direct']['tpot_ms'] or {}).get('p50'), 3)} / {fmt((r['gateway']['tpot_ms'] or {}).get('p50'), 3)}",
              fmt(max(r["direct"]["client_cpu_pct"] or 0, r["gateway"]["client_cpu_pct"] or 0), 0)]
             for r in rows]))
        parts.append("## Harness fidelity (client means vs vLLM's histograms, same requests)\n" + md_table(
            ["Concurrency", "Path", "TTFT client / vLLM (ms)", "TTFT diff", "TPOT client / vLLM (ms)", "TPOT diff"],
            [[str(r["concurrency"]), path,
              f"{fmt(r[path]['client_ttft_mean_ms'], 2)} / {fmt(r[path]['vllm_ttft_mean_ms'], 2)}",
              f"{fmt(r[path]['ttft_fidelity_pct'], 1)}%",
              f"{fmt(r[path]['client_tpot_mean_ms'], 3)} / {fmt(r[path]['vllm_tpot_mean_ms'], 3)}",
              f"{fmt(r[path]['tpot_fidelity_pct'], 1)}%"] for r in rows for path in PATHS]))
    if summary.get("targets"):
        parts.append("## Targets\n" + md_table(["Target", "Worst level", "Value", "Verdict"],
                                               [[t["target"], str(t["level"]), t["value"], t["verdict"]]
                                                for t in summary["targets"]]))
    if summary.get("streaming"):
        s = summary["streaming"]
        parts.append("## Streaming (medians of single streamed requests)\n" + md_table(
            ["Path", "TTFT (ms)", "Decode (ms)", "Output tokens", "Avg interval (ms)", "Tokens/s", "TTFT / interval"],
            [[path, fmt(s[path]["ttft_ms"], 2), fmt(s[path]["decode_ms"], 1), fmt(s[path]["output_tokens"], 0),
              fmt(s[path]["avg_interval_ms"], 3), fmt(s[path]["tokens_per_s"], 0),
              fmt(s[path]["ttft_interval_ratio"], 1)] for path in PATHS]))
    if summary.get("prefix"):
        p = summary["prefix"]
        parts.append("## Prefix caching (TTFT p50)\n" + md_table(
            ["Path", "Prompt tokens", "Unique prefix (ms)", "Shared prefix (ms)", "Reduction", "vLLM hit rate (shared)"],
            [[path, fmt(p[path]["prompt_tokens"], 0), fmt(p[path]["ttft_unique_p50_ms"], 2),
              fmt(p[path]["ttft_shared_p50_ms"], 2), f"{fmt(p[path]['reduction_pct'], 0)}%",
              f"{fmt(p[path]['hit_rate_shared'] * 100, 0)}%"] for path in PATHS]))
    if summary.get("latency"):
        lines = []
        for path in PATHS:
            result = summary["latency"][path]
            if "error" in result:
                lines.append([path, "error: " + result["error"], "", "", "", "", ""])
                continue
            for prompt in result.get("results", []) + result.get("sweep", []):
                lines.append([path, prompt.get("label", "?"), fmt(prompt.get("input_tokens"), 0),
                              fmt(prompt.get("output_tokens"), 0), fmt(nested(prompt, "ttft_ms"), 2),
                              fmt(nested(prompt, "tpot_ms"), 3), fmt(nested(prompt, "total_ms"), 1)])
        parts.append("## Single-request latency (medians)\n" + md_table(
            ["Path", "Prompt", "Input tokens", "Output tokens", "TTFT (ms)", "TPOT (ms)", "Total (ms)"], lines))
    if summary.get("memory"):
        parts.append("## Memory report and KV planner (vLLM's own figures beside them)\n" + memory_table(summary["memory"]))
    return "\n\n".join(parts) + "\n"


def memory_table(memory: dict) -> str:
    report = memory.get("memory_report") or {}
    rows = []
    if "error" in report:
        rows.append(["memory report", "-", report["error"]])
    else:
        weights, kv = report.get("weights") or {}, report.get("kv_cache") or {}
        rows += [["model weights (GiB)", fmt(weights.get("theoretical_gib"), 3) + " theoretical "
                  f"({fmt(weights.get('parameters'), 0)} parameters)", fmt(weights.get("measured_gib"), 2) + " logged"],
                 ["KV cache pool", f"{fmt(kv.get('bytes_per_token'), 0)} B/token",
                  f"{fmt(kv.get('gib'), 2)} GiB, {fmt(kv.get('tokens'), 0)} tokens"],
                 ["CUDA graph pool (GiB)", "-", fmt(report.get("cuda_graph_gib"), 2)],
                 ["max concurrency at max_model_len", "-", fmt(report.get("max_concurrency"), 2)]]
    for key, label in (("kv_planner_from_log", "planner from vLLM's KV space"),
                       ("kv_planner_predicted", "planner from GPU size x utilisation")):
        check = (memory.get(key) or {}).get("cross_check") or {}
        if check:
            rows.append([label + " (tokens)", f"{fmt(check.get('predicted_tokens'), 0)} ({check.get('basis')})",
                         f"{fmt(check.get('reported_tokens'), 0)} reported, "
                         f"{fmt(check.get('difference_percent'), 3)}% apart"])
        elif (memory.get(key) or {}).get("error"):
            rows.append([label, "-", memory[key]["error"]])
    return md_table(["What", "Computed", "vLLM"], rows)


def gpu_memory_gib(gpu: str) -> float | None:
    """'NVIDIA H200, 143771 MiB, 580.159.04' -> 140.4"""
    for part in gpu.split(","):
        if part.strip().endswith("MiB"):
            return float(part.strip()[:-3]) / 1024
    return None


def nested(entry: dict, key: str) -> float | None:
    value = entry.get(key)
    if isinstance(value, dict):
        return value.get("median")
    return value


def target_rows(rows: list[dict]) -> list[dict]:
    out = []
    checks = [("added TTFT p50 <= 1 ms", "added_ttft_p50_ms", TARGETS["added_ttft_p50_ms"], False, 2, ""),
              ("added TTFT p99 <= 3 ms", "added_ttft_p99_ms", TARGETS["added_ttft_p99_ms"], False, 2, ""),
              ("gateway tok/s >= 0.99 x direct", "throughput_ratio", TARGETS["throughput_ratio"], True, 3, "")]
    for label, key, target, higher, digits, _ in checks:
        values = [(r[key], r["concurrency"]) for r in rows if r.get(key) is not None]
        if not values:
            continue
        worst = min(values) if higher else max(values)
        out.append({"target": label, "level": worst[1], "value": fmt(worst[0], digits),
                    "verdict": verdict(worst[0], target, higher)})
    for label, key in (("harness TTFT within 5% of vLLM", "ttft_fidelity_pct"),
                       ("harness TPOT within 5% of vLLM", "tpot_fidelity_pct")):
        values = [(abs(r["direct"][key]), r["concurrency"], r["direct"][key]) for r in rows
                  if r["direct"].get(key) is not None]
        if values:
            worst = max(values)
            out.append({"target": label + " (direct path)", "level": worst[1], "value": f"{worst[2]:+.1f}%",
                        "verdict": verdict(worst[0], TARGETS["fidelity_pct"])})
    return out


def charts(out_dir: Path, rows: list[dict]) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
    fig.tight_layout()
    fig.savefig(out_dir / "gateway_vs_direct.png", dpi=110)
    plt.close(fig)
    return ["gateway_vs_direct.png"]


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--render"]:
        argv = sys.argv[1:]
    if argv and argv[0] == "--render":
        # Re-render a finished run's tables and chart from its summary.json.
        if len(argv) != 2 or not Path(argv[1]).is_file():
            raise UsageError("--render takes the path of a run's summary.json")
        summary = json.loads(Path(argv[1]).read_text())
        charts(Path(argv[1]).parent, summary.get("concurrency") or [])
        (Path(argv[1]).parent / "summary.md").write_text(render(summary))
        print(render(summary))
        return 0
    args = parse_args(argv)
    key = first_key(args.api_key_file)
    out_dir = Path(args.results) / f"gateway-vs-direct-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"environment": environment(args, key), "settings": {
        k: v for k, v in vars(args).items() if k not in ("skip",)} | {"skip": sorted(args.skip)}}
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
        summary["streaming"] = streaming_summary(paired(args, harness, "streaming", "streaming",
                                                        "--streaming-requests", str(args.streaming_requests)))
        save()
    if "prefix" not in args.skip:
        summary["prefix"] = prefix_summary(paired(args, harness, "prefix caching", "prefix",
                                                  "--prefix-requests", str(args.prefix_requests)))
        save()
    if "latency" not in args.skip:
        summary["latency"] = {}
        for path in PATHS:
            progress(f"single-request latency: {path}")
            url = args.gateway if path == "gateway" else args.direct
            summary["latency"][path] = harness.script(
                "latency.py", "--base-url", url, "--api-key", key, "--runs", str(args.latency_runs),
                "--output", str(out_dir / f"latency-{path}.json"), "--chart", str(out_dir / f"latency-{path}.png"))
        save()
    if "memory" not in args.skip and args.vllm_log:
        progress("memory report and KV planner cross-check")
        stack = ["--vllm-url", args.direct, "--vllm-log", args.vllm_log]
        summary["memory"] = {
            "memory_report": harness.script("memory_report.py", *stack, "--output", str(out_dir / "memory.json"),
                                            "--chart", str(out_dir / "memory.png")),
            "kv_planner_from_log": harness.script("kv_planner.py", "--check-stack", *stack,
                                                  "--output", str(out_dir / "kv_planner_log.json"), "--no-chart"),
        }
        env = summary["environment"]
        gpu_gib = gpu_memory_gib(env.get("gpu", ""))
        if gpu_gib and env.get("model_root") and Path(env["model_root"]).is_dir():
            # The planner's own prediction (GPU size x utilisation minus its overhead estimates) vs vLLM.
            summary["memory"]["kv_planner_predicted"] = harness.script(
                "kv_planner.py", env["model_root"], "--gpu-memory-gib", f"{gpu_gib:.2f}",
                "--max-model-len", str(env.get("max_model_len") or 4096), "--check-stack", *stack,
                "--output", str(out_dir / "kv_planner.json"), "--chart", str(out_dir / "kv_planner.png"))
    summary["charts"] = charts(out_dir, summary.get("concurrency") or [])
    save()
    print(json.dumps(summary, indent=2, default=str) if args.json else render(summary))
    progress(f"files: {out_dir}/ (summary.json, summary.md, gateway_vs_direct.png, runs/)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as err:
        print(f"gateway_vs_direct.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    except BenchmarkError as err:
        print(f"gateway_vs_direct.py: error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("gateway_vs_direct.py: interrupted", file=sys.stderr)
        sys.exit(130)
