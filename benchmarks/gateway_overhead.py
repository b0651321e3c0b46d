#!/usr/bin/env python3
"""Time to first byte of a streamed completion through the gateway vs straight to vLLM.

Run from inside the stack's network so both paths start at the same client: with
--compose-project the script re-runs itself in a throwaway container on that project's backend
network (using the local vLLM image for its Python). Requests alternate between the two paths.
Prints median, p90 and p99 of time-to-first-byte and time-to-first-token for each, and the
difference: the latency the gateway adds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit


def event_has_text(event: bytes) -> bool:
    if not event.startswith(b"data: ") or event == b"data: [DONE]":
        return False
    choices = json.loads(event[len(b"data: "):]).get("choices") or [{}]
    return bool(choices[0].get("text"))


def stream_once(url: str, api_key: str | None, model: str, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first body byte, seconds to the first chunk with text) for one request."""
    parts = urlsplit(url)
    body = json.dumps({"model": model, "prompt": "Measure me", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        started = time.perf_counter()
        connection.request("POST", "/v1/completions", body=body, headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {response.read()[:200]!r}")
        first_byte = None
        first_token = None
        pending = b""
        while True:
            chunk = response.read1(65536)
            if not chunk:
                break
            now = time.perf_counter()
            first_byte = first_byte or now
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            if first_token is None and any(event_has_text(e) for e in events):
                first_token = now
        return first_byte - started, (first_token or first_byte) - started
    finally:
        connection.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def measure(args: argparse.Namespace) -> dict:
    paths = {"gateway": (args.gateway_url, args.api_key), "direct": (args.direct_url, None)}
    samples = {name: {"ttfb": [], "ttft": []} for name in paths}
    for _ in range(args.warmup):
        for url, key in paths.values():
            stream_once(url, key, args.model, args.max_tokens)
    for index in range(args.requests):
        order = list(paths.items()) if index % 2 == 0 else list(reversed(paths.items()))
        for name, (url, key) in order:
            ttfb, ttft = stream_once(url, key, args.model, args.max_tokens)
            samples[name]["ttfb"].append(ttfb * 1000)
            samples[name]["ttft"].append(ttft * 1000)
        print(f"\r  {index + 1}/{args.requests} request pairs", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    summary = {}
    for name, metrics in samples.items():
        summary[name] = {metric: {"median_ms": statistics.median(values), "p90_ms": percentile(values, 90),
                                  "p99_ms": percentile(values, 99)} for metric, values in metrics.items()}
    summary["added_by_gateway_ms"] = {
        metric: {stat: summary["gateway"][metric][stat] - summary["direct"][metric][stat]
                 for stat in ("median_ms", "p90_ms", "p99_ms")} for metric in ("ttfb", "ttft")}
    summary["requests_per_path"] = args.requests
    return summary


def print_table(summary: dict) -> None:
    print(f"{'path':<22}{'TTFB p50':>10}{'p90':>9}{'p99':>9}{'TTFT p50':>11}{'p90':>9}{'p99':>9}   (ms)")
    for name in ("gateway", "direct", "added_by_gateway_ms"):
        row = summary[name]
        label = "added by the gateway" if name == "added_by_gateway_ms" else name
        print(f"{label:<22}" + "".join(f"{row['ttfb'][s]:>{w}.2f}" for s, w in
                                       (("median_ms", 10), ("p90_ms", 9), ("p99_ms", 9)))
              + "".join(f"{row['ttft'][s]:>{w}.2f}" for s, w in (("median_ms", 11), ("p90_ms", 9), ("p99_ms", 9))))


def run_in_network(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-run this script in a container on the project's backend network."""
    script = Path(__file__).resolve()
    forwarded = [a for a in argv if a not in ("--compose-project", args.compose_project)]
    command = ["docker", "run", "--rm", "--network", f"{args.compose_project}_backend",
               "-v", f"{script}:/bench/{script.name}:ro", "--entrypoint", "python3", args.image,
               f"/bench/{script.name}", *forwarded]
    return subprocess.run(command).returncode


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--gateway-url", default="http://nginx:8080")
    parser.add_argument("--direct-url", default="http://vllm:8000")
    parser.add_argument("--api-key", default=os.environ.get("LLM_STACK_API_KEY"),
                        help="key for the gateway (default: $LLM_STACK_API_KEY)")
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--requests", type=int, default=20, help="requests per path (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--compose-project", help="run inside this compose project's backend network")
    parser.add_argument("--image", default="llm-stack/vllm-cpu:0.32.0",
                        help="image whose python3 runs the script with --compose-project")
    args = parser.parse_args(argv)
    if not args.api_key:
        parser.error("an API key is needed: --api-key or LLM_STACK_API_KEY")
    if args.requests < 1 or args.warmup < 0 or args.max_tokens < 1:
        parser.error("--requests and --max-tokens must be positive, --warmup not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.compose_project:
        return run_in_network(args, argv)
    try:
        summary = measure(args)
    except (OSError, RuntimeError, http.client.HTTPException) as err:
        print(f"gateway_overhead: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
