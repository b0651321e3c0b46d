"""Single-request latency through the HTTP API (the lab's second experiment, done properly).

Warm-up requests first, then each prompt measured several times, one request at a time, with
streaming: input and output tokens (the server's usage counts), TTFT (first chunk with text), TPOT
((total - TTFT) / (output tokens - 1)), total time and tokens/s, as medians with min-max spread.
A sweep of longer prompts gives the TTFT-vs-prompt-length chart.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

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
from llmstack.sse import ApiClient, RequestFailed
from llmstack.stats import percentile, spread

SHORT_PROMPT = "What is artificial intelligence?"
LONG_PROMPT = (
    "Please explain in detail the development history of deep learning, starting from the perceptron, "
    "through multi-layer perceptrons, convolutional neural networks, recurrent neural networks, and "
    "finally the Transformer architecture. For each stage, please describe its core innovations and "
    "representative work."
)
DEFAULT_BASE_URL = "http://localhost:8080"


@dataclass
class Sample:
    label: str
    input_tokens: int
    output_tokens: int
    ttft_ms: float
    tpot_ms: float | None
    total_ms: float
    tokens_per_s: float
    text_chunks: int  # fewer than output tokens: the server coalesced tokens into one SSE event


def measure(client: ApiClient, model: str, label: str, prompt: str, max_tokens: int, unique: bool = True) -> Sample:
    if unique:
        # A different first block each time, so vLLM's prefix cache cannot skip the prefill being measured.
        prompt = f"Request {uuid.uuid4().hex[:12]}. {prompt}"
    record = client.completion(model, prompt, max_tokens, kind=label)
    if record.ttft is None:
        raise StackError("the stream carried no text")
    tpot = record.tpot
    return Sample(
        label,
        record.prompt_tokens,
        record.output_tokens,
        record.ttft * 1000,
        None if tpot is None else tpot * 1000,
        record.e2e * 1000,
        record.tokens_per_second or 0.0,
        len(record.chunk_offsets),
    )


def summary(values: list[float]) -> dict:
    """Median and range (llmstack.stats) of one figure over the runs."""
    return spread(values).as_dict()


def summarise(samples: list[Sample]) -> dict:
    tpots = [s.tpot_ms for s in samples if s.tpot_ms is not None]
    return {
        "label": samples[0].label,
        "runs": len(samples),
        "input_tokens": int(percentile([s.input_tokens for s in samples], 50) or 0),
        "output_tokens": int(percentile([s.output_tokens for s in samples], 50) or 0),
        "ttft_ms": summary([s.ttft_ms for s in samples]),
        "tpot_ms": summary(tpots) if tpots else None,
        "total_ms": summary([s.total_ms for s in samples]),
        "tokens_per_s": summary([s.tokens_per_s for s in samples]),
        "text_chunks": summary([s.text_chunks for s in samples]),
    }


def fmt(stat: dict | None, digits: int = 1) -> str:
    if not stat:
        return "n/a"
    return f"{stat['p50']:.{digits}f} [{stat['min']:.{digits}f}-{stat['max']:.{digits}f}]"


def print_table(summaries: list[dict]) -> None:
    print(
        f"{'Prompt':<10} | {'In tok':>6} | {'Out tok':>7} | {'TTFT ms':>20} | {'TPOT ms':>17} | "
        f"{'Total ms':>22} | {'tok/s':>20}"
    )
    print("-" * 121)
    for s in summaries:
        print(
            f"{s['label']:<10} | {s['input_tokens']:>6} | {s['output_tokens']:>7} | {fmt(s['ttft_ms']):>20} | "
            f"{fmt(s['tpot_ms'], 2):>17} | {fmt(s['total_ms']):>22} | {fmt(s['tokens_per_s']):>20}"
        )
    print(f"(median [min-max] of {summaries[0]['runs']} runs each)")
    coalesced = [s["label"] for s in summaries if s["text_chunks"]["min"] < s["output_tokens"]]
    if coalesced:
        print(
            f"Note: {', '.join(coalesced)}: some streams carried fewer SSE events than tokens (the server "
            "sent several tokens per event), so TPOT there is the gap the client saw, not the decode step."
        )


def chart(sweep: list[dict], path: Path, model: str) -> None:
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [s["input_tokens"] for s in sweep]
    med = [s["ttft_ms"]["p50"] for s in sweep]
    low = [s["ttft_ms"]["p50"] - s["ttft_ms"]["min"] for s in sweep]
    high = [s["ttft_ms"]["max"] - s["ttft_ms"]["p50"] for s in sweep]
    ax.errorbar(xs, med, yerr=[low, high], marker="o", capsize=4, label="TTFT (median, min-max)")
    tpot = [s["tpot_ms"]["p50"] for s in sweep if s["tpot_ms"]]
    if len(tpot) == len(xs):
        ax.plot(xs, tpot, marker="s", linestyle="--", label="TPOT (median)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("prompt length (input tokens)")
    ax.set_ylabel("milliseconds")
    ax.set_title(f"{model}: time to first token vs prompt length")
    ax.grid(alpha=0.3)
    ax.legend()
    save_chart(plt, fig, path)


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise UsageError(f"'{text}' is not a comma-separated list of integers") from err
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"'{text}' must list positive integers")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc("latency.py", __doc__)
    parser.add_argument(
        "--base-url",
        default=os.environ.get("LLM_STACK_BASE_URL", DEFAULT_BASE_URL),
        help="the gateway (default: LLM_STACK_BASE_URL or %(default)s)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("LLM_STACK_API_KEY"), help="API key (default: LLM_STACK_API_KEY)"
    )
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--runs", type=int, default=5, help="measured runs per prompt (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=50, help="output tokens per request (default: %(default)s)")
    parser.add_argument("--short-prompt", default=SHORT_PROMPT)
    parser.add_argument("--long-prompt", default=LONG_PROMPT)
    parser.add_argument(
        "--sweep",
        default="1,4,16,32",
        type=str,
        help="TTFT-vs-length sweep: the long prompt repeated this many times (default: %(default)s; 'none' to skip)",
    )
    parser.add_argument(
        "--allow-prefix-cache",
        action="store_true",
        help="send identical prompts (default: a unique prefix per request defeats prefix caching)",
    )
    parser.add_argument("--timeout", type=float, default=120, help="seconds per request (default: %(default)s)")
    add_output_arguments(parser, "latency")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.max_tokens < 2 or args.timeout <= 0:
        raise UsageError("--runs must be >= 1, --warmup >= 0, --max-tokens >= 2 and --timeout > 0")
    args.sweep_repeats = [] if args.sweep.lower() == "none" else positive_ints(args.sweep)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = ApiClient(args.base_url, args.api_key, args.timeout)
    models = client.models()
    if not models:
        raise StackError(f"{args.base_url}/v1/models lists no model")
    model = args.model or models[0]["id"]
    if model not in [m["id"] for m in models]:
        raise UsageError(f"model '{model}' is not served (served: {', '.join(m['id'] for m in models)})")
    max_len = models[0].get("max_model_len")
    for i in range(args.warmup):
        progress(f"warm-up {i + 1}/{args.warmup}")
        measure(client, model, "warmup", args.short_prompt, args.max_tokens)
    cases = [("Short", args.short_prompt), ("Long", args.long_prompt)]
    sweep_cases = [(f"Long x{n}", " ".join([args.long_prompt] * n)) for n in args.sweep_repeats]
    samples: dict[str, list[Sample]] = {}
    skipped = []
    for label, prompt in cases + sweep_cases:
        for run in range(args.runs):
            progress(f"{label}: run {run + 1}/{args.runs}")
            try:
                samples.setdefault(label, []).append(
                    measure(client, model, label, prompt, args.max_tokens, not args.allow_prefix_cache)
                )
            except RequestFailed as err:
                # A sweep point longer than max_model_len is refused by vLLM with 400; skip it, keep the rest.
                if label.startswith("Long x") and err.status == 400:
                    skipped.append({"label": label, "reason": str(err)})
                    samples.pop(label, None)
                    break
                raise
    summaries = {label: summarise(s) for label, s in samples.items()}
    table = [summaries[label] for label, _ in cases]
    sweep = sorted(
        (summaries[label] for label, _ in sweep_cases if label in summaries), key=lambda s: s["input_tokens"]
    )
    report = {
        "base_url": args.base_url,
        "model": model,
        "max_model_len": max_len,
        "max_tokens": args.max_tokens,
        "prefix_cache_defeated": not args.allow_prefix_cache,
        "runs": args.runs,
        "warmup": args.warmup,
        "results": table,
        "sweep": sweep,
        "skipped": skipped,
        "samples": [asdict(s) for group in samples.values() for s in group],
    }
    chart_path = None
    if len(sweep) >= 2 and not args.no_chart:
        chart_path = args.chart or results_path("latency.png")
        chart(sweep, chart_path, model)
        report["chart"] = str(chart_path)
    output = args.output or results_path("latency.json")
    write_json(output, report)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"Model {model} at {args.base_url}, {args.max_tokens} output tokens per request (ignore_eos), "
        f"streaming, one request at a time\n"
    )
    print_table(table)
    if sweep:
        print("\nTTFT vs prompt length (the long prompt repeated):")
        print_table(sweep)
    for item in skipped:
        print(f"Skipped {item['label']}: {item['reason']}")
    if chart_path:
        print(f"\nChart: {chart_path}")
    print(f"JSON:  {output}")
    return 0
