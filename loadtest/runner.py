"""Locust's runner driving the experiments: one phase = one user class + one step shape.

One process uses Locust's local runner; with several workers (loadtest.distributed) this process is
Locust's master and the users run in worker processes on this host.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gevent
from locust import LoadTestShape, events
from locust.env import Environment

from llmstack.promtext import Snapshot
from llmstack.sse import RequestRecord
from loadtest import goodput, metrics, results
from loadtest.arrivals import PoissonArrivalUser, RateStepShape
from loadtest.distributed import LocalWorkers
from loadtest.metrics import E2E
from loadtest.settings import RUNNING_SAMPLE_INTERVAL_S, Settings, rate_label
from loadtest.step_state import STEP_STATE, StepWindow
from loadtest.steps import StepLoadShape
from loadtest.users import (
    CompletionUser,
    OpenAIUser,
    PrefixCacheUser,
    PrefixWorkload,
    StreamingChatUser,
    StreamingCompletionUser,
    use_settings,
)

SAMPLER_START_TIMEOUT_S = 15


class ExperimentRunner:
    def __init__(
        self,
        settings: Settings,
        vllm_metrics_url: str | None,
        workers: int = 1,
        sample_interval_s: float = RUNNING_SAMPLE_INTERVAL_S,
    ):
        self.settings = settings
        use_settings(settings)
        self.vllm_metrics_url = vllm_metrics_url or None
        self.sample_interval_s = sample_interval_s
        self.all_records: list[RequestRecord] = []
        self.running_samples: list[tuple[float, float, float]] = []
        self.windows: list[StepWindow] = []
        # The workers' own step windows: their CPU time is the load generator's cost.
        self.worker_windows: list[StepWindow] = []
        self._first_sample = ""
        self.workers: LocalWorkers | None = None
        if workers > 1:
            environment = Environment(
                user_classes=[
                    CompletionUser,
                    StreamingCompletionUser,
                    StreamingChatUser,
                    PrefixCacheUser,
                    PoissonArrivalUser,
                ],
                host=settings.host,
                events=events,
            )
            self._log_dir = Path(tempfile.mkdtemp(prefix="loadtest-workers-"))
            self.workers = LocalWorkers(environment, workers, self._worker_env(), self._log_dir)

    @property
    def loader_processes(self) -> int:
        return self.workers.count if self.workers else 1

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LOADTEST_HOST"] = self.settings.host
        # The keys travel in the environment of our own child processes only, never on a command line.
        env["LOADTEST_API_KEY_FILE"] = ""
        env["LOADTEST_API_KEY"] = ""
        env["LOADTEST_API_KEYS"] = "\n".join(self.settings.api_keys)
        env["LOADTEST_PROMPT"] = self.settings.prompt
        return env

    def close(self) -> None:
        if self.workers:
            self.workers.close()
            self.workers = None

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
        shape = StepLoadShape(levels, step_seconds=step_seconds, requests_per_user=requests_per_user)
        total = sum(levels) * requests_per_user if requests_per_user else None
        return self.run_shape(user_class, shape, label, total, sample_running)

    def run_shape(
        self,
        user_class: type[OpenAIUser],
        shape: LoadTestShape,
        label: str,
        total: int | None,
        sample_running: bool = False,
    ) -> list[RequestRecord]:
        first = len(metrics.RECORDS)
        STEP_STATE.reset()
        if self.workers:
            self.workers.start_phase(
                {
                    "max_tokens": self.settings.max_tokens,
                    "model": self.settings.model,
                    "prefix_words": self.settings.prefix_words,
                    "prefix_mode": PrefixWorkload.mode,
                }
            )
            environment = self.workers.environment
            environment.user_classes = [user_class]
            environment.shape_class = shape
            runner = self.workers.runner
            shape.runner = runner
        else:
            environment = Environment(
                user_classes=[user_class], shape_class=shape, host=self.settings.host, events=events
            )
            runner = environment.create_local_runner()
        sampler = self._start_sampler() if sample_running else None
        progress = gevent.spawn(self._progress, label, total, first, runner)
        try:
            runner.start_shape()
            gevent.sleep(0.1)
            while runner.shape_greenlet is not None:
                if self.workers:
                    self.workers.check_alive()
                gevent.sleep(0.05)
        finally:
            if self.workers:
                runner.stop()
            else:
                runner.quit()
            progress.kill()
            STEP_STATE.finish()
            print("", file=sys.stderr, flush=True)
            self.running_samples = self._stop_sampler(sampler) if sampler else []
        self.windows = list(STEP_STATE.windows)
        if self.workers:
            records, self.worker_windows, model = self.workers.collect()
            self.settings.model = self.settings.model or model
        else:
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
                str(self.sample_interval_s),
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

    def _progress(self, label: str, total: int | None, first: int, runner) -> None:
        started = time.perf_counter()
        while True:
            gevent.sleep(1)
            if self.workers:  # the workers' reports, every WORKER_REPORT_INTERVAL_S
                done = sum(e.num_requests for (_, method), e in runner.stats.entries.items() if method == E2E)
            else:
                done = len(metrics.RECORDS) - first
            level = STEP_STATE.level
            of_total = f"/{total}" if total else ""
            step = f", concurrency {level}" if level is not None else ""
            print(
                f"\r[{label}] {done}{of_total} requests{step}, {time.perf_counter() - started:.0f}s   ",
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
                level,
                [r for r in records if r.step == level],
                max_tokens,
                self.windows,
                self.running_samples,
                self.worker_windows,
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

    def goodput(
        self,
        search: goodput.RateSearch,
        objective: goodput.Objective,
        seconds: float,
        minimum: int,
        sweep: int | None = None,
    ) -> dict:
        """Open-loop Poisson arrivals, one rate per phase (each drains before the next), rates from
        the search until it has found the highest that meets the objective. `sweep`: this sweep's
        number among several, in its requests' tags."""
        rows = []
        before = self.snapshot()
        first = len(self.all_records)  # earlier sweeps' records are not this sweep's
        while (rate := search.next_rate()) is not None:
            count = goodput.requests_for_rate(rate, seconds, minimum, self.loader_processes)
            shape = RateStepShape([rate], requests_per_step=count)
            records = self.run_shape(PoissonArrivalUser, shape, rate_label(rate), count)
            row = goodput.rate_row(rate, records, objective)
            rows.append(row)
            search.record(rate, row["meets_objective"])
        rows.sort(key=lambda row: row["offered_rate"])
        open_loop = [record for record in self.all_records[first:] if record.kind == "open-loop"]
        if sweep is not None:
            goodput.tag_sweep(self.all_records[first:], sweep)
        return {
            "objective": {"ttft_p95_ms": objective.ttft_p95_ms, "tpot_p95_ms": objective.tpot_p95_ms},
            "max_tokens": self.settings.max_tokens,
            "rows": rows,
            "goodput_rps": search.goodput,
            "lowest_miss_rps": search.lowest_miss,
            "vllm": results.cross_check(before, self.snapshot(), open_loop),
        }
