#!/usr/bin/env python3
"""Single-request latency through the HTTP API (the lab's second experiment, done properly).

Warm-up requests first, then each prompt measured several times, one request at a time, with
streaming: input and output tokens (the server's usage counts), TTFT (first chunk with text), TPOT
((total - TTFT) / (output tokens - 1)), total time and tokens/s, as medians with min-max spread.
A sweep of longer prompts gives the TTFT-vs-prompt-length chart.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from lablib import (ScriptArgumentParser, StackError, UsageError, load_pyplot, progress,
                    results_path, run_main, save_chart, write_json)

SHORT_PROMPT = "What is artificial intelligence?"
LONG_PROMPT = ("Please explain in detail the development history of deep learning, starting from the perceptron, "
               "through multi-layer perceptrons, convolutional neural networks, recurrent neural networks, and "
               "finally the Transformer architecture. For each stage, please describe its core innovations and "
               "representative work.")
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


class Client:
    """A streaming OpenAI-API client on http.client: no dependencies, and timing close to the socket."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise UsageError(f"--base-url '{base_url}' is not an http(s) URL")
        self.https = parsed.scheme == "https"
        self.host, self.port = parsed.hostname, parsed.port or (443 if self.https else 80)
        self.prefix = parsed.path.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.base_url = base_url

    def connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def _check(self, response: http.client.HTTPResponse) -> None:
        if response.status == 200:
            return
        body = response.read().decode(errors="replace")
        try:
            detail = json.loads(body).get("error", {})
            detail = detail.get("message", "") if isinstance(detail, dict) else str(detail)
        except (json.JSONDecodeError, AttributeError):
            detail = body.strip()[:200]
        hint = " (check --api-key / LLM_STACK_API_KEY)" if response.status == 401 else ""
        raise StackError(f"{self.base_url} answered {response.status} {response.reason}{hint}: {detail}".rstrip(": "))

    def request(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        conn = self.connection()
        try:
            conn.request(method, self.prefix + path, body=json.dumps(body) if body else None, headers=self.headers)
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as err:
            raise StackError(f"cannot reach {self.base_url}: {err}") from err

    def models(self) -> list[dict]:
        response = self.request("GET", "/v1/models")
        self._check(response)
        return json.loads(response.read()).get("data", [])

    def stream_completion(self, model: str, prompt: str, max_tokens: int) -> dict:
        """One streamed completion; returns timings (perf_counter seconds) and the server's usage."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        response = self.request("POST", "/v1/completions", body)
        self._check(response)
        first_text, chunk_times, usage = None, [], None
        try:
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    first_text = first_text or now
                    chunk_times.append(now)
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
            raise StackError(f"the stream from {self.base_url} broke: {err}") from err
        end = time.perf_counter()
        if usage is None:
            raise StackError("the server sent no usage chunk (stream_options.include_usage unsupported?)")
        if first_text is None:
            raise StackError("the stream carried no text")
        return {"start": start, "first_text": first_text, "end": end, "chunk_times": chunk_times,
                "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]}


def measure(client: Client, model: str, label: str, prompt: str, max_tokens: int, unique: bool = True) -> Sample:
    if unique:
        # A different first block each time, so vLLM's prefix cache cannot skip the prefill being measured.
        prompt = f"Request {uuid.uuid4().hex[:12]}. {prompt}"
    r = client.stream_completion(model, prompt, max_tokens)
    total = r["end"] - r["start"]
    ttft = r["first_text"] - r["start"]
    out = r["completion_tokens"]
    tpot = (total - ttft) / (out - 1) * 1000 if out > 1 else None
    return Sample(label, r["prompt_tokens"], out, ttft * 1000, tpot, total * 1000, out / total if total else 0.0,
                  len(r["chunk_times"]))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(samples: list[Sample]) -> dict:
    tpots = [s.tpot_ms for s in samples if s.tpot_ms is not None]
    return {
        "label": samples[0].label, "runs": len(samples),
        "input_tokens": int(statistics.median(s.input_tokens for s in samples)),
        "output_tokens": int(statistics.median(s.output_tokens for s in samples)),
        "ttft_ms": spread([s.ttft_ms for s in samples]),
        "tpot_ms": spread(tpots) if tpots else None,
        "total_ms": spread([s.total_ms for s in samples]),
        "tokens_per_s": spread([s.tokens_per_s for s in samples]),
        "text_chunks": spread([s.text_chunks for s in samples]),
    }


def fmt(stat: dict | None, digits: int = 1) -> str:
    if not stat:
        return "n/a"
    return f"{stat['median']:.{digits}f} [{stat['min']:.{digits}f}-{stat['max']:.{digits}f}]"


def print_table(summaries: list[dict]) -> None:
    print(f"{'Prompt':<10} | {'In tok':>6} | {'Out tok':>7} | {'TTFT ms':>20} | {'TPOT ms':>17} | "
          f"{'Total ms':>22} | {'tok/s':>20}")
    print("-" * 121)
    for s in summaries:
        print(f"{s['label']:<10} | {s['input_tokens']:>6} | {s['output_tokens']:>7} | {fmt(s['ttft_ms']):>20} | "
              f"{fmt(s['tpot_ms'], 2):>17} | {fmt(s['total_ms']):>22} | {fmt(s['tokens_per_s']):>20}")
    print(f"(median [min-max] of {summaries[0]['runs']} runs each)")
    coalesced = [s["label"] for s in summaries if s["text_chunks"]["min"] < s["output_tokens"]]
    if coalesced:
        print(f"Note: {', '.join(coalesced)}: some streams carried fewer SSE events than tokens (the server "
              "sent several tokens per event), so TPOT there is the gap the client saw, not the decode step.")


def chart(sweep: list[dict], path: Path, model: str) -> None:
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [s["input_tokens"] for s in sweep]
    med = [s["ttft_ms"]["median"] for s in sweep]
    low = [s["ttft_ms"]["median"] - s["ttft_ms"]["min"] for s in sweep]
    high = [s["ttft_ms"]["max"] - s["ttft_ms"]["median"] for s in sweep]
    ax.errorbar(xs, med, yerr=[low, high], marker="o", capsize=4, label="TTFT (median, min-max)")
    tpot = [s["tpot_ms"]["median"] for s in sweep if s["tpot_ms"]]
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
    parser = ScriptArgumentParser(prog="latency.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("LLM_STACK_BASE_URL", DEFAULT_BASE_URL),
                        help="the gateway (default: LLM_STACK_BASE_URL or %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("LLM_STACK_API_KEY"),
                        help="API key (default: LLM_STACK_API_KEY)")
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--runs", type=int, default=5, help="measured runs per prompt (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=50, help="output tokens per request (default: %(default)s)")
    parser.add_argument("--short-prompt", default=SHORT_PROMPT)
    parser.add_argument("--long-prompt", default=LONG_PROMPT)
    parser.add_argument("--sweep", default="1,4,16,32", type=str,
                        help="TTFT-vs-length sweep: the long prompt repeated this many times (default: %(default)s; "
                             "'none' to skip)")
    parser.add_argument("--allow-prefix-cache", action="store_true",
                        help="send identical prompts (default: a unique prefix per request defeats prefix caching)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per request (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--output", type=Path, help="also save the JSON here (default: results/latency.json)")
    parser.add_argument("--chart", type=Path, help="PNG path (default: results/latency.png)")
    parser.add_argument("--no-chart", action="store_true")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.max_tokens < 2 or args.timeout <= 0:
        raise UsageError("--runs must be >= 1, --warmup >= 0, --max-tokens >= 2 and --timeout > 0")
    args.sweep_repeats = [] if args.sweep.lower() == "none" else positive_ints(args.sweep)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = Client(args.base_url, args.api_key, args.timeout)
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
                    measure(client, model, label, prompt, args.max_tokens, not args.allow_prefix_cache))
            except StackError as err:
                # A sweep point longer than max_model_len is refused by vLLM with 400; skip it, keep the rest.
                if label.startswith("Long x") and " 400 " in str(err):
                    skipped.append({"label": label, "reason": str(err)})
                    samples.pop(label, None)
                    break
                raise
    summaries = {label: summarise(s) for label, s in samples.items()}
    table = [summaries[label] for label, _ in cases]
    sweep = sorted((summaries[label] for label, _ in sweep_cases if label in summaries),
                   key=lambda s: s["input_tokens"])
    report = {"base_url": args.base_url, "model": model, "max_model_len": max_len, "max_tokens": args.max_tokens,
              "prefix_cache_defeated": not args.allow_prefix_cache,
              "runs": args.runs, "warmup": args.warmup, "results": table, "sweep": sweep, "skipped": skipped,
              "samples": [asdict(s) for group in samples.values() for s in group]}
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
    print(f"Model {model} at {args.base_url}, {args.max_tokens} output tokens per request (ignore_eos), "
          f"streaming, one request at a time\n")
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


if __name__ == "__main__":
    sys.exit(run_main("latency.py", main))
