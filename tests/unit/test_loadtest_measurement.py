"""The load generator's measurement logic: SSE parsing, timing, usage, precision, steps, tables."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import requests

from llmstack.promtext import Snapshot
from llmstack.sse import COMPLETIONS, RequestRecord, build_body, chunk_text, iter_sse_data, send
from llmstack.stats import first_wave_split, mean_in_flight_by_part, percentile, percentiles
from loadtest import distributed, report, results
from loadtest.buckets import precise_bucket
from loadtest.settings import Settings, SettingsError, parse_levels, read_keys
from loadtest.step_state import (
    StepState,
    StepWindow,
    TicketDraw,
    TicketPool,
    max_overlap,
    may_ask_ahead,
    samples_in_step,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_sse_events_split_across_network_chunks():
    chunks = [b'data: {"a"', b': 1}\n\ndata: {"a": 2}\n', b"\ndata: [DONE]\n\n"]
    payloads = [data for _, data in iter_sse_data(chunks)]
    assert payloads == [b'{"a": 1}', b'{"a": 2}', b"[DONE]"]


def test_sse_crlf_and_comments():
    payloads = [data for _, data in iter_sse_data([b": keep-alive\r\n\r\ndata: x\r\n\r\n"])]
    assert payloads == [b"x"]


def test_chunk_text_ignores_role_only_chat_chunks():
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "Hi"}}]}) == "Hi"
    assert chunk_text({"choices": [{"text": "yo"}]}) == "yo"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_body_asks_for_usage_and_fixed_length():
    body = build_body(COMPLETIONS, "m", "p", None, 50, stream=True)
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 50


def test_tpot_uses_usage_tokens_not_chunks():
    record = RequestRecord(
        "k", COMPLETIONS, True, 0.0, 0.0, e2e=0.5, ttft=0.1, output_tokens=41, chunk_offsets=[0.1, 0.3, 0.5]
    )
    assert record.tpot == pytest.approx(0.01)
    assert record.chunk_gaps == pytest.approx([0.2, 0.2])


def test_precise_bucket_keeps_single_digit_milliseconds():
    assert precise_bucket(1.634) == 1.63
    assert precise_bucket(12.34) == 12.3
    assert precise_bucket(1234.5) == 1230.0


def streamed(ttft: float, e2e: float, step: int = 1) -> RequestRecord:
    return RequestRecord(
        "stream-completion",
        COMPLETIONS,
        True,
        started=1.0,
        started_wall=0.0,
        e2e=e2e,
        ttft=ttft,
        output_tokens=11,
        chunk_offsets=[ttft, e2e],
        step=step,
    )


def test_the_tables_take_their_percentiles_from_llmstack_stats():
    """The one percentile: a level's p50/p90/p99 are llmstack.stats.percentile of the raw values,
    interpolated (nearest rank would give 40 ms for p90 of these ten)."""
    ttfts = [0.001 * x for x in (5, 1, 9, 3, 7, 2, 8, 4, 6, 40)]
    records = [streamed(ttft, ttft + 0.1) for ttft in ttfts]
    for index, record in enumerate(records):
        record.started += index  # one after another, as one client sends them
    row = results.concurrency_row(1, records, 11, [], [])
    for q in (50, 90, 99):
        assert row["ttft_ms"][f"p{q}"] == pytest.approx(percentile(ttfts, q) * 1000)
    assert row["ttft_ms"]["p90"] == pytest.approx(12.1)
    assert row["ttft_ms_deciles"] == pytest.approx([percentile(ttfts, q) * 1000 for q in range(10, 100, 10)])
    assert row["ttft_ms_deciles"][-1] == pytest.approx(row["ttft_ms"]["p90"])
    # One client: its first request (5 ms) against its nine others.
    first, later = row["ttft_ms_first_wave_and_later"]
    assert first == pytest.approx(5.0) and later == pytest.approx(sum(ttfts[1:]) / 9 * 1000)
    assert row["tpot_ms"]["p90"] == pytest.approx(percentile([r.tpot for r in records], 90) * 1000)
    # The streaming table's medians are the same percentile's p50.
    assert results.streaming_result(records[:4], 11)["median"]["ttft_ms"] == pytest.approx(4.0)
    # The goodput rows' set of percentiles (p95 too) is the same percentile, scaled.
    assert percentiles(ttfts, (50, 95), 1000) == pytest.approx(
        {q: percentile(ttfts, int(q[1:])) * 1000 for q in ("p50", "p95")}
    )
    assert percentiles([], (50,)) == {"p50": None}


def test_levels_and_keys(tmp_path):
    assert parse_levels("1, 2,4,8") == [1, 2, 4, 8]
    with pytest.raises(SettingsError):
        parse_levels("1,x")
    with pytest.raises(SettingsError):
        parse_levels("0")
    # Each level is one step and one row of the table, so a level given twice is refused.
    with pytest.raises(SettingsError, match="8 more than once"):
        parse_levels("8,16,8")
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsk-a\n\nsk-b\n")
    assert read_keys(str(keys)) == ["sk-a", "sk-b"]
    settings = Settings(api_keys=["a", "b"])
    assert [settings.next_key() for _ in range(3)] == ["a", "b", "a"]
    with pytest.raises(SettingsError):
        read_keys(str(tmp_path / "missing"))


def test_a_host_that_is_not_an_http_url_is_refused_before_any_user_starts():
    """Users would fail in their start (requests refuses the URL) and a run wait for their requests."""
    assert (
        Settings.from_environment({"LOADTEST_API_KEY": "k", "LOADTEST_HOST": "https://gw:8443/"}).host
        == "https://gw:8443"
    )
    for host in ("nginx:8080", "http://", "ftp://nginx"):
        with pytest.raises(SettingsError, match=f"LOADTEST_HOST must be a URL such as http://nginx:8080, got '{host}'"):
            Settings.from_environment({"LOADTEST_API_KEY": "k", "LOADTEST_HOST": host})


def test_step_budget_gates_requests():
    state = StepState()
    state.begin(2, 3)
    state.mark_spawned()
    assert [state.try_start()[0] for _ in range(4)] == [True, True, True, False]
    state.begin(4, None)
    state.mark_spawned()
    assert state.try_start() == (True, 4)
    state.finish()
    assert [w.level for w in state.windows] == [2, 4] and all(w.ended for w in state.windows)


def test_no_request_of_a_step_starts_before_all_its_users_run():
    state = StepState()
    state.begin(8, 16)
    assert state.try_start() == (False, 8)  # Locust is still starting the step's users
    state.mark_spawned()  # its spawning_complete event
    assert state.try_start() == (True, 8)
    state.begin(8, 16)  # the same level again: no user starts, so no event comes
    assert state.try_start() == (True, 8)
    state.begin(4, 8)  # fewer users: Locust stops some, then reports the spawning complete
    assert state.try_start() == (False, 4)


def test_mean_in_flight_by_quarter_shows_where_a_level_was_not_held():
    # Four requests over 0-4 s: all four in the first second, two in the second, then one.
    intervals = [(0.0, 4.0), (0.0, 2.0), (0.0, 1.0), (0.0, 1.0)]
    assert mean_in_flight_by_part(intervals) == [4.0, 2.0, 1.0, 1.0]
    assert sum(mean_in_flight_by_part(intervals)) / 4 == 8.0 / 4.0  # Little's law over the span
    assert mean_in_flight_by_part([]) == [] and mean_in_flight_by_part([(1.0, 1.0)]) == []


def test_first_wave_split_takes_every_clients_first_request_by_start():
    # Two clients: their first requests (started at 0) waited 900 and 700 ms, the later ones 100-300.
    requests = [(1.2, 300.0), (0.0, 900.0), (1.0, 100.0), (0.0, 700.0)]
    assert first_wave_split(requests, 2) == (800.0, 200.0)
    assert first_wave_split(requests[:1], 2) == (300.0, None) and first_wave_split([], 2) == (None, None)


class FakeMaster:
    """The master's side of the ticket messages, answered at once (loadtest.steps): its pool holds a
    step's requests beyond every client's first."""

    def __init__(self, level: int, requests: int):
        self.level = level
        self.pool = TicketPool()
        self.step_id = self.pool.open(requests - level)
        self.asks: list[int] = []
        self.held: list[tuple[StepState, int]] = []  # asks not yet answered (deliver() answers them)
        self.answer_at_once = True

    def draw(self, state: StepState, users_here: int) -> TicketDraw:
        def ask(count: int) -> None:
            self.asks.append(count)
            if self.answer_at_once:
                self.answer(state, count)
            else:
                self.held.append((state, count))

        remaining = self.pool.remaining
        return TicketDraw(
            self.step_id,
            ask=ask,
            users_here=lambda: users_here,
            pool_left=remaining,
        )

    def answer(self, state: StepState, count: int) -> None:
        state.grant(self.step_id, self.pool.take(self.step_id, count), self.pool.remaining)

    def deliver(self) -> None:
        held, self.held = self.held, []
        for state, count in held:
            self.answer(state, count)


def test_a_distributed_step_sends_each_users_first_request_then_draws_on_the_masters_pool():
    state = StepState()
    master = FakeMaster(level=2, requests=4)  # 2 users here, 2 requests each
    state.begin(2, None, draw=master.draw(state, users_here=2))
    assert state.try_start() == (False, 2)  # its users are still starting
    state.mark_spawned()
    assert master.asks == []  # its users' first requests are its own
    assert state.try_start("a")[0] and master.asks == []  # each user's first
    assert state.try_start("b")[0] and master.asks == [1]  # then a chunk ahead once none is left here
    assert state.try_start("a")[0] and master.asks == [1, 1]
    assert state.try_start("b")[0]
    assert state.try_start("a") == (False, 2) and master.pool.remaining == 0
    state.close()
    assert state.try_start() == (False, 2)
    state.finish()  # a worker's test_stop: the web UI's next run may have no steps
    assert state.try_start() == (True, None)
    assert [w.level for w in state.windows] == [2] and state.windows[0].cpu_ended is not None


def test_every_user_of_a_distributed_step_sends_its_first_request_at_once():
    master = FakeMaster(level=8, requests=8)  # the warm-up's one request per client, 8 clients on 3 workers
    workers = [StepState() for _ in range(3)]
    for state, users in zip(workers, (3, 3, 2), strict=True):
        state.begin(8, None, draw=master.draw(state, users_here=users))
    # However the spawn events interleave, no worker's ask can take another worker's first requests.
    for state in workers:
        state.mark_spawned()
        while state.try_start(object())[0]:
            pass
    assert [state.started_requests for state in workers] == [3, 3, 2] and master.asks == []


def test_workers_draw_from_one_pool_so_a_fast_worker_sends_what_a_slow_one_does_not():
    master = FakeMaster(level=16, requests=64)  # 16 clients x 4 requests, 8 users on each of two workers
    fast, slow = StepState(), StepState()
    fast.begin(16, None, draw=master.draw(fast, users_here=8))
    slow.begin(16, None, draw=master.draw(slow, users_here=8))
    fast.mark_spawned()
    slow.mark_spawned()
    slow_users = [object() for _ in range(8)]
    assert sum(slow.try_start(user)[0] for user in slow_users) == 8  # each slow user's first request
    fast_user = object()
    sent_by_fast = 0
    # A waiting user polls again: its wait's ask is answered at once here.
    while fast.try_start(fast_user)[0] or fast.try_start(fast_user)[0]:
        sent_by_fast += 1
    # The fast worker sent all the rest but what the slow one had asked for ahead: at most a chunk
    # (one eighth of its users), and none once the pool fell under a level's worth.
    held_by_slow = slow.budget - slow.started_requests
    assert sent_by_fast + 8 + held_by_slow == 64 and held_by_slow <= slow.draw.chunk
    assert master.pool.remaining == 0


def test_near_a_steps_end_a_worker_asks_only_for_the_users_that_wait():
    master = FakeMaster(level=12, requests=14)  # a pool of 2: under a quarter-level from the start
    state = StepState()
    state.begin(12, None, draw=master.draw(state, users_here=12))
    state.mark_spawned()
    users = [object() for _ in range(12)]
    assert all(state.try_start(user)[0] for user in users) and master.asks == []  # nothing asked ahead
    master.answer_at_once = False
    assert state.try_start(users[0]) == (False, 12)  # one user waits: one request asked for
    assert state.try_start(users[1]) == (False, 12)  # a second waits while the ask is out
    assert master.asks == [1]
    master.deliver()  # the grant comes, and with it the ask for the second waiting user
    assert master.asks == [1, 1]
    master.deliver()
    assert state.try_start(users[0])[0] and state.try_start(users[1])[0] and master.pool.remaining == 0
    assert may_ask_ahead(3, 12) and not may_ask_ahead(2, 12)


def test_a_lost_answer_is_asked_again_and_a_failed_send_is_not_counted_as_asked(monkeypatch):
    from loadtest import step_state

    master = FakeMaster(level=2, requests=8)
    master.answer_at_once = False
    state = StepState()
    state.begin(2, None, draw=master.draw(state, users_here=2))
    state.mark_spawned()
    state.try_start("a")
    state.try_start("b")
    assert master.asks == [1]  # a chunk ahead (pool of 6 >= a level's worth)
    master.held.clear()  # that answer never comes
    state.try_start("b")
    assert master.asks == [1]  # one ask at a time
    later = step_state.time.monotonic() + step_state.ASK_RETRY_S + 0.1
    monkeypatch.setattr(step_state.time, "monotonic", lambda: later)
    state.try_start("a")
    assert master.asks == [1, 1]  # asked again after ASK_RETRY_S

    def broken(count: int) -> None:
        raise OSError("master gone")

    other = StepState()
    other.begin(2, None, draw=TicketDraw(master.step_id, ask=broken, users_here=lambda: 2, pool_left=6))
    other.mark_spawned()
    assert other.try_start("a")[0]
    with pytest.raises(OSError):
        other.try_start("b")  # the last request here is gone: the chunk ahead is asked for
    assert other.draw is not None and other.draw.asked_at is None


def test_a_grant_for_an_ended_step_is_ignored_and_the_pool_refuses_old_steps():
    pool = TicketPool()
    old = pool.open(10)
    new = pool.open(5)
    assert pool.take(old, 3) == 0 and pool.take(new, 3) == 3 and pool.take(new, 3) == 2
    state = StepState()
    state.begin(4, None, draw=TicketDraw(new, ask=lambda count: None, users_here=lambda: 4, pool_left=0))
    state.mark_spawned()
    assert state.budget == 4  # its users' first requests
    state.grant(old, 7, 0)
    assert state.budget == 4
    idle = StepState()  # a worker none of whose users are in this step takes and asks nothing
    idle.begin(4, None, draw=TicketDraw(new, ask=lambda count: pytest.fail("asked"), users_here=lambda: 0, pool_left=5))
    idle.mark_spawned()
    assert idle.budget == 0
    state.grant(new, 2, 0)
    assert [state.try_start(object())[0] for _ in range(7)] == [True] * 6 + [False]
    pool.close()
    assert pool.take(new, 1) == 0


def test_worker_count_follows_the_highest_level_and_the_cores():
    assert distributed.auto_workers(8, cpus=16) == 1
    assert distributed.auto_workers(64, cpus=16) == 4
    assert distributed.auto_workers(512, cpus=16) == 15
    assert distributed.auto_workers(512, cpus=2) == 1
    assert distributed.parse_workers("3", 512) == 3
    with pytest.raises(ValueError, match="auto"):
        distributed.parse_workers("0", 8)


def test_records_and_windows_cross_processes_unchanged():
    record = streamed(0.02, 0.2)
    record.step, record.tag, record.chunk_offsets = 4, "shared-prefix", [0.02, 0.03, 0.2]
    assert distributed.record_from_message(distributed.record_to_message(record)) == record
    window = StepWindow(4, started=1.0, ended=2.0, cpu_started=0.5, cpu_ended=0.7)
    assert distributed.window_from_message(window.__dict__) == window


def test_client_cpu_adds_the_workers_cpu_to_the_masters():
    master = [StepWindow(4, started=10.0, ended=20.0, cpu_started=1.0, cpu_ended=1.5)]
    workers = [
        StepWindow(4, started=10.1, ended=20.0, cpu_started=0.0, cpu_ended=6.0),
        StepWindow(4, started=10.1, ended=20.0, cpu_started=0.0, cpu_ended=4.5),
    ]
    assert results.client_cpu(master, 1000, workers)["client_cpu_pct"] == pytest.approx(110.0)
    assert results.client_cpu(master, 1000)["client_cpu_pct"] == pytest.approx(5.0)


def vllm_page(ttft_sum: float, ttft_count: int, running_sum: float | None = None) -> Snapshot:
    running = (
        "# TYPE vllm:request_inference_time_seconds histogram\n"
        f'vllm:request_inference_time_seconds_sum{{model_name="m"}} {running_sum}\n'
        if running_sum is not None
        else ""
    )
    return Snapshot.from_text(
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {ttft_count}\n'
        f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}\n'
        f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {ttft_count}\n' + running
    )


def test_cross_check_reads_vllm_histograms_between_two_snapshots():
    check = results.cross_check(vllm_page(1.0, 10), vllm_page(1.3, 13), [streamed(0.02, 0.2)] * 3)
    assert check["vllm_ttft_mean_ms"] == pytest.approx(100.0)
    assert check["vllm_requests"] == 3 and check["client_requests"] == 3
    assert check["client_ttft_mean_ms"] == pytest.approx(20.0)
    # Without vLLM's metrics the cross-check is empty, not an error.
    assert results.cross_check(None, None, [])["vllm_ttft_mean_ms"] is None
    # A vLLM without the running-time histogram: no mean running, the rest stays.
    assert check["vllm_mean_running"] is None


def test_cross_check_gives_requests_at_once_from_vllms_counters_not_from_samples():
    """Little's law over the requests' span: three requests of 0.2 s, all started at 1.0 s, were three
    at once for the client; vLLM ran them 0.15 s each (0.45 s of running time), 2.25 at once."""
    records = [streamed(0.02, 0.2)] * 3
    check = results.cross_check(vllm_page(1.0, 10, 5.0), vllm_page(1.3, 13, 5.45), records)
    assert check["client_mean_in_flight"] == pytest.approx(3.0)
    assert check["vllm_mean_running"] == pytest.approx(2.25) and check["span_s"] == pytest.approx(0.2)
    # A replica restarted in between (its counters reset): no figure rather than a negative one.
    assert results.cross_check(vllm_page(1.0, 10, 5.0), vllm_page(1.3, 13, 0.4), records)["vllm_mean_running"] is None
    assert results.cross_check(vllm_page(1.0, 10, 5.0), vllm_page(1.0, 10, 5.0), [])["vllm_mean_running"] is None
    assert results.read_snapshot("") is None and results.read_snapshot("http://127.0.0.1:9/metrics") is None


class SlowStream(BaseHTTPRequestHandler):
    """A real HTTP server streaming SSE chunks 5 ms apart, like vLLM through nginx."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"text": ""}]}] + [{"choices": [{"text": f"t{i}"}]} for i in range(10)]
        events.append({"choices": [], "usage": {"completion_tokens": 10, "prompt_tokens": 4}})
        for event in events:
            time.sleep(0.005)
            self.write_chunk(f"data: {json.dumps(event)}\n\n".encode())
        self.write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def log_message(self, *_args):
        pass


def test_streamed_request_timing_against_a_real_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowStream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        record = send(
            requests.Session(),
            url,
            COMPLETIONS,
            build_body(COMPLETIONS, "m", "p", None, 10, True),
            {},
            "stream-completion",
        )
    finally:
        server.shutdown()
    assert record.ok, record.error
    assert record.output_tokens == 10 and record.prompt_tokens == 4
    assert len(record.chunk_offsets) == 10
    # The empty first chunk does not count: TTFT is the second event, >= 2 x 5 ms.
    assert 0.009 < record.ttft < record.e2e
    # Gaps are resolved to well under a millisecond, not rounded to whole ones.
    assert all(0.003 < gap < 0.05 for gap in record.chunk_gaps)
    assert any(abs(gap * 1000 - round(gap * 1000)) > 0.01 for gap in record.chunk_gaps)


class KeepAliveStream(SlowStream):
    """The same stream over HTTP/1.1 keep-alive (as nginx serves it), noting each client port."""

    protocol_version = "HTTP/1.1"
    client_ports: ClassVar[list[int]] = []

    def setup(self):
        super().setup()
        KeepAliveStream.client_ports.append(self.client_address[1])


def test_streams_read_to_their_end_reuse_the_connection():
    """A read stopped at [DONE] closes its connection when it is collected: each stream would cost
    a new TCP connection, paid inside the next request's TTFT."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAliveStream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    session = requests.Session()
    body = build_body(COMPLETIONS, "m", "p", None, 10, True)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        records = [send(session, url, COMPLETIONS, body, {}, "stream-completion") for _ in range(3)]
    finally:
        session.close()
        server.shutdown()
    assert all(record.ok for record in records), [record.error for record in records]
    assert len(set(KeepAliveStream.client_ports)) == 1, KeepAliveStream.client_ports


def test_connection_refused_is_a_failed_record():
    record = send(
        requests.Session(),
        "http://127.0.0.1:9",
        COMPLETIONS,
        build_body(COMPLETIONS, "m", "p", None, 2, True),
        {},
        "k",
        timeout=2,
    )
    assert not record.ok and "ConnectionError" in record.error


def test_a_failed_connection_through_locusts_session_names_its_cause():
    """Locust's HttpSession does not raise on a failed connection: it answers status 0, no body,
    and the exception (LocustResponse), which the record names rather than "HTTP 0"."""

    class LocustLikeSession:
        def post(self, *_args, **_kwargs):
            response = requests.Response()
            response.status_code, response.error = 0, requests.ConnectionError("Connection refused")
            return response

    body = build_body(COMPLETIONS, "m", "p", None, 2, True)
    record = send(LocustLikeSession(), "http://127.0.0.1:9", COMPLETIONS, body, {}, "k")
    assert record.error == "ConnectionError: Connection refused"


def test_tables_render_lab_columns():
    summary = {
        "run_id": "r",
        "host": "h",
        "model": "m",
        "requests": 2,
        "failures": 0,
        "duration_s": 1.0,
        "concurrency": {
            "rows": [
                {
                    "concurrency": 1,
                    "requests": 2,
                    "failures": 0,
                    "max_tokens": 50,
                    "throughput_tok_s": 100.0,
                    "avg_tps_per_request": 90.0,
                    "total_time_s": 1.0,
                    "output_tokens": 100,
                    "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0},
                    "tpot_ms": {"p50": 1.5, "p90": 1.6, "p99": 1.7},
                    "max_running_in_vllm": 1.0,
                }
            ],
            "vllm": {},
        },
    }
    text = report.render_tables(summary)
    assert "Concurrency | Throughput (tok/s) | Avg TPS per request | Total time (s)" in text
    assert "1.00/2.00/3.00" in text
    assert "not held" not in text  # no mean in flight: nothing to judge
    rows = summary["concurrency"]["rows"]  # type: ignore[index]
    rows[0]["mean_in_flight"] = 0.95
    rows.append(rows[0] | {"concurrency": 512, "mean_in_flight": 393.2})
    note = report.render_tables(summary).splitlines()[-1]
    assert note.startswith("Level not held (512 clients held 393.2 requests in flight on average)")


@pytest.mark.parametrize(
    "argv",
    [["bogus"], ["--levels", "0"], ["--max-tokens", "1"], ["goodput", "--sweeps", "0"], ["--host", "nginx:8080"]],
)
def test_experiments_cli_usage_errors(argv, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "loadtest.experiments", *argv, "--results", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"LOADTEST_API_KEY": "x", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("python -m loadtest.experiments: error: ")
    assert len(result.stderr.strip().splitlines()) == 1


def test_in_flight_and_vllm_samples_are_attributed_to_their_step():
    # Back to back (one ends as the next starts) is one at a time; an overlap is two.
    assert max_overlap([(0.0, 1.0), (1.0, 2.0), (1.5, 2.5)]) == 2
    assert max_overlap([]) == 0
    windows = [StepWindow(1, started=10.0, ended=20.0), StepWindow(2, started=20.0, ended=30.0)]
    # A scrape sent in step 1 and answered in step 2 may hold either step's value: neither gets it.
    samples = [(11.0, 11.1, 1.0), (19.9, 20.2, 2.0), (21.0, 21.1, 2.0)]
    assert samples_in_step(windows, samples, 1) == [1.0]
    assert samples_in_step(windows, samples, 2) == [2.0]


def test_the_experiments_entry_point_loads_no_ssl_before_locust_patches_it():
    # gevent must patch ssl before anything imports it; else Locust's first SSL context recurses
    # without end (RecursionError in SSLContext.minimum_version) inside the Locust image.
    probe = "import sys, loadtest.experiments; print(sorted({'ssl', 'urllib3', 'requests'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_running_sampler_asks_for_one_gauge_and_falls_back_to_the_page():
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    from loadtest.running_sampler import METRIC, one_gauge_url, read_running, reading_url

    # prometheus_client's own server, as vLLM mounts it at /metrics/: it honours name[].
    registry = CollectorRegistry()
    Gauge(METRIC, "running", registry=registry).set(3)
    Gauge("vllm:kv_cache_usage_perc", "other", registry=registry).set(0.5)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert reading_url(url) == one_gauge_url(url) == url + "/?name%5B%5D=vllm%3Anum_requests_running"
        page = requests.get(one_gauge_url(url), timeout=5).text
        assert METRIC in page and "kv_cache_usage_perc" not in page
        assert read_running(reading_url(url)) == 3
    finally:
        server.shutdown()

    # A server with the page at /metrics only: the sampler reads the whole page.
    class PageOnly(BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"# TYPE {METRIC} gauge\n{METRIC} 2.0\n".encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    page_only = ThreadingHTTPServer(("127.0.0.1", 0), PageOnly)
    threading.Thread(target=page_only.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{page_only.server_port}/metrics"
        assert reading_url(url) == url and read_running(url) == 2
    finally:
        page_only.shutdown()
