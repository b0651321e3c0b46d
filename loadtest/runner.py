"""Locust's local runner driving the experiments: one phase = one user class + one step shape."""

from __future__ import annotations

import statistics
import select
import subprocess
import sys
import time

import gevent
from locust import events
from locust.env import Environment

from loadtest import metrics
from loadtest.openai_stream import RequestRecord
from loadtest.settings import Settings
from loadtest.stats_math import max_overlap, scaled, spread
from loadtest.step_state import STEP_STATE, samples_in_step
from loadtest.steps import StepLoadShape
from loadtest.users import (OpenAIUser, PrefixCacheUser, PrefixWorkload, StreamingCompletionUser,
                            use_settings)
from loadtest.vllm_metrics import Snapshot, VllmMetrics

SAMPLE_INTERVAL_S = 0.05
SAMPLER_START_TIMEOUT_S = 15


class ExperimentRunner:
    def __init__(self, settings: Settings, vllm_metrics_url: str | None):
        self.settings = settings
        use_settings(settings)
        self.vllm = VllmMetrics(vllm_metrics_url)
        self.all_records: list[RequestRecord] = []
        self.running_samples: list[tuple[float, float, float]] = []
        self.windows = []
        self.vllm_metrics_url = vllm_metrics_url

    # --- running -------------------------------------------------------------------------------
    def run_phase(self, user_class: type[OpenAIUser], levels: list[int], requests_per_user: int | None,
                  step_seconds: float | None, label: str, sample_running: bool = False) -> list[RequestRecord]:
        first = len(metrics.RECORDS)
        STEP_STATE.reset()
        shape = StepLoadShape(levels, step_seconds=step_seconds, requests_per_user=requests_per_user)
        environment = Environment(user_classes=[user_class], shape_class=shape, host=self.settings.host,
                                  events=events)
        runner = environment.create_local_runner()
        sampler = self._start_sampler() if sample_running else None
        progress = gevent.spawn(self._progress, label, levels, requests_per_user, first)
        try:
            runner.start_shape()
            gevent.sleep(0.1)
            while runner.shape_greenlet is not None:
                gevent.sleep(0.05)
        finally:
            runner.quit()
            progress.kill()
            STEP_STATE.finish()
            print("", file=sys.stderr, flush=True)
            self.running_samples = self._stop_sampler(sampler) if sampler else []
        self.windows = list(STEP_STATE.windows)
        records = metrics.RECORDS[first:]
        self.all_records.extend(records)
        return records

    def _start_sampler(self) -> subprocess.Popen | None:
        """vLLM's num_requests_running while the steps run: proof each step reached its level."""
        if not self.vllm_metrics_url:
            return None
        sampler = subprocess.Popen([sys.executable, "-m", "loadtest.running_sampler", self.vllm_metrics_url,
                                    "--interval", str(SAMPLE_INTERVAL_S)], stdout=subprocess.PIPE, text=True)
        # Start the load only once the sampler polls: a short first step could finish before it starts.
        ready, _, _ = select.select([sampler.stdout], [], [], SAMPLER_START_TIMEOUT_S)
        self._first_sample = sampler.stdout.readline() if ready else ""
        return sampler

    def _stop_sampler(self, sampler: subprocess.Popen) -> list[tuple[float, float, float]]:
        sampler.terminate()
        output, _ = sampler.communicate(timeout=10)
        samples = []
        for line in (self._first_sample + output).splitlines():
            sent, received, value = line.split()
            samples.append((float(sent), float(received), float(value)))
        return samples

    def _progress(self, label: str, levels: list[int], requests_per_user: int | None, first: int) -> None:
        started = time.perf_counter()
        while True:
            gevent.sleep(1)
            done = len(metrics.RECORDS) - first
            level = STEP_STATE.level
            total = f"/{sum(levels) * requests_per_user}" if requests_per_user else ""
            step = f", concurrency {level}" if level is not None else ""
            print(f"\r[{label}] {done}{total} requests{step}, {time.perf_counter() - started:.0f}s   ",
                  end="", file=sys.stderr, flush=True)

    def warm_up(self) -> None:
        """One request first: model discovery, connection set-up and any lazy compilation stay
        out of the tables. A gateway that refuses us is reported, and the run goes on so that every
        request's failure is counted in the tables."""
        self.run_phase(StreamingCompletionUser, [1], 1, None, "warm-up")
        records = self.all_records
        self.all_records = []
        if not self.settings.model or (records and not records[-1].ok):
            reason = records[-1].error if records else "no response"
            print(f"experiments: warning: the warm-up request through {self.settings.host} failed: {reason}",
                  file=sys.stderr, flush=True)

    def snapshot(self) -> Snapshot | None:
        return self.vllm.snapshot()

    # --- the experiments -----------------------------------------------------------------------
    def concurrency(self, levels: list[int], requests_per_user: int | None, step_seconds: float | None,
                    max_tokens: int) -> dict:
        self.settings.max_tokens = max_tokens
        before = self.snapshot()
        records = self.run_phase(StreamingCompletionUser, levels, requests_per_user, step_seconds,
                                 "concurrency", sample_running=True)
        after = self.snapshot()
        rows = []
        for level in levels:
            step_records = [r for r in records if r.step == level]
            ok = [r for r in step_records if r.ok]
            running = samples_in_step(self.windows, self.running_samples, level)
            row = {"concurrency": level, "requests": len(step_records), "failures": len(step_records) - len(ok),
                   "max_tokens": max_tokens,
                   "max_in_flight": max_overlap([(r.started, r.started + r.e2e) for r in step_records]),
                   "max_running_in_vllm": max(running) if running else None,
                   "running_samples_in_vllm": len(running)}
            if ok:
                begin = min(r.started for r in ok)
                end = max(r.started + r.e2e for r in ok)
                tokens = sum(r.output_tokens for r in ok)
                row.update({
                    "output_tokens": tokens,
                    "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok),
                    "total_time_s": end - begin,
                    "throughput_tok_s": tokens / (end - begin),
                    "avg_tps_per_request": statistics.fmean(r.tokens_per_second for r in ok),
                    "ttft_ms": scaled(spread([r.ttft for r in ok if r.ttft is not None]), 1000),
                    "tpot_ms": scaled(spread([r.tpot for r in ok if r.tpot is not None]), 1000),
                    "e2e_ms": scaled(spread([r.e2e for r in ok]), 1000),
                })
                row.update(self.client_cpu(level, tokens))
            rows.append(row)
        return {"rows": rows, "vllm": self.cross_check(before, after, records)}

    def streaming(self, count: int, max_tokens: int) -> dict:
        self.settings.max_tokens = max_tokens
        records = self.run_phase(StreamingCompletionUser, [1], count, None, "streaming")
        rows = []
        for record in records:
            row = {"ok": record.ok, "error": record.error}
            if record.ok:
                gaps = record.chunk_gaps
                decode = record.decode_time or 0.0
                interval = statistics.fmean(gaps) if gaps else None
                row.update({
                    "ttft_ms": record.ttft * 1000 if record.ttft is not None else None,
                    "decode_ms": decode * 1000,
                    "output_tokens": record.output_tokens,
                    "chunks": len(record.chunk_offsets),
                    "avg_interval_ms": interval * 1000 if interval is not None else None,
                    "tpot_ms": record.tpot * 1000 if record.tpot is not None else None,
                    "tokens_per_s": (record.output_tokens - 1) / decode if decode > 0 else None,
                    "ttft_interval_ratio": (record.ttft / interval) if interval and record.ttft else None,
                    "e2e_ms": record.e2e * 1000,
                })
            rows.append(row)
        ok_rows = [row for row in rows if row["ok"]]
        median = {key: statistics.median(row[key] for row in ok_rows if row.get(key) is not None)
                  for key in ("ttft_ms", "decode_ms", "output_tokens", "avg_interval_ms", "tpot_ms",
                              "tokens_per_s", "ttft_interval_ratio", "e2e_ms")
                  if any(row.get(key) is not None for row in ok_rows)}
        timeline = next((r.chunk_offsets for r in reversed(records) if r.ok), [])
        return {"max_tokens": max_tokens, "rows": rows, "median": median, "timeline_s": timeline}

    def prefix(self, count: int) -> dict:
        PrefixWorkload.mode = "shared"
        # Puts the shared prompt in the cache, as a first user of a chat app would.
        self.run_phase(PrefixCacheUser, [1], 1, None, "prefix warm-up")
        phases = {}
        for kind in ("unique", "shared"):
            PrefixWorkload.mode = kind
            before = self.snapshot()
            records = self.run_phase(PrefixCacheUser, [1], count, None, f"prefix {kind}")
            after = self.snapshot()
            ok = [r for r in records if r.ok and r.ttft is not None]
            hit_rate = None
            if before and after and before.delta(after, "vllm:prefix_cache_queries_total") > 0:
                hit_rate = (before.delta(after, "vllm:prefix_cache_hits_total")
                            / before.delta(after, "vllm:prefix_cache_queries_total"))
            phases[kind] = {"requests": len(records), "failures": len(records) - len(ok),
                            "ttft_ms": scaled(spread([r.ttft for r in ok]), 1000),
                            "prompt_tokens": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
                            "cached_tokens_reported": sum(r.cached_tokens or 0 for r in ok),
                            "vllm_prefix_cache_hit_rate": hit_rate,
                            "vllm_ttft_mean_ms": mean_ms(before, after, "vllm:time_to_first_token_seconds")}
        PrefixWorkload.mode = "alternate"
        unique = phases["unique"]["ttft_ms"]["p50"]
        shared = phases["shared"]["ttft_ms"]["p50"]
        reduction = (1 - shared / unique) * 100 if unique and shared is not None else None
        return {"prefix_words": self.settings.prefix_words, "phases": phases, "ttft_reduction_pct": reduction}

    def client_cpu(self, level: int, tokens: int) -> dict:
        """The load generator's CPU use during a step (one process = one Locust worker's worth)."""
        windows = [w for w in self.windows if w.level == level and w.cpu_ended is not None]
        wall = sum(w.ended - w.started for w in windows)
        cpu = sum(w.cpu_ended - w.cpu_started for w in windows)
        if wall <= 0 or tokens <= 0:
            return {}
        return {"client_cpu_pct": cpu / wall * 100, "client_cpu_ms_per_token": cpu / tokens * 1000}

    def cross_check(self, before: Snapshot | None, after: Snapshot | None, records: list[RequestRecord]) -> dict:
        """Client-side means against vLLM's own histograms over the same requests."""
        ok = [r for r in records if r.ok]
        client_ttft = [r.ttft for r in ok if r.ttft is not None]
        client_tpot = [r.tpot for r in ok if r.tpot is not None]
        result = {"client_ttft_mean_ms": statistics.fmean(client_ttft) * 1000 if client_ttft else None,
                  "client_tpot_mean_ms": statistics.fmean(client_tpot) * 1000 if client_tpot else None,
                  "vllm_ttft_mean_ms": mean_ms(before, after, "vllm:time_to_first_token_seconds"),
                  "vllm_tpot_mean_ms": mean_ms(before, after, "vllm:request_time_per_output_token_seconds"),
                  "vllm_requests": (before.delta(after, "vllm:time_to_first_token_seconds_count")
                                    if before and after else None),
                  "client_requests": len(ok)}
        return result


def mean_ms(before: Snapshot | None, after: Snapshot | None, name: str) -> float | None:
    if not before or not after:
        return None
    mean = before.histogram_mean(after, name)
    return mean * 1000 if mean is not None else None
