"""Soak: offered load at a multiple of the stack's capacity through the gateway, for minutes.

First a closed-loop probe finds the capacity (completed requests per second with --probe-clients
streams in flight); then requests arrive as a Poisson process at --overload times that rate for
--minutes. Pass means, over the whole run:
  - every request ended as 200, or as a clean 429 / 503 JSON error a client may retry; no other
    status, no connection error (one is retried once, as the openai SDK does; retries are counted
    and shown, and one that duplicated work would break the next check);
  - nothing was lost: the client's 200s = the gateway's 200s for the soak key (its access log,
    followed while it is written) = the requests vLLM finished (vllm:request_success_total);
  - no container's memory grew: each one's mean RSS over the last fifth of the run is within
    --memory-growth of its mean over the second fifth (the first is warm-up).
Run it against the compose stack (a deliberately small KV cache makes preemption and queueing
part of it), with a key of its own:
  scripts/apikeys.py create soak > secrets/soak_key
  VLLM_CPU_KVCACHE_SPACE=0.25 docker compose up -d --wait     # the CPU path, small KV cache
  python benchmarks/soak.py --gateway https://localhost:8443 --ca-file secrets/tls_certificate \\
      --key-file secrets/soak_key --minutes 30 --output docs/soak/soak-cpu.json
Writes JSON and a PNG (each container's memory over time, the request outcomes per minute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from llmstack import REPO_ROOT
from llmstack.cli import (
    StackError,
    UsageError,
    add_output_arguments,
    load_pyplot,
    main_exit,
    parser_from_doc,
    progress,
    read_saved_run,
    results_path,
    save_chart,
    write_json,
)
from llmstack.vllm import ComposeStack

PROG = "soak.py"
RETRYABLE = {429, 503}
PROMPT = "Write about the sea."


class Soak:
    def __init__(self, args: argparse.Namespace, key: str):
        self.args = args
        self.session = requests.Session()
        # Per request: requests lets REQUESTS_CA_BUNDLE override a session's own verify.
        self.verify: str | bool = args.ca_file or True
        self.session.mount("https://", requests.adapters.HTTPAdapter(pool_maxsize=args.max_in_flight))
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=args.max_in_flight))
        # The overload phase's own User-Agent picks its lines out of the gateway's access log.
        self.run_agent = f"llmstack-soak/{os.getpid()}-{int(time.time())}"
        self.headers = {"Authorization": f"Bearer {key}", "User-Agent": "llmstack-soak/probe"}
        self.outcomes: list[tuple[float, str]] = []  # (seconds since start, outcome)
        self.retried: list[str] = []  # connection errors retried once (their first outcome)
        self.error_details: list[str] = []
        self.lock = threading.Lock()
        self.model = ""
        self.started = 0.0

    def request(self) -> str:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.args.max_tokens, "ignore_eos": True}
        body |= {"stream": True} if random.random() < 0.5 else {}
        outcome = self.send(body)
        if outcome.startswith("error"):
            # As the openai SDK does: a connection error is retried once. The commonest is HTTP/1.1's
            # keep-alive race (the gateway closes a pooled connection that has been idle for 75 s
            # just as the client reuses it); a retry that duplicated work would show in the counts.
            with self.lock:
                self.retried.append(outcome)
            outcome = self.send(body)
        return outcome

    def send(self, body: dict) -> str:
        try:
            with self.session.post(
                self.args.gateway + "/v1/completions",
                json=body,
                headers=self.headers,
                stream=True,
                timeout=300,
                verify=self.verify,
            ) as response:
                if response.status_code == 200:
                    ended = any(b"[DONE]" in chunk for chunk in response.iter_lines()) if body.get("stream") else True
                    if not ended or (not body.get("stream") and "usage" not in response.json()):
                        return "cut"
                    return "200"
                is_json = response.headers.get("Content-Type", "").startswith("application/json")
                if response.status_code in RETRYABLE and is_json and "error" in response.json():
                    return str(response.status_code)
                return f"bad {response.status_code}"
        except (requests.RequestException, ValueError) as err:
            cause = err.__context__ or err.__cause__ or err
            with self.lock:
                if len(self.error_details) < 50:
                    self.error_details.append(f"{time.monotonic() - self.started:.1f} s: {err}"[:300])
            return f"error {type(err).__name__} ({type(cause).__name__})"

    def record(self, outcome: str) -> None:
        with self.lock:
            self.outcomes.append((time.monotonic() - self.started, outcome))

    def probe_capacity(self) -> float:
        """Completed requests per second with probe-clients requests in flight (closed loop)."""
        done: Counter[str] = Counter()
        deadline = time.monotonic() + self.args.probe_seconds

        def client() -> None:
            while time.monotonic() < deadline:
                done[self.request()] += 1

        with ThreadPoolExecutor(self.args.probe_clients) as pool:
            for _ in range(self.args.probe_clients):
                pool.submit(client)
        if not done["200"]:
            raise StackError(f"the capacity probe got no 200 ({dict(done)}): is the stack up and the key valid?")
        return done["200"] / self.args.probe_seconds

    def run(self, rate: float, seconds: float, sampler: MemorySampler) -> None:
        self.headers = {**self.headers, "User-Agent": self.run_agent}
        self.started = time.monotonic()
        in_flight = threading.Semaphore(self.args.max_in_flight)
        rng = random.Random(7)
        next_report = 60.0

        def one() -> None:
            try:
                self.record(self.request())
            finally:
                in_flight.release()

        with ThreadPoolExecutor(self.args.max_in_flight) as pool:
            moment = 0.0
            while moment < seconds:
                moment += rng.expovariate(rate)
                wait = self.started + moment - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not in_flight.acquire(blocking=False):
                    self.record("client saturated")  # over --max-in-flight: counted, never sent
                    continue
                pool.submit(one)
                if moment >= next_report:
                    counts = Counter(outcome for _, outcome in self.outcomes)
                    progress(f"{moment / 60:.0f}/{seconds / 60:.0f} min: {dict(counts)}; {sampler.latest()}")
                    next_report += 60.0


class MemorySampler(threading.Thread):
    """Each container's memory (docker stats) of the stack, every few seconds."""

    def __init__(self, stack: ComposeStack, interval: float):
        super().__init__(daemon=True)
        self.interval = interval
        self.samples: list[dict] = []
        self.stop_event = threading.Event()
        self.started = time.monotonic()
        rows = [json.loads(line) for line in stack.run("ps", "--format", "json").splitlines() if line.strip()]
        rows = [row for group in rows for row in (group if isinstance(group, list) else [group])]
        self.services = {row["ID"]: row["Service"] for row in rows}
        if not self.services:
            raise StackError("docker compose ps shows no container: is the stack up (and -p/-f right)?")

    def sample(self) -> None:
        stats = subprocess.run(
            ["docker", "stats", "--no-stream", "--format", "{{json .}}", *self.services],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.splitlines()
        point: dict = {"t": round(time.monotonic() - self.started, 1), "mib": {}}
        for line in stats:
            entry = json.loads(line)
            service = next((name for cid, name in self.services.items() if entry["ID"].startswith(cid[:12])), None)
            if service:
                point["mib"][service] = round(to_mib(entry["MemUsage"].split("/")[0].strip()), 1)
        self.samples.append(point)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval)

    def latest(self) -> str:
        if not self.samples:
            return "no memory sample yet"
        return ", ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(self.samples[-1]["mib"].items()))


def to_mib(text: str) -> float:
    units = {"B": 1 / 2**20, "KiB": 1 / 1024, "kB": 1 / 1024, "MiB": 1, "MB": 1, "GiB": 1024, "GB": 1024}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * units[unit]
    raise StackError(f"docker stats printed a size it does not know: {text!r}")


def memory_growth(samples: list[dict]) -> dict[str, dict]:
    """Per container: mean MiB over the second fifth of the run and over the last fifth."""
    if len(samples) < 10:
        return {}
    fifth = len(samples) // 5
    early, late = samples[fifth : 2 * fifth], samples[-fifth:]
    growth = {}
    for name in samples[-1]["mib"]:
        before = [s["mib"][name] for s in early if name in s["mib"]]
        after = [s["mib"][name] for s in late if name in s["mib"]]
        if before and after:
            first, last = sum(before) / len(before), sum(after) / len(after)
            growth[name] = {
                "early_mib": round(first, 1),
                "late_mib": round(last, 1),
                "growth": round(last / first - 1, 4),
            }
    return growth


class GatewayLog(threading.Thread):
    """Follows the gateway's access log (docker compose logs -f) and counts one client's requests by
    status. Read as it is written: docker's json-file driver keeps 3 x 20 MB of nginx's log
    (compose/stack.yaml), about 35 minutes at 2x the CPU stack's capacity, so reading it only at the
    end would miss the first lines of a long run."""

    def __init__(self, stack: ComposeStack, owner: str, agent: str):
        super().__init__(daemon=True)
        self.owner, self.agent = owner, agent
        self.counts: Counter = Counter()
        self.request_ids: set[str | None] = set()
        self.duplicates = 0
        self.lines = 0
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
        command = [*stack.base_command(), "logs", "-f", "--no-color", "--no-log-prefix", "--since", since, "nginx"]
        self.process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )

    def run(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines += 1
            if not line.startswith("{"):
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("key_owner") != self.owner or entry.get("user_agent") != self.agent:
                continue
            # Once per request: a follower can be handed a line twice when the log file rotates.
            request_id = entry.get("request_id")
            if request_id in self.request_ids:
                self.duplicates += 1
                continue
            self.request_ids.add(request_id)
            self.counts[str(entry["status"])] += 1

    def finish(self, quiet_seconds: float = 3, timeout: float = 60) -> Counter:
        """Waits until no new line has come for quiet_seconds (the last requests' lines), then stops."""
        deadline = time.monotonic() + timeout
        seen = -1
        while seen != self.lines and time.monotonic() < deadline:
            seen = self.lines
            time.sleep(quiet_seconds)
        self.process.terminate()
        self.join(10)
        return self.counts


def vllm_finished(stack: ComposeStack) -> float:
    """Requests vLLM finished, summed over every replica."""
    return stack.replicas_total("vllm:request_success_total")


def chart(summary: dict, path: Path) -> None:
    plt = load_pyplot()
    fig, (memory, outcomes) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    samples = summary["memory_samples"]
    for name in sorted(samples[-1]["mib"]) if samples else []:
        memory.plot([s["t"] / 60 for s in samples], [s["mib"].get(name) for s in samples], label=name)
    memory.set_ylabel("memory (MiB)")
    memory.set_yscale("log")
    memory.legend(fontsize=8, loc="upper left")
    memory.set_title(
        f"Soak: {summary['minutes']} min at {summary['overload']}x capacity ({summary['capacity_rps']:.1f} req/s)"
    )
    per_minute: dict[str, Counter] = {}
    for moment, outcome in summary["outcomes_timeline"]:
        per_minute.setdefault(outcome, Counter())[int(moment // 60)] += 1
    minutes = range(int(summary["minutes"]) + 1)
    for outcome, counts in sorted(per_minute.items()):
        outcomes.plot(list(minutes), [counts.get(m, 0) for m in minutes], marker="o", label=outcome)
    outcomes.set_xlabel("minute")
    outcomes.set_ylabel("requests ended per minute")
    outcomes.legend(fontsize=8)
    save_chart(plt, fig, path)


# Prometheus's in-memory TSDB head grows with every sample until its 2-hour compaction: by
# design, not a leak. Its growth is reported, not judged.
GROWS_BY_DESIGN = {"prometheus": "TSDB head grows until its 2-hour compaction"}


def evaluate(summary: dict, memory_growth_limit: float) -> dict:
    """The pass/fail checks of a run (also re-applied by --render to a saved run)."""
    client, gateway = Counter(summary["client"]), Counter(summary["gateway"])
    growth = memory_growth(summary["memory_samples"])
    judged = {name: g for name, g in growth.items() if name not in GROWS_BY_DESIGN}
    checks = {
        "only_200_or_retryable": not [k for k in client if k not in ("200", "429", "503", "client saturated")],
        "client_200_equals_gateway_200": client["200"] == gateway["200"] and not gateway["log rotated away"],
        "gateway_200_equals_vllm_finished": gateway["200"] == summary["vllm_finished"],
        "no_memory_growth": bool(judged) and all(g["growth"] <= memory_growth_limit for g in judged.values()),
    }
    return summary | {
        "memory_growth": growth,
        "memory_growth_limit": memory_growth_limit,
        "not_judged": GROWS_BY_DESIGN,
        "checks": checks,
        "passed": all(checks.values()),
    }


def render(path: Path, args: argparse.Namespace) -> int:
    summary = evaluate(read_saved_run(path), args.memory_growth)
    write_json(path, summary)
    if not args.no_chart:
        chart(summary, args.chart or path.with_suffix(".png"))
    shown = {k: v for k, v in summary.items() if k not in ("outcomes_timeline", "memory_samples")}
    print(json.dumps(shown, indent=2) if args.json else format_summary(shown))
    return 0 if summary["passed"] else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--render", type=Path, help="re-check and redraw a saved run's JSON, measure nothing")
    parser.add_argument("--gateway", help="the gateway's URL, e.g. https://localhost:8443")
    parser.add_argument("--ca-file", help="CA file for an HTTPS gateway with a self-signed certificate")
    parser.add_argument("--key-file", type=Path, help="the soak key (its owner names its log lines)")
    parser.add_argument("--key-owner", default="soak", help="that key's owner in the keys file (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=30, help="length of the overload phase (default: %(default)s)")
    parser.add_argument("--overload", type=float, default=2.0, help="offered rate / capacity (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: %(default)s)")
    parser.add_argument("--probe-clients", type=int, default=16, help="streams in flight while probing (default: 16)")
    parser.add_argument("--probe-seconds", type=float, default=20, help="length of the probe (default: %(default)s)")
    parser.add_argument("--max-in-flight", type=int, default=256, help="the client's own limit (default: %(default)s)")
    parser.add_argument("--memory-interval", type=float, default=10, help="seconds between memory samples")
    parser.add_argument("--memory-growth", type=float, default=0.10, help="largest growth that passes (default: 0.10)")
    parser.add_argument("--project-name", "-p", default=os.environ.get("COMPOSE_PROJECT_NAME"))
    parser.add_argument("--compose-file", "-f", action="append", help="compose file(s) (default: COMPOSE_FILE / .env)")
    parser.add_argument("--env-file", help="compose env file (default: .env)")
    add_output_arguments(parser, "soak")
    args = parser.parse_args(argv)
    if args.render:
        return args
    if not args.gateway or not args.key_file:
        raise UsageError("--gateway and --key-file are needed (or --render FILE)")
    if args.minutes <= 0 or args.overload <= 0 or args.max_tokens < 1 or args.probe_clients < 1:
        raise UsageError("--minutes, --overload, --max-tokens and --probe-clients must be positive")
    if not args.key_file.is_file():
        raise UsageError(f"--key-file {args.key_file}: no such file (scripts/apikeys.py create soak > FILE)")
    if args.ca_file and not Path(args.ca_file).is_file():
        raise UsageError(f"--ca-file {args.ca_file}: no such file")
    args.gateway = args.gateway.rstrip("/")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args.render, args)
    words = args.key_file.read_text().split()
    if not words:
        raise UsageError(f"--key-file {args.key_file} is empty")
    key = words[0]
    stack = ComposeStack(project_name=args.project_name, compose_files=args.compose_file or [], env_file=args.env_file)
    soak = Soak(args, key)
    try:
        models = soak.session.get(args.gateway + "/v1/models", headers=soak.headers, timeout=30, verify=soak.verify)
    except requests.RequestException as err:
        raise StackError(f"cannot reach {args.gateway}: {err}") from None
    if models.status_code != 200:
        raise StackError(f"{args.gateway}/v1/models answered {models.status_code}: {models.text[:200]}")
    soak.model = models.json()["data"][0]["id"]
    progress(f"probing capacity: {args.probe_clients} streams for {args.probe_seconds:.0f} s")
    capacity = soak.probe_capacity()
    rate = capacity * args.overload
    progress(f"capacity {capacity:.2f} req/s; offering {rate:.2f} req/s for {args.minutes:g} min")
    gateway_log = GatewayLog(stack, args.key_owner, soak.run_agent)
    gateway_log.start()
    vllm_before = vllm_finished(stack)
    sampler = MemorySampler(stack, args.memory_interval)
    sampler.start()
    soak.run(rate, args.minutes * 60, sampler)
    sampler.stop_event.set()
    sampler.join(30)
    gateway = gateway_log.finish()
    vllm_after = vllm_finished(stack)
    client = Counter(outcome for _, outcome in soak.outcomes)
    summary = {
        "command": "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "minutes": args.minutes,
        "overload": args.overload,
        "capacity_rps": round(capacity, 3),
        "offered_rps": round(rate, 3),
        "client": dict(client),
        "gateway": dict(gateway),
        "vllm_finished": round(vllm_after - vllm_before),
        "retried_connection_errors": dict(Counter(soak.retried)),
        "gateway_log_lines_repeated": gateway_log.duplicates,
        "error_details": soak.error_details,
        "outcomes_timeline": [(round(t, 2), o) for t, o in soak.outcomes],
        "memory_samples": sampler.samples,
    }
    summary = evaluate(summary, args.memory_growth)
    output = args.output or results_path("soak.json")
    write_json(output, summary)
    if not args.no_chart:
        chart(summary, args.chart or output.with_suffix(".png"))
    shown = {k: v for k, v in summary.items() if k not in ("outcomes_timeline", "memory_samples")}
    print(json.dumps(shown, indent=2) if args.json else format_summary(shown))
    return 0 if summary["passed"] else 1


def markdown_table(summary: dict) -> str:
    """docs/soak.md's table of a run (llmstack.docs)."""
    client, gateway = summary["client"], summary["gateway"]
    rows = [
        "| | |",
        "|---|---|",
        f"| length, offered load | {summary['minutes']:g} min at {summary['overload']:g}x the measured capacity "
        f"({summary['capacity_rps']:.1f} req/s): {summary['offered_rps']:.1f} req/s |",
        "| client outcomes | " + ", ".join(f"{k}: {v:,}" for k, v in sorted(client.items())) + " |",
        f"| 200s: client / gateway log / vLLM finished | {client.get('200', 0):,} / {gateway.get('200', 0):,} / "
        f"{summary['vllm_finished']:,} |",
    ]
    if "retried_connection_errors" in summary:
        retried = summary["retried_connection_errors"]
        shown = ", ".join(f"{k}: {v:,}" for k, v in sorted(retried.items())) or "none"
        rows.append(f"| connection errors retried once | {shown} |")
    for name, g in sorted(summary["memory_growth"].items()):
        note = " (not judged: " + summary["not_judged"][name] + ")" if name in summary.get("not_judged", {}) else ""
        rows.append(
            f"| memory of {name}, 2nd vs last fifth | {g['early_mib']:,.0f} → {g['late_mib']:,.0f} MiB "
            f"({g['growth']:+.1%}){note} |"
        )
    verdicts = ", ".join(f"{name.replace('_', ' ')}: {'yes' if ok else 'NO'}" for name, ok in summary["checks"].items())
    rows.append(f"| checks | {verdicts} |")
    return "\n".join(rows) + "\n"


def format_summary(summary: dict) -> str:
    lines = [
        f"Soak: {summary['minutes']:g} min at {summary['overload']:g}x capacity "
        f"({summary['capacity_rps']:.2f} req/s measured, {summary['offered_rps']:.2f} offered)",
        f"client outcomes: {summary['client']}",
        f"gateway 200s {summary['gateway'].get('200', 0)}, vLLM finished {summary['vllm_finished']}",
        f"connection errors retried once: {summary.get('retried_connection_errors') or 'none'}",
    ]
    for name, g in sorted(summary["memory_growth"].items()):
        why = f"  (not judged: {summary['not_judged'][name]})" if name in summary.get("not_judged", {}) else ""
        lines.append(f"  {name}: {g['early_mib']:.0f} -> {g['late_mib']:.0f} MiB ({g['growth']:+.1%}){why}")
    lines.append("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in summary["checks"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main_exit(PROG, main)
