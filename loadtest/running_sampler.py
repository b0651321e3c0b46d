"""Sample vLLM's num_requests_running in a separate process, so the polling and parsing never
delay the load generator's timestamps. Prints "<perf_counter> <value>" lines (perf_counter is the
system-wide monotonic clock on Linux, comparable with the parent's).

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
        try:
            value = read_running(args.url)
        except (OSError, ValueError):
            value = None
        if value is not None:
            print(f"{time.perf_counter():.6f} {value}", flush=True)
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
