"""Faults, and what a client sees and for how long: nginx reloaded mid-stream, vLLM frozen under
a streaming and a non-streaming client. (vLLM down or loading: test_gateway.py; Prometheus
restarted with its data kept: test_observability.py.) The test stack's timeouts are short
(tests/stack.py); the shipped ones are 900 s for a whole answer and 120 s between two events."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import threading
import time

import pytest
import requests

from llmstack.sse import iter_sse_data

MODEL = "tiny-qwen3"
STREAM_IDLE_S = 8  # tests/stack.py: UPSTREAM_STREAM_IDLE_TIMEOUT
READ_S = 20  # tests/stack.py: UPSTREAM_READ_TIMEOUT


def stream_events(stack, max_tokens: int, started: threading.Event | None = None) -> tuple[list[str], bool, float, int]:
    """One streamed completion: (its events' texts, whether it ended with [DONE], seconds taken, the
    tokens its usage counted; vLLM may put several tokens in one event when the client lags)."""
    begin = time.monotonic()
    texts: list[str] = []
    usage_tokens: list[int] = []
    done = False
    payload = {
        "model": MODEL,
        "prompt": "Go on",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with requests.post(
            stack.url("/v1/completions"), json=payload, headers=stack.auth("streams"), stream=True, timeout=120
        ) as response:
            assert response.status_code == 200, response.text
            for _, data in iter_sse_data(response.iter_content(chunk_size=None)):
                if data == b"[DONE]":
                    done = True
                else:
                    event = json.loads(data)
                    if event.get("usage"):
                        usage_tokens.append(event["usage"]["completion_tokens"])
                    if event.get("choices"):
                        texts.append(event["choices"][0]["text"])
                    if started is not None and len(texts) == 5:
                        started.set()
    except requests.exceptions.ChunkedEncodingError:
        pass  # the connection closed mid-stream
    return texts, done, time.monotonic() - begin, usage_tokens[-1] if usage_tokens else 0


def wait_started(started: threading.Event, streams: list[concurrent.futures.Future], timeout: float) -> None:
    """Until some stream has its first events; a stream that failed before says why at once
    (a bare wait would only say that the time ran out)."""
    deadline = time.monotonic() + timeout
    while not started.wait(0.5):
        for stream in streams:
            if stream.done() and not started.is_set():
                texts, done, seconds, _ = stream.result()  # raises what failed the stream
                raise AssertionError(f"a stream ended early: {len(texts)} events, done={done}, {seconds:.1f} s")
        assert time.monotonic() < deadline, f"no stream had 5 events within {timeout:.0f} s"


def docker(*args: str) -> None:
    """A docker command whose failure says docker's own reason (check=True would hide its stderr)."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"docker {args[0]} exited {done.returncode}: {done.stderr.strip() or 'no output'}"


def wait_running(containers: list[str], timeout: float) -> None:
    """Until every container runs: docker pause refuses one that is restarting or stopped (an earlier
    destructive test may have left a replica coming back)."""
    deadline = time.monotonic() + timeout
    while True:
        states = subprocess.run(
            ["docker", "inspect", "--format", "{{.State.Status}}", *containers],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        if states == ["running"] * len(containers):
            return
        assert time.monotonic() < deadline, f"replicas not running after {timeout:.0f} s: {states}"
        time.sleep(1)


def test_a_reload_during_streams_cuts_none(stack):
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream_events, stack, 600, started) for _ in range(3)]
        wait_started(started, streams, 60)
        stack.exec("nginx", "nginx", "-s", "reload")
        results = [f.result() for f in streams]
    for _texts, done, _, tokens in results:
        assert done and tokens == 600


@pytest.mark.destructive
def test_a_frozen_vllm_is_found_out_within_the_timeouts(stack):
    """docker pause on every replica: vLLM keeps its connections but answers nothing. (One frozen
    replica among others is taken out of rotation by the router's health checks.)"""
    vllm = [stack.compose_command("ps", "--quiet", replica).stdout.strip() for replica in stack.replicas]
    assert all(vllm), "a replica has no container"
    # The streaming client. On 2 cores the tiny model can finish a long stream before the pause
    # takes hold (one CI run saw it): then that stream was not frozen, and another one is tried.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for _attempt in range(3):
            started = threading.Event()
            streaming = pool.submit(stream_events, stack, 4000, started)
            wait_started(started, [streaming], 60)
            wait_running(vllm, 60)
            docker("pause", *vllm)
            paused = time.monotonic()
            texts, done, _, _ = streaming.result()
            stream_waited = time.monotonic() - paused
            if not done:
                break
            docker("unpause", *vllm)
    try:
        assert not done, "three 4000-token streams each finished before vLLM was paused"
        # Its stream ends, without [DONE], one idle timeout after the last event it got.
        assert len(texts) >= 5
        assert stream_waited <= STREAM_IDLE_S + 10, stream_waited
        # The non-streaming client, vLLM still frozen: a 503 JSON error it may retry, after the
        # read timeout.
        begin = time.monotonic()
        answer = requests.post(
            stack.url("/v1/completions"),
            json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
            headers=stack.auth("bob"),
            timeout=120,
        )
        waited = time.monotonic() - begin
    finally:
        subprocess.run(["docker", "unpause", *vllm], check=False, capture_output=True, timeout=60)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_unavailable"
    assert "Retry-After" in answer.headers
    # After the read timeout, or sooner once the router's health checks have taken every frozen
    # replica out of rotation (it then answers 503 at once).
    assert waited <= READ_S + 10, waited
    # Unfrozen, vLLM serves again at once.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ok = requests.post(
            stack.url("/v1/completions"),
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers=stack.auth("bob"),
            timeout=60,
        )
        if ok.status_code == 200:
            break
        time.sleep(1)
    assert ok.status_code == 200
