"""Noisy neighbour: key A sends the worst the gateway lets it, key B ordinary chat; B's TTFT idle vs under attack.

Key A (--key-a-file) sends, from --a-clients connections at once, streamed requests as large as
the gateway lets one request be: n at the n cap, max_tokens at the max_tokens cap (less what the
prompt takes of the model's context, or vLLM itself refuses it), --a-prompt-tokens tokens of fresh
random text per prompt (no prefix-cache hits; under the prompt-size cap); half of the connections
use /v1/completions with a list of prompts at the prompts cap, half /v1/chat/completions. A
refused request (429) is sent again after its Retry-After, as the openai SDK does. A also sends,
--a-over-cap-rate times a second, requests one over each cap: each must come back 400 naming the
cap. Key B (--key-b-file) sends ordinary streamed chat requests (a short question, --b-max-tokens
tokens) at a steady --b-rate, throughout. A runs in its own process, so its reading of streams
never delays B's clock.

Phases alternate, idle (B alone) then attack (A and B), --repeats times. B's requests sent in the
first --ramp-seconds of an attack, or in the --settle-seconds after it (vLLM drops A's cut
streams), are not counted. Reported: B's TTFT p50/p99 and errors per phase (the SSE client
llmstack.sse; percentiles from llmstack.stats), per repeat, and their mean with the spread over
repeats; A's requests accepted and refused, by status and reason; vLLM's running and waiting
requests and generated tokens/s per phase where its metrics can be read (--vllm-url on a bare
host, else through docker compose; --no-vllm-metrics skips). Target: B's TTFT p50 under attack
at most 2x idle, and no errors for B.

The caps default to the gateway's defaults from compose.yaml, .env and the environment
(MAX_N_PER_REQUEST, MAX_TOKENS_PER_REQUEST, MAX_PROMPTS_PER_REQUEST,
MAX_PROMPT_BYTES_PER_REQUEST; --a-clients from MAX_CONCURRENT_REQUESTS_PER_KEY): pass --cap-*
when key A has its own limits in the keys file. Make the two keys with the key helper:

  scripts/apikeys.py create noisy-a > /tmp/key-a    # prints the new key once
  scripts/apikeys.py create noisy-b > /tmp/key-b
  python3 benchmarks/noisy_neighbour.py --gateway http://127.0.0.1:8080 \\
      --key-a-file /tmp/key-a --key-b-file /tmp/key-b --output results/noisy_neighbour.json
  python3 benchmarks/noisy_neighbour.py --render results/noisy_neighbour.json   # tables and chart again
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import random
import re
import socket
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

from llmstack import REPO_ROOT, composefile, promtext
from llmstack.bench import host_environment
from llmstack.bench.gateway_report import fmt, md_table
from llmstack.cli import (
    StackError,
    UsageError,
    add_output_arguments,
    load_pyplot,
    main_exit,
    parser_from_doc,
    progress,
    render_saved_run,
    results_path,
    save_chart,
    write_json,
)
from llmstack.secrets import read_env_file
from llmstack.sse import CHAT_COMPLETIONS, COMPLETIONS, ApiClient, build_body, send
from llmstack.stats import difference, spread
from llmstack.vllm import ComposeStack, HostVllm

PROG = "noisy_neighbour.py"
TARGET_RATIO = 2.0
# The gateway's caps and the setting (compose.yaml / .env) each defaults to, with the refusal code
# the gateway answers a request one over it with.
CAPS = {
    "n": ("MAX_N_PER_REQUEST", "n_cap"),
    "max_tokens": ("MAX_TOKENS_PER_REQUEST", "max_tokens_cap"),
    "prompts": ("MAX_PROMPTS_PER_REQUEST", "prompts_cap"),
    "prompt_bytes": ("MAX_PROMPT_BYTES_PER_REQUEST", "prompt_size_cap"),
    # n x prompts of one request: over the key's sequences in flight, never admissible.
    "sequences": ("MAX_SEQUENCES_IN_FLIGHT_PER_KEY", "sequences_cap"),
}
CLIENTS_SETTING = "MAX_CONCURRENT_REQUESTS_PER_KEY"
B_QUESTION = "What is the capital of France? Answer in one short sentence."
SYLLABLES = ("ka", "lo", "mi", "ner", "tu", "vas", "pel", "dor", "qui", "zen", "bra", "sto", "fil", "gu", "ram", "ox")
CONTEXT_MARGIN = 32  # tokens left free of A's prompt + max_tokens: the chat template's own tokens


# --- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One stretch of the run, in seconds from its start. B's requests sent in [count_from, end)
    are counted; a settle phase counts none."""

    kind: str  # idle | attack | settle
    repeat: int
    start: float
    end: float
    count_from: float

    @property
    def counted(self) -> bool:
        return self.kind != "settle"


def phase_plan(repeats: int, idle_s: float, attack_s: float, ramp_s: float, settle_s: float) -> list[Phase]:
    """idle, attack, settle, idle, attack, ... (ABAB), ending with the last attack."""
    plan: list[Phase] = []
    t = 0.0
    for repeat in range(1, repeats + 1):
        plan.append(Phase("idle", repeat, t, t + idle_s, t))
        t += idle_s
        plan.append(Phase("attack", repeat, t, t + attack_s, t + ramp_s))
        t += attack_s
        if repeat < repeats:
            plan.append(Phase("settle", repeat, t, t + settle_s, t + settle_s))
            t += settle_s
    return plan


def phase_index(plan: list[Phase], t: float) -> int | None:
    for index, phase in enumerate(plan):
        if phase.start <= t < phase.end:
            return index
    return None


def gateway_caps(environ: dict[str, str]) -> dict[str, int]:
    """The gateway's default caps and per-key concurrency, as compose gives them to nginx (0: no cap)."""
    env = composefile.service([REPO_ROOT / "compose.yaml"], "nginx", environ)["environment"]

    def number(name: str) -> int:
        value = str(env.get(name) or "").strip()
        return int(value) if value.isdigit() else 0

    caps = {cap: number(setting) for cap, (setting, _) in CAPS.items()}
    caps["clients"] = number(CLIENTS_SETTING)
    return caps


# --- key A's requests -------------------------------------------------------------------------------


def filler(words: int, rng: random.Random) -> str:
    """Random made-up words: a prompt no earlier request shares (no prefix-cache hits)."""
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(words))


@dataclass(frozen=True)
class AttackShape:
    """What each of key A's requests asks for."""

    model: str
    n: int
    prompts: int
    words: int  # per prompt
    prompt_tokens: int  # per prompt, measured
    max_tokens: int

    def body(self, route: str, rng: random.Random) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "n": self.n,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
        }
        if route == COMPLETIONS:
            body["prompt"] = [filler(self.words, rng) for _ in range(self.prompts)]
        else:
            body["messages"] = [{"role": "user", "content": filler(self.words, rng)}]
        return body


def over_cap_bodies(model: str, caps: dict[str, int]) -> dict[str, tuple[str, dict]]:
    """One request one over each cap (and within the others): cap -> (route, body)."""
    base = {"model": model, "max_tokens": 4, "stream": False}
    chat = [{"role": "user", "content": "hi"}]
    bodies: dict[str, tuple[str, dict]] = {}
    if caps.get("n"):
        bodies["n"] = (CHAT_COMPLETIONS, {**base, "messages": chat, "n": caps["n"] + 1})
    if caps.get("max_tokens"):
        bodies["max_tokens"] = (CHAT_COMPLETIONS, {**base, "messages": chat, "max_tokens": caps["max_tokens"] + 1})
    if caps.get("prompts"):
        bodies["prompts"] = (COMPLETIONS, {**base, "prompt": ["hi"] * (caps["prompts"] + 1)})
    if caps.get("prompt_bytes"):
        # The gateway measures the JSON of the messages: the content alone is already over the cap.
        big = [{"role": "user", "content": "a" * (caps["prompt_bytes"] + 1)}]
        bodies["prompt_bytes"] = (CHAT_COMPLETIONS, {**base, "messages": big})
    if caps.get("sequences"):
        n = min(caps.get("n") or caps["sequences"] + 1, caps["sequences"] + 1)
        prompts = -(-(caps["sequences"] + 1) // n)  # ceil: n x prompts just over the cap
        if not caps.get("prompts") or prompts <= caps["prompts"]:
            bodies["sequences"] = (COMPLETIONS, {**base, "prompt": ["hi"] * prompts, "n": n})
    return bodies


@dataclass
class RawResult:
    status: int | None = None
    code: str = ""
    events: int = 0
    cut: bool = False
    retry_after: float | None = None
    error: str = ""


CODE_PATTERN = re.compile(rb'"code"\s*:\s*"([^"]+)"')
TYPE_PATTERN = re.compile(rb'"type"\s*:\s*"([^"]+)"')


def parse_head(head: bytes) -> tuple[int, float | None]:
    """(status, Retry-After seconds) from a response's status line and headers."""
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    retry_after = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"retry-after":
            try:
                retry_after = float(value.strip())
            except ValueError:
                retry_after = None
    return status, retry_after


def error_code(body: bytes) -> str:
    """The OpenAI-style error's code (or type) in a refusal's body."""
    match = CODE_PATTERN.search(body) or TYPE_PATTERN.search(body)
    return match.group(1).decode(errors="replace") if match else ""


def raw_request(
    host: str, port: int, path: str, body: bytes, key: str, stop: Callable[[], bool], timeout: float = 900
) -> RawResult:
    """One POST on its own connection, read until the server closes it or `stop()` says to cut it
    (closing the connection: the gateway, then vLLM, drop the request). Counts SSE events."""
    result = RawResult()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(head + body)
            sock.settimeout(0.25)
            buffer, header_seen, kept = b"", False, b""
            while True:
                if stop() or time.monotonic() - started > timeout:
                    result.cut = True
                    break
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                if not header_seen:
                    buffer += data
                    if b"\r\n\r\n" not in buffer:
                        continue
                    header, data = buffer.split(b"\r\n\r\n", 1)
                    result.status, result.retry_after = parse_head(header)
                    header_seen = True
                if result.status == 200:
                    result.events += data.count(b"data:")
                elif len(kept) < 65536:
                    kept += data
            if result.status not in (None, 200):
                result.code = error_code(kept)
    except (OSError, ValueError, IndexError) as err:
        result.error = f"{type(err).__name__}: {err}"[:160]
    return result


def outcome(result: RawResult) -> str:
    """How one of A's requests ended, as a counter key: 'accepted', '429 sequences_in_flight', ..."""
    if result.status is None:
        if result.error:
            return "connection error"
        return "cut before the answer began" if result.cut else "closed without an answer"
    if result.status == 200:
        return "accepted"
    return f"{result.status} {result.code}".strip()


def attacker_process(
    gateway: str,
    key: str,
    shape: AttackShape,
    caps: dict[str, int],
    clients: int,
    over_cap_rate: float,
    attacking: Any,
    finished: Any,
    phase: Any,
    results: Any,
) -> None:
    """Key A, in its own process: `clients` connections while `attacking` is set, and the
    over-cap probes; each request's record goes to `results` when the run is finished."""
    parsed = urllib.parse.urlsplit(gateway)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    records: list[dict] = []
    lock = threading.Lock()

    def stop() -> bool:
        return not attacking.is_set() or finished.is_set()

    def note(kind: str, result: RawResult, phase_at_send: int, seconds: float) -> None:
        with lock:
            records.append({"phase": phase_at_send, "kind": kind, "outcome": outcome(result)} | asdict(result))
            records[-1]["seconds"] = round(seconds, 3)

    def client(index: int) -> None:
        rng = random.Random(index * 7919 + os.getpid())
        route = COMPLETIONS if index % 2 == 0 else CHAT_COMPLETIONS
        while not finished.is_set():
            if not attacking.wait(0.2):
                continue
            sent_in = phase.value
            started = time.monotonic()
            result = raw_request(host, port, route, json.dumps(shape.body(route, rng)).encode(), key, stop)
            note(route, result, sent_in, time.monotonic() - started)
            if result.status == 200 or result.cut:
                continue
            # Refused (or broken): again after Retry-After, as the openai SDK does; at most 5 s.
            pause = min(result.retry_after if result.retry_after is not None else 1.0, 5.0)
            deadline = time.monotonic() + pause
            while time.monotonic() < deadline and not stop():
                time.sleep(0.05)

    def over_cap() -> None:
        bodies = list(over_cap_bodies(shape.model, caps).items())
        if not bodies or over_cap_rate <= 0:
            return
        turn = 0
        while not finished.is_set():
            if not attacking.wait(0.2):
                continue
            cap, (route, body) = bodies[turn % len(bodies)]
            turn += 1
            sent_in = phase.value
            started = time.monotonic()
            # Not cut at the attack's end: each probe's answer is read whole.
            result = raw_request(host, port, route, json.dumps(body).encode(), key, finished.is_set, timeout=60)
            note(f"over_cap:{cap}", result, sent_in, time.monotonic() - started)
            time.sleep(max(0.0, 1 / over_cap_rate - (time.monotonic() - started)))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    threads.append(threading.Thread(target=over_cap, daemon=True))
    for thread in threads:
        thread.start()
    finished.wait()
    for thread in threads:
        thread.join(timeout=15)
    with lock:
        results.put(list(records))


# --- vLLM's own view --------------------------------------------------------------------------------

VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
VLLM_COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")


class VllmSampler(threading.Thread):
    """vLLM's running/waiting gauges and token counters every `interval` seconds."""

    def __init__(self, stack: ComposeStack | HostVllm, interval: float, clock: Callable[[], float]):
        super().__init__(daemon=True)
        self.stack, self.interval, self.clock = stack, interval, clock
        self.samples: list[dict] = []
        self.halt = threading.Event()
        self.error = ""

    def read(self) -> dict:
        samples = promtext.parse(self.stack.get("/metrics"))
        values = {name: promtext.total(samples, name) for name in (*VLLM_GAUGES, *VLLM_COUNTERS)}
        return {"t": self.clock(), **values}

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.samples.append(self.read())
            except (StackError, ValueError) as err:
                self.error = str(err)
                return
            self.halt.wait(self.interval)


def vllm_phase(samples: list[dict], phase: Phase) -> dict | None:
    """Max running/waiting and generated tokens/s over the samples taken during one phase."""
    inside = [s for s in samples if phase.count_from <= s["t"] < phase.end]
    if not inside:
        return None
    figures: dict[str, float | None] = {
        "max_running": max((s["vllm:num_requests_running"] or 0) for s in inside),
        "max_waiting": max((s["vllm:num_requests_waiting"] or 0) for s in inside),
        "samples": len(inside),
        "generation_tok_s": None,
    }
    first, last = inside[0], inside[-1]
    counter = "vllm:generation_tokens_total"
    if last["t"] > first["t"] and first[counter] is not None and last[counter] is not None:
        figures["generation_tok_s"] = (last[counter] - first[counter]) / (last["t"] - first["t"])
    return figures


# --- summaries --------------------------------------------------------------------------------------


def ttft_figures(records: list[dict]) -> dict:
    """B's requests of one phase: count, errors by kind, TTFT spread (ms) of the successful ones."""
    ok = [r["ttft_ms"] for r in records if not r["error"] and r["ttft_ms"] is not None]
    errors = Counter(r["error"] for r in records if r["error"])
    return {
        "requests": len(records),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "ttft_ms": spread(ok).as_dict(),
    }


def a_figures(records: list[dict]) -> dict:
    """Key A's requests of one phase: outcomes, SSE events received, over-cap probes by cap."""
    main = [r for r in records if not r["kind"].startswith("over_cap:")]
    probes = [r for r in records if r["kind"].startswith("over_cap:")]
    accepted = [r for r in main if r["outcome"] == "accepted"]
    over: dict[str, dict] = {}
    for cap, (_, code) in CAPS.items():
        mine = [r for r in probes if r["kind"] == f"over_cap:{cap}"]
        if mine:
            over[cap] = {
                "sent": len(mine),
                "refused_400": sum(r["status"] == 400 and r["code"] == code for r in mine),
                "accepted": sum(r["status"] == 200 for r in mine),
                "outcomes": dict(Counter(r["outcome"] for r in mine)),
            }
    return {
        "requests": len(main),
        "accepted": len(accepted),
        "completed": sum(not r["cut"] for r in accepted),
        "cut_at_phase_end": sum(r["cut"] for r in accepted),
        "sse_events": sum(r["events"] for r in accepted),
        "outcomes": dict(Counter(r["outcome"] for r in main)),
        "over_cap": over,
    }


def summarize(plan: list[Phase], b_records: list[dict], a_records: list[dict], vllm_samples: list[dict]) -> dict:
    """Per phase, per repeat and over the repeats, from the raw records of a run."""
    phases = []
    for index, phase in enumerate(plan):
        if not phase.counted:
            continue
        mine = [r for r in b_records if r["phase"] == index and r["t"] >= phase.count_from]
        entry = {**asdict(phase), "b": ttft_figures(mine)}
        if phase.kind == "attack":
            entry["a"] = a_figures([r for r in a_records if r["phase"] == index])
        entry["vllm"] = vllm_phase(vllm_samples, phase)
        phases.append(entry)
    repeats = []
    for repeat in sorted({p["repeat"] for p in phases}):
        idle = next((p for p in phases if p["repeat"] == repeat and p["kind"] == "idle"), None)
        attack = next((p for p in phases if p["repeat"] == repeat and p["kind"] == "attack"), None)
        if not idle or not attack:
            continue
        row: dict[str, Any] = {"repeat": repeat}
        for kind, entry in (("idle", idle), ("attack", attack)):
            ttft = entry["b"]["ttft_ms"]
            row[f"{kind}_p50_ms"], row[f"{kind}_p99_ms"] = ttft["p50"], ttft["p99"]
            row[f"{kind}_requests"], row[f"{kind}_errors"] = entry["b"]["requests"], entry["b"]["errors"]
        row["ratio_p50"] = (
            row["attack_p50_ms"] / row["idle_p50_ms"] if row["idle_p50_ms"] and row["attack_p50_ms"] else None
        )
        row["ratio_p99"] = (
            row["attack_p99_ms"] / row["idle_p99_ms"] if row["idle_p99_ms"] and row["attack_p99_ms"] else None
        )
        row["a_accepted"] = attack["a"]["accepted"]
        row["a_refused"] = attack["a"]["requests"] - attack["a"]["accepted"]
        repeats.append(row)
    return {"phases": phases, "repeats": repeats, "overall": overall(repeats, phases)}


def overall(repeats: list[dict], phases: list[dict]) -> dict:
    def over(key: str) -> dict:
        return spread([r[key] for r in repeats if r.get(key) is not None]).as_dict()

    result: dict[str, Any] = {
        key: over(key)
        for key in ("idle_p50_ms", "attack_p50_ms", "idle_p99_ms", "attack_p99_ms", "ratio_p50", "ratio_p99")
    }
    delta, exceeds = difference(
        [r["idle_p50_ms"] for r in repeats if r["idle_p50_ms"] is not None],
        [r["attack_p50_ms"] for r in repeats if r["attack_p50_ms"] is not None],
    )
    result["p50_difference_ms"] = {"value": delta, "larger_than_spread": exceeds}
    result["b_errors"] = {
        kind: sum(p["b"]["errors"] for p in phases if p["kind"] == kind) for kind in ("idle", "attack")
    }
    result["b_requests"] = {
        kind: sum(p["b"]["requests"] for p in phases if p["kind"] == kind) for kind in ("idle", "attack")
    }
    attacks = [p["a"] for p in phases if p["kind"] == "attack"]
    outcomes: Counter = Counter()
    for a in attacks:
        outcomes.update(a["outcomes"])
    over_cap: dict[str, dict] = {}
    for a in attacks:
        for cap, figures in a["over_cap"].items():
            total = over_cap.setdefault(cap, {"sent": 0, "refused_400": 0, "accepted": 0})
            for key in total:
                total[key] += figures[key]
    result["a"] = {
        "requests": sum(a["requests"] for a in attacks),
        "accepted": sum(a["accepted"] for a in attacks),
        "completed": sum(a["completed"] for a in attacks),
        "cut_at_phase_end": sum(a["cut_at_phase_end"] for a in attacks),
        "outcomes": dict(outcomes),
        "over_cap": over_cap,
    }
    result["targets"] = targets(result)
    return result


def targets(result: dict) -> list[dict]:
    ratio = result["ratio_p50"]
    ratio_mean, ratio_max = ratio.get("mean"), ratio.get("max")
    errors = result["b_errors"]["idle"] + result["b_errors"]["attack"]
    over = result["a"]["over_cap"]
    sent = sum(c["sent"] for c in over.values())
    refused = sum(c["refused_400"] for c in over.values())
    rows = [
        {
            "target": f"B's TTFT p50 under attack <= {TARGET_RATIO:g}x idle",
            "value": "-" if ratio_mean is None else f"{ratio_mean:.2f}x mean, {ratio_max:.2f}x worst repeat",
            "verdict": "-" if ratio_mean is None else ("met" if ratio_max <= TARGET_RATIO else "MISSED"),
        },
        {
            "target": "no errors for B",
            "value": f"{errors} of {result['b_requests']['idle'] + result['b_requests']['attack']}",
            "verdict": "met" if errors == 0 else "MISSED",
        },
    ]
    if sent:
        accepted = sum(c["accepted"] for c in over.values())
        rows.append(
            {
                "target": "A's over-cap requests never reach vLLM",
                "value": f"{refused} of {sent} refused with 400 naming the cap, {sent - refused - accepted} "
                "refused otherwise (an earlier 429), "
                f"{accepted} accepted",
                "verdict": "met" if accepted == 0 else "MISSED",
            }
        )
    return rows


# --- report -----------------------------------------------------------------------------------------


def spread_cell(figures: dict, digits: int = 1, unit: str = "") -> str:
    """mean (min-max) of per-repeat figures."""
    if not figures.get("n"):
        return "-"
    return f"{fmt(figures['mean'], digits)}{unit} ({fmt(figures['min'], digits)}-{fmt(figures['max'], digits)})"


def markdown_table(summary: dict) -> str:
    """B's TTFT per repeat and over repeats, A's requests, vLLM's load: docs/gateway-policy.md's table."""
    attack_by_repeat = {p["repeat"]: p for p in summary["phases"] if p["kind"] == "attack"}
    rows = []
    for r in summary["repeats"]:
        attack = attack_by_repeat[r["repeat"]]
        vllm = attack.get("vllm") or {}
        rows.append(
            [
                str(r["repeat"]),
                f"{fmt(r['idle_p50_ms'])} / {fmt(r['attack_p50_ms'])}",
                fmt(r["ratio_p50"], 2) + "x",
                f"{fmt(r['idle_p99_ms'])} / {fmt(r['attack_p99_ms'])}",
                f"{r['idle_errors']} / {r['attack_errors']} of {r['idle_requests']} / {r['attack_requests']}",
                f"{r['a_accepted']} / {r['a_refused']}",
                f"{fmt(vllm.get('max_running'), 0)} / {fmt(vllm.get('max_waiting'), 0)}",
                fmt(vllm.get("generation_tok_s"), 0),
            ]
        )
    o = summary["overall"]
    rows.append(
        [
            "mean (min-max)",
            f"{spread_cell(o['idle_p50_ms'])} / {spread_cell(o['attack_p50_ms'])}",
            spread_cell(o["ratio_p50"], 2, "x"),
            f"{spread_cell(o['idle_p99_ms'])} / {spread_cell(o['attack_p99_ms'])}",
            f"{o['b_errors']['idle']} / {o['b_errors']['attack']} of "
            f"{o['b_requests']['idle']} / {o['b_requests']['attack']}",
            f"{o['a']['accepted']} / {o['a']['requests'] - o['a']['accepted']}",
            "",
            "",
        ]
    )
    return md_table(
        [
            "Repeat",
            "B TTFT p50 idle / attack (ms)",
            "p50 ratio",
            "B TTFT p99 idle / attack (ms)",
            "B errors idle / attack",
            "A accepted / refused",
            "vLLM max running / waiting (attack)",
            "vLLM gen tok/s (attack)",
        ],
        rows,
    )


def a_table(summary: dict) -> str:
    """Key A over all attacks: each outcome, and each over-cap probe."""
    a = summary["overall"]["a"]
    rows = [[outcome_name, str(count)] for outcome_name, count in sorted(a["outcomes"].items(), key=lambda x: -x[1])]
    rows.append(["accepted, then cut at the attack's end / completed", f"{a['cut_at_phase_end']} / {a['completed']}"])
    for cap, figures in a["over_cap"].items():
        rows.append(
            [
                f"over the {cap} cap: 400 {CAPS[cap][1]} / sent (accepted)",
                f"{figures['refused_400']} / {figures['sent']} ({figures['accepted']})",
            ]
        )
    return md_table(["Key A's requests (all attack phases)", "count"], rows)


def targets_table(summary: dict) -> str:
    return md_table(
        ["Target", "Value", "Verdict"], [[t["target"], t["value"], t["verdict"]] for t in summary["overall"]["targets"]]
    )


def render(summary: dict) -> str:
    env, shape = summary["environment"], summary["attack"]
    head = (
        f"# Noisy neighbour: {env.get('model')} behind {env.get('gateway')}, {env.get('date')}\n\n"
        f"Key A: {shape['clients']} connections, n={shape['n']}, {shape['prompts']} prompts of "
        f"{shape['prompt_tokens']} tokens per completions request, max_tokens={shape['max_tokens']}. "
        f"Key B: {summary['settings']['b_rate']} chat requests/s of {summary['settings']['b_max_tokens']} tokens."
    )
    return "\n\n".join([head, markdown_table(summary), a_table(summary), targets_table(summary)]) + "\n"


def chart(summary: dict, path: Path) -> None:
    """B's TTFT over the run with the attacks shaded, and p50/p99 per repeat against 2x idle."""
    plt = load_pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    for phase in summary["plan"]:
        if phase["kind"] == "attack":
            left.axvspan(phase["start"], phase["end"], color="tab:red", alpha=0.12, lw=0)
    ok = [r for r in summary["b_records"] if not r["error"] and r["ttft_ms"] is not None]
    failed = [r for r in summary["b_records"] if r["error"]]
    left.scatter([r["t"] for r in ok], [r["ttft_ms"] for r in ok], s=8, color="tab:blue", label="B's TTFT")
    if failed:
        top = max([r["ttft_ms"] for r in ok] or [1])
        left.scatter([r["t"] for r in failed], [top] * len(failed), marker="x", color="black", label="B error")
    left.set(yscale="log", xlabel="seconds (red: key A attacking)", ylabel="ms", title="Key B's time to first token")
    left.legend(loc="upper left")
    left.grid(alpha=0.3)
    repeats = summary["repeats"]
    x = [r["repeat"] for r in repeats]
    for key, marker, color, label in (
        ("idle_p50_ms", "o", "tab:blue", "p50 idle"),
        ("attack_p50_ms", "o", "tab:red", "p50 attack"),
        ("idle_p99_ms", "^", "tab:blue", "p99 idle"),
        ("attack_p99_ms", "^", "tab:red", "p99 attack"),
    ):
        right.plot(
            x, [r[key] for r in repeats], marker=marker, color=color, label=label, ls="-" if "p50" in key else ":"
        )
    right.plot(
        x,
        [TARGET_RATIO * r["idle_p50_ms"] if r["idle_p50_ms"] else None for r in repeats],
        color="gray",
        ls="--",
        label=f"{TARGET_RATIO:g}x idle p50 (target)",
    )
    right.set(yscale="log", xlabel="repeat", ylabel="ms", title="Key B per repeat")
    right.set_xticks(x)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    save_chart(plt, fig, path)


# --- the run ----------------------------------------------------------------------------------------


def read_key(path: str, option: str) -> str:
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as err:
        raise UsageError(f"{option} {path}: {err.strerror}") from None
    if not lines:
        raise UsageError(f"{option} {path}: holds no key")
    return lines[0]


def calibrate(client: ApiClient, model: str, target_tokens: int, rng: random.Random) -> tuple[int, int]:
    """(words, tokens) of filler text whose prompt is about target_tokens, measured through the gateway."""
    words = max(8, target_tokens // 3)
    tokens = 0
    for _ in range(3):
        record = client.completion(model, filler(words, rng), 1, kind="calibrate", stream=False)
        tokens = record.prompt_tokens
        if not tokens:
            raise StackError("the gateway's answer carried no usage.prompt_tokens")
        if abs(tokens - target_tokens) <= max(8, target_tokens // 50):
            break
        words = max(1, round(words * target_tokens / tokens))
    return words, tokens


def plan_attack(args: argparse.Namespace, client_a: ApiClient, model: str, max_model_len: int) -> AttackShape:
    caps = args.caps
    target = min(args.a_prompt_tokens, max_model_len - CONTEXT_MARGIN - 1)
    rng = random.Random(1)
    words, tokens = calibrate(client_a, model, target, rng)
    n = max(1, caps["n"] or 1)
    prompts = max(1, caps["prompts"] or 1)
    if caps.get("sequences"):
        # The most sequences one request may ask for is the key's whole in-flight allowance.
        prompts = max(1, min(prompts, caps["sequences"] // n))
    if caps["prompt_bytes"]:
        # The list of prompts, as JSON, must stay under the prompt-size cap.
        sample = json.dumps([filler(words, rng) for _ in range(prompts)])
        if len(sample.encode()) > caps["prompt_bytes"] * 0.95:
            scale = caps["prompt_bytes"] * 0.9 / len(sample.encode())
            words, tokens = calibrate(client_a, model, max(8, int(tokens * scale)), rng)
    room = max_model_len - tokens - CONTEXT_MARGIN
    max_tokens = min(caps["max_tokens"], room) if caps["max_tokens"] else room
    if max_tokens < 1:
        raise UsageError(f"--a-prompt-tokens {args.a_prompt_tokens} leaves no room to generate in {max_model_len}")
    return AttackShape(model, n, prompts, words, tokens, max_tokens)


def b_sender(gateway: str, key: str, model: str, max_tokens: int) -> Callable[[], dict]:
    local = threading.local()
    headers = {"Authorization": f"Bearer {key}"}
    messages = [{"role": "user", "content": B_QUESTION}]

    def once() -> dict:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        body = build_body(CHAT_COMPLETIONS, model, None, messages, max_tokens, stream=True)
        record = send(local.session, gateway, CHAT_COMPLETIONS, body, headers, "b", timeout=120)
        return {
            "started": record.started,
            "ttft_ms": None if record.ttft is None else record.ttft * 1000,
            "e2e_ms": record.e2e * 1000,
            "error": record.error,
        }

    return once


def metrics_stack(args: argparse.Namespace) -> ComposeStack | HostVllm | None:
    if args.no_vllm_metrics:
        return None
    if args.vllm_url:
        return HostVllm(args.vllm_url.rstrip("/"), Path(os.devnull))
    files = [f for item in (args.compose_file or []) for f in item.split(":") if f]
    return ComposeStack(project_name=args.project_name, compose_files=files, env_file=args.env_file)


def run(args: argparse.Namespace) -> dict:
    key_a, key_b = read_key(args.key_a_file, "--key-a-file"), read_key(args.key_b_file, "--key-b-file")
    client_b, client_a = ApiClient(args.gateway, key_b), ApiClient(args.gateway, key_a)
    models = client_b.models()
    if not models:
        raise StackError(f"{args.gateway}/v1/models lists no model")
    model = args.model or models[0]["id"]
    max_model_len = int(next((m.get("max_model_len") for m in models if m["id"] == model), 0) or 4096)
    shape = plan_attack(args, client_a, model, max_model_len)
    progress(
        f"key A: {args.a_clients} connections, n={shape.n}, {shape.prompts} x {shape.prompt_tokens}-token prompts "
        f"(completions) or one (chat), max_tokens={shape.max_tokens}; key B: {args.b_rate}/s"
    )
    plan = phase_plan(args.repeats, args.idle_seconds, args.attack_seconds, args.ramp_seconds, args.settle_seconds)

    # A's process first, before this process starts threads.
    context = multiprocessing.get_context("fork")
    attacking, finished = context.Event(), context.Event()
    current_phase = context.Value("i", -1)
    a_results = context.Queue()
    attacker = context.Process(
        target=attacker_process,
        args=(
            args.gateway,
            key_a,
            shape,
            args.caps,
            args.a_clients,
            args.a_over_cap_rate,
            attacking,
            finished,
            current_phase,
            a_results,
        ),
        daemon=True,
    )
    attacker.start()

    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    stack = metrics_stack(args)
    sampler = VllmSampler(stack, args.metrics_interval, clock) if stack else None
    if sampler:
        sampler.start()
    send_b = b_sender(args.gateway, key_b, model, args.b_max_tokens)
    b_futures = []
    interval = 1 / args.b_rate
    next_b = 0.0
    index_now = None
    try:
        with ThreadPoolExecutor(max_workers=args.b_workers) as pool:
            while True:
                now = clock()
                index = phase_index(plan, now)
                if index is None:
                    break
                if index != index_now:
                    index_now = index
                    phase = plan[index]
                    current_phase.value = index
                    if phase.kind == "attack":
                        attacking.set()
                    else:
                        attacking.clear()
                    progress(f"{phase.kind} {phase.repeat}/{args.repeats} ({phase.end - phase.start:.0f} s)")
                if now >= next_b:
                    b_futures.append((index, pool.submit(send_b)))
                    next_b += interval
                time.sleep(max(0.0, min(next_b, plan[index].end) - clock()))
            attacking.clear()
    finally:
        attacking.clear()
        finished.set()
        if sampler:
            sampler.halt.set()
    try:
        a_records = a_results.get(timeout=60)
    except queue.Empty:
        a_records = []
        progress("key A's process sent no results")
    attacker.join(timeout=30)
    if sampler and sampler.error:
        progress(f"vLLM's metrics could not be read ({sampler.error}); the vLLM columns stay empty")
    b_records = []
    for index, future in b_futures:
        record = future.result()
        b_records.append(
            {
                "phase": index,
                "t": round(record["started"] - t0, 4),
                "ttft_ms": record["ttft_ms"],
                "e2e_ms": record["e2e_ms"],
                "error": record["error"],
            }
        )
    summary = summarize(plan, b_records, a_records, sampler.samples if sampler else [])
    summary["environment"] = {
        **host_environment(),
        "gateway": args.gateway,
        "model": model,
        "max_model_len": max_model_len,
        "vllm_metrics": None if not sampler else (sampler.error or "read"),
    }
    summary["settings"] = {
        k: v for k, v in vars(args).items() if k not in ("key_a_file", "key_b_file", "json", "output", "chart")
    }
    summary["attack"] = asdict(shape) | {"clients": args.a_clients}
    summary["plan"] = [asdict(p) for p in plan]
    summary["b_records"] = b_records
    summary["vllm_samples"] = sampler.samples if sampler else []
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--gateway", default="http://127.0.0.1:8080", help="the gateway's URL (default: %(default)s)")
    parser.add_argument("--key-a-file", required=True, help="file holding key A (the noisy one)")
    parser.add_argument("--key-b-file", required=True, help="file holding key B (the ordinary one)")
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--repeats", type=int, default=3, help="idle/attack pairs (default: %(default)s)")
    parser.add_argument("--idle-seconds", type=float, default=20)
    parser.add_argument("--attack-seconds", type=float, default=30)
    parser.add_argument("--ramp-seconds", type=float, default=5, help="start of each attack not counted for B")
    parser.add_argument("--settle-seconds", type=float, default=5, help="pause after each attack, not counted")
    parser.add_argument("--b-rate", type=float, default=2, help="key B's requests per second (default: %(default)s)")
    parser.add_argument("--b-max-tokens", type=int, default=24, help="tokens per B request (default: %(default)s)")
    parser.add_argument("--b-workers", type=int, default=64, help="most B requests in flight (default: %(default)s)")
    parser.add_argument("--a-clients", type=int, help=f"key A's connections (default: {CLIENTS_SETTING})")
    parser.add_argument(
        "--a-prompt-tokens", type=int, default=1024, help="tokens per prompt of A (default: %(default)s)"
    )
    parser.add_argument("--a-over-cap-rate", type=float, default=2, help="over-cap probes per second (default: 2)")
    for cap, (setting, _) in CAPS.items():
        parser.add_argument(f"--cap-{cap.replace('_', '-')}", type=int, help=f"key A's {cap} cap (default: {setting})")
    parser.add_argument("--metrics-interval", type=float, default=2, help="seconds between reads of vLLM's metrics")
    parser.add_argument("--no-vllm-metrics", action="store_true", help="do not read vLLM's metrics")
    parser.add_argument("--vllm-url", help="vLLM's own URL for its metrics (a bare host); default: docker compose")
    parser.add_argument("--project-name", "-p", default=os.environ.get("COMPOSE_PROJECT_NAME"))
    parser.add_argument("--compose-file", "-f", action="append", help="compose file(s) for reading vLLM's metrics")
    parser.add_argument("--env-file", help="compose env file (default: .env)")
    add_output_arguments(parser, "noisy_neighbour")
    args = parser.parse_args(argv)
    for name in ("repeats", "b_max_tokens", "b_workers", "a_prompt_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("idle_seconds", "attack_seconds", "b_rate", "metrics_interval"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.ramp_seconds < 0 or args.settle_seconds < 0 or args.a_over_cap_rate < 0:
        raise UsageError("--ramp-seconds, --settle-seconds and --a-over-cap-rate must not be negative")
    if args.ramp_seconds >= args.attack_seconds:
        raise UsageError("--ramp-seconds must be shorter than --attack-seconds")
    parsed = urllib.parse.urlsplit(args.gateway)
    if parsed.scheme != "http" or not parsed.hostname:
        raise UsageError(f"--gateway must be an http:// URL, not {args.gateway!r}")
    args.gateway = args.gateway.rstrip("/")
    for option in ("key_a_file", "key_b_file"):
        if not Path(getattr(args, option)).is_file():
            raise UsageError(f"--{option.replace('_', '-')} {getattr(args, option)}: no such file")
    defaults = gateway_caps(read_env_file(REPO_ROOT / ".env") | dict(os.environ))
    args.caps = {cap: getattr(args, f"cap_{cap}") for cap in CAPS}
    args.caps = {cap: defaults[cap] if value is None else value for cap, value in args.caps.items()}
    if args.a_clients is None:
        args.a_clients = defaults["clients"] or 64
    if args.a_clients < 1 or min(args.caps.values()) < 0:
        raise UsageError("--a-clients must be at least 1 and the caps not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rendered = render_saved_run(argv, chart, render)
    if rendered is not None:
        return rendered
    args = parse_args(argv)
    summary = run(args)
    output = args.output or results_path("noisy_neighbour.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    write_json(output, summary)
    if not args.no_chart:
        chart(summary, args.chart or output.with_suffix(".png"))
    print(json.dumps(summary["overall"], indent=2) if args.json else render(summary), end="")
    progress(f"wrote {output}")
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
