"""Sample vLLM's num_requests_running in a separate process, so the polling and parsing never
delay the load generator's timestamps. Prints "<sent> <received> <value>" lines: the value was true
at some moment between the two perf_counter readings (the system-wide monotonic clock on Linux,
comparable with the parent's), so a reader can tell which step it belongs to even when a scrape
is slow.

  python -m loadtest.running_sampler URL [--interval S] [--max-seconds S]
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request

METRIC = b"vllm:num_requests_running"


def read_running(url: str) -> float | None:
    with urllib.request.urlopen(url, timeout=2) as response:
        total, seen = 0.0, False
        for line in response.read().splitlines():
            if line.startswith(METRIC) and line[len(METRIC):len(METRIC) + 1] in (b"{", b" "):
                total += float(line.rsplit(b" ", 1)[1])
                seen = True
    return total if seen else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.running_sampler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--max-seconds", type=float, default=3600)
    args = parser.parse_args(argv)
    deadline = time.perf_counter() + args.max_seconds
    while time.perf_counter() < deadline:
        sent = time.perf_counter()
        try:
            value = read_running(args.url)
        except (OSError, ValueError):
            value = None
        if value is not None:
            print(f"{sent:.6f} {time.perf_counter():.6f} {value}", flush=True)
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
