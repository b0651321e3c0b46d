"""The current concurrency step in this process (no Locust import)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StepWindow:
    level: int
    started: float
    ended: float | None = None
    # CPU seconds this process used (time.process_time): the load generator's own cost per step.
    cpu_started: float = 0.0
    cpu_ended: float | None = None

    def close(self) -> None:
        self.ended = time.perf_counter()
        self.cpu_ended = time.process_time()


@dataclass
class StepState:
    """The current step in this process: users ask it before each request."""

    level: int | None = None
    budget: int | None = None
    started_requests: int = 0
    # On a distributed worker no process knows its share of the step before its users run: the
    # budget is then counted once they do (late_budget: requests per user times Locust's count of
    # them). The users draw from it together, so one whose requests end sooner sends more and
    # `level` requests stay in flight until the step's last, as with `vllm bench serve`.
    late_budget: Callable[[], int] | None = None
    # No request of a step starts before all of its users run (Locust's spawning_complete): Locust
    # starts users at a limited rate, and early users would otherwise finish before late ones begin.
    spawned: bool = True
    windows: list[StepWindow] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(
        self,
        level: int,
        budget: int | None,
        late_budget: Callable[[], int] | None = None,
    ) -> None:
        with self._lock:
            self._close_window()
            # The same level again starts no user, so nothing would report the spawning complete.
            self.spawned = level == self.level
            self.level, self.budget, self.started_requests = level, budget, 0
            self.late_budget = late_budget
            self.windows.append(StepWindow(level, time.perf_counter(), cpu_started=time.process_time()))
            if self.spawned:
                self._count_late_budget()

    def close(self) -> None:
        """The last step is over: no further request starts here until the next begin or reset
        (users still running until the runner stops them must not send one more)."""
        with self._lock:
            self._close_window()
            self.budget = self.started_requests

    def _close_window(self) -> None:
        if self.windows and self.windows[-1].ended is None:
            self.windows[-1].close()

    def finish(self) -> None:
        """No step any more: the run ended here (the runner), or a worker's run stopped (its
        test_stop). The next run starts unlimited until a shape begins a step; the windows stay
        for whoever collects them."""
        with self._lock:
            self._close_window()
            self.level, self.budget, self.late_budget, self.spawned = None, None, None, True

    def mark_spawned(self) -> None:
        with self._lock:
            self.spawned = True
            self._count_late_budget()

    def _count_late_budget(self) -> None:
        """Every user of the step runs here, so this process's share can be counted."""
        if self.late_budget is not None:
            self.budget, self.late_budget = self.late_budget(), None

    def try_start(self) -> tuple[bool, int | None]:
        """(may send now, step label). Outside any step there is no limit and no label."""
        with self._lock:
            if not self.spawned:
                return False, self.level
            if self.budget is not None and self.started_requests >= self.budget:
                return False, self.level
            self.started_requests += 1
            return True, self.level

    def reset(self) -> None:
        with self._lock:
            self.level, self.budget, self.started_requests, self.windows = None, None, 0, []
            self.late_budget, self.spawned = None, True


def samples_in_step(windows: list[StepWindow], samples: list[tuple[float, float, float]], level: int) -> list[float]:
    """Values of (sent, received, value) samples taken wholly inside a step of this level: a slow
    scrape that straddles a step boundary could hold either step's value, so it counts for neither."""
    return [
        value
        for window in windows
        if window.level == level
        for sent, received, value in samples
        if window.started <= sent and received <= (window.ended or float("inf"))
    ]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most (start, end) intervals open at one moment; one ending as another starts is not an overlap."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = current = 0
    for _moment, change in events:
        current += change
        most = max(most, current)
    return most


STEP_STATE = StepState()
