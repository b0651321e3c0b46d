"""Streams held open through the gateway, for the tests of per-key limits: a limit is only tested
while every stream that should hold it is still in flight."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import requests

T = TypeVar("T")


class OpenStream:
    """A streamed request whose first event has arrived; a thread reads the rest and notes its end
    (normal, or cut: a stalled replica's stream ends at the gateway's idle timeout)."""

    def __init__(self, response: requests.Response):
        self.response = response
        self.ended = threading.Event()
        lines = response.iter_lines()
        next(lines)
        self._reader = threading.Thread(target=self._read, args=(lines,), daemon=True)
        self._reader.start()

    def _read(self, lines: Iterator[bytes]) -> None:
        try:
            for _ in lines:
                pass
        except (requests.RequestException, AttributeError, ValueError):
            pass  # closed under it by close()
        finally:
            self.ended.set()

    def close(self) -> None:
        self.response.close()
        self._reader.join(timeout=30)


class StalledStart(Exception):
    """The gateway's 503: no replica answered within its timeout (a starved machine, not a limit)."""


def start_stream(stack, owner: str, path: str, payload: dict) -> OpenStream:
    response = requests.post(stack.url(path), json=payload, headers=stack.auth(owner), stream=True, timeout=120)
    if response.status_code == 503:
        raise StalledStart(response.text[:300])
    assert response.status_code == 200, response.text[:300]
    return OpenStream(response)


def while_streaming(
    stack, owner: str, path: str, payloads: list[dict], request: Callable[[], T], attempts: int = 3
) -> T:
    """Start one stream per payload, then call request(); its result once every stream was still in
    flight a moment after it answered. On a starved 2-core machine a stream may end, stall out (an 8 s
    silence ends it at the test stack's idle timeout) or not start (503): that attempt says nothing
    about the limit, and is made again, up to `attempts` times."""
    for attempt in range(attempts):
        if attempt:
            time.sleep(2)  # the last attempt's streams given back (nginx ends them as it sees the close)
        with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
            started = [pool.submit(start_stream, stack, owner, path, payload) for payload in payloads]
        streams = [future.result() for future in started if future.exception() is None]
        try:
            if any(isinstance(future.exception(), StalledStart) for future in started):
                continue
            for future in started:
                future.result()  # a stream refused: its error, after the others are closed
            result = request()
            time.sleep(0.3)  # long enough for a reader to see an end that came before the answer
            if not any(stream.ended.is_set() for stream in streams):
                return result
        finally:
            for stream in streams:
                stream.close()
    raise AssertionError(f"in {attempts} attempts the streams never stayed in flight long enough to test the limit")
