"""Time to first byte and first token of a streamed completion through the gateway vs straight to vLLM.

Run from inside the stack's network so both paths start at the same client: with
--compose-project the benchmark re-runs itself in a throwaway container on that project's backend
network (the local vLLM image's Python, with this repo mounted). Requests alternate between the
two paths. Prints p50, p90 and p99 (llmstack.stats) of time-to-first-byte and time-to-first-token
for each, and the difference: the latency the gateway adds.

  python3 benchmarks/gateway_overhead.py --compose-project llm-stack [--requests 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import requests

from llmstack import REPO_ROOT
from llmstack.cli import StackError, UsageError, add_json_argument, main_exit, parser_from_doc, progress_bar
from llmstack.sse import COMPLETIONS, RequestRecord, build_body, send
from llmstack.stats import spread

PROG = "gateway_overhead.py"
STATS = ("p50", "p90", "p99")


class FirstByteSession:
    """A requests.Session whose streamed responses note when their first body bytes arrived, so the
    one SSE client (llmstack.sse.send) measures TTFB beside TTFT."""

    def __init__(self) -> None:
        self.session = requests.Session()
        self.first_byte: float | None = None

    def post(self, url: str, **kwargs: Any) -> requests.Response:
        self.first_byte = None
        response = self.session.post(url, **kwargs)
        chunks = response.iter_content

        def timed(*args: Any, **chunk_kwargs: Any):
            for chunk in chunks(*args, **chunk_kwargs):
                if chunk and self.first_byte is None:
                    self.first_byte = time.perf_counter()
                yield chunk

        response.iter_content = timed  # type: ignore[method-assign]
        return response


def stream_once(
    session: FirstByteSession, url: str, api_key: str | None, model: str, max_tokens: int
) -> tuple[float, float]:
    """(seconds to the first body byte, seconds to the first chunk with text) for one request."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = build_body(COMPLETIONS, model, "Measure me", None, max_tokens, stream=True)
    record: RequestRecord = send(session, url, COMPLETIONS, body, headers, "gateway-overhead", timeout=60)
    if not record.ok or record.ttft is None or session.first_byte is None:
        raise StackError(f"{url}: {record.error or 'no text in the stream'}")
    return session.first_byte - record.started, record.ttft


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict:
    """Per path and metric, p50/p90/p99 in ms; and gateway minus direct."""
    summary: dict = {}
    for name, metrics in samples.items():
        summary[name] = {}
        for metric, values in metrics.items():
            figures = spread(values).as_dict()
            summary[name][metric] = {f"{stat}_ms": figures[stat] for stat in STATS}
    summary["added_by_gateway_ms"] = {
        metric: {
            f"{stat}_ms": summary["gateway"][metric][f"{stat}_ms"] - summary["direct"][metric][f"{stat}_ms"]
            for stat in STATS
        }
        for metric in ("ttfb", "ttft")
    }
    return summary


def measure(args: argparse.Namespace) -> dict:
    paths = {"gateway": (args.gateway_url, args.api_key), "direct": (args.direct_url, None)}
    samples: dict[str, dict[str, list[float]]] = {name: {"ttfb": [], "ttft": []} for name in paths}
    session = FirstByteSession()
    for _ in range(args.warmup):
        for url, key in paths.values():
            stream_once(session, url, key, args.model, args.max_tokens)
    for index in progress_bar(range(args.requests), "request pairs"):
        order = list(paths.items()) if index % 2 == 0 else list(reversed(paths.items()))
        for name, (url, key) in order:
            ttfb, ttft = stream_once(session, url, key, args.model, args.max_tokens)
            samples[name]["ttfb"].append(ttfb * 1000)
            samples[name]["ttft"].append(ttft * 1000)
    summary = summarize(samples)
    summary["requests_per_path"] = args.requests
    return summary


def table(summary: dict) -> str:
    lines = [f"{'path':<22}{'TTFB p50':>10}{'p90':>9}{'p99':>9}{'TTFT p50':>11}{'p90':>9}{'p99':>9}   (ms)"]
    for name in ("gateway", "direct", "added_by_gateway_ms"):
        row = summary[name]
        label = "added by the gateway" if name == "added_by_gateway_ms" else name
        cells = [f"{row['ttfb'][f'{s}_ms']:>{w}.2f}" for s, w in zip(STATS, (10, 9, 9), strict=True)]
        cells += [f"{row['ttft'][f'{s}_ms']:>{w}.2f}" for s, w in zip(STATS, (11, 9, 9), strict=True)]
        lines.append(f"{label:<22}" + "".join(cells))
    return "\n".join(lines)


def run_in_network(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this benchmark again in a container on the project's backend network."""
    forwarded = [a for a in argv if a not in ("--compose-project", args.compose_project)]
    command = [
        "docker",
        "run",
        "--rm",
        "--network",
        f"{args.compose_project}_backend",
        "-v",
        f"{REPO_ROOT}:/bench:ro",
        "-w",
        "/bench",
        "-e",
        "PYTHONPATH=/bench",
        "--entrypoint",
        "python3",
        args.image,
        "-m",
        __name__,
        *forwarded,
    ]
    try:
        return subprocess.run(command).returncode
    except FileNotFoundError as err:
        raise StackError("docker is not installed or not on PATH") from err


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--gateway-url", default="http://nginx:8080")
    parser.add_argument("--direct-url", default="http://vllm:8000")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LLM_STACK_API_KEY"),
        help="key for the gateway (default: $LLM_STACK_API_KEY)",
    )
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--requests", type=int, default=20, help="requests per path (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    add_json_argument(parser)
    parser.add_argument("--compose-project", help="run inside this compose project's backend network")
    parser.add_argument(
        "--image",
        default="llm-stack/vllm:cpu",
        help="image whose python3 runs the benchmark with --compose-project (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if not args.api_key:
        raise UsageError("an API key is needed: --api-key or LLM_STACK_API_KEY")
    if args.requests < 1 or args.warmup < 0 or args.max_tokens < 1:
        raise UsageError("--requests and --max-tokens must be positive, --warmup not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.compose_project:
        return run_in_network(args, argv)
    summary = measure(args)
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
