"""Locust users for the OpenAI-compatible API behind the gateway.

Each user is a closed-loop client (no think time, as the lab's clients) with its own API key from
the key file (round-robin), sending through the gateway like any other client.
"""

from __future__ import annotations

import contextlib
import random
import threading

import gevent
import requests
import urllib3
from locust import HttpUser, constant, task

from llmstack.sse import CHAT_COMPLETIONS, COMPLETIONS, RequestRecord, build_body, send
from loadtest import metrics
from loadtest.settings import Settings
from loadtest.step_state import STEP_STATE

_settings: Settings | None = None
_model_lock = threading.Lock()
# Prompt words; any text would do, these read like the domain.
_VOCABULARY = (
    "kernel cache token batch decode prefill memory tensor latency throughput scheduler block "
    "attention query value key layer stream request server client gateway model weight page"
)
_WORDS = _VOCABULARY.split()


def settings() -> Settings:
    global _settings
    if _settings is None:
        _settings = Settings.from_environment()
    return _settings


def use_settings(new: Settings) -> None:
    global _settings
    _settings = new


def words(count: int, seed: int | str) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(count))


SHARED_SYSTEM_SEED = "shared-system-prompt"


class PrefixWorkload:
    """Which system prompt the prefix-caching users send: "shared", "unique" or "alternate"."""

    mode = "alternate"
    _counter = 0

    @classmethod
    def next_kind(cls) -> str:
        if cls.mode != "alternate":
            return cls.mode
        cls._counter += 1
        return "shared" if cls._counter % 2 else "unique"


class OpenAIUser(HttpUser):
    abstract = True
    wait_time = constant(0)
    host = "http://nginx:8080"

    def __init__(self, environment) -> None:
        super().__init__(environment)
        # The load-test key goes only where the settings say (LOADTEST_HOST: the gateway), never
        # to a host typed into the web UI's host field.
        self.host = settings().host
        self.client.base_url = self.host

    def on_start(self) -> None:
        config = settings()
        self.headers = {"Authorization": f"Bearer {config.next_key()}"}
        if not config.model:
            self.discover_model(config)
        self.open_connection()

    def open_connection(self) -> None:
        """Opens this user's keep-alive connection now, before its first request, as a client in
        service holds one: a step that opens with hundreds of users then times their requests on
        open connections, as it times every later one, not hundreds of TCP handshakes at once (at
        512 clients those doubled the first requests' TTFT: docs/loadtest.md). Requests has no
        public call that only connects, hence urllib3's pool; a failure here is left to the first
        request, which counts it."""
        try:
            # The pool a request to this host would take: same proxies, verification and certificate.
            options = self.client.merge_environment_settings(self.host, {}, None, None, None)
            pool = self.client.get_adapter(self.host).get_connection_with_tls_context(
                requests.Request("GET", self.host).prepare(), options["verify"], options["proxies"], options["cert"]
            )
        except (requests.RequestException, ValueError):
            return  # a host requests cannot use (no scheme, bad URL): each request reports it
        connection = pool._get_conn()
        if connection.sock is None:  # not open yet (the model's discovery may have opened it)
            try:
                connection.connect()
            except (OSError, urllib3.exceptions.HTTPError):
                connection.close()
        pool._put_conn(connection)

    def discover_model(self, config: Settings) -> None:
        with _model_lock:
            if config.model:
                return
            response = self.client.get("/v1/models", headers=self.headers, name="/v1/models")
            # Unknown, it stays unset: the requests fail visibly (401, 503) and each is counted.
            with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                config.model = response.json()["data"][0]["id"]

    def run_request(self, endpoint: str, body: dict, kind: str, tag: str = "") -> RequestRecord | None:
        allowed, step = STEP_STATE.try_start(self)
        while not allowed:
            # No request of the step is free here yet (or the step is over): wait for one, or for the
            # shape to start the next step.
            gevent.sleep(0.005)
            allowed, step = STEP_STATE.try_start(self)
        record = RequestRecord(kind, endpoint, bool(body.get("stream")), 0.0, 0.0, step=step, tag=tag)
        name = metrics.entry_name(record)
        record = send(self.client, "", endpoint, body, self.headers, kind, name=name)
        record.step, record.tag = step, tag
        metrics.publish(record)
        return record

    def body(self, endpoint: str, stream: bool, **overrides) -> dict:
        config = settings()
        return build_body(
            endpoint,
            config.model or "unknown-model",
            overrides.get("prompt", config.prompt),
            overrides.get("messages"),
            overrides.get("max_tokens", config.max_tokens),
            stream,
        )


class CompletionUser(OpenAIUser):
    """Non-streaming /v1/completions (the lab's concurrency test)."""

    @task
    def completion(self) -> None:
        self.run_request(COMPLETIONS, self.body(COMPLETIONS, stream=False), "completion")


class StreamingCompletionUser(OpenAIUser):
    """Streamed /v1/completions with TTFT, TPOT and every inter-chunk gap."""

    @task
    def streaming_completion(self) -> None:
        self.run_request(COMPLETIONS, self.body(COMPLETIONS, stream=True), "stream-completion")


class StreamingChatUser(OpenAIUser):
    """Streamed /v1/chat/completions."""

    @task
    def streaming_chat(self) -> None:
        messages = [{"role": "user", "content": settings().prompt}]
        self.run_request(CHAT_COMPLETIONS, self.body(CHAT_COMPLETIONS, stream=True, messages=messages), "stream-chat")


class PrefixCacheUser(OpenAIUser):
    """Streamed chat whose long system prompt is either shared by every request (its KV cache is
    reused) or unique to the request (always a full prefill); same length either way."""

    max_tokens = 8

    @task
    def prefix_request(self) -> None:
        config = settings()
        kind = PrefixWorkload.next_kind()
        if kind == "shared":
            system = words(config.prefix_words, SHARED_SYSTEM_SEED)
        else:
            # A different first word already defeats every cached block.
            system = words(config.prefix_words, random.getrandbits(64))
        question = f"Question {random.getrandbits(32)}: {config.prompt}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        body = self.body(CHAT_COMPLETIONS, stream=True, messages=messages, max_tokens=self.max_tokens)
        self.run_request(CHAT_COMPLETIONS, body, "prefix-cache", tag=f"{kind}-prefix")
