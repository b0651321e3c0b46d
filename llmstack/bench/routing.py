"""Routing policies compared: vLLM's own client (`vllm bench serve`) through the router, each policy in turn.

Two vLLM replicas behind vllm-router. For each repeat (--repeats), each policy (--policies, in an
order that rotates from repeat to repeat) is set on the router, then every workload at every level
of concurrent clients runs with `vllm bench serve` (closed loop, --requests per run, --output-tokens
each with ignore_eos). "single" sends the same runs to the first replica alone: one replica's cache
and share of the hardware, the baseline. Workloads (llmstack/bench/routing_workload.py):
  prefix-heavy  a few dozen long system prompts shared by many requests, plus multi-turn chats that
                resend their history; the distinct prefixes fill --working-set x ONE replica's KV
                cache (read from vLLM's cache_config_info), so they fit only in both together
  prefix-light  unique prompts of the same length
Every run has its own text (nothing is reused from an earlier run's cache). Per run: TTFT p50/p90,
TPOT p50, output tokens/s, failures (from `vllm bench serve`), and from each replica's own counters
the requests it finished and its prefix-cache hit rate. Across repeats: the median and the range;
a difference smaller than the range of either side is "none" (llmstack.stats.difference).

Also (--phases picks; default all):
  router hop   concurrency 1, prefix-light: the first replica directly vs through the router
               (round_robin over idle replicas), interleaved ABBA, --hop-repeats each
  fault run    --fault-policy (round_robin: both replicas busy) under load; --kill-after seconds
               into the load, the second replica is killed (SIGKILL); requests that failed before
               their first token vs streams cut
Targets: cache_aware TTFT p50 >= 30% below round_robin on prefix-heavy; within 5% of the best
policy on prefix-light; the hop <= 1 ms p50.

Two places to run it:
  a bare host (--bare; scripts/bare_host.py start --replicas 2): `vllm bench serve` here, one router
      per policy side by side (llmstack.launch, ports 8010...), so that a repeat interleaves the
      policies run by run (kv_aware needs bare_host.py --kv-events);
  the compose stack (default): `vllm bench serve` inside the vLLM container; the router recreated
      with ROUTER_POLICY for each policy (-p, -f, --env-file as for docker compose).

  python3 benchmarks/routing.py --bare --policies single,round_robin,power_of_two,cache_aware,kv_aware
  python3 benchmarks/routing.py -f compose.yaml -f compose.airgap.yaml -f compose.cpu.yaml \\
      -f .build/compose.replicas.yaml --levels 2,4 --requests 48 --output docs/routing/cpu.json
  python3 benchmarks/routing.py --render docs/routing/gpu.json     # tables and chart again
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from llmstack import launch, promtext
from llmstack.bench import host_environment, routing_workload
from llmstack.bench.gateway_report import fmt, median_range
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
from llmstack.vllm import VLLM_PORT, ComposeStack, HostVllm, cache_config_labels, label_number, served_model

PROG = "routing.py"
POLICIES = ("single", "round_robin", "power_of_two", "cache_aware", "kv_aware")
WORKLOADS = ("prefix-heavy", "prefix-light")
PHASES = ("table", "hop", "fault")
MARKER = "@@ROUTING@@"
SIDE_ROUTER_PORT, SIDE_METRICS_PORT = 8010, 29010
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")
KEPT = (
    *("duration", "completed", "failed", "output_throughput", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"),
    *("median_tpot_ms", "p90_tpot_ms", "total_input_tokens", "total_output_tokens"),
)

# Runs in one Python process (one import of vLLM): each builds its prompts, reads the replicas'
# counters, runs `vllm bench serve`, reads them again.
SHIM_LOOP = """
import json, os, sys, time, urllib.request
os.environ.setdefault("OPENAI_API_KEY", "unused")
from transformers import AutoTokenizer
from vllm.entrypoints.cli.main import main
workload = {}
exec(compile(__WORKLOAD__, "routing_workload", "exec"), workload)
tokenizer = AutoTokenizer.from_pretrained(__TOKENIZER__)

def counters(url):
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError as err:
        return "# unreachable: %s" % err
    return "\\n".join(l for l in text.splitlines() if l.startswith(__COUNTERS__))

kept = []
for run in __RUNS__:
    facts = workload["write"](run["workload"], tokenizer, run["dataset"])
    sys.argv = ["vllm", "bench", "serve"] + run["options"] + ["--num-prompts", str(facts["requests"])]
    before = {url: counters(url) for url in __REPLICAS__}
    open(run["file"] + ".started", "w").close()
    started = time.time()
    try:
        main()
    except SystemExit as exit:
        if exit.code not in (0, None):
            raise
    after = {url: counters(url) for url in __REPLICAS__}
    with open(run["file"]) as handle:
        data = json.load(handle)
    entry = {key: data.get(key) for key in __KEPT__}
    entry.update(ttfts=data.get("ttfts"), errors=data.get("errors"))
    entry.update(name=run["name"], facts=facts, before=before, after=after, wall_start=started, wall_end=time.time())
    kept.append(entry)
    time.sleep(__PAUSE__)
sys.stdout.write("\\n__MARKER__" + json.dumps(kept) + "\\n")
"""


def shim(runs: list[dict], replicas: list[str], tokenizer: str, pause: float) -> str:
    source = Path(routing_workload.__file__).read_text()
    loop = (
        SHIM_LOOP.replace("__WORKLOAD__", repr(source))
        .replace("__TOKENIZER__", repr(tokenizer))
        .replace("__COUNTERS__", repr(COUNTERS))
        .replace("__RUNS__", repr(runs))
        .replace("__REPLICAS__", repr(replicas))
        .replace("__KEPT__", repr(KEPT))
        .replace("__PAUSE__", repr(pause))
        .replace("__MARKER__", MARKER)
    )
    return VLLM_CPU_PATCH + loop


# --- where it runs -----------------------------------------------------------------------------------


class BareHost:
    """Replicas and router started by scripts/bare_host.py on this host."""

    description = "on this host (scripts/bare_host.py)"

    def __init__(self, args: argparse.Namespace):
        self.workdir = Path(args.workdir)
        self.count = len(list(self.workdir.glob("vllm*.pid")))
        if self.count < 2:
            raise UsageError(f"{self.workdir} shows {self.count} vLLM replica(s); start bare_host.py with --replicas 2")
        self.replica_urls = launch.replica_urls(self.count)
        self.router_url = f"http://127.0.0.1:{launch.ROUTER_PORT}"
        self.failed: dict[str, str] = {}
        self.stack = HostVllm(self.replica_urls[0], self.workdir / "vllm.log")
        self.launch_args = argparse.Namespace(
            compose_file=[Path(f) for f in (args.compose_file or ["compose.yaml"])],
            replicas=self.count,
            policy=None,
            workdir=str(self.workdir),
            model=None,
        )

    def python(self, code: str, timeout: float) -> str:
        return self.stack.python(code, timeout=timeout)

    def set_policy(self, policy: str) -> None:
        self.launch_args.policy = policy
        launch.stop_process(self.workdir, "router")
        launch.start_router(self.launch_args, launch.read_settings(self.launch_args), self.workdir)

    def routers(self, policies: list[str]) -> dict[str, str]:
        """One router per policy side by side (ports 8010, ...): every policy in one batch, no restarts."""
        urls = {}
        for index, policy in enumerate(p for p in policies if p != "single"):
            name = f"router-{policy}"
            launch.stop_process(self.workdir, name)
            self.launch_args.policy = policy
            settings = launch.read_settings(self.launch_args)
            try:
                urls[policy] = launch.start_router(
                    self.launch_args, settings, self.workdir, name, SIDE_ROUTER_PORT + index, SIDE_METRICS_PORT + index
                )
            except StackError as err:
                # A policy whose router will not start is left out of the table and said so.
                self.failed[policy] = str(err).splitlines()[-1][:300]
                progress(f"{policy} left out: {err}")
        return urls

    def stop_routers(self, policies: list[str]) -> None:
        for policy in policies:
            launch.stop_process(self.workdir, f"router-{policy}")

    def exists(self, path: str) -> bool:
        return Path(path).exists()

    def kill_replica(self, index: int) -> None:
        name = launch.replicas.replica_name(index)
        os.killpg(int((self.workdir / f"{name}.pid").read_text()), signal.SIGKILL)

    def restore_replica(self, index: int) -> None:
        progress("the killed replica stays down on a bare host (start the host again to restore it)")


class ComposeHost:
    """The compose stack: `vllm bench serve` inside the first replica's container."""

    description = "in the vLLM container (compose stack)"

    def __init__(self, args: argparse.Namespace):
        files = [f for item in (args.compose_file or []) for f in item.split(":") if f]
        self.stack = ComposeStack(args.project_name, files, args.env_file)
        self.services = self.stack.replicas()
        if len(self.services) < 2:
            raise UsageError(f"the compose stack runs {len(self.services)} vLLM replica(s); the benchmark needs 2")
        self.count = len(self.services)
        self.replica_urls = [f"http://{name}:{VLLM_PORT}" for name in self.services]
        self.router_url = f"http://router:{VLLM_PORT}"

    def python(self, code: str, timeout: float) -> str:
        return self.stack.python(code, timeout=timeout)

    def set_policy(self, policy: str) -> None:
        if policy == "kv_aware":
            raise UsageError("kv_aware needs the replicas' KV-cache events: run it on a bare host (--bare)")
        os.environ["ROUTER_POLICY"] = policy
        self.stack.run("up", "-d", "--no-deps", "--force-recreate", "--wait", "router", timeout=300)

    def exists(self, path: str) -> bool:
        try:
            self.stack.run("exec", "-T", self.services[0], "test", "-e", path, timeout=30)
        except StackError:
            return False
        return True

    def kill_replica(self, index: int) -> None:
        self.stack.run("kill", self.services[index])

    def restore_replica(self, index: int) -> None:
        self.stack.run("start", self.services[index], timeout=300)
        self.stack.run("up", "-d", "--wait", self.services[index], timeout=600)


# --- the runs ----------------------------------------------------------------------------------------


def bench_options(args: argparse.Namespace, url: str, level: int, name: str, dataset: str, file: str) -> list[str]:
    return [
        *("--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions"),
        *("--model", args.model, "--tokenizer", args.tokenizer),
        *("--dataset-name", "custom", "--dataset-path", dataset, "--custom-output-len", "-1"),
        *("--skip-chat-template", "--disable-shuffle", "--ignore-eos"),
        *("--max-concurrency", str(level), "--request-rate", "inf", "--num-warmups", "0"),
        *("--disable-tqdm", "--save-result", "--save-detailed"),
        *("--result-dir", str(Path(file).parent), "--result-filename", Path(file).name),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"),
    ]


def workload_spec(args: argparse.Namespace, workload: str, salt: str, seed: int, requests: int) -> dict:
    return {
        "workload": workload,
        "salt": salt,
        "seed": seed,
        "requests": requests,
        "system_tokens": args.system_tokens,
        "question_tokens": args.question_tokens,
        "output_tokens": args.output_tokens,
        "replica_kv_tokens": args.replica_kv_tokens,
        "working_set": args.working_set,
        "turns": args.turns,
        "multi_turn_share": args.multi_turn_share,
    }


def make_run(args: argparse.Namespace, url: str, workload: str, level: int, label: str, requests: int) -> dict:
    name = f"routing-{label}"
    dataset, file = f"/tmp/{name}.jsonl", f"/tmp/{name}.json"
    args.seed += 1
    return {
        "name": name,
        "workload": workload_spec(args, workload, name, args.seed, requests),
        "dataset": dataset,
        "file": file,
        "options": bench_options(args, url, level, name, dataset, file),
    }


def execute(where: BareHost | ComposeHost, args: argparse.Namespace, runs: list[dict]) -> list[dict]:
    output = where.python(shim(runs, where.replica_urls, args.tokenizer, args.pause), timeout=args.batch_timeout)
    if MARKER not in output:
        raise StackError(f"`vllm bench serve` gave no result: {output.strip()[-400:]}")
    return json.loads(output.split(MARKER)[-1])


def counter(text: str, name: str) -> float:
    return promtext.total(promtext.parse(text), name) or 0.0 if not text.startswith("# unreachable") else 0.0


def per_replica(result: dict) -> list[dict]:
    """Each replica's requests and prefix-cache hit rate over the run, from its own counters."""
    rows = []
    for url, before in result["before"].items():
        after = result["after"][url]
        if after.startswith("# unreachable"):
            rows.append({"replica": url, "requests": None, "hit_rate": None})
            continue
        hits = counter(after, COUNTERS[0]) - counter(before, COUNTERS[0])
        queries = counter(after, COUNTERS[1]) - counter(before, COUNTERS[1])
        done = counter(after, COUNTERS[2]) - counter(before, COUNTERS[2])
        rows.append({"replica": url, "requests": round(done), "hit_rate": hits / queries if queries else None})
    return rows


def run_figures(result: dict) -> dict:
    replicas = per_replica(result)
    hits = [r for r in replicas if r["hit_rate"] is not None and r["requests"]]
    total = sum(r["requests"] for r in hits)
    return {
        "ttft_p50_ms": result.get("median_ttft_ms"),
        "ttft_p90_ms": result.get("p90_ttft_ms"),
        "tpot_p50_ms": result.get("median_tpot_ms"),
        "output_tok_s": result.get("output_throughput"),
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "duration_s": result.get("duration"),
        "replicas": replicas,
        # Weighted by requests: the hit rate the fleet saw.
        "hit_rate": sum(r["hit_rate"] * r["requests"] for r in hits) / total if total else None,
        "prompts": result.get("facts"),
    }


def policy_order(policies: list[str], repeat: int) -> list[str]:
    shift = repeat % len(policies)
    return policies[shift:] + policies[:shift]


def batches(args: argparse.Namespace, where: BareHost | ComposeHost) -> list[tuple[str | None, list[tuple]]]:
    """(policy to set first or None, [(policy, workload, level, url)]) per `vllm bench serve` process.
    A bare host runs a router per policy side by side: a repeat is one batch, policies interleaved
    run by run. The compose stack has one router: a batch per policy, the router recreated between."""
    side = where.routers(args.policies) if isinstance(where, BareHost) else None
    if isinstance(where, BareHost):
        args.policies = [p for p in args.policies if p not in where.failed]
    plan: list[tuple[str | None, list[tuple]]] = []
    for repeat in range(args.repeats):
        workloads = args.workloads if repeat % 2 == 0 else args.workloads[::-1]
        cells = [(workload, level) for workload in workloads for level in args.levels]
        order = policy_order(args.policies, repeat)
        if side is not None:
            runs = [
                (policy, workload, level, side.get(policy, where.replica_urls[0]))
                for workload, level in cells
                for policy in order
            ]
            plan.append((None, runs))
            continue
        for policy in order:
            url = where.replica_urls[0] if policy == "single" else where.router_url
            plan.append((None if policy == "single" else policy, [(policy, w, c, url) for w, c in cells]))
    return plan


def measure(args: argparse.Namespace, where: BareHost | ComposeHost) -> list[dict]:
    rows: list[dict] = []
    plan = batches(args, where)
    for number, (policy_to_set, cells) in enumerate(plan):
        if policy_to_set:
            where.set_policy(policy_to_set)
        repeat = number * args.repeats // len(plan)
        runs = [
            make_run(args, url, workload, level, f"r{repeat + 1}-{policy}-{workload}-c{level}", args.requests)
            for policy, workload, level, url in cells
        ]
        started = time.monotonic()
        results = execute(where, args, runs)
        for (policy, workload, level, _), result in zip(cells, results, strict=True):
            figures = run_figures(result)
            rows.append({"repeat": repeat, "policy": policy, "workload": workload, "level": level, **figures})
            progress(
                f"repeat {repeat + 1}/{args.repeats} {policy:<12} {workload:<12} c={level:<3} "
                f"TTFT p50 {fmt(figures['ttft_p50_ms'])} ms, {fmt(figures['output_tok_s'], 0)} tok/s, "
                f"hit rate {fmt_rate(figures['hit_rate'])}, failed {figures['failed']}"
            )
        progress(f"batch {number + 1}/{len(plan)}: {len(runs)} runs in {time.monotonic() - started:.0f} s")
    if isinstance(where, BareHost):
        where.stop_routers(args.policies)
    return rows


def measure_hop(args: argparse.Namespace, where: BareHost | ComposeHost) -> dict:
    """TTFT at one client, first replica directly vs through the router (round_robin), ABBA."""
    where.set_policy("round_robin")
    runs, paths = [], []
    for repeat in range(args.hop_repeats):
        for path in ("direct", "router") if repeat % 2 == 0 else ("router", "direct"):
            url = where.replica_urls[0] if path == "direct" else where.router_url
            runs.append(make_run(args, url, "prefix-light", 1, f"hop-r{repeat + 1}-{path}", args.hop_requests))
            paths.append(path)
    results = execute(where, args, runs)
    p50: dict[str, list[float]] = {"direct": [], "router": []}
    for path, result in zip(paths, results, strict=True):
        p50[path].append(result["median_ttft_ms"])
    hop = hop_figures(p50) | {"requests_per_run": args.hop_requests}
    beyond = "beyond" if hop["larger_than_spread"] else "within"
    progress(f"router hop: {fmt(hop['added_ttft_p50_ms'], 2)} ms TTFT p50 ({beyond} the spread)")
    return hop


def hop_figures(p50: dict[str, list[float]]) -> dict:
    """The router's added TTFT p50 from each run's p50, direct and through the router."""
    delta, significant = difference(p50["direct"], p50["router"])
    return {
        "direct_ttft_p50_ms": p50["direct"],
        "router_ttft_p50_ms": p50["router"],
        "added_ttft_p50_ms": delta,
        "larger_than_spread": significant,
    }


def measure_fault(args: argparse.Namespace, where: BareHost | ComposeHost) -> dict:
    """cache_aware under load; the second replica killed mid-run: who lost what."""
    where.set_policy(args.fault_policy)
    run = make_run(args, where.router_url, "prefix-light", args.fault_level, "fault", args.fault_requests)
    stop = threading.Event()

    def kill_when_started() -> None:
        # Counted from the start of the load itself, not from vLLM's import and the prompts' making.
        while not stop.is_set() and not where.exists(run["file"] + ".started"):
            time.sleep(0.5)
        if not stop.wait(args.kill_after):
            where.kill_replica(1)

    killer = threading.Thread(target=kill_when_started, daemon=True)
    killer.start()
    try:
        result = execute(where, args, [run])[0]
    finally:
        stop.set()
    ttfts, errors = result.get("ttfts") or [], result.get("errors") or []
    before_first = sum(1 for t, e in zip(ttfts, errors, strict=False) if e and not t)
    cut = sum(1 for t, e in zip(ttfts, errors, strict=False) if e and t)
    fault = {
        "requests": len(ttfts),
        "completed": result.get("completed"),
        "failed_before_first_token": before_first,
        "streams_cut": cut,
        "level": args.fault_level,
        "killed_after_s": args.kill_after,
        "errors_seen": sorted({e.strip().splitlines()[-1][:160] for e in errors if e})[:5],
        "replicas": per_replica(result),
    }
    progress(f"fault run: {before_first} failed before the first token, {cut} streams cut, of {len(ttfts)}")
    where.restore_replica(1)
    return fault


# --- summary -----------------------------------------------------------------------------------------

METRICS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "output_tok_s", "hit_rate")


def summarize(rows: list[dict]) -> list[dict]:
    cells: dict[tuple[str, int, str], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["workload"], row["level"], row["policy"]), []).append(row)
    table = []
    for (workload, level, policy), group in sorted(cells.items()):
        entry: dict[str, Any] = {"workload": workload, "level": level, "policy": policy, "repeats": len(group)}
        for metric in METRICS:
            values = [r[metric] for r in group if r[metric] is not None]
            entry[metric] = spread(values).as_dict() | {"values": values}
        entry["failed"] = sum(r["failed"] or 0 for r in group)
        shares = [r["requests"] or 0 for g in group for r in g["replicas"]]
        entry["requests_per_replica"] = [
            sum(g["replicas"][i]["requests"] or 0 for g in group) for i in range(len(group[0]["replicas"]))
        ]
        entry["requests_total"] = sum(shares)
        table.append(entry)
    return table


def targets(table: list[dict]) -> list[dict]:
    """cache_aware vs round_robin on prefix-heavy (>= 30% lower TTFT p50), vs the best on prefix-light
    (within 5%), per level."""
    found = {(e["workload"], e["level"], e["policy"]): e for e in table}
    rows = []
    for workload, level in sorted({(e["workload"], e["level"]) for e in table}):
        aware = found.get((workload, level, "cache_aware"))
        if not aware:
            continue
        values = aware["ttft_p50_ms"]["values"]
        if workload == "prefix-heavy" and (workload, level, "round_robin") in found:
            other = found[(workload, level, "round_robin")]["ttft_p50_ms"]["values"]
            delta, significant = difference(other, values)
            base = spread(other).p50
            change = delta / base if delta is not None and base else None
            rows.append(
                {
                    "target": f"prefix-heavy c={level}: cache_aware TTFT p50 vs round_robin, at most -30%",
                    "value": change,
                    "met": bool(change is not None and change <= -0.30 and significant),
                    "larger_than_spread": significant,
                }
            )
        if workload == "prefix-light":
            routed = [
                e
                for e in table
                if e["workload"] == workload and e["level"] == level and e["policy"] not in ("single", "cache_aware")
            ]
            best = min(routed, key=lambda e: e["ttft_p50_ms"]["p50"] or float("inf"), default=None)
            if best and best["ttft_p50_ms"]["p50"] and aware["ttft_p50_ms"]["p50"]:
                delta, significant = difference(best["ttft_p50_ms"]["values"], values)
                excess = aware["ttft_p50_ms"]["p50"] / best["ttft_p50_ms"]["p50"] - 1
                rows.append(
                    {
                        "target": f"prefix-light c={level}: cache_aware TTFT p50 vs the best ({best['policy']}), "
                        "at most +5%",
                        "value": excess,
                        "met": excess <= 0.05 or not significant,
                        "larger_than_spread": significant,
                    }
                )
    return rows


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def with_range(cell: dict, digits: int = 1, rate: bool = False) -> str:
    return median_range(cell, digits, show=fmt_rate if rate else None)


def markdown_table(summary: dict) -> str:
    lines = [
        "| workload | clients | policy | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | output tok/s | prefix hit rate "
        "| requests per replica | failed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for e in summary["table"]:
        lines.append(
            f"| {e['workload']} | {e['level']} | {e['policy']} | {with_range(e['ttft_p50_ms'])} "
            f"| {with_range(e['ttft_p90_ms'])} | {with_range(e['tpot_p50_ms'], 2)} "
            f"| {with_range(e['output_tok_s'], 0)} "
            f"| {with_range(e['hit_rate'], rate=True)} | {' / '.join(str(n) for n in e['requests_per_replica'])} "
            f"| {e['failed']} |"
        )
    return "\n".join(lines) + "\n"


def targets_table(summary: dict) -> str:
    lines = ["| target | measured | beyond the spread | met |", "|---|---:|---|---|"]
    for t in summary["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:+.0%}"
        beyond, met = ("yes" if t["larger_than_spread"] else "no"), ("yes" if t["met"] else "no")
        lines.append(f"| {t['target']} | {value} | {beyond} | {met} |")
    hop = summary.get("hop")
    if hop:
        added = hop["added_ttft_p50_ms"]
        hop_met = added is not None and (added <= 1.0 or not hop["larger_than_spread"])
        lines.append(
            f"| router hop adds <= 1 ms TTFT p50 (1 client) | {fmt(added, 2)} ms "
            f"| {'yes' if hop['larger_than_spread'] else 'no'} | {'yes' if hop_met else 'no'} |"
        )
    fault = summary.get("fault")
    if fault:
        lines.append(
            f"| fault run: 0 requests failed before their first token ({fault['requests']} sent, "
            f"{fault['streams_cut']} streams cut) | {fault['failed_before_first_token']} | - "
            f"| {'yes' if fault['failed_before_first_token'] == 0 else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def render(summary: dict) -> str:
    env = summary["environment"]
    return (
        f"# Routing policies: `vllm bench serve` {env['bench_where']}, {env['date']}\n\n"
        f"Median over {summary['settings']['repeats']} repeats (min–max in brackets).\n\n"
        + markdown_table(summary)
        + "\n"
        + targets_table(summary)
    )


def chart(summary: dict, path: Path) -> None:
    plt = load_pyplot()
    workloads = sorted({e["workload"] for e in summary["table"]})
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    for column, workload in enumerate(workloads):
        entries = [e for e in summary["table"] if e["workload"] == workload]
        for policy in sorted({e["policy"] for e in entries}):
            mine = sorted((e for e in entries if e["policy"] == policy), key=lambda e: e["level"])
            levels = [e["level"] for e in mine]
            for row, metric, label in ((0, "ttft_p50_ms", "TTFT p50 (ms)"), (1, "output_tok_s", "output tokens/s")):
                mid = [e[metric]["p50"] or 0 for e in mine]
                low = [m - (e[metric]["min"] or m) for m, e in zip(mid, mine, strict=True)]
                high = [(e[metric]["max"] or m) - m for m, e in zip(mid, mine, strict=True)]
                axes[row][column].errorbar(levels, mid, yerr=[low, high], marker="o", capsize=3, label=policy)
                axes[row][column].set_ylabel(label)
                axes[row][column].set_xscale("log", base=2)
        axes[0][column].set_title(workload)
        axes[1][column].set_xlabel("concurrent clients")
        axes[0][column].legend(fontsize=8)
    fig.suptitle(f"Routing policies ({summary['environment']['bench_where']}); bars: min–max over repeats")
    save_chart(plt, fig, path)


# --- entry -------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--bare", action="store_true", help="replicas and router from scripts/bare_host.py here")
    parser.add_argument("--workdir", default=launch.DEFAULT_WORKDIR, help="bare_host.py's workdir (%(default)s)")
    parser.add_argument("--policies", default="single,round_robin,power_of_two,cache_aware", help="(%(default)s)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="(default: %(default)s)")
    parser.add_argument("--levels", default="8,32", help="concurrent clients (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--requests", type=int, default=256, help="requests per run (default: %(default)s)")
    parser.add_argument("--system-tokens", type=int, default=1024, help="system prompt tokens (default: 1024)")
    parser.add_argument("--question-tokens", type=int, default=64, help="tokens per question (default: 64)")
    parser.add_argument("--output-tokens", type=int, default=32, help="tokens per answer (default: 32)")
    parser.add_argument("--working-set", type=float, default=1.5, help="distinct prefixes / one replica's KV cache")
    parser.add_argument("--turns", type=int, default=4, help="turns per multi-turn chat (default: 4)")
    parser.add_argument("--multi-turn-share", type=float, default=0.3, help="requests that are chat turns (0.3)")
    parser.add_argument("--phases", default="table,hop,fault", help="what to run (default: %(default)s)")
    parser.add_argument("--hop-repeats", type=int, default=4, help="runs per path for the router hop (default: 4)")
    parser.add_argument("--hop-requests", type=int, default=64, help="requests per hop run (default: 64)")
    parser.add_argument("--fault-level", type=int, default=32, help="clients in the fault run (default: 32)")
    parser.add_argument("--fault-requests", type=int, default=3000, help="requests in the fault run (3000)")
    parser.add_argument(
        "--fault-policy",
        default="round_robin",
        help="the router's policy in the fault run (default: round_robin, so the killed replica has streams open)",
    )
    parser.add_argument("--kill-after", type=float, default=10.0, help="seconds into the fault run's load (10)")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between runs (default: 1)")
    parser.add_argument("--batch-timeout", type=float, default=3600, help="seconds for one policy's runs")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--model", help="served model name (default: vLLM's /v1/models)")
    parser.add_argument("--tokenizer", help="tokenizer path as vLLM's Python sees it (default: the model's root)")
    parser.add_argument("--project-name", "-p", default=os.environ.get("COMPOSE_PROJECT_NAME"))
    parser.add_argument("--compose-file", "-f", action="append", help="compose file(s), as for docker compose")
    parser.add_argument("--env-file", help="compose env file (default: .env)")
    parser.add_argument(
        "--rebuild-from",
        nargs=2,
        metavar=("FOLDER", "LOG"),
        help="make the summary again from a run's raw result files and its progress log",
    )
    parser.add_argument("--fault-result", help="with --rebuild-from: a fault run's summary JSON to take in")
    add_output_arguments(parser, "routing")
    args = parser.parse_args(argv)
    args.levels = parse_levels(args.levels)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(args.policies) - set(POLICIES))
    if unknown or not args.policies:
        raise UsageError(f"--policies: {', '.join(unknown) or 'none given'}; choose from {', '.join(POLICIES)}")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        raise UsageError(f"--workloads: choose from {', '.join(WORKLOADS)}")
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not args.phases or set(args.phases) - set(PHASES):
        raise UsageError(f"--phases: choose from {', '.join(PHASES)}")
    positive = ("repeats", "requests", "hop_repeats", "fault_level", "fault_requests", "system_tokens")
    for name in (*positive, "question_tokens", "output_tokens", "turns"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.multi_turn_share <= 1 or args.working_set <= 0:
        raise UsageError("--multi-turn-share must be within 0..1 and --working-set positive")
    return args


def write_rebuilt(args: argparse.Namespace) -> int:
    folder, log = Path(args.rebuild_from[0]), Path(args.rebuild_from[1])
    try:
        rows, hop = rebuild(folder, log)
        fault = json.loads(Path(args.fault_result).read_text()) if args.fault_result else None
    except (OSError, ValueError, KeyError) as err:
        raise UsageError(f"--rebuild-from: {err}") from None
    if not rows:
        raise UsageError(f"--rebuild-from: no progress lines in {log}")
    table = summarize(rows)
    summary = {
        "environment": (fault or {}).get("environment", {}) | {"rebuilt_from": [str(folder), str(log)]},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "output", "chart", "no_chart")},
        "runs": rows,
        "table": table,
        "targets": targets(table),
        "hop": hop,
        "fault": (fault or {}).get("fault"),
    }
    return finish(args, summary)


def finish(args: argparse.Namespace, summary: dict) -> int:
    """Write the summary and its chart, print the tables (or the JSON)."""
    output = args.output or results_path("routing.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    write_json(output, summary)
    if not args.no_chart and summary["table"]:
        chart(summary, args.chart or output.with_suffix(".png"))
    print(json.dumps(summary, indent=2) if args.json else render(summary), end="")
    progress(f"wrote {output}")
    return 0


def replica_kv_tokens(where: BareHost | ComposeHost) -> int:
    labels = cache_config_labels(where.stack.metrics())
    blocks, size = label_number(labels, "num_gpu_blocks"), label_number(labels, "block_size")
    if not blocks or not size:
        raise StackError("vLLM's cache_config_info gives no num_gpu_blocks/block_size")
    return int(blocks * size)


PROGRESS_LINE = re.compile(
    r"repeat (?P<repeat>\d+)/\d+ (?P<policy>\S+)\s+(?P<workload>\S+)\s+c=(?P<level>\d+)\s.*hit rate (?P<hit>\d+|-)%?"
)


def rebuild(folder: Path, log: Path) -> tuple[list[dict], dict | None]:
    """Rows (and the hop) from a run's raw files: `vllm bench serve`'s result per run
    (routing-r<repeat>-<policy>-<workload>-c<level>.json) and the fleet's hit rate from the
    progress log (whole percent). Requests per replica are not in either: left empty."""
    hits = {}
    for line in log.read_text(errors="replace").splitlines():
        found = PROGRESS_LINE.search(line)
        if found:
            key = (int(found["repeat"]) - 1, found["policy"], found["workload"], int(found["level"]))
            hits[key] = None if found["hit"] == "-" else int(found["hit"]) / 100
    rows = []
    for (repeat, policy, workload, level), hit in sorted(hits.items()):
        path = folder / f"routing-r{repeat + 1}-{policy}-{workload}-c{level}.json"
        result = json.loads(path.read_text())
        figures = run_figures(result | {"before": {}, "after": {}})
        figures["hit_rate"] = hit
        rows.append({"repeat": repeat, "policy": policy, "workload": workload, "level": level, **figures})
    p50: dict[str, list[float]] = {"direct": [], "router": []}
    for path in sorted(folder.glob("routing-hop-r*-*.json")):
        p50[path.stem.rsplit("-", 1)[1]].append(json.loads(path.read_text())["median_ttft_ms"])
    return rows, hop_figures(p50) if p50["direct"] and p50["router"] else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rendered = render_saved_run(argv, chart, render)
    if rendered is not None:
        return rendered
    args = parse_args(argv)
    if args.rebuild_from:
        return write_rebuilt(args)
    where: BareHost | ComposeHost = BareHost(args) if args.bare else ComposeHost(args)
    model = served_model(where.stack)
    args.model = args.model or model["id"]
    args.tokenizer = args.tokenizer or model.get("root") or model["id"]
    args.replica_kv_tokens = replica_kv_tokens(where)
    progress(f"one replica's KV cache: {args.replica_kv_tokens:,} tokens; {where.count} replicas")
    started = time.perf_counter()
    rows = measure(args, where) if "table" in args.phases else []
    hop = measure_hop(args, where) if "hop" in args.phases else None
    fault = measure_fault(args, where) if "fault" in args.phases else None
    table = summarize(rows)
    summary = {
        "environment": {
            **host_environment(),
            "bench_where": where.description,
            "replicas": where.count,
            "replica_kv_tokens": args.replica_kv_tokens,
            "max_model_len": model.get("max_model_len"),
            "duration_s": round(time.perf_counter() - started, 1),
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "output", "chart", "no_chart")},
        "runs": rows,
        "table": table,
        "targets": targets(table),
        "hop": hop,
        "fault": fault,
        "policies_left_out": getattr(where, "failed", {}),
    }
    return finish(args, summary)


if __name__ == "__main__":
    main_exit(PROG, main)
