"""A load shape that steps through concurrency levels (the lab's 1, 2, 4, 8 by default).

Each step holds `level` users either for a time (LOADTEST_STEP_SECONDS) or until a number of
requests per user has completed (LOADTEST_STEP_REQUESTS_PER_USER: the lab sends 1). Every request
is labelled with the step it started in, so Locust's entries (" [c=4]") and the experiments'
tables are per step. In request mode a process-wide gate lets no more than the step's budget start,
so steps never overlap; on distributed workers the master's count decides when a step ends.
"""

from __future__ import annotations

import os
import sys

from locust import LoadTestShape

from loadtest.metrics import E2E
from loadtest.settings import DEFAULT_LEVELS, SettingsError, parse_levels
from loadtest.step_state import STEP_STATE

STEP_MESSAGE = "loadtest_step"
SPAWN_AT_ONCE = 100  # Locust warns above 100 users per second; levels above it ramp over a second or two


def on_step_message(environment, msg, **_kwargs) -> None:
    """On a worker: the master started a step, or ended the last one. In request mode each user
    may start its share of the step's requests; the master's count decides when the step ends."""
    level = msg.data.get("level")
    if level is None:
        STEP_STATE.close()
    else:
        STEP_STATE.begin(level, None, per_user=msg.data.get("requests_per_user"))


def on_worker_test_stop(**_kwargs) -> None:
    """On a worker: a closed last step must not block the next run's users (a plain user count
    from the web UI has no steps)."""
    STEP_STATE.reopen()


class StepLoadShape(LoadTestShape):
    """Concurrency steps; settings from LOADTEST_STEPS, LOADTEST_STEP_SECONDS,
    LOADTEST_STEP_REQUESTS_PER_USER (request mode wins when both are set)."""

    def __init__(
        self,
        levels: list[int] | None = None,
        step_seconds: float | None = None,
        requests_per_user: int | None = None,
    ):
        super().__init__()
        env = os.environ
        self.levels = levels or parse_levels(env.get("LOADTEST_STEPS") or ",".join(map(str, DEFAULT_LEVELS)))
        if step_seconds is None and requests_per_user is None:
            if env.get("LOADTEST_STEP_REQUESTS_PER_USER"):
                requests_per_user = int(env["LOADTEST_STEP_REQUESTS_PER_USER"])
            else:
                step_seconds = float(env.get("LOADTEST_STEP_SECONDS") or "30")
        if requests_per_user is not None and requests_per_user < 1:
            raise SettingsError("requests per user per step must be at least 1")
        if requests_per_user is None and (step_seconds is None or step_seconds <= 0):
            raise SettingsError("step seconds must be positive")
        self.step_seconds = step_seconds
        self.requests_per_user = requests_per_user
        self.index = -1
        self.began_this_tick = False
        self.step_started = 0.0
        self.max_step_seconds = float(env.get("LOADTEST_STEP_TIMEOUT_SECONDS") or "600")

    def reset_time(self) -> None:
        # Locust calls this at each start: a second run from the web UI begins at the first step
        # again, not where the last one stopped. A master also calls it when the first step's
        # users start, right after tick() began that step: that call must not begin it twice.
        super().reset_time()
        if not self.began_this_tick:
            self.index = -1

    def _begin(self, index: int) -> None:
        self.index = index
        self.began_this_tick = True
        self.step_started = self.get_run_time()
        level = self.levels[index]
        budget = level * self.requests_per_user if self.requests_per_user else None
        STEP_STATE.begin(level, budget)
        self._tell_workers(level)
        print(f"\n[step] concurrency {level} ({index + 1}/{len(self.levels)})", file=sys.stderr, flush=True)

    def _tell_workers(self, level: int | None) -> None:
        runner = self.runner
        if runner is not None and type(runner).__name__ == "MasterRunner":
            runner.send_message(STEP_MESSAGE, {"level": level, "requests_per_user": self.requests_per_user})

    def completed_in_step(self) -> int:
        level = self.levels[self.index]
        suffix = f"[c={level}]"
        return sum(
            entry.num_requests
            for (name, method), entry in self.runner.stats.entries.items()
            if method == E2E and name.endswith(suffix)
        )

    def step_done(self) -> bool:
        held = self.get_run_time() - self.step_started
        if self.requests_per_user:
            budget = self.levels[self.index] * self.requests_per_user
            return self.completed_in_step() >= budget or held >= self.max_step_seconds
        return held >= self.step_seconds

    def tick(self):
        self.began_this_tick = False
        if self.index == -1:
            self._begin(0)
        elif self.step_done():
            if self.index + 1 >= len(self.levels):
                STEP_STATE.close()
                self._tell_workers(None)
                return None
            self._begin(self.index + 1)
        # Every client of a step starts at once, as the lab's thread pool does; a gradual ramp
        # would let the first users spend the step's budget before the last one arrives.
        return self.levels[self.index], SPAWN_AT_ONCE
