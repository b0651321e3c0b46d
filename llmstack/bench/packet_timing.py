"""Ground truth for the client's timings: the gateway port's packets against the SSE client's TTFT and inter-token gaps.

tshark captures the gateway's plain-HTTP port (--interface, default lo) while --requests streamed
completions go out one at a time (llmstack.sse.ApiClient, concurrency 1, --pause between them).
The capture is then read back packet by packet: each TCP stream's bytes in order (a retransmitted
segment counts once, at its first sighting), its HTTP/1.1 exchanges (keep-alive: several per
stream), each response's body (chunked, or by Content-Length) split into server-sent events exactly
as llmstack.sse.iter_sse_data splits them. An event's wire time is the timestamp of the packet that
carried its last byte; it "has content" when chunk_text() of its JSON is not empty (the client's
TTFT definition), and [DONE] is ignored. Exchanges are matched to the client's RequestRecords in
order of their start (concurrency 1 makes that unambiguous; the counts must agree).

Per request:
  wire TTFT      first content event's packet - the request's first packet;
  TTFT diff      client TTFT - wire TTFT: what the client adds, the sum of
    send lag     the request's first packet - the client's start stamp (started_wall; it holds the
                 TCP connect, SYN to request, where the request opened a connection), and
    read lag     the client's arrival of the first content event - its packet;
  event lag      for every content event, the client's arrival (started_wall + chunk_offsets[i]) -
                 its packet. The client stamps each content event (not each network read) with the
                 arrival of the read that completed it, so the i-th offset is the i-th content event
                 on the wire, one to one;
  gap diff       client inter-token gap - the same gap on the wire.
p50 / p99 / max of each (llmstack.stats); target: |difference| within 0.5 ms at p99. TTFT means
three ways (vLLM's time_to_first_token histogram over the same requests, summed over replicas; the
wire; the client) split the CPU stack's TTFT gap into "before the bytes reach the gateway's socket"
(wire - vLLM: nginx, the router, vLLM's API server) and "the client" (client - wire).

Times: pcap timestamps and started_wall are both the host's wall clock; the client's offsets are
time.perf_counter, added to started_wall (their drift over one request is far below 1 µs). Run it
as root (or with capture rights for dumpcap). On loopback the port is the one the client talks to:
with Docker's userland proxy that is docker-proxy's socket, not nginx's. Where the published port
does not go over lo (userland proxy off), try --interface any.

  sudo python3 benchmarks/packet_timing.py --api-key-file secrets/loadtest_api_key
  sudo python3 benchmarks/packet_timing.py --gateway-url http://127.0.0.1:8080 --requests 200 \\
      --max-tokens 64 --capture-file /tmp/gateway.pcapng --output results/packet_timing.json
  python3 benchmarks/packet_timing.py --render results/packet_timing.json   # tables and chart again
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmstack.bench import host_environment
from llmstack.bench.gateway_overhead import add_api_key_argument, read_key
from llmstack.bench.gateway_report import fmt, md_table, verdict
from llmstack.cli import (
    StackError,
    UsageError,
    add_output_arguments,
    load_pyplot,
    main_exit,
    parser_from_doc,
    progress,
    progress_bar,
    render_saved_run,
    results_path,
    save_chart,
    write_json,
)
from llmstack.promtext import Snapshot
from llmstack.sse import COMPLETIONS, ApiClient, RequestRecord, chunk_text, event_data
from llmstack.stats import spread
from llmstack.vllm import ComposeStack, HostVllm, add_stack_arguments, stack_from_args

PROG = "packet_timing.py"
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
TARGET_P99_MS = 0.5
# Packets with payload, and the clients' SYNs (when a request opened a connection).
CAPTURE_FILTER = "tcp.len>0 or (tcp.flags.syn==1 and tcp.flags.ack==0)"
FIELDS = ("frame.number", "frame.time_epoch", "tcp.stream", "tcp.srcport", "tcp.dstport", "tcp.seq", "tcp.payload")
DEFAULT_PROMPT = "Explain in one paragraph how a load balancer decides where to send a request."
# How far the capture's first packet of a request may be from the client's start stamp (same clock).
MATCH_TOLERANCE_S = 1.0


class CaptureError(StackError):
    """The capture could not be taken or read, or does not fit what the client sent."""


# --- the capture's bytes ----------------------------------------------------------------------------


@dataclass
class ByteStream:
    """One direction of a TCP stream: its bytes in order, and per byte the time of the packet that
    made it readable (a packet's bytes are readable once every earlier byte is, hence a running max)."""

    data: bytes = b""
    times: array = field(default_factory=lambda: array("d"))

    def __len__(self) -> int:
        return len(self.data)


@dataclass
class Conversation:
    stream: int
    client: ByteStream
    server: ByteStream
    syn: float | None = None  # the client's SYN, where the connection opened during the capture


def assemble(stream: int, direction: str, segments: list[tuple[int, int, float, bytes]]) -> ByteStream:
    """(frame, seq, time, payload) segments of one direction into a ByteStream. Each byte counts at
    its first sighting (a retransmission adds only bytes not seen before, whatever its length); a
    byte is readable once every earlier byte is (a running max over the stream)."""
    if not segments:
        return ByteStream()
    in_order = sorted(segments)  # by frame number: the order tshark saw them
    base = in_order[0][1]

    def offset(seq: int) -> int:
        # Sequence numbers wrap at 2^32; relative to the first packet's, signed.
        return (seq - base + 2**31) % 2**32 - 2**31

    placed = [(offset(seq), when, payload) for _, seq, when, payload in in_order]
    start = min(at for at, _, _ in placed)
    size = max(at + len(payload) for at, _, payload in placed) - start
    data, seen = bytearray(size), bytearray(size)
    first_seen = array("d", [0.0]) * size
    for at, when, payload in placed:
        at -= start
        end = at + len(payload)
        if seen.find(1, at, end) < 0:  # nothing of it seen before: the usual case
            data[at:end] = payload
            seen[at:end] = b"\x01" * len(payload)
            first_seen[at:end] = array("d", [when]) * len(payload)
            continue
        for index in range(at, end):
            if not seen[index]:
                data[index], seen[index], first_seen[index] = payload[index - at], 1, when
    missing = seen.find(0)
    if missing >= 0:
        after = seen.find(1, missing)
        raise CaptureError(
            f"TCP stream {stream} ({direction}): {after - missing} bytes missing at offset {missing} "
            "(the capture dropped packets?)"
        )
    return ByteStream(bytes(data), array("d", itertools.accumulate(first_seen, max)))


def parse_fields(text: str, server_port: int) -> dict[int, Conversation]:
    """tshark's `-T fields` lines (FIELDS, tab-separated, payload in hex) into each TCP stream's two
    directions; the server is the side on `server_port`. A line without payload from the client is
    its SYN (CAPTURE_FILTER lets only those through)."""
    segments: dict[tuple[int, str], list[tuple[int, int, float, bytes]]] = {}
    syns: dict[int, float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != len(FIELDS):
            raise CaptureError(f"tshark's line {number} has {len(parts)} fields, not {len(FIELDS)}: {line[:80]!r}")
        frame, epoch, stream_index, srcport, dstport, seq, payload = parts
        try:
            hex_text = payload.replace(":", "").strip()
            entry = (int(frame), int(seq), float(epoch), bytes.fromhex(hex_text))
            key = (int(stream_index), "server" if int(srcport) == server_port else "client")
            if int(srcport) != server_port and int(dstport) != server_port:
                continue
        except ValueError as err:
            raise CaptureError(f"tshark's line {number} is not frame/time/stream/ports/seq/payload: {err}") from None
        if entry[3]:
            segments.setdefault(key, []).append(entry)
        elif key[1] == "client":
            syns[key[0]] = min(syns.get(key[0], entry[2]), entry[2])
    conversations = {}
    for stream in sorted({key[0] for key in segments}):
        conversations[stream] = Conversation(
            stream,
            assemble(stream, "client to server", segments.get((stream, "client"), [])),
            assemble(stream, "server to client", segments.get((stream, "server"), [])),
            syns.get(stream),
        )
    return conversations


# --- HTTP/1.1 and server-sent events ----------------------------------------------------------------


@dataclass
class WireEvent:
    time: float
    data: bytes
    content: bool
    done: bool


@dataclass
class WireRequest:
    method: str
    target: str
    time: float  # the packet that carried its first byte


@dataclass
class WireResponse:
    status: int
    head_time: float  # the packet that completed its head
    complete: bool
    events: list[WireEvent]


@dataclass
class Exchange:
    stream: int
    request: WireRequest
    response: WireResponse | None
    syn: float | None = None  # the connection's SYN, for the first exchange of a new connection

    @property
    def content_times(self) -> list[float]:
        if self.response is None:
            return []
        return [event.time for event in self.response.events if event.content]

    @property
    def ttft(self) -> float | None:
        times = self.content_times
        return times[0] - self.request.time if times else None


def parse_head(data: bytes, start: int) -> tuple[str, dict[str, str], int] | None:
    """(first line, lower-cased headers, offset after the blank line) of a head at `start`."""
    end = data.find(b"\r\n\r\n", start)
    if end < 0:
        return None
    lines = data[start:end].decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return lines[0], headers, end + 4


def read_body(stream: ByteStream, start: int, headers: dict[str, str]) -> tuple[bytes, array, int, bool]:
    """(body, per-byte times, offset after it, complete) for a message whose head ends at `start`."""
    data = stream.data
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return dechunk(stream, start)
    if "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise CaptureError(f"Content-Length {headers['content-length']!r} is not a number") from None
        end = start + length
        return data[start:end], stream.times[start:end], min(end, len(data)), end <= len(data)
    return data[start:], stream.times[start:], len(data), False


def dechunk(stream: ByteStream, start: int) -> tuple[bytes, array, int, bool]:
    """A chunked body: its data with each byte's time, the offset after the last chunk's trailers."""
    data, pos = stream.data, start
    body = bytearray()
    times = array("d")
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return bytes(body), times, len(data), False
        try:
            size = int(data[pos:line_end].split(b";")[0].strip(), 16)
        except ValueError:
            raise CaptureError(f"a chunk-size line is not hex: {data[pos:line_end][:40]!r}") from None
        pos = line_end + 2
        if size == 0:
            while True:  # trailers, up to an empty line
                line_end = data.find(b"\r\n", pos)
                if line_end < 0:
                    return bytes(body), times, len(data), False
                empty = line_end == pos
                pos = line_end + 2
                if empty:
                    return bytes(body), times, pos, True
        body += data[pos : pos + size]
        times.extend(stream.times[pos : pos + size])
        if pos + size > len(data):
            return bytes(body), times, len(data), False
        pos += size + 2


def sse_events(body: bytes, times: Sequence[float]) -> list[WireEvent]:
    """The body's server-sent events as llmstack.sse.iter_sse_data splits them (CRLF as LF, an
    empty line ends an event), each at the time of the byte that completed it."""
    if b"\r\n" in body:
        kept = [i for i in range(len(body)) if not (body[i] == 13 and body[i + 1 : i + 2] == b"\n")]
        body = bytes(body[i] for i in kept)
        times = [times[i] for i in kept]
    events: list[WireEvent] = []
    pos = 0
    while True:
        end = body.find(b"\n\n", pos)
        if end < 0:
            break
        add_event(events, body[pos:end], times[end + 1])
        pos = end + 2
    if body[pos:].strip():
        add_event(events, body[pos:], times[len(body) - 1])
    return events


def add_event(events: list[WireEvent], text: bytes, when: float) -> None:
    payload = event_data(text)
    if payload is None:
        return
    if any(event.done for event in events):
        return  # the client ignores what follows [DONE]
    if payload.strip() == b"[DONE]":
        events.append(WireEvent(when, payload, False, True))
        return
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = None
    content = isinstance(parsed, dict) and bool(chunk_text(parsed))
    events.append(WireEvent(when, payload, content, False))


def parse_exchanges(conversation: Conversation) -> list[Exchange]:
    """The stream's requests in order, each with its response (None where the capture ends first)."""
    requests: list[WireRequest] = []
    client, pos = conversation.client, 0
    while pos < len(client):
        head = parse_head(client.data, pos)
        if head is None:
            break
        line, headers, body_start = head
        method, _, rest = line.partition(" ")
        requests.append(WireRequest(method, rest.rpartition(" ")[0] or rest, client.times[pos]))
        pos = read_body(client, body_start, headers)[2]
    responses: list[WireResponse] = []
    server, pos = conversation.server, 0
    while pos < len(server) and len(responses) < len(requests):
        head = parse_head(server.data, pos)
        if head is None:
            break
        line, headers, body_start = head
        try:
            status = int(line.split(" ")[1])
        except (IndexError, ValueError):
            raise CaptureError(f"TCP stream {conversation.stream}: not an HTTP status line: {line[:60]!r}") from None
        if 100 <= status < 200:  # 100 Continue: the real response follows
            pos = body_start
            continue
        body, times, pos, complete = read_body(server, body_start, headers)
        # A client that closes as soon as it has [DONE] may leave the empty last chunk unsent: the
        # events it read are all there.
        complete = complete or b"data: [DONE]" in body
        responses.append(WireResponse(status, server.times[body_start - 1], complete, sse_events(body, times)))
    return [
        Exchange(
            conversation.stream,
            request,
            responses[i] if i < len(responses) else None,
            conversation.syn if i == 0 else None,
        )
        for i, request in enumerate(requests)
    ]


def completion_exchanges(conversations: dict[int, Conversation], endpoint: str = COMPLETIONS) -> list[Exchange]:
    """Every POST to the completions endpoint in the capture, by the time of its first packet."""
    found = [
        exchange
        for conversation in conversations.values()
        for exchange in parse_exchanges(conversation)
        if exchange.request.method == "POST" and urllib.parse.urlsplit(exchange.request.target).path.endswith(endpoint)
    ]
    return sorted(found, key=lambda exchange: exchange.request.time)


def match(records: list[RequestRecord], exchanges: list[Exchange]) -> list[tuple[RequestRecord, Exchange]]:
    """The client's records and the capture's exchanges, both in order of their start."""
    ordered = sorted(records, key=lambda record: record.started_wall)
    if len(ordered) != len(exchanges):
        raise CaptureError(
            f"the capture holds {len(exchanges)} completion exchanges, the client sent {len(ordered)} "
            "(packets dropped, another client on the port, or the wrong --interface?)"
        )
    pairs = list(zip(ordered, exchanges, strict=True))
    for number, (record, exchange) in enumerate(pairs, 1):
        offset = exchange.request.time - record.started_wall
        if abs(offset) > MATCH_TOLERANCE_S:
            raise CaptureError(
                f"request {number}: its first packet is {offset * 1000:+.1f} ms from the client's start "
                f"(more than {MATCH_TOLERANCE_S:g} s: not the same request, or a clock step)"
            )
        if exchange.response is None or not exchange.response.complete:
            raise CaptureError(f"request {number} (TCP stream {exchange.stream}): the capture ends inside its response")
        if exchange.response.status != 200:
            raise CaptureError(f"request {number}: the capture shows HTTP {exchange.response.status}")
    return pairs


# --- the comparison ---------------------------------------------------------------------------------


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def request_row(number: int, record: RequestRecord, exchange: Exchange) -> dict[str, Any]:
    """One request's client-vs-wire figures, in ms."""
    wire_times = exchange.content_times
    client_times = [record.started_wall + offset for offset in record.chunk_offsets]
    paired = list(zip(client_times, wire_times, strict=False))
    lags = [(client - wire) * 1000 for client, wire in paired]
    wire_gaps = [(b - a) * 1000 for a, b in itertools.pairwise(wire_times)]
    client_gaps = [gap * 1000 for gap in record.chunk_gaps]
    gap_diffs = [c - w for c, w in zip(client_gaps, wire_gaps, strict=False)][: max(len(paired) - 1, 0)]
    wire_ttft = exchange.ttft
    return {
        "request": number,
        "tcp_stream": exchange.stream,
        "started_wall": record.started_wall,
        "client_ttft_ms": ms(record.ttft),
        "wire_ttft_ms": ms(wire_ttft),
        "ttft_diff_ms": ms(record.ttft - wire_ttft) if record.ttft is not None and wire_ttft is not None else None,
        "send_lag_ms": ms(exchange.request.time - record.started_wall),
        "new_connection": exchange.syn is not None,
        "connect_ms": ms(exchange.request.time - exchange.syn) if exchange.syn is not None else None,
        "read_lag_ms": lags[0] if lags else None,
        "client_events": len(client_times),
        "wire_events": len(wire_times),
        "output_tokens": record.output_tokens,
        "event_lags_ms": lags,
        "gap_diffs_ms": gap_diffs,
        "wire_gaps_ms": wire_gaps,
    }


def figures(values: list[float]) -> dict[str, float | int | None]:
    s = spread(values)
    absolute = spread(abs(v) for v in values)
    return {"n": s.n, "mean": s.mean, "min": s.min, "p50": s.p50, "p99": s.p99, "max": s.max, "abs_p99": absolute.p99}


SUMMARY_ROWS = (  # (key, label, row key or list key, whether the target applies)
    ("ttft_diff_ms", "client TTFT - wire TTFT", True),
    ("event_lag_ms", "client arrival - packet, every content event", True),
    ("gap_diff_ms", "client inter-token gap - wire gap", True),
    ("send_lag_ms", "request's first packet - client start", False),
    ("read_lag_ms", "client arrival - packet, first content event", False),
)


def summarize(rows: list[dict], vllm: dict | None = None) -> dict[str, Any]:
    """p50/p99/max of each difference, the 0.5 ms p99 verdicts and the three-way TTFT means."""
    values: dict[str, list[float]] = {
        "ttft_diff_ms": [r["ttft_diff_ms"] for r in rows if r["ttft_diff_ms"] is not None],
        "event_lag_ms": [lag for r in rows for lag in r["event_lags_ms"]],
        "gap_diff_ms": [gap for r in rows for gap in r["gap_diffs_ms"]],
        "send_lag_ms": [r["send_lag_ms"] for r in rows if r["send_lag_ms"] is not None],
        "read_lag_ms": [r["read_lag_ms"] for r in rows if r["read_lag_ms"] is not None],
    }
    summary: dict[str, Any] = {key: figures(values[key]) for key, _, _ in SUMMARY_ROWS}
    summary["targets"] = [
        {
            "target": f"{label}: |p99| <= {TARGET_P99_MS} ms",
            "value": summary[key]["abs_p99"],
            "verdict": verdict(summary[key]["abs_p99"], TARGET_P99_MS),
        }
        for key, label, applies in SUMMARY_ROWS
        if applies
    ]
    summary["requests_with_event_count_mismatch"] = sum(r["client_events"] != r["wire_events"] for r in rows)
    summary["new_connections"] = sum(bool(r.get("new_connection")) for r in rows)
    connects = [r["connect_ms"] for r in rows if r.get("connect_ms") is not None]
    client = spread(r["client_ttft_ms"] for r in rows if r["client_ttft_ms"] is not None).mean
    wire = spread(r["wire_ttft_ms"] for r in rows if r["wire_ttft_ms"] is not None).mean
    server = (vllm or {}).get("ttft_mean_ms")
    summary["ttft_means_ms"] = {
        "vllm": server,
        "vllm_requests": (vllm or {}).get("requests"),
        "wire": wire,
        "client": client,
        "before_gateway_socket": wire - server if wire is not None and server is not None else None,
        "client_late": client - wire if client is not None and wire is not None else None,
        "client_sending": summary["send_lag_ms"]["mean"],
        "client_connecting": spread(connects).mean,
        "client_reading": summary["read_lag_ms"]["mean"],
    }
    return summary


# --- report -----------------------------------------------------------------------------------------


def render(result: dict) -> str:
    env, settings = result["environment"], result["settings"]
    head = (
        f"# Packet timing: {env.get('gateway_url')}, captured on {env.get('interface')} "
        f"({env.get('capture_filter') or 'the gateway port'}), {env.get('date')}\n\n"
        f"{len(result.get('requests') or [])} streamed completions of {settings.get('max_tokens')} tokens "
        f"({settings.get('model')}), one at a time; {env.get('packets')} packets with payload, "
        f"tshark {env.get('tshark_version')}. Client minus wire in ms (positive: the client is later)."
    )
    return f"{head}\n\n{tables(result)}"


def tables(result: dict) -> str:
    """The tables alone (the docs' generated block): client minus wire, and the TTFT split."""
    summary = result["summary"]
    differences = md_table(
        ["Difference (ms)", "n", "p50", "p99", "max", "|p99|", f"Target |p99| <= {TARGET_P99_MS}"],
        [
            [
                label,
                str(summary[key]["n"]),
                fmt(summary[key]["p50"], 3, True),
                fmt(summary[key]["p99"], 3, True),
                fmt(summary[key]["max"], 3, True),
                fmt(summary[key]["abs_p99"], 3),
                verdict(summary[key]["abs_p99"], TARGET_P99_MS) if applies else "",
            ]
            for key, label, applies in SUMMARY_ROWS
        ],
    )
    means = summary["ttft_means_ms"]
    split = md_table(
        ["TTFT at 1 client (mean, ms)", "Value"],
        [
            [f"vLLM's histogram ({fmt(means.get('vllm_requests'), 0)} requests)", fmt(means["vllm"], 2)],
            ["wire (gateway port's packets)", fmt(means["wire"], 2)],
            ["client (llmstack.sse)", fmt(means["client"], 2)],
            ["wire - vLLM: before the bytes reach the gateway's socket", fmt(means["before_gateway_socket"], 2, True)],
            ["client - wire: the client", fmt(means["client_late"], 2, True)],
            ["  of which sending (first packet - start)", fmt(means["client_sending"], 2, True)],
            [
                f"    of that, TCP connect: SYN to request ({summary.get('new_connections')} new connections)",
                fmt(means.get("client_connecting"), 2, True),
            ],
            ["  of which reading late (arrival - packet)", fmt(means["client_reading"], 2, True)],
        ],
    )
    parts = [differences, split]
    mismatched = summary.get("requests_with_event_count_mismatch")
    if mismatched:
        parts.append(f"{mismatched} request(s) had a different number of content events on the wire and in the client.")
    return "\n\n".join(parts) + "\n"


def chart(result: dict, path: Path) -> None:
    """Per request, client TTFT against wire TTFT; the spread of the per-event lag and TTFT diff."""
    plt = load_pyplot()
    rows = [r for r in result.get("requests") or [] if r.get("client_ttft_ms") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    wire = [r["wire_ttft_ms"] for r in rows]
    client = [r["client_ttft_ms"] for r in rows]
    left.scatter(wire, client, s=14, alpha=0.7)
    if wire:
        low, high = min(wire + client), max(wire + client)
        left.plot([low, high], [low, high], color="gray", lw=0.8, label="client = wire")
        left.plot([low, high], [low + TARGET_P99_MS, high + TARGET_P99_MS], "r:", lw=0.8, label="+0.5 ms")
        left.legend(fontsize=8)
    left.set(xlabel="wire TTFT (ms)", ylabel="client TTFT (ms)", title="TTFT per request")
    left.grid(alpha=0.3)
    lags = [lag for r in result.get("requests") or [] for lag in r.get("event_lags_ms") or []]
    diffs = [r["ttft_diff_ms"] for r in rows if r.get("ttft_diff_ms") is not None]
    if lags or diffs:
        right.hist([lags, diffs], bins=40, label=["every content event's lag", "TTFT diff"], alpha=0.8)
    right.axvline(TARGET_P99_MS, color="tab:red", ls=":", label=f"{TARGET_P99_MS} ms target")
    right.set(xlabel="client - wire (ms)", ylabel="count", title="Client behind the packets")
    right.set_yscale("log")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    save_chart(plt, fig, path)


# --- the capture ------------------------------------------------------------------------------------


class Capture:
    """tshark writing the port's packets to a pcapng file while the requests run."""

    def __init__(self, tool: str, interface: str | Sequence[str], capture_filter: str, file: Path):
        # Several interfaces: one capture, one clock (hop_timing.py's bridges).
        self.interfaces = [interface] if isinstance(interface, str) else list(interface)
        self.interface = ", ".join(self.interfaces)
        self.tool, self.capture_filter, self.file = tool, capture_filter, file
        self.lines: list[str] = []
        self.started = threading.Event()
        self.process: subprocess.Popen[str] | None = None
        self.reader: threading.Thread | None = None

    def _read(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip())
            if "Capturing on" in line:
                self.started.set()

    def last_line(self) -> str:
        useful = [line for line in self.lines if line and "Running as user" not in line]
        return useful[-1] if useful else "no output"

    def start(self, timeout: float = 20.0) -> None:
        interfaces = [argument for name in self.interfaces for argument in ("-i", name)]
        command = [self.tool, *interfaces, "-f", self.capture_filter, "-w", str(self.file), "-q"]
        try:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        except OSError as err:
            raise CaptureError(
                f"cannot run {self.tool}: {err.strerror} (apt-get install tshark, or --capture-tool)"
            ) from None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + timeout
        while not self.started.wait(0.05):
            if self.process.poll() is not None:
                self.reader.join(2)
                raise CaptureError(
                    f"{self.tool} stopped (exit {self.process.returncode}): {self.last_line()} "
                    "(capturing needs root or the wireshark group)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise CaptureError(f"{self.tool} did not start capturing on {self.interface} in {timeout:.0f} s")
        time.sleep(0.3)  # the filter is set when it says so; a moment more costs nothing

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        time.sleep(0.3)  # the last packets reach the file
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        if self.reader is not None:
            self.reader.join(2)

    def dropped(self) -> int | None:
        """Packets the kernel or tshark dropped, from its closing lines: "N packets dropped ..." per
        interface that dropped any, none where it dropped none (0, once it has said "N packets
        captured"); None when it never said how many it captured."""
        counts = [line.split() for line in self.lines]
        drops = [
            int(w[0])
            for w in counts
            if len(w) >= 3 and w[0].isdigit() and w[1:3] in (["packets", "dropped"], ["packet", "dropped"])
        ]
        if drops:
            return sum(drops)
        captured = any(
            len(w) >= 3 and w[0].isdigit() and w[1] in ("packets", "packet") and w[2] == "captured" for w in counts
        )
        return 0 if captured else None


def read_capture(tool: str, file: Path) -> str:
    """The capture's packets with payload and SYNs, one line each (FIELDS, tab-separated)."""
    command = [tool, "-r", str(file), "-Y", CAPTURE_FILTER, "-T", "fields", "-E", "separator=/t"]
    for name in FIELDS:
        command += ["-e", name]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise CaptureError(f"cannot read the capture {file} with {tool}: {err}") from None
    if result.returncode != 0:
        message = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise CaptureError(f"{tool} could not read {file}: {message}")
    return result.stdout


def tshark_version(tool: str) -> str | None:
    try:
        result = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = (result.stdout.strip().splitlines() or [""])[0]
    return first.split(" ")[2] if first.startswith("TShark (Wireshark)") and len(first.split(" ")) > 2 else first


# --- vLLM's histogram -------------------------------------------------------------------------------


def vllm_snapshot(stack: ComposeStack | HostVllm) -> Snapshot:
    """vLLM's /metrics summed over every replica of the compose stack (or the one URL)."""
    if isinstance(stack, ComposeStack):
        pages = [stack.replica(service).get("/metrics") for service in stack.replicas() or [stack.service]]
        return Snapshot.from_text("\n".join(pages))
    return Snapshot.from_text(stack.get("/metrics"))


def vllm_ttft(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    mean = before.histogram_mean(after, TTFT_HISTOGRAM)
    return {"ttft_mean_ms": ms(mean), "requests": before.delta(after, TTFT_HISTOGRAM + "_count")}


# --- the run ----------------------------------------------------------------------------------------


def gateway_port(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise UsageError(f"--gateway-url must be a plain http:// URL (the capture cannot read TLS), not {url!r}")
    try:
        return parts.port or 80
    except ValueError:
        raise UsageError(f"--gateway-url {url!r} has no valid port") from None


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """The requests a capture times (one at a time through the gateway) and the capture tool:
    this benchmark's and hop_timing.py's."""
    parser.add_argument(
        "--gateway-url",
        default="http://127.0.0.1:8080",
        help="the gateway's plain-HTTP URL, as this host reaches it (default: %(default)s)",
    )
    add_api_key_argument(parser)
    parser.add_argument("--requests", type=int, default=50, help="streamed completions (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens each (default: %(default)s)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt of every request")
    parser.add_argument("--model", help="served model name (default: the first of the gateway's /v1/models)")
    parser.add_argument("--pause", type=float, default=0.2, help="seconds between requests (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="requests before the capture (default: %(default)s)")
    parser.add_argument("--capture-tool", default="tshark", help="tshark's path (default: %(default)s)")
    parser.add_argument("--capture-file", type=Path, help="keep the pcapng here (default: a temporary file)")


def check_request_arguments(args: argparse.Namespace, min_tokens: int, why: str) -> None:
    if args.requests < 1 or args.warmup < 0:
        raise UsageError("--requests must be at least 1 and --warmup not negative")
    if args.max_tokens < min_tokens:
        raise UsageError(f"--max-tokens must be at least {min_tokens} ({why})")
    if args.pause < 0:
        raise UsageError("--pause must not be negative")


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a result file keeps: every option but the key and the output ones."""
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("api_key_file", "json", "output", "chart", "no_chart", "render")
    }


def save_and_print(
    result: dict,
    args: argparse.Namespace,
    name: str,
    chart: Callable[[dict, Path], None],
    render: Callable[[dict], str],
) -> None:
    """The result to --output (default results/NAME.json), its chart beside it, then its tables (or JSON)."""
    output = args.output or results_path(f"{name}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    write_json(output, result)
    if not args.no_chart:
        chart(result, args.chart or output.with_suffix(".png"))
    print(json.dumps(result, indent=2) if args.json else render(result), end="" if not args.json else "\n")
    progress(f"wrote {output}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    add_request_arguments(parser)
    parser.add_argument("--interface", default="lo", help="where tshark captures (default: %(default)s)")
    parser.add_argument(
        "--server-port",
        type=int,
        help="the port whose answers are timed (default: the gateway's); 8000 with --interface on the "
        "stack's backend network times vLLM's own socket",
    )
    parser.add_argument(
        "--capture-filter",
        help="tshark's capture filter (default: tcp port SERVER_PORT); e.g. add 'and (host IP1 or host IP2)' "
        "for the vLLM replicas where the router listens on the same port",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's TTFT histogram (no stack access)")
    add_output_arguments(parser, "packet_timing")
    add_stack_arguments(parser)
    args = parser.parse_args(argv)
    check_request_arguments(args, 2, "inter-token gaps need two tokens")
    args.port = args.server_port or gateway_port(args.gateway_url)
    args.capture_filter = args.capture_filter or f"tcp port {args.port}"
    return args


def send_requests(client: ApiClient, args: argparse.Namespace) -> list[RequestRecord]:
    records = []
    for _ in progress_bar(range(args.requests), "streamed completions"):
        records.append(client.completion(args.model, args.prompt, args.max_tokens, kind="packet-timing"))
        time.sleep(args.pause)
    return records


def ready_client(args: argparse.Namespace, key: str) -> ApiClient:
    """The SSE client on the gateway, --model filled in from /v1/models, --warmup requests sent."""
    client = ApiClient(args.gateway_url, key)
    if not args.model:
        models = client.models()
        if not models:
            raise StackError(f"{args.gateway_url}/v1/models lists no model")
        args.model = models[0]["id"]
    for _ in range(args.warmup):
        client.completion(args.model, args.prompt, args.max_tokens, kind="warmup")
    return client


@dataclass
class CapturedRun:
    records: list[RequestRecord]
    text: str  # read_capture's lines
    dropped: int | None
    before: Snapshot | None  # vLLM's /metrics around the requests (None without the stack)
    after: Snapshot | None
    capture_filter: str
    tshark_version: str

    def environment(self, args: argparse.Namespace) -> dict[str, Any]:
        """What a result file keeps of the capture and the client's host."""
        return {
            **host_environment(),
            "gateway_url": args.gateway_url,
            "capture_filter": self.capture_filter,
            "tshark_version": self.tshark_version,
            "packets": sum(1 for line in self.text.splitlines() if not line.endswith("\t")),
            "packets_dropped": self.dropped,
            "capture_file": str(args.capture_file) if args.capture_file else None,
            "host": platform.node(),
        }


def captured_run(
    args: argparse.Namespace,
    client: ApiClient,
    interface: str | Sequence[str],
    capture_filter: str,
    stack: ComposeStack | HostVllm | None,
    version: str,
) -> CapturedRun:
    """The --requests sent while tshark captures, and the capture read back."""
    with tempfile.TemporaryDirectory(prefix="capture-") as tmp:
        file = args.capture_file or Path(tmp) / "capture.pcapng"
        if args.capture_file:
            file.parent.mkdir(parents=True, exist_ok=True)
        before = vllm_snapshot(stack) if stack is not None else None
        capture = Capture(args.capture_tool, interface, capture_filter, file)
        progress(f"capturing '{capture_filter}' on {capture.interface} ({args.capture_tool})")
        capture.start()
        try:
            records = send_requests(client, args)
        finally:
            capture.stop()
        after = vllm_snapshot(stack) if stack is not None else None
        progress(f"reading {file}")
        text = read_capture(args.capture_tool, file)
        return CapturedRun(records, text, capture.dropped(), before, after, capture_filter, version)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rendered = render_saved_run(argv, chart, render)
    if rendered is not None:
        return rendered
    args = parse_args(argv)
    key = read_key(args.api_key_file)
    if args.vllm_url and not args.vllm_log:
        args.vllm_log = os.devnull  # stack_from_args wants a log; only /metrics is read here
    stack = None if args.no_vllm else stack_from_args(args)
    version = tshark_version(args.capture_tool)
    if version is None:
        raise CaptureError(f"cannot run {args.capture_tool} (apt-get install tshark, or --capture-tool)")
    client = ready_client(args, key)
    run = captured_run(args, client, args.interface, args.capture_filter, stack, version)
    text, records, before, after = run.text, run.records, run.before, run.after
    conversations = parse_fields(text, args.port)
    pairs = match(records, completion_exchanges(conversations))
    rows = [request_row(number, record, exchange) for number, (record, exchange) in enumerate(pairs, 1)]
    vllm = vllm_ttft(before, after) if before is not None and after is not None else None
    result = {
        "command": "python3 benchmarks/packet_timing.py " + shlex.join(argv),
        "environment": {
            **run.environment(args),
            "interface": args.interface,
            "server_port": args.port,
            "tcp_streams": len(conversations),
            "vllm": None if stack is None else (args.vllm_url or "compose stack"),
        },
        "settings": run_settings(args),
        "vllm": vllm,
        "summary": summarize(rows, vllm),
        "requests": rows,
    }
    save_and_print(result, args, "packet_timing", chart, render)
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
