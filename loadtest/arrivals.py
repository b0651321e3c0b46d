"""Open-loop load: requests arrive at an offered rate, Poisson, whether or not earlier ones finished.

Closed-loop clients (the concurrency steps) slow down when the server does, so they never show what
happens past saturation; a real service's users do not wait for each other. As `vllm bench serve
--request-rate`, each arrival here follows an exponential gap. One PoissonArrivalUser runs in each
load generator process (a Locust worker, or the one local process) at rate / generators; the sum of
independent Poisson processes is Poisson at the whole rate. RateStepShape steps through rates,
held for seconds (the web UI: LOADTEST_RATES, LOADTEST_RATE_STEP_SECONDS) or until a number of
requests finished (the headless goodput sweep, one rate per phase).
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from dataclasses import dataclass, field

import gevent
from gevent.pool import Group
from locust import constant, task
from urllib3 import PoolManager

from llmstack.sse import COMPLETIONS
from loadtest.settings import SettingsError, parse_rates, rate_label
from loadtest.steps import SteppedShape
from loadtest.users import OpenAIUser

RATE_MESSAGE = "loadtest_rate"
# Open connections one generator process may keep to the gateway (requests in flight reuse them).
MAX_CONNECTIONS = 4096
DEFAULT_RATES = "1,2,4,8"


@dataclass
class ArrivalState:
    """The offered rate in this process; RateStepShape sets it (a message on a worker)."""

    rate: float | None = None
    generators: int = 1
    # Arrivals this process may start at this rate (None: until the step ends).
    budget: int | None = None
    started: int = 0
    epoch: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set(self, rate: float | None, generators: int = 1, budget: int | None = None) -> None:
        with self._lock:
            self.rate, self.generators, self.budget, self.started = rate, max(1, generators), budget, 0
            self.epoch += 1

    def try_start(self, epoch: int) -> bool:
        with self._lock:
            if epoch != self.epoch or self.rate is None:
                return False
            if self.budget is not None and self.started >= self.budget:
                return False
            self.started += 1
            return True


ARRIVALS = ArrivalState()


def on_rate_message(environment, msg, **_kwargs) -> None:
    """On a worker: the master began a rate (or ended the last one: rate None)."""
    ARRIVALS.set(msg.data.get("rate"), msg.data.get("generators", 1), msg.data.get("budget"))


class PoissonArrivalUser(OpenAIUser):
    """Open loop: streamed completions arriving at the offered rate of RateStepShape (pick that
    shape with this user); each request runs in its own greenlet, so a slow server does not slow
    the arrivals."""

    wait_time = constant(0)
    pool_manager = PoolManager(maxsize=MAX_CONNECTIONS, block=False)

    def on_start(self) -> None:
        super().on_start()
        self.in_flight = Group()
        self.epoch, self.next_arrival = -1, 0.0

    def on_stop(self) -> None:
        self.in_flight.kill(block=False)

    @task
    def arrivals(self) -> None:
        epoch, rate = ARRIVALS.epoch, ARRIVALS.rate
        if rate is None or rate <= 0:
            gevent.sleep(0.01)
            return
        if epoch != self.epoch:
            # Memoryless: a new rate starts its own schedule now.
            self.epoch, self.next_arrival = epoch, time.perf_counter()
        # Arrivals keep an absolute schedule, so late wake-ups do not lower the offered rate; a
        # generator that falls behind sends at once, and the arrival rate in the table shows it.
        self.next_arrival += random.expovariate(rate / ARRIVALS.generators)
        gevent.sleep(max(0.0, self.next_arrival - time.perf_counter()))
        if ARRIVALS.try_start(epoch):
            self.in_flight.spawn(self.one_request, rate)

    def one_request(self, rate: float) -> None:
        self.run_request(COMPLETIONS, self.body(COMPLETIONS, stream=True), "open-loop", tag=rate_label(rate))


class RateStepShape(SteppedShape):
    """Offered request rates (Poisson arrivals, PoissonArrivalUser) in steps: LOADTEST_RATES
    (requests/s, comma-separated) each held LOADTEST_RATE_STEP_SECONDS (30)."""

    label = "rate"

    def __init__(
        self,
        rates: list[float] | None = None,
        step_seconds: float | None = None,
        requests_per_step: int | None = None,
    ):
        super().__init__()
        env = os.environ
        rates = rates or parse_rates(env.get("LOADTEST_RATES") or DEFAULT_RATES)
        if step_seconds is None and requests_per_step is None:
            step_seconds = float(env.get("LOADTEST_RATE_STEP_SECONDS") or "30")
        if requests_per_step is None and (step_seconds is None or step_seconds <= 0):
            raise SettingsError("rate step seconds must be positive")
        self.requests_per_step = requests_per_step
        self.setup_steps(rates, step_seconds)

    def generators(self) -> int:
        return int(getattr(self.runner, "worker_count", 0) or 1)

    def describe(self, step) -> str:
        return f"{step:g} requests/s"

    def entry_suffix(self, step) -> str:
        return rate_label(step)

    def budget(self, step) -> int | None:
        return self.requests_per_step

    def begin_step(self, step) -> None:
        self._tell(step)

    def end_steps(self) -> None:
        self._tell(None)

    def _tell(self, rate: float | None) -> None:
        generators = self.generators()
        budget = math.ceil(self.requests_per_step / generators) if self.requests_per_step and rate else None
        if self.is_master():
            self.runner.send_message(RATE_MESSAGE, {"rate": rate, "generators": generators, "budget": budget})
        else:
            ARRIVALS.set(rate, generators, budget)

    def users(self, step) -> tuple:
        # One arrival generator per load generator process; the rate is theirs to keep.
        return self.generators(), self.generators(), [PoissonArrivalUser]
