"""Load-test settings from the environment (compose sets them; the experiments' flags override)."""

from __future__ import annotations

import itertools
import os
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from llmstack import cli
from llmstack.cli import UsageError

LAB_PROMPT = "Please describe the inference process of large language models in three sentences"
DEFAULT_LEVELS = (1, 2, 4, 8)
# How often the harness reads vLLM's num_requests_running during a run. Each read makes vLLM's API
# server, the process that also streams every token, render its whole /metrics page: 3.5-4.3 ms of
# its CPU on the 2-core CPU stack. Every 50 ms (before) that cost the harness a sixth of its tokens/s
# against `vllm bench serve` at 1 client; every 0.5 s, no difference (docs/loadtest.md).
RUNNING_SAMPLE_INTERVAL_S = 0.5


class SettingsError(UsageError):
    """A setting the user gave is unusable; the message says which (exit code 2)."""


def check_host(url: str, what: str) -> str:
    """The load's target without a trailing slash. Anything but an http(s) URL with a host is
    refused here: the users would otherwise fail before their first request and the run wait."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SettingsError(f"{what} must be a URL such as http://nginx:8080, got {url!r}")
    return url.rstrip("/")


def parse_levels(text: str, what: str = "concurrency levels") -> list[int]:
    """llmstack.cli.parse_levels, failing with a SettingsError (a setting of the load test)."""
    try:
        return cli.parse_levels(text, what)
    except UsageError as exc:
        raise SettingsError(str(exc)) from None


def rate_label(rate: float) -> str:
    """The tag of a rate's requests (Locust's entries and records.csv): 'rate 2.5/s'."""
    return f"rate {rate:g}/s"


def parse_rates(text: str) -> list[float]:
    """Offered request rates (requests/s), comma-separated, each once."""
    try:
        rates = [float(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise SettingsError(f"request rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not rate > 0 or rate == float("inf") for rate in rates):
        raise SettingsError(f"request rates must be positive numbers, got {text!r}")
    # A step's records are tagged by its rate's label: two rates with one label would merge two steps in one row.
    labels = [rate_label(rate) for rate in rates]
    repeated = cli.repeated_values(labels)
    if repeated:
        given = ", ".join(label.removeprefix("rate ") for label in repeated)
        raise SettingsError(f"request rates give {given} more than once: each rate is one step and one row")
    return rates


def read_keys(path: str) -> list[str]:
    """Keys from a file: one per line; blank lines and # comments ignored."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SettingsError(f"cannot read the API key file {path}: {exc.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise SettingsError(f"the API key file {path} holds no key")
    return keys


@dataclass
class Settings:
    host: str = "http://nginx:8080"
    api_keys: list[str] = field(default_factory=list)
    model: str = ""
    prompt: str = LAB_PROMPT
    max_tokens: int = 50
    prefix_words: int = 600
    # The goodput's latency objective (loadtest.goodput).
    slo_ttft_p95_ms: float = 200.0
    slo_tpot_p95_ms: float = 50.0
    _next_key: itertools.count = field(default_factory=itertools.count, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def next_key(self) -> str:
        """Keys round-robin, one per simulated user, so each key's limits see a share of the load."""
        with self._lock:
            return self.api_keys[next(self._next_key) % len(self.api_keys)]

    @classmethod
    def from_environment(cls, environ=os.environ) -> Settings:
        if environ.get("LOADTEST_API_KEYS"):  # the experiments' worker processes get their master's keys
            keys = environ["LOADTEST_API_KEYS"].split("\n")
        elif environ.get("LOADTEST_API_KEY"):
            keys = [environ["LOADTEST_API_KEY"]]
        else:
            keys = read_keys(environ.get("LOADTEST_API_KEY_FILE") or "/run/secrets/loadtest_api_key")
        host = check_host(environ.get("LOADTEST_HOST") or "http://nginx:8080", "LOADTEST_HOST")
        try:
            return cls(
                host=host,
                api_keys=keys,
                model=(environ.get("LOADTEST_MODEL") or ""),
                prompt=environ.get("LOADTEST_PROMPT") or LAB_PROMPT,
                max_tokens=int(environ.get("LOADTEST_MAX_TOKENS") or "50"),
                prefix_words=int(environ.get("LOADTEST_PREFIX_WORDS") or "600"),
                slo_ttft_p95_ms=float(environ.get("LOADTEST_SLO_TTFT_P95_MS") or "200"),
                slo_tpot_p95_ms=float(environ.get("LOADTEST_SLO_TPOT_P95_MS") or "50"),
            )
        except ValueError as exc:
            raise SettingsError(f"bad number in LOADTEST_* settings: {exc}") from None
