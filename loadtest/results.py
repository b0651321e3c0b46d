"""The experiments' figures from the raw records (no Locust import, so unit tests can use it).

Every percentile and spread comes from llmstack.stats; vLLM's side comes from promtext Snapshots
taken before and after a phase.
"""

from __future__ import annotations

import statistics

from llmstack.promtext import MetricsFormatError, Snapshot, fetch
from llmstack.sse import RequestRecord
from llmstack.stats import deciles, first_wave_split, mean_in_flight_by_part, spread
from loadtest.step_state import StepWindow, max_overlap, samples_in_step

TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
TPOT_HISTOGRAM = "vllm:request_time_per_output_token_seconds"
# From a request's first scheduling to its last token (preemptions included): its time in vLLM's batch.
RUNNING_HISTOGRAM = "vllm:request_inference_time_seconds"
STREAMING_KEYS = (
    "ttft_ms",
    "decode_ms",
    "output_tokens",
    "avg_interval_ms",
    "tpot_ms",
    "tokens_per_s",
    "ttft_interval_ratio",
    "e2e_ms",
)


def read_snapshot(url: str | None) -> Snapshot | None:
    """vLLM's /metrics now; None when it is not configured or not reachable (the cross-check is
    optional, the load test goes on)."""
    if not url:
        return None
    try:
        return Snapshot.from_text(fetch(url, timeout=5))
    except (OSError, MetricsFormatError):
        return None


def spread_ms(values: list[float]) -> dict:
    """Spread of values in seconds, in milliseconds."""
    return spread(values).scaled(1000).as_dict()


def mean_ms(before: Snapshot | None, after: Snapshot | None, name: str) -> float | None:
    if not before or not after:
        return None
    mean = before.histogram_mean(after, name)
    return mean * 1000 if mean is not None else None


def span(ok: list[RequestRecord]) -> tuple[float, float, int]:
    """(first request's start, last response's end, output tokens) of successful requests:
    every throughput in the tables is tokens over that span."""
    begin = min(r.started for r in ok)
    end = max(r.started + r.e2e for r in ok)
    return begin, end, sum(r.output_tokens for r in ok)


def mean_in_flight(ok: list[RequestRecord], seconds: float) -> float | None:
    """Requests at once on average over `seconds` (Little's law): their summed time over the span."""
    return sum(r.e2e for r in ok) / seconds if seconds > 0 else None


def concurrency_row(
    level: int,
    records: list[RequestRecord],
    max_tokens: int,
    windows: list[StepWindow],
    running_samples: list[tuple[float, float, float]],
    worker_windows: list[StepWindow] | None = None,
) -> dict:
    """One level of the concurrency table from that step's records."""
    ok = [r for r in records if r.ok]
    running = samples_in_step(windows, running_samples, level)
    row: dict = {
        "concurrency": level,
        "requests": len(records),
        "failures": len(records) - len(ok),
        "max_tokens": max_tokens,
        "max_in_flight": max_overlap([(r.started, r.started + r.e2e) for r in records]),
        "max_running_in_vllm": max(running) if running else None,
        "running_samples_in_vllm": len(running),
    }
    if ok:
        begin, end, tokens = span(ok)
        first_tokens = [(r.started, r.ttft) for r in ok if r.ttft is not None]  # (start, TTFT in s)
        row.update(
            {
                "output_tokens": tokens,
                "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok),
                "total_time_s": end - begin,
                "throughput_tok_s": tokens / (end - begin),
                # Requests in flight on average over the step (the time they took over its span):
                # a closed loop of `level` clients should keep it near the level.
                "mean_in_flight": mean_in_flight(ok, end - begin),
                "mean_in_flight_by_quarter": mean_in_flight_by_part([(r.started, r.started + r.e2e) for r in ok]),
                "avg_tps_per_request": statistics.fmean(r.tokens_per_second or 0.0 for r in ok),
                "ttft_ms": spread_ms([ttft for _start, ttft in first_tokens]),
                "ttft_ms_deciles": deciles(ttft * 1000 for _start, ttft in first_tokens),
                # Every client's first request, sent together when the step opens, against the rest.
                "ttft_ms_first_wave_and_later": first_wave_split(
                    [(start, ttft * 1000) for start, ttft in first_tokens], level
                ),
                "tpot_ms": spread_ms([r.tpot for r in ok if r.tpot is not None]),
                "e2e_ms": spread_ms([r.e2e for r in ok]),
            }
        )
        row.update(
            client_cpu(
                [w for w in windows if w.level == level],
                tokens,
                [w for w in worker_windows or [] if w.level == level],
            )
        )
    return row


def cpu_seconds(windows: list[StepWindow]) -> float:
    return sum((w.cpu_ended or 0.0) - w.cpu_started for w in windows if w.cpu_ended is not None)


def client_cpu(windows: list[StepWindow], tokens: int, worker_windows: list[StepWindow] | None = None) -> dict:
    """The load generator's CPU use during a step, in % of one core: this process's, plus its
    worker processes' over their windows of the same step (so it can pass 100 with workers)."""
    closed = [w for w in windows if w.cpu_ended is not None and w.ended is not None]
    wall = sum((w.ended or 0.0) - w.started for w in closed)
    cpu = cpu_seconds(closed) + cpu_seconds(worker_windows or [])
    if wall <= 0 or tokens <= 0:
        return {}
    return {"client_cpu_pct": cpu / wall * 100, "client_cpu_ms_per_token": cpu / tokens * 1000}


def cross_check(before: Snapshot | None, after: Snapshot | None, records: list[RequestRecord]) -> dict:
    """Client-side means against vLLM's own histograms over the same requests."""
    ok = [r for r in records if r.ok]
    client_ttft = [r.ttft for r in ok if r.ttft is not None]
    client_tpot = [r.tpot for r in ok if r.tpot is not None]
    # Requests at once on average over the requests' span (Little's law), from the client's
    # latencies and from vLLM's own running time: counters, so no sampling can miss a busy moment.
    begin, end, _ = span(ok) if ok else (0.0, 0.0, 0)
    seconds = end - begin
    running = RUNNING_HISTOGRAM + "_sum"
    # A replica restarted between the snapshots resets its counters: no figure then.
    running_s = (
        before.delta(after, running) if before and after and before.has(running) and after.has(running) else None
    )
    return {
        "client_ttft_mean_ms": statistics.fmean(client_ttft) * 1000 if client_ttft else None,
        "client_tpot_mean_ms": statistics.fmean(client_tpot) * 1000 if client_tpot else None,
        "vllm_ttft_mean_ms": mean_ms(before, after, TTFT_HISTOGRAM),
        "vllm_tpot_mean_ms": mean_ms(before, after, TPOT_HISTOGRAM),
        "vllm_requests": before.delta(after, TTFT_HISTOGRAM + "_count") if before and after else None,
        "client_requests": len(ok),
        "span_s": seconds if seconds > 0 else None,
        "client_mean_in_flight": mean_in_flight(ok, seconds),
        "vllm_mean_running": running_s / seconds if running_s is not None and running_s >= 0 and seconds > 0 else None,
    }


def streaming_row(record: RequestRecord) -> dict:
    row: dict = {"ok": record.ok, "error": record.error}
    if not record.ok:
        return row
    gaps = record.chunk_gaps
    decode = record.decode_time or 0.0
    interval = statistics.fmean(gaps) if gaps else None
    row.update(
        {
            "ttft_ms": record.ttft * 1000 if record.ttft is not None else None,
            "decode_ms": decode * 1000,
            "output_tokens": record.output_tokens,
            "chunks": len(record.chunk_offsets),
            "avg_interval_ms": interval * 1000 if interval is not None else None,
            "tpot_ms": record.tpot * 1000 if record.tpot is not None else None,
            "tokens_per_s": (record.output_tokens - 1) / decode if decode > 0 else None,
            "ttft_interval_ratio": (record.ttft / interval) if interval and record.ttft else None,
            "e2e_ms": record.e2e * 1000,
        }
    )
    return row


def medians(rows: list[dict], keys: tuple[str, ...] = STREAMING_KEYS) -> dict:
    """The median of each key over the rows that have it."""
    result = {}
    for key in keys:
        values = [row[key] for row in rows if row.get(key) is not None]
        if values:
            result[key] = spread(values).p50
    return result


def streaming_result(records: list[RequestRecord], max_tokens: int) -> dict:
    rows = [streaming_row(record) for record in records]
    timeline = next((r.chunk_offsets for r in reversed(records) if r.ok), [])
    return {
        "max_tokens": max_tokens,
        "rows": rows,
        "median": medians([row for row in rows if row["ok"]]),
        "timeline_s": timeline,
    }


def prefix_phase(records: list[RequestRecord], before: Snapshot | None, after: Snapshot | None) -> dict:
    ok = [r for r in records if r.ok and r.ttft is not None]
    hit_rate = None
    if before and after and before.delta(after, "vllm:prefix_cache_queries_total") > 0:
        hit_rate = before.delta(after, "vllm:prefix_cache_hits_total") / before.delta(
            after, "vllm:prefix_cache_queries_total"
        )
    return {
        "requests": len(records),
        "failures": len(records) - len(ok),
        "ttft_ms": spread_ms([r.ttft for r in ok if r.ttft is not None]),
        "prompt_tokens": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
        "cached_tokens_reported": sum(r.cached_tokens or 0 for r in ok),
        "vllm_prefix_cache_hit_rate": hit_rate,
        "vllm_ttft_mean_ms": mean_ms(before, after, TTFT_HISTOGRAM),
    }


def ttft_reduction_pct(phases: dict) -> float | None:
    unique = phases["unique"]["ttft_ms"]["p50"]
    shared = phases["shared"]["ttft_ms"]["p50"]
    return (1 - shared / unique) * 100 if unique and shared is not None else None
