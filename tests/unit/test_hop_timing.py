"""The hop-timing benchmark without a capture: made-up exchanges on each hop (as packet_timing's
reader would give them) assigned to the client's requests, each request's segments, the summary
against vLLM's histogram, the tables again from a saved run, and the command line's one-line errors."""

from __future__ import annotations

import json

import pytest

from llmstack.bench import hop_timing
from llmstack.bench.packet_timing import (
    ByteStream,
    CaptureError,
    Conversation,
    Exchange,
    WireEvent,
    WireRequest,
    WireResponse,
)
from llmstack.cli import run
from llmstack.sse import COMPLETIONS, RequestRecord


def exchange(sent: float, first_token: float | None, target: str = COMPLETIONS, stream: int = 1) -> Exchange:
    """A POST sent at `sent`, answered 200 (head 1 ms later), its first content event at first_token."""
    events = [] if first_token is None else [WireEvent(first_token, b"{}", True, False)]
    return Exchange(stream, WireRequest("POST", target, sent), WireResponse(200, sent + 0.001, True, events))


def record(started_wall: float, ttft: float) -> RequestRecord:
    return RequestRecord(
        kind="hop-timing",
        endpoint=COMPLETIONS,
        streamed=True,
        started=5.0,
        started_wall=started_wall,
        e2e=0.2,
        ttft=ttft,
        output_tokens=2,
        chunk_offsets=[ttft, ttft + 0.002],
    )


def one_request(start: float) -> tuple[RequestRecord, Exchange, list[Exchange], list[Exchange]]:
    """A request whose way is: nginx in +1 ms, to router +2, render calls to two replicas +3 (answered
    +7 and +9), to vLLM +10, vLLM's first token +22, router's +23, nginx's +24, client's +26 (ms)."""
    at = lambda ms: start + ms / 1000  # noqa: E731
    gateway = exchange(at(1), at(24), stream=10)
    upstream = [exchange(at(2), at(23), stream=20), exchange(at(10), at(22), stream=30)]
    renders = [
        Exchange(31, WireRequest("POST", hop_timing.RENDER, at(3)), WireResponse(200, at(7), True, [])),
        Exchange(32, WireRequest("POST", hop_timing.RENDER, at(3.5)), WireResponse(200, at(9), True, [])),
    ]
    return record(start, 0.026), gateway, upstream, renders


def test_each_request_gets_its_hops_and_segments():
    first, second = one_request(100.0), one_request(100.5)
    hops = hop_timing.assign([first[1], second[1]], first[2] + second[2], first[3] + second[3])
    assert [len(h.renders) for h in hops] == [2, 2]
    assert hops[1].to_router is second[2][0] and hops[1].to_vllm is second[2][1]
    row = hop_timing.request_row(1, first[0], hops[0])
    expected = {
        "client_to_nginx_ms": 1,
        "nginx_ms": 1,
        "router_before_vllm_ms": 8,
        "render_ms": 6,
        "vllm_ms": 12,
        "router_after_vllm_ms": 1,
        "nginx_after_ms": 1,
        "client_read_ms": 2,
    }
    assert {key: round(row[key], 6) for key in expected} == expected
    assert row["render_calls"] == 2 and round(row["client_ttft_ms"], 6) == 26
    # The segments add up to the client's TTFT.
    assert round(sum(row[key] for key, _ in hop_timing.SEGMENTS), 6) == 26


def test_a_request_without_render_calls_has_no_render_segment():
    rec, gateway, upstream, _ = one_request(100.0)
    row = hop_timing.request_row(1, rec, hop_timing.assign([gateway], upstream, [])[0])
    assert row["render_ms"] is None and row["render_calls"] == 0 and round(row["vllm_ms"], 6) == 12


@pytest.mark.parametrize("upstream_count", [1, 3])
def test_anything_but_two_upstream_requests_per_request_is_an_error(upstream_count):
    _rec, gateway, upstream, renders = one_request(100.0)
    legs = ([*upstream, exchange(100.015, 100.03, stream=40)])[:upstream_count]
    with pytest.raises(CaptureError, match=f"request 1: {upstream_count} completion requests on the upstream port"):
        hop_timing.assign([gateway], legs, renders)


def test_an_upstream_response_without_a_token_is_an_error():
    _rec, gateway, upstream, renders = one_request(100.0)
    upstream[1] = exchange(100.010, None, stream=30)
    with pytest.raises(CaptureError, match="request 1 \\(TCP stream 30\\): a response without a token"):
        hop_timing.assign([gateway], upstream, renders)


def test_a_gateway_response_without_a_token_is_an_error_not_a_traceback():
    _rec, _gateway, upstream, renders = one_request(100.0)
    with pytest.raises(CaptureError, match="request 1 \\(TCP stream 10\\): a response without a token"):
        hop_timing.assign([exchange(100.001, None, stream=10)], upstream, renders)


def test_streams_caught_in_the_middle_of_an_answer_are_left_out():
    whole = Conversation(1, ByteStream(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"), ByteStream(b"HTTP/1.1 200 OK\r\n"))
    cut = Conversation(2, ByteStream(b"ics HTTP/1.1\r\n\r\n"), ByteStream(b"vllm:num_requests_running 0\n"))
    assert list(hop_timing.from_their_start({1: whole, 2: cut})) == [1]


def saved_result() -> dict:
    rec, gateway, upstream, renders = one_request(100.0)
    rows = [hop_timing.request_row(1, rec, hop_timing.assign([gateway], upstream, renders)[0])]
    return {
        "command": "python3 benchmarks/hop_timing.py",
        "environment": {"gateway_url": "http://127.0.0.1:8080", "interfaces": ["br-a", "br-b"], "packets": 40},
        "settings": {"max_tokens": 2, "model": "m"},
        "vllm": {"ttft_mean_ms": 11.0, "requests": 1},
        "summary": hop_timing.summarize(rows, {"ttft_mean_ms": 11.0, "requests": 1}),
        "requests": rows,
    }


def test_the_summary_sets_vllm_on_the_wire_against_its_histogram():
    summary = saved_result()["summary"]
    assert round(summary["vllm_outside_hist_ms"], 6) == 1 and summary["requests_with_render"] == 1


def test_render_prints_the_tables_again(tmp_path, capsys):
    path = tmp_path / "hop_timing.json"
    path.write_text(json.dumps(saved_result()))
    assert run(hop_timing.PROG, hop_timing.main, ["--render", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| vLLM: request in to first token out | 1 | 12.00 |" in out
    assert "| outside the histogram (API server, mostly) | +1.00 |" in out
    assert path.with_suffix(".png").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "0"], "--requests must be at least 1"),
        (["--gateway-port", "8000"], "--gateway-port and --upstream-port must differ"),
        (["--vllm-url", "http://127.0.0.1:8000"], "needs the compose stack"),
        (["--gateway-url", "https://127.0.0.1:8443"], "must be a plain http:// URL"),
        (["--render", "/nonexistent.json"], "--render /nonexistent.json: "),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert run(hop_timing.PROG, hop_timing.main, args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hop_timing.py: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_capture_tool_is_exit_1_before_any_request(tmp_path, capsys):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    args = [
        "--api-key-file",
        str(key),
        "--capture-tool",
        str(tmp_path / "tshark"),
        "--gateway-url",
        "http://127.0.0.1:9",
    ]
    assert run(hop_timing.PROG, hop_timing.main, args) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hop_timing.py: error: cannot run {tmp_path / 'tshark'} (apt-get install tshark, or --capture-tool)"
    ]
