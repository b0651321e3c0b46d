"""Locust's local runner driving the experiments: one phase = one user class + one step shape."""

from __future__ import annotations

import select
import subprocess
import sys
import time

import gevent
from locust import events
from locust.env import Environment

from llmstack.promtext import Snapshot
from llmstack.sse import RequestRecord
from loadtest import metrics, results
from loadtest.settings import Settings
from loadtest.step_state import STEP_STATE, StepWindow
from loadtest.steps import StepLoadShape
from loadtest.users import OpenAIUser, PrefixCacheUser, PrefixWorkload, StreamingCompletionUser, use_settings

SAMPLE_INTERVAL_S = 0.05
SAMPLER_START_TIMEOUT_S = 15


class ExperimentRunner:
    def __init__(self, settings: Settings, vllm_metrics_url: str | None):
        self.settings = settings
        use_settings(settings)
        self.vllm_metrics_url = vllm_metrics_url or None
        self.all_records: list[RequestRecord] = []
        self.running_samples: list[tuple[float, float, float]] = []
        self.windows: list[StepWindow] = []
        self._first_sample = ""

    # --- running -------------------------------------------------------------------------------
    def run_phase(
        self,
        user_class: type[OpenAIUser],
        levels: list[int],
        requests_per_user: int | None,
        step_seconds: float | None,
        label: str,
        sample_running: bool = False,
    ) -> list[RequestRecord]:
        first = len(metrics.RECORDS)
        STEP_STATE.reset()
        shape = StepLoadShape(levels, step_seconds=step_seconds, requests_per_user=requests_per_user)
        environment = Environment(user_classes=[user_class], shape_class=shape, host=self.settings.host, events=events)
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
        sampler = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loadtest.running_sampler",
                self.vllm_metrics_url,
                "--interval",
                str(SAMPLE_INTERVAL_S),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        # Start the load only once the sampler polls: a short first step could finish before it starts.
        output = sampler.stdout
        assert output is not None  # stdout=PIPE
        ready, _, _ = select.select([output], [], [], SAMPLER_START_TIMEOUT_S)
        self._first_sample = output.readline() if ready else ""
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
            print(
                f"\r[{label}] {done}{total} requests{step}, {time.perf_counter() - started:.0f}s   ",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def warm_up(self) -> None:
        """One request first: model discovery, connection set-up and any lazy compilation stay
        out of the tables. A gateway that refuses us is reported, and the run goes on so that every
        request's failure is counted in the tables."""
        self.run_phase(StreamingCompletionUser, [1], 1, None, "warm-up")
        records = self.all_records
        self.all_records = []
        if not self.settings.model or (records and not records[-1].ok):
            reason = records[-1].error if records else "no response"
            print(
                f"experiments: warning: the warm-up request through {self.settings.host} failed: {reason}",
                file=sys.stderr,
                flush=True,
            )

    def snapshot(self) -> Snapshot | None:
        return results.read_snapshot(self.vllm_metrics_url)

    # --- the experiments -----------------------------------------------------------------------
    def concurrency(
        self, levels: list[int], requests_per_user: int | None, step_seconds: float | None, max_tokens: int
    ) -> dict:
        self.settings.max_tokens = max_tokens
        before = self.snapshot()
        records = self.run_phase(
            StreamingCompletionUser,
            levels,
            requests_per_user,
            step_seconds,
            "concurrency",
            sample_running=True,
        )
        after = self.snapshot()
        rows = [
            results.concurrency_row(
                level, [r for r in records if r.step == level], max_tokens, self.windows, self.running_samples
            )
            for level in levels
        ]
        return {"rows": rows, "vllm": results.cross_check(before, after, records)}

    def streaming(self, count: int, max_tokens: int) -> dict:
        self.settings.max_tokens = max_tokens
        records = self.run_phase(StreamingCompletionUser, [1], count, None, "streaming")
        return results.streaming_result(records, max_tokens)

    def prefix(self, count: int) -> dict:
        PrefixWorkload.mode = "shared"
        # Puts the shared prompt in the cache, as a first user of a chat app would.
        self.run_phase(PrefixCacheUser, [1], 1, None, "prefix warm-up")
        phases = {}
        for kind in ("unique", "shared"):
            PrefixWorkload.mode = kind
            before = self.snapshot()
            records = self.run_phase(PrefixCacheUser, [1], count, None, f"prefix {kind}")
            phases[kind] = results.prefix_phase(records, before, self.snapshot())
        PrefixWorkload.mode = "alternate"
        return {
            "prefix_words": self.settings.prefix_words,
            "phases": phases,
            "ttft_reduction_pct": results.ttft_reduction_pct(phases),
        }
