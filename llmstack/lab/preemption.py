"""What happens when concurrency exceeds the KV cache: queueing, preemption, and longer TTFT.

Sends a baseline of single requests, then a burst of concurrent long streamed requests through the
gateway, while polling vLLM's scheduler metrics through `docker compose`. Reports the KV capacity
(vllm:cache_config_info) against the burst's demand, how many requests waited and ran at once, how
far vllm:num_preemptions_total rose, whether every request still completed, and TTFT alone vs in
the burst. Run it against a stack with a deliberately small KV cache to see preemption (docs/preemption.md),
e.g. VLLM_EXTRA_ARGS="--num-gpu-blocks-override 24" MAX_MODEL_LEN=2048.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmstack import promtext
from llmstack.cli import (
    StackError,
    UsageError,
    add_output_arguments,
    load_pyplot,
    parser_from_doc,
    progress,
    results_path,
    save_chart,
    write_json,
)
from llmstack.lab.latency import DEFAULT_BASE_URL, LONG_PROMPT, measure
from llmstack.sse import ApiClient
from llmstack.stats import percentile, spread
from llmstack.vllm import (
    ComposeStack,
    HostVllm,
    add_stack_arguments,
    cache_config_labels,
    label_number,
    stack_from_args,
)

SCHEDULER_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
)


class MetricsPoller(threading.Thread):
    """Polls vLLM's scheduler gauges until stopped; each poll is one `docker compose exec`."""

    def __init__(self, stack: ComposeStack | HostVllm, interval: float, max_polls: int):
        super().__init__(daemon=True)
        self.stack, self.interval, self.max_polls = stack, interval, max_polls
        self.samples: list[dict] = []
        self.stopped = threading.Event()
        self.error: str | None = None
        self.start_time = time.perf_counter()

    def run(self) -> None:
        for _ in range(self.max_polls):
            if self.stopped.is_set():
                return
            try:
                samples = self.stack.metrics()
            except StackError as err:
                self.error = str(err)
                return
            row: dict[str, float | None] = {"t": time.perf_counter() - self.start_time}
            for name in SCHEDULER_METRICS:
                row[name.split(":", 1)[1]] = promtext.total(samples, name)
            self.samples.append(row)
            self.stopped.wait(self.interval)


def burst_request(client: ApiClient, model: str, prompt: str, max_tokens: int, start: float, index: int) -> dict:
    sent = time.perf_counter()
    try:
        sample = measure(client, model, f"burst-{index}", prompt, max_tokens)
        return {
            "index": index,
            "completed": True,
            "sent_s": sent - start,
            "ttft_ms": sample.ttft_ms,
            "total_ms": sample.total_ms,
            "input_tokens": sample.input_tokens,
            "output_tokens": sample.output_tokens,
        }
    except StackError as err:
        return {"index": index, "completed": False, "sent_s": sent - start, "error": str(err)}


def chart(report: dict, path: Path) -> None:
    plt = load_pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5))
    polls = report["metrics_timeline"]
    if polls:
        ts = [p["t"] for p in polls]
        top.plot(ts, [p["num_requests_running"] for p in polls], label="running")
        top.plot(ts, [p["num_requests_waiting"] for p in polls], label="waiting")
        base = polls[0]["num_preemptions_total"] or 0
        top.plot(ts, [(p["num_preemptions_total"] or 0) - base for p in polls], label="preemptions (since start)")
        top.set_xlabel("seconds into the burst")
        top.set_ylabel("requests / preemptions")
        top.legend(fontsize=8)
        top.grid(alpha=0.3)
    done = [r for r in report["burst"] if r["completed"]]
    bottom.bar([r["index"] for r in done], [r["ttft_ms"] for r in done], label="TTFT in the burst")
    if report["baseline_ttft_ms"]:
        bottom.axhline(
            report["baseline_ttft_ms"]["p50"],
            color="red",
            linestyle="--",
            label=f"TTFT alone (median {report['baseline_ttft_ms']['p50']:.0f} ms)",
        )
    bottom.set_yscale("log")
    bottom.set_xlabel("request")
    bottom.set_ylabel("TTFT (ms)")
    bottom.legend(fontsize=8)
    fig.suptitle(
        f"{report['model']}: {report['concurrency']} concurrent requests, KV capacity "
        f"{report['kv_capacity_tokens']:,} tokens"
    )
    save_chart(plt, fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc("preemption.py", __doc__)
    parser.add_argument(
        "--base-url",
        default=os.environ.get("LLM_STACK_BASE_URL", DEFAULT_BASE_URL),
        help="the gateway (default: LLM_STACK_BASE_URL or %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LLM_STACK_API_KEY"),
        help="API key (default: LLM_STACK_API_KEY); its per-key concurrency limit must allow --concurrency",
    )
    parser.add_argument("--concurrency", type=int, default=12, help="requests in the burst (default: %(default)s)")
    parser.add_argument(
        "--prompt-repeats",
        type=int,
        default=4,
        help="the lab's long prompt repeated this many times (default: %(default)s)",
    )
    parser.add_argument("--max-tokens", type=int, default=400, help="output tokens per request (default: %(default)s)")
    parser.add_argument("--baseline-runs", type=int, default=3, help="single requests first (default: %(default)s)")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between metric polls")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per request (default: %(default)s)")
    add_stack_arguments(parser)
    add_output_arguments(parser, "preemption")
    args = parser.parse_args(argv)
    if not 1 <= args.concurrency <= 256:
        raise UsageError("--concurrency must be between 1 and 256")
    if args.prompt_repeats < 1 or args.max_tokens < 2 or args.baseline_runs < 1 or args.poll_interval <= 0:
        raise UsageError("--prompt-repeats >= 1, --max-tokens >= 2, --baseline-runs >= 1, --poll-interval > 0")
    return args


def summary(values: list[float]) -> dict | None:
    """Median and range (llmstack.stats) of the TTFTs, None when no request completed."""
    return spread(values).as_dict() if values else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = ApiClient(args.base_url, args.api_key, args.timeout)
    stack = stack_from_args(args)
    models = client.models()
    if not models:
        raise StackError(f"{args.base_url}/v1/models lists no model")
    model = models[0]["id"]
    progress("reading the KV cache size from vllm:cache_config_info ...")
    before = stack.metrics()
    labels = cache_config_labels(before)
    block_size = int(label_number(labels, "block_size") or 0)
    blocks = int(label_number(labels, "num_gpu_blocks") or 0)
    capacity = int(label_number(labels, "kv_cache_size_tokens") or blocks * block_size)
    preemptions_before = promtext.total(before, "vllm:num_preemptions_total") or 0.0
    prompt = " ".join([LONG_PROMPT] * args.prompt_repeats)

    baseline = []
    for i in range(args.baseline_runs):
        progress(f"baseline: single request {i + 1}/{args.baseline_runs}")
        baseline.append(measure(client, model, "alone", prompt, args.max_tokens))
    per_request = int(percentile([s.input_tokens for s in baseline], 50) or 0) + args.max_tokens

    progress(
        f"burst: {args.concurrency} concurrent requests of ~{per_request} tokens "
        f"(demand {per_request * args.concurrency:,} tokens, capacity {capacity:,}) ..."
    )
    before_burst = stack.metrics()
    poller = MetricsPoller(stack, args.poll_interval, max_polls=int(args.timeout / args.poll_interval) + 10)
    poller.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        futures = [
            pool.submit(burst_request, client, model, prompt, args.max_tokens, start, i)
            for i in range(args.concurrency)
        ]
        burst = []
        for future in futures:
            burst.append(future.result())
            progress(f"burst: {len(burst)}/{args.concurrency} requests finished")
    burst_seconds = time.perf_counter() - start
    poller.stopped.set()
    poller.join(timeout=30)
    after = stack.metrics()
    preemptions = (promtext.total(after, "vllm:num_preemptions_total") or 0.0) - preemptions_before
    # vLLM's own queue-time histogram over the burst: the polled gauge can miss a queue when the
    # host is too busy to poll often, this cannot.
    queued = {
        part: (promtext.total(after, f"vllm:request_queue_time_seconds_{part}") or 0.0)
        - (promtext.total(before_burst, f"vllm:request_queue_time_seconds_{part}") or 0.0)
        for part in ("sum", "count")
    }

    completed = [r for r in burst if r["completed"]]
    timeline = poller.samples
    report = {
        "base_url": args.base_url,
        "model": model,
        "concurrency": args.concurrency,
        "kv_block_size": block_size,
        "kv_blocks": blocks,
        "kv_capacity_tokens": capacity,
        "tokens_per_request": per_request,
        "demand_tokens": per_request * args.concurrency,
        "preemptions": int(preemptions),
        "completed": len(completed),
        "failed": len(burst) - len(completed),
        "max_running": max((p["num_requests_running"] or 0 for p in timeline), default=None),
        "max_waiting": max((p["num_requests_waiting"] or 0 for p in timeline), default=None),
        "mean_queue_seconds": queued["sum"] / queued["count"] if queued["count"] else None,
        "max_kv_cache_usage": max((p["kv_cache_usage_perc"] or 0 for p in timeline), default=None),
        "baseline_ttft_ms": summary([s.ttft_ms for s in baseline]),
        "burst_ttft_ms": summary([r["ttft_ms"] for r in completed]),
        "burst_seconds": burst_seconds,
        "burst": burst,
        "metrics_timeline": timeline,
        "poll_error": poller.error,
    }
    if not args.no_chart:
        path = args.chart or results_path("preemption.png")
        chart(report, path)
        report["chart"] = str(path)
    output = args.output or results_path("preemption.json")
    write_json(output, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
        print(f"JSON:  {output}")
    return 0 if not report["failed"] else 1


def print_report(r: dict) -> None:
    print(
        f"Model {r['model']}: KV cache {r['kv_blocks']:,} blocks x {r['kv_block_size']} = "
        f"{r['kv_capacity_tokens']:,} tokens"
    )
    print(
        f"Burst: {r['concurrency']} requests x ~{r['tokens_per_request']:,} tokens = {r['demand_tokens']:,} "
        f"tokens demanded ({r['demand_tokens'] / max(r['kv_capacity_tokens'], 1):.1f}x the cache)\n"
    )
    print(
        f"Completed:               {r['completed']}/{r['concurrency']}"
        + (f"  ({r['failed']} FAILED)" if r["failed"] else "")
    )
    print(f"Preemptions (vllm:num_preemptions_total rose by): {r['preemptions']}")
    if r["max_running"] is not None:
        print(
            f"Most running at once:    {r['max_running']:.0f}    most waiting: {r['max_waiting']:.0f}    "
            f"peak KV cache usage: {100 * r['max_kv_cache_usage']:.0f} %"
        )
    if r.get("mean_queue_seconds") is not None:
        print(f"Mean time in vLLM's queue (vllm:request_queue_time_seconds): {r['mean_queue_seconds']:.2f} s")
    if r["poll_error"]:
        print(f"(metric polling stopped: {r['poll_error']})")
    b, c = r["baseline_ttft_ms"], r["burst_ttft_ms"]
    print(f"TTFT alone:              median {b['p50']:.0f} ms [{b['min']:.0f}-{b['max']:.0f}]")
    if c:
        print(
            f"TTFT in the burst:       median {c['p50']:.0f} ms [{c['min']:.0f}-{c['max']:.0f}] "
            f"({c['p50'] / b['p50']:.1f}x alone)"
        )
    print(f"Burst took {r['burst_seconds']:.1f} s")
    if not r["preemptions"]:
        print("No preemption: the KV cache held the burst. Shrink it (docs/preemption.md) or raise --concurrency.")
    if r.get("chart"):
        print(f"\nChart: {r['chart']}")
