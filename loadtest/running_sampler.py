"""Sample vLLM's num_requests_running in a separate process, so the polling and parsing never
delay the load generator's timestamps. Prints "<sent> <received> <value>" lines: the value was true
at some moment between the two perf_counter readings (the system-wide monotonic clock on Linux,
comparable with the parent's), so a reader can tell which step it belongs to even when a scrape
is slow.

  python -m loadtest.running_sampler URL [--interval S] [--max-seconds S]
"""

from __future__ import annotations

import time
import urllib.parse

from llmstack import promtext
from llmstack.cli import main_exit, parser_from_doc, positive_seconds
from loadtest.settings import RUNNING_SAMPLE_INTERVAL_S

PROG = "python -m loadtest.running_sampler"
METRIC = "vllm:num_requests_running"


def read_running(url: str) -> float | None:
    """Summed over every replica the URL's host name stands for."""
    return promtext.total(promtext.parse_family(promtext.fetch(url, timeout=2), METRIC), METRIC)


def one_gauge_url(url: str) -> str:
    """The /metrics URL asking for the gauge alone (prometheus_client's `name[]` filter), so that
    vLLM's API server, which also streams every token, renders one metric instead of its whole page.
    vLLM answers the filter at /metrics/, where prometheus_client's own app is mounted; its /metrics
    route (prometheus-fastapi-instrumentator's) ignores it."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.urlencode({"name[]": METRIC})
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/", query=query))


def reading_url(url: str) -> str:
    """one_gauge_url where its answer holds the gauge, else the whole page: vLLM's multiprocess
    metrics (--api-server-count > 1) know no names to filter by, other servers no filter."""
    gauge_alone = one_gauge_url(url)
    try:
        if read_running(gauge_alone) is not None:
            return gauge_alone
    except (OSError, promtext.MetricsFormatError):
        pass
    return url


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("url", help="vLLM's /metrics URL")
    parser.add_argument(
        "--interval",
        type=positive_seconds,
        default=RUNNING_SAMPLE_INTERVAL_S,
        help="seconds between polls (default: %(default)s)",
    )
    parser.add_argument(
        "--max-seconds", type=positive_seconds, default=3600, help="stop after this long (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    deadline = time.perf_counter() + args.max_seconds
    url = reading_url(args.url)
    try:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            try:
                value = read_running(url)
            except (OSError, promtext.MetricsFormatError):
                value = None
            if value is not None:
                print(f"{sent:.6f} {time.perf_counter():.6f} {value}", flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass  # the runner stops us with SIGTERM or Ctrl-C: either is the normal end
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
