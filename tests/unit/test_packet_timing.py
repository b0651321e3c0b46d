"""The packet-timing benchmark without a capture: tshark's field lines made up here, cut in awkward
places (a chunk-size line split, an event over two packets, a retransmission, a request over two
packets), read back into exchanges, SSE events and wire TTFT, matched to the client's records; the
summary's verdicts; and its command line's one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmstack.bench import packet_timing
from llmstack.bench.packet_timing import CaptureError
from llmstack.cli import run
from llmstack.sse import COMPLETIONS, RequestRecord
from llmstack.stats import percentile

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER, CLIENT = 8080, 50000
UNREACHABLE = ("--gateway-url", "http://127.0.0.1:9", "--no-vllm")


class Wire:
    """tshark's `-T fields` lines for one made-up capture; seq numbers kept per stream and side."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.seq: dict[tuple[int, str], int] = {}

    def send(self, t: float, side: str, payload: bytes, stream: int = 0, seq: int | None = None) -> int:
        """One packet from `side` ("client" or "server"); returns its seq (for a retransmission)."""
        key = (stream, side)
        at = self.seq.get(key, 1) if seq is None else seq
        if seq is None:
            self.seq[key] = at + len(payload)
        src, dst = (SERVER, CLIENT + stream) if side == "server" else (CLIENT + stream, SERVER)
        self.lines.append(f"{len(self.lines) + 1}\t{t:.9f}\t{stream}\t{src}\t{dst}\t{at}\t{payload.hex()}")
        return at

    def syn(self, t: float, stream: int = 0) -> None:
        self.lines.append(f"{len(self.lines) + 1}\t{t:.9f}\t{stream}\t{CLIENT + stream}\t{SERVER}\t0\t")

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def event(text: str | None = None, usage: bool = False) -> bytes:
    payload: dict = {"choices": [{"text": text or ""}]}
    if usage:
        payload = {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


REQUEST_BODY = b'{"model": "m", "stream": true}'
REQUEST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Length: %d\r\n\r\n" % len(
    REQUEST_BODY
)
RESPONSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
DONE = chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def two_exchanges() -> Wire:
    """Two keep-alive exchanges on stream 0 (the first opens the connection), and a GET on stream 1."""
    wire = Wire()
    wire.syn(100.0000)
    wire.send(100.0010, "client", REQUEST_HEAD + REQUEST_BODY)
    # Response 1: the role chunk (no text), then "Hi" whose chunk-size line and data are cut up.
    first, hi = chunk(event()), chunk(event("Hi"))
    cut = hi.index(b"\r\n") - 1  # inside the chunk-size line
    middle = hi.index(b"Hi")  # inside the event
    wire.send(100.0200, "server", RESPONSE_HEAD + first + hi[:cut])
    wire.send(100.0300, "server", hi[cut:middle])
    wire.send(100.0400, "server", hi[middle:])  # completes "Hi": wire TTFT 39 ms
    there = chunk(event(" there"))
    seq = wire.send(100.0500, "server", there)
    wire.send(100.0520, "server", there, seq=seq)  # a retransmission: counts at its first sighting
    wire.send(100.0600, "server", chunk(event(usage=True)) + DONE)
    # Exchange 2, same connection: the request's head and body in two packets.
    wire.send(101.0000, "client", REQUEST_HEAD)
    wire.send(101.0004, "client", REQUEST_BODY)
    wire.send(101.0100, "server", RESPONSE_HEAD)
    # "A"'s event ends in the next chunk, a packet later; "B" uses CRLF line ends.
    a = event("A")
    wire.send(101.0300, "server", chunk(a[:-1]))
    wire.send(101.0350, "server", chunk(a[-1:]))
    wire.send(101.0450, "server", chunk(event("B").replace(b"\n", b"\r\n")) + DONE)
    # Another client's GET on its own connection: not a completion.
    wire.send(100.5000, "client", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", stream=1)
    wire.send(100.5100, "server", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", stream=1)
    return wire


def record(started_wall: float, offsets: list[float]) -> RequestRecord:
    return RequestRecord(
        kind="packet-timing",
        endpoint=COMPLETIONS,
        streamed=True,
        started=5.0,
        started_wall=started_wall,
        e2e=0.07,
        ttft=offsets[0],
        output_tokens=len(offsets),
        chunk_offsets=offsets,
    )


def test_keep_alive_exchanges_are_rebuilt_from_awkwardly_cut_packets():
    conversations = packet_timing.parse_fields(two_exchanges().text, SERVER)
    assert sorted(conversations) == [0, 1]
    assert conversations[0].syn == pytest.approx(100.0)
    exchanges = packet_timing.completion_exchanges(conversations)
    assert [e.request.time for e in exchanges] == pytest.approx([100.001, 101.0])
    first, second = exchanges
    assert first.syn == pytest.approx(100.0) and second.syn is None  # the connection is reused
    assert first.response is not None and first.response.complete and first.response.status == 200
    events = first.response.events
    # role chunk, "Hi", " there", usage, [DONE]: content only where chunk_text is not empty
    assert [e.content for e in events] == [False, True, True, False, False] and events[-1].done
    assert [e.time for e in events] == pytest.approx([100.02, 100.04, 100.05, 100.06, 100.06])
    assert first.content_times == pytest.approx([100.04, 100.05])
    assert first.ttft == pytest.approx(0.039)
    assert second.content_times == pytest.approx([101.035, 101.045])
    assert second.ttft == pytest.approx(0.035)


def test_a_byte_is_readable_only_once_every_earlier_byte_is():
    # The second segment arrives first; then a retransmission of the first with more bytes.
    stream = packet_timing.assemble(
        0, "server to client", [(2, 4, 1.0, b"def"), (3, 1, 2.0, b"abc"), (4, 1, 3.0, b"abcdefgh")]
    )
    assert stream.data == b"abcdefgh"
    assert list(stream.times) == [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0]


def test_missing_bytes_are_a_clear_error():
    wire = Wire()
    wire.send(1.0, "client", REQUEST_HEAD)
    wire.send(1.1, "client", REQUEST_BODY, seq=1 + len(REQUEST_HEAD) + 5)
    with pytest.raises(CaptureError, match=r"TCP stream 0 \(client to server\): 5 bytes missing"):
        packet_timing.parse_fields(wire.text, SERVER)


def test_exchanges_match_records_in_start_order_and_compare():
    exchanges = packet_timing.completion_exchanges(packet_timing.parse_fields(two_exchanges().text, SERVER))
    early = record(100.0005, [0.0402, 0.0500])  # 0.5 ms to send; "Hi" read 0.2 ms late, " there" 0 ms
    late = record(100.9990, [0.0370, 0.0470])  # 1 ms to send; 1.0 and 1.0 ms late
    pairs = packet_timing.match([late, early], exchanges)  # any order in, start order out
    assert [r for r, _ in pairs] == [early, late]
    rows = [packet_timing.request_row(n, r, e) for n, (r, e) in enumerate(pairs, 1)]
    one, two = rows
    assert one["wire_ttft_ms"] == pytest.approx(39.0) and one["client_ttft_ms"] == pytest.approx(40.2)
    assert one["ttft_diff_ms"] == pytest.approx(1.2)
    assert one["send_lag_ms"] == pytest.approx(0.5) and one["read_lag_ms"] == pytest.approx(0.7)
    assert one["ttft_diff_ms"] == pytest.approx(one["send_lag_ms"] + one["read_lag_ms"])
    assert one["new_connection"] and one["connect_ms"] == pytest.approx(1.0)
    assert one["event_lags_ms"] == pytest.approx([0.7, 0.5])
    assert one["wire_gaps_ms"] == pytest.approx([10.0]) and one["gap_diffs_ms"] == pytest.approx([-0.2])
    assert not two["new_connection"] and two["connect_ms"] is None
    assert two["ttft_diff_ms"] == pytest.approx(2.0) and two["event_lags_ms"] == pytest.approx([1.0, 1.0])
    assert one["client_events"] == one["wire_events"] == 2


def test_counts_that_do_not_match_are_an_error():
    exchanges = packet_timing.completion_exchanges(packet_timing.parse_fields(two_exchanges().text, SERVER))
    records = [record(100.0005, [0.04]), record(100.9990, [0.04]), record(102.0, [0.04])]
    with pytest.raises(CaptureError, match="holds 2 completion exchanges, the client sent 3"):
        packet_timing.match(records, exchanges)
    with pytest.raises(CaptureError, match="request 2: its first packet is"):
        packet_timing.match([record(100.0005, [0.04]), record(200.0, [0.04])], exchanges)


def test_a_capture_that_ends_inside_a_response_is_an_error():
    wire = Wire()
    wire.send(1.0, "client", REQUEST_HEAD + REQUEST_BODY)
    wire.send(1.01, "server", RESPONSE_HEAD + chunk(event("x")))
    exchanges = packet_timing.completion_exchanges(packet_timing.parse_fields(wire.text, SERVER))
    with pytest.raises(CaptureError, match="ends inside its response"):
        packet_timing.match([record(1.0, [0.011])], exchanges)


def row(ttft_diff: float, lags: list[float], gaps: list[float]) -> dict:
    return {
        "client_ttft_ms": 40.0 + ttft_diff,
        "wire_ttft_ms": 40.0,
        "ttft_diff_ms": ttft_diff,
        "send_lag_ms": ttft_diff - lags[0],
        "read_lag_ms": lags[0],
        "new_connection": True,
        "connect_ms": 0.1,
        "client_events": len(lags),
        "wire_events": len(lags),
        "event_lags_ms": lags,
        "gap_diffs_ms": gaps,
    }


def test_summary_percentiles_and_the_half_millisecond_verdict():
    rows = [row(0.2 + i / 100, [0.1, 0.05], [-0.05]) for i in range(20)] + [row(3.0, [0.1, 0.1], [0.0])]
    summary = packet_timing.summarize(rows, {"ttft_mean_ms": 30.0, "requests": 21.0})
    diffs = [r["ttft_diff_ms"] for r in rows]
    assert summary["ttft_diff_ms"]["p99"] == pytest.approx(percentile(diffs, 99))
    assert summary["ttft_diff_ms"]["p50"] == pytest.approx(percentile(diffs, 50))
    assert summary["ttft_diff_ms"]["max"] == pytest.approx(3.0) and summary["event_lag_ms"]["n"] == 42
    verdicts = {t["target"].split(":")[0]: t["verdict"] for t in summary["targets"]}
    assert verdicts == {
        "client TTFT - wire TTFT": "MISSED",
        "client arrival - packet, every content event": "met",
        "client inter-token gap - wire gap": "met",  # |p99| of signed gaps
    }
    means = summary["ttft_means_ms"]
    assert means["wire"] == pytest.approx(40.0) and means["vllm"] == 30.0
    assert means["before_gateway_socket"] == pytest.approx(10.0)
    assert means["client_late"] == pytest.approx(means["client"] - 40.0)
    assert summary["new_connections"] == 21 and summary["requests_with_event_count_mismatch"] == 0
    met = packet_timing.summarize([row(0.3, [0.1], [])], None)
    assert met["targets"][0]["verdict"] == "met" and met["ttft_means_ms"]["before_gateway_socket"] is None


def saved_result(rows: list[dict]) -> dict:
    return {
        "command": "python3 benchmarks/packet_timing.py",
        "environment": {"gateway_url": "http://127.0.0.1:8080", "interface": "lo", "packets": 10},
        "settings": {"max_tokens": 2, "model": "m"},
        "vllm": None,
        "summary": packet_timing.summarize(rows, None),
        "requests": rows,
    }


def test_render_prints_the_tables_again(tmp_path, capsys):
    path = tmp_path / "packet_timing.json"
    path.write_text(json.dumps(saved_result([row(0.3, [0.1, 0.2], [0.1])])))
    assert run(packet_timing.PROG, packet_timing.main, ["--render", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| client TTFT - wire TTFT | 1 | +0.300 |" in out and "before the bytes reach" in out
    assert path.with_suffix(".png").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--api-key-file", "/nonexistent"], "--api-key-file /nonexistent: No such file"),
        (["--requests", "0"], "--requests must be at least 1"),
        (["--max-tokens", "1"], "--max-tokens must be at least 2"),
        (["--gateway-url", "https://127.0.0.1:8443"], "must be a plain http:// URL"),
        (["--render", "/nonexistent.json"], "--render /nonexistent.json: "),
        (["--render"], "--render takes the path"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert run(packet_timing.PROG, packet_timing.main, args) == 2
    err = capsys.readouterr().err
    assert err.startswith("packet_timing.py: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_capture_tool_is_exit_1_before_any_request(tmp_path, capsys):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    args = ["--api-key-file", str(key), "--model", "m", "--no-vllm", "--capture-tool", str(tmp_path / "tshark")]
    args += ["--gateway-url", "http://127.0.0.1:9", "--output", str(tmp_path / "r.json")]
    assert run(packet_timing.PROG, packet_timing.main, args) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"packet_timing.py: error: cannot run {tmp_path / 'tshark'} (apt-get install tshark, or --capture-tool)"
    ]


def test_the_entry_point_reports_an_unreachable_gateway_in_one_line(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks/packet_timing.py"), "--api-key-file", str(key), *UNREACHABLE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("packet_timing.py: error: cannot reach http://127.0.0.1:9")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "closing, dropped",
    [
        (["1234 packets captured"], 0),
        (["1 packet captured"], 0),
        (["1234 packets captured", "7 packets dropped from br-1", "2 packets dropped from br-2"], 9),
        (["tshark: interrupted"], None),
    ],
)
def test_dropped_packets_are_read_from_tsharks_closing_lines(tmp_path, closing, dropped):
    capture = packet_timing.Capture("tshark", ["br-1", "br-2"], "tcp", tmp_path / "c.pcapng")
    capture.lines = ["Capturing on 'br-1' and 'br-2'", *closing]
    assert capture.dropped() == dropped
