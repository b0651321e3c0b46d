"""A load shape that steps through concurrency levels (the lab's 1, 2, 4, 8 by default).

Each step holds `level` users either for a time (LOADTEST_STEP_SECONDS) or until a number of
requests per user has completed (LOADTEST_STEP_REQUESTS_PER_USER: the lab sends 1). Every request
is labelled with the step it started in, so Locust's entries (" [c=4]") and the experiments'
tables are per step. In request mode a process-wide gate lets no more than the step's budget start,
so steps never overlap; its users draw from that budget together, so `level` requests stay in flight
until the step's last ones. With worker processes the budget is the master's one pool, which the
workers draw on a few requests at a time (TicketPool), and the master's count decides when a step
ends.
"""

from __future__ import annotations

import os
import sys

from locust import LoadTestShape, events

from loadtest.metrics import E2E
from loadtest.settings import DEFAULT_LEVELS, SettingsError, parse_levels
from loadtest.step_state import STEP_STATE, TicketDraw, TicketPool

STEP_MESSAGE = "loadtest_step"
TICKETS_ASK = "loadtest_tickets_ask"  # worker to master: {step_id, count}
TICKETS_GRANT = "loadtest_tickets_grant"  # master to one worker: {step_id, count, remaining}
SPAWN_AT_ONCE = 100  # Locust warns above 100 users per second; levels above it ramp over a second or two


TICKET_POOL = TicketPool()


def on_tickets_ask(environment, msg, **_kwargs) -> None:
    """On the master: grant a worker what is left of what it asks for."""
    step_id = msg.data["step_id"]
    granted = TICKET_POOL.take(step_id, msg.data["count"])
    remaining = TICKET_POOL.remaining if step_id == TICKET_POOL.step_id else 0
    environment.runner.send_message(
        TICKETS_GRANT, {"step_id": step_id, "count": granted, "remaining": remaining}, client_id=msg.node_id
    )


def on_tickets_grant(environment, msg, **_kwargs) -> None:
    STEP_STATE.grant(msg.data["step_id"], msg.data["count"], msg.data["remaining"])


def on_step_message(environment, msg, **_kwargs) -> None:
    """On a worker: the master started a step, or ended the last one. In request mode this process's
    users, once they all run, send their first requests, then draw the rest of the step's requests
    from the master's pool; the master's count decides when the step ends."""
    level = msg.data.get("level")
    if level is None:
        STEP_STATE.close()
        return
    step_id, pool = msg.data.get("step_id"), msg.data.get("pool")
    if not msg.data.get("requests_per_user") or step_id is None or pool is None:
        STEP_STATE.begin(level, None)
        return
    runner = environment.runner
    draw = TicketDraw(
        step_id,
        ask=lambda count: runner.send_message(TICKETS_ASK, {"step_id": step_id, "count": count}),
        users_here=lambda: runner.user_count,
        pool_left=pool,
    )
    STEP_STATE.begin(level, None, draw=draw)


def serve_tickets(master_runner) -> None:
    """A master (the web UI's, or the headless experiments') hands out request-counted steps."""
    master_runner.register_message(TICKETS_ASK, on_tickets_ask)


def follow_steps(worker_runner) -> None:
    """A worker process follows the master's steps and draws on its pool."""
    worker_runner.register_message(STEP_MESSAGE, on_step_message)
    worker_runner.register_message(TICKETS_GRANT, on_tickets_grant)
    worker_runner.environment.events.test_stop.add_listener(on_worker_test_stop)


@events.spawning_complete.add_listener
def on_spawning_complete(**_kwargs) -> None:
    """Every user of the step runs (here, or on every worker: the master tells each one)."""
    STEP_STATE.mark_spawned()


def on_worker_test_stop(**_kwargs) -> None:
    """On a worker: a closed last step must not block the next run's users (a plain user count
    from the web UI has no steps)."""
    STEP_STATE.finish()


class SteppedShape(LoadTestShape):
    """Steps held for a time, or until a number of requests of the step finished (as Locust's
    statistics count them, the workers' included). Subclasses say what a step is."""

    abstract = True
    label = "step"

    def setup_steps(self, steps: list, step_seconds: float | None) -> None:
        self.steps = steps
        self.step_seconds = step_seconds
        self.index = -1
        self.began_this_tick = False
        self.step_started = 0.0
        self.completed_before = 0
        self.max_step_seconds = float(os.environ.get("LOADTEST_STEP_TIMEOUT_SECONDS") or "600")

    # --- what a subclass defines ---------------------------------------------------------------
    def describe(self, step) -> str:
        raise NotImplementedError

    def entry_suffix(self, step) -> str:
        """How the names of this step's Locust entries end."""
        raise NotImplementedError

    def budget(self, step) -> int | None:
        """Requests that end the step; None: it lasts step_seconds."""
        raise NotImplementedError

    def begin_step(self, step) -> None:
        raise NotImplementedError

    def end_steps(self) -> None:
        raise NotImplementedError

    def users(self, step) -> tuple:
        raise NotImplementedError

    # --- the machinery --------------------------------------------------------------------------
    def reset_time(self) -> None:
        # Locust calls this at each start: a second run from the web UI begins at the first step
        # again, not where the last one stopped. A master also calls it when the first step's
        # users start, right after tick() began that step: that call must not begin it twice.
        super().reset_time()
        if not self.began_this_tick:
            self.index = -1

    def _begin(self, index: int) -> None:
        self.index, self.began_this_tick = index, True
        self.step_started = self.get_run_time()
        # A level that comes again in this run has the same entries: count only what this step
        # completes. (A first occurrence counts from 0: Locust resets its statistics when a run
        # starts, which may come after this.)
        repeated = self.steps[index] in self.steps[:index]
        self.completed_before = self.completed_in_step() if repeated else 0
        self.begin_step(self.steps[index])
        print(
            f"\n[{self.label}] {self.describe(self.steps[index])} ({index + 1}/{len(self.steps)})",
            file=sys.stderr,
            flush=True,
        )

    def is_master(self) -> bool:
        return self.runner is not None and type(self.runner).__name__ == "MasterRunner"

    def completed_in_step(self) -> int:
        suffix = self.entry_suffix(self.steps[self.index])
        return sum(
            entry.num_requests
            for (name, method), entry in self.runner.stats.entries.items()
            if method == E2E and name.endswith(suffix)
        )

    def step_done(self) -> bool:
        held = self.get_run_time() - self.step_started
        budget = self.budget(self.steps[self.index])
        if budget:
            return self.completed_in_step() - self.completed_before >= budget or held >= self.max_step_seconds
        return held >= (self.step_seconds or 0)

    def tick(self):
        self.began_this_tick = False
        if self.index == -1:
            self._begin(0)
        elif self.step_done():
            if self.index + 1 >= len(self.steps):
                self.end_steps()
                return None
            self._begin(self.index + 1)
        return self.users(self.steps[self.index])


class StepLoadShape(SteppedShape):
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
        levels = levels or parse_levels(
            env.get("LOADTEST_STEPS") or ",".join(map(str, DEFAULT_LEVELS)), "LOADTEST_STEPS"
        )
        if step_seconds is None and requests_per_user is None:
            if env.get("LOADTEST_STEP_REQUESTS_PER_USER"):
                requests_per_user = int(env["LOADTEST_STEP_REQUESTS_PER_USER"])
            else:
                step_seconds = float(env.get("LOADTEST_STEP_SECONDS") or "30")
        if requests_per_user is not None and requests_per_user < 1:
            raise SettingsError("requests per user per step must be at least 1")
        if requests_per_user is None and (step_seconds is None or step_seconds <= 0):
            raise SettingsError("step seconds must be positive")
        self.requests_per_user = requests_per_user
        self.setup_steps(levels, step_seconds)

    def describe(self, step) -> str:
        return f"concurrency {step}"

    def entry_suffix(self, step) -> str:
        return f"[c={step}]"

    def budget(self, step) -> int | None:
        return step * self.requests_per_user if self.requests_per_user else None

    def begin_step(self, step) -> None:
        budget = self.budget(step)
        STEP_STATE.begin(step, budget)
        # The workers' users send their first requests on their own; the pool holds the rest.
        pool = budget - step if budget else None
        step_id = TICKET_POOL.open(pool) if pool is not None and self.is_master() else None
        self._tell_workers(step, step_id, pool)

    def end_steps(self) -> None:
        STEP_STATE.close()
        if self.is_master():
            TICKET_POOL.close()
        self._tell_workers(None, None, None)

    def _tell_workers(self, level: int | None, step_id: int | None, pool: int | None) -> None:
        if self.is_master():
            data = {"level": level, "requests_per_user": self.requests_per_user, "step_id": step_id, "pool": pool}
            self.runner.send_message(STEP_MESSAGE, data)

    def users(self, step) -> tuple:
        # Every client of a step starts at once, as the lab's thread pool does; a gradual ramp
        # would let the first users spend the step's budget before the last one arrives.
        return step, SPAWN_AT_ONCE
