"""The current concurrency step in this process, and the master's pool of a step's requests (no Locust import)."""

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
class TicketDraw:
    """A worker's draw on the master's pool of a step's requests (loadtest.steps sends the messages)."""

    step_id: int
    ask: Callable[[int], None]  # asks the master for n more requests of this step
    users_here: Callable[[], int]  # this process's users (Locust's count), once they all run
    # Asked for ahead whenever no more than this many are left: small, so a worker holds few
    # requests that another worker's idle user could send.
    chunk: int = 1
    asking: bool = False
    pool_empty: bool = False


@dataclass
class StepState:
    """The current step in this process: users ask it before each request."""

    level: int | None = None
    budget: int | None = None
    started_requests: int = 0
    # On a distributed worker the step's requests come from the master's one pool (as
    # `vllm bench serve` draws from one list of prompts), a few at a time: whichever user is free on
    # any worker sends the next, so `level` requests stay in flight until the step's last ones.
    draw: TicketDraw | None = None
    # No request of a step starts before all of its users run (Locust's spawning_complete): Locust
    # starts users at a limited rate, and early users would otherwise finish before late ones begin.
    spawned: bool = True
    windows: list[StepWindow] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, level: int, budget: int | None, draw: TicketDraw | None = None) -> None:
        """A step of `level` users: `budget` requests (None: no limit), or, with a draw, as many as
        the master grants."""
        with self._lock:
            self._close_window()
            # The same level again starts no user, so nothing would report the spawning complete.
            self.spawned = level == self.level
            self.level, self.started_requests = level, 0
            self.budget, self.draw = (0, draw) if draw else (budget, None)
            self.windows.append(StepWindow(level, time.perf_counter(), cpu_started=time.process_time()))
            wanted = self._first_ask() if self.spawned else 0
        self._send_ask(wanted)

    def close(self) -> None:
        """The last step is over: no further request starts here until the next begin or reset
        (users still running until the runner stops them must not send one more)."""
        with self._lock:
            self._close_window()
            self.budget, self.draw = self.started_requests, None

    def _close_window(self) -> None:
        if self.windows and self.windows[-1].ended is None:
            self.windows[-1].close()

    def finish(self) -> None:
        """No step any more: the run ended here (the runner), or a worker's run stopped (its
        test_stop). The next run starts unlimited until a shape begins a step; the windows stay
        for whoever collects them."""
        with self._lock:
            self._close_window()
            self.level, self.budget, self.draw, self.spawned = None, None, None, True

    def mark_spawned(self) -> None:
        with self._lock:
            self.spawned = True
            wanted = self._first_ask()
        self._send_ask(wanted)

    def _first_ask(self) -> int:
        """Every user of the step runs here: one request for each, as every client of a step sends
        its first at once; the chunks ahead follow as they start (_next_ask). A worker without
        users in this step asks for none."""
        draw = self.draw
        if draw is None or draw.asking or self.budget:
            return 0
        users = draw.users_here()
        if users < 1:
            return 0
        draw.chunk = max(1, -(-users // 8))
        draw.asking = True
        return users

    def _next_ask(self) -> int:
        draw = self.draw
        if draw is None or draw.asking or draw.pool_empty or self.budget is None:
            return 0
        if self.budget - self.started_requests > draw.chunk:
            return 0
        draw.asking = True
        return draw.chunk

    def _send_ask(self, wanted: int) -> None:
        # Outside the lock: sending to the master may switch to another greenlet.
        draw = self.draw
        if wanted and draw is not None:
            draw.ask(wanted)

    def grant(self, step_id: int, count: int, pool_empty: bool) -> None:
        """The master's answer: `count` more requests of the step, and whether its pool is now empty."""
        with self._lock:
            draw = self.draw
            if draw is None or draw.step_id != step_id or self.budget is None:
                return  # an answer for a step that has ended here
            self.budget += count
            draw.asking, draw.pool_empty = False, pool_empty
            wanted = self._next_ask()
        self._send_ask(wanted)

    def try_start(self) -> tuple[bool, int | None]:
        """(may send now, step label). Outside any step there is no limit and no label."""
        with self._lock:
            if not self.spawned:
                return False, self.level
            if self.budget is not None and self.started_requests >= self.budget:
                allowed = False
            else:
                self.started_requests += 1
                allowed = True
            level, wanted = self.level, self._next_ask()
        self._send_ask(wanted)
        return allowed, level

    def reset(self) -> None:
        with self._lock:
            self.level, self.budget, self.started_requests, self.windows = None, None, 0, []
            self.draw, self.spawned = None, True


class TicketPool:
    """On the master: the requests left in the current request-counted step, which the workers draw
    on (loadtest.steps passes the messages). With a share per worker, a worker whose share was spent
    left its users idle while other workers still sent; one pool, as `vllm bench serve` has, keeps
    every user busy until the step's last requests."""

    def __init__(self) -> None:
        self.step_id = 0
        self.remaining = 0

    def open(self, requests: int) -> int:
        self.step_id += 1
        self.remaining = requests
        return self.step_id

    def close(self) -> None:
        self.open(0)

    def take(self, step_id: int, count: int) -> int:
        if step_id != self.step_id:
            return 0
        granted = max(0, min(count, self.remaining))
        self.remaining -= granted
        return granted


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
