"""The one SSE timing client: requests to the OpenAI-compatible API and what one request measured,
streamed or not. Used by the load tests (through Locust's session), the lab scripts and benchmarks.

Timing uses time.perf_counter: TTFT is from just before the request is sent to the arrival of the
first chunk whose text is not empty; token counts come from the server's `usage`, never from
counting chunks (a chunk may carry several tokens).
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import requests

from llmstack.cli import StackError, UsageError

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; chunk_offsets are from `started`."""

    kind: str
    endpoint: str
    streamed: bool
    started: float
    started_wall: float
    e2e: float = 0.0
    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    chunk_offsets: list[float] = field(default_factory=list)
    status: int | None = None
    error: str | None = None
    step: int | None = None
    tag: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def chunk_gaps(self) -> list[float]:
        offsets = self.chunk_offsets
        return [b - a for a, b in itertools.pairwise(offsets)]

    @property
    def decode_time(self) -> float | None:
        """First text chunk to last text chunk (the lab's "decode total time")."""
        if len(self.chunk_offsets) < 2:
            return None
        return self.chunk_offsets[-1] - self.chunk_offsets[0]

    @property
    def tokens_per_second(self) -> float | None:
        """Output tokens over the whole request (the lab's per-request TPS)."""
        return self.output_tokens / self.e2e if self.e2e > 0 and self.ok else None


def event_data(event: bytes) -> bytes | None:
    """The data of one server-sent event (its `data:` lines joined), None if it has none."""
    data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


def iter_sse_data(chunks: Iterable[bytes]) -> Iterator[tuple[float, bytes]]:
    """(arrival time, data payload) for each server-sent event in a byte stream.

    The arrival time is when the network chunk that completed the event came in, so events that
    share a chunk share a time, as the client really saw them.
    """
    buffer = b""
    for chunk in chunks:
        if not chunk:
            continue
        arrived = time.perf_counter()
        buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event_data(event)
            if data is not None:
                yield arrived, data
    if buffer.strip():
        data = event_data(buffer)
        if data is not None:
            yield time.perf_counter(), data


def chunk_text(payload: dict) -> str:
    """The generated text in one streamed chunk (completions or chat)."""
    text = ""
    for choice in payload.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
        text += delta.get("reasoning_content") or delta.get("reasoning") or ""
    return text


# Greedy sampling: the same work for every request and every client (vllm bench serve is told the
# same: without --temperature it leaves sampling to the model's default, 1.0, random sampling).
TEMPERATURE = 0


def build_body(
    endpoint: str,
    model: str,
    prompt: str | None,
    messages: list[dict] | None,
    max_tokens: int,
    stream: bool,
    ignore_eos: bool = True,
) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": TEMPERATURE, "stream": stream}
    if ignore_eos:
        # Fixed output length: vLLM's extension, so every request decodes exactly max_tokens.
        body["ignore_eos"] = True
    if endpoint == CHAT_COMPLETIONS:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def error_message(status: int, body_text: str) -> str:
    try:
        error = json.loads(body_text).get("error") or {}
        detail = error.get("code") or error.get("type") or error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        detail = body_text.strip()[:120]
    return f"HTTP {status}: {detail}" if detail else f"HTTP {status}"


def apply_usage(record: RequestRecord, usage: dict | None) -> None:
    if not usage:
        return
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        record.cached_tokens = int(details["cached_tokens"])


def send(
    session,
    base_url: str,
    endpoint: str,
    body: dict,
    headers: dict,
    kind: str,
    timeout: float = 900.0,
    **request_kwargs,
) -> RequestRecord:
    """Send one request through `session` (requests.Session or Locust's HttpSession)."""
    record, response = _send(session, base_url, endpoint, body, headers, kind, timeout, **request_kwargs)
    if response is not None:
        response.close()
    return record


def _send(session, base_url, endpoint, body, headers, kind, timeout, **request_kwargs):
    streamed = bool(body.get("stream"))
    record = RequestRecord(
        kind=kind, endpoint=endpoint, streamed=streamed, started=time.perf_counter(), started_wall=time.time()
    )
    try:
        response = session.post(
            base_url + endpoint, json=body, headers=headers, stream=streamed, timeout=timeout, **request_kwargs
        )
    except Exception as exc:  # connection refused, reset, timeout: a failed request, not a crash
        record.e2e = time.perf_counter() - record.started
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return record, None
    record.status = response.status_code
    try:
        if response.status_code == 0 and getattr(response, "error", None) is not None:
            # Locust's HttpSession answers a failed connection with status 0, no body and the exception.
            record.error = f"{type(response.error).__name__}: {response.error}"[:200]
            return record, None
        if response.status_code != 200:
            record.error = error_message(response.status_code, response.text)
        elif streamed:
            read_stream(record, response)
        else:
            payload = response.json()
            apply_usage(record, payload.get("usage"))
    except Exception as exc:  # a stream cut short or a body that is not JSON
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        record.e2e = time.perf_counter() - record.started
    if record.ok and record.output_tokens == 0:
        record.error = "no usage in the response (stream_options.include_usage ignored?)"
    return record, response


def read_stream(record: RequestRecord, response) -> None:
    """Reads the stream to its very end, past [DONE]: a read left suspended there closes the
    connection when it is collected (urllib3), so the next request would pay a TCP connect inside
    its TTFT (benchmarks/packet_timing.py found every request on a connection of its own)."""
    done = False
    for arrived, data in iter_sse_data(response.iter_content(chunk_size=None)):
        if done:
            continue
        if data.strip() == b"[DONE]":
            done = True
            continue
        payload = json.loads(data)
        if "error" in payload and not payload.get("choices"):
            raise RuntimeError(f"error event: {str(payload['error'])[:150]}")
        if chunk_text(payload):
            offset = arrived - record.started
            if record.ttft is None:
                record.ttft = offset
            record.chunk_offsets.append(offset)
        apply_usage(record, payload.get("usage"))
    if not done:
        raise RuntimeError("stream ended without [DONE]")


class RequestFailed(StackError):
    """A request the server refused or that broke; `status` is the HTTP status, if one came."""

    def __init__(self, message: str, status: int | None):
        super().__init__(message)
        self.status = status


class ApiClient:
    """The OpenAI-compatible API at a base URL (the gateway, or vLLM itself) for the lab scripts and
    benchmarks: errors become StackError / UsageError with one readable line."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float = 120.0):
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise UsageError(f"'{base_url}' is not an http(s) URL")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = requests.Session()

    def _failure(self, status: int | None, detail: str) -> RequestFailed:
        hint = " (check --api-key / LLM_STACK_API_KEY)" if status == 401 else ""
        where = f"{self.base_url} answered {status}" if status else f"cannot reach {self.base_url}"
        return RequestFailed(f"{where}{hint}: {detail}", status)

    def models(self) -> list[dict]:
        try:
            response = self.session.get(self.base_url + "/v1/models", headers=self.headers, timeout=self.timeout)
        except requests.ConnectionError:
            raise self._failure(None, "connection failed (is the stack up? docker compose ps)") from None
        except requests.RequestException as err:
            raise self._failure(None, type(err).__name__) from None
        if response.status_code != 200:
            raise self._failure(response.status_code, error_message(response.status_code, response.text))
        return list(response.json().get("data") or [])

    def completion(
        self, model: str, prompt: str, max_tokens: int, kind: str = "completion", stream: bool = True
    ) -> RequestRecord:
        """One completion (streamed by default, fixed length); a failed request raises StackError."""
        body = build_body(COMPLETIONS, model, prompt, None, max_tokens, stream)
        record = send(self.session, self.base_url, COMPLETIONS, body, self.headers, kind, timeout=self.timeout)
        if not record.ok:
            raise self._failure(record.status, record.error or "failed")
        return record
