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


# A worker that heard nothing back this long asks again (a lost message must not stall the step).
ASK_RETRY_S = 2.0


def may_ask_ahead(remaining: int, level: int) -> bool:
    """Whether workers may still hold requests ahead (TicketDraw): while the pool has a quarter of
    a level's worth or more."""
    return remaining * 4 >= level


@dataclass
class TicketDraw:
    """A worker's draw on the master's pool of a step's requests (loadtest.steps sends the messages).

    Every user's first request is the worker's own (a step opens with all its clients sending at
    once); the master's pool holds the rest. While the pool holds a quarter of a level's worth or
    more, a worker keeps up to a chunk (an eighth of its users) ahead, so a user that finishes finds
    its next request here without a round trip to the master; those are sent long before the pool
    runs dry. For the last quarter-level it asks only for users that wait, so at the end no worker
    holds requests that another worker's idle user could send (`vllm bench serve`'s one list gives
    the next prompt to whichever client is free)."""

    step_id: int
    ask: Callable[[int], None]  # asks the master for n more requests of this step
    users_here: Callable[[], int]  # this process's users (Locust's count), once they all run
    pool_left: int  # requests left in the master's pool, as of its last word
    chunk: int = 1  # an eighth of the users here
    first_wave_taken: bool = False
    asked_at: float | None = None  # when the outstanding ask went out
    waiting: set[int] = field(default_factory=set)  # users here that found no request to send


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
        """Every user of the step runs here: each sends its first request at once, from this
        worker's own part of the step; then the asks to the master begin (_next_ask). A worker
        without users in this step takes nothing."""
        draw = self.draw
        if draw is None or draw.first_wave_taken or self.budget is None:
            return 0
        users = draw.users_here()
        if users < 1:
            return 0
        draw.first_wave_taken = True
        draw.chunk = max(1, -(-users // 8))
        self.budget += users
        return self._next_ask()

    def _next_ask(self) -> int:
        draw = self.draw
        if draw is None or not draw.first_wave_taken or draw.pool_left <= 0 or self.budget is None:
            return 0
        if draw.asked_at is not None and time.monotonic() - draw.asked_at < ASK_RETRY_S:
            return 0  # one ask at a time
        available = self.budget - self.started_requests
        # Ahead: topped up to a chunk, never more held here. Near the end: only for users that wait.
        ahead = may_ask_ahead(draw.pool_left, self.level or 0)
        wanted = (draw.chunk if ahead else len(draw.waiting)) - available
        if wanted <= 0:
            return 0
        draw.asked_at = time.monotonic()
        return wanted

    def _send_ask(self, wanted: int) -> None:
        # Outside the lock: sending to the master may switch to another greenlet.
        draw = self.draw
        if not wanted or draw is None:
            return
        try:
            draw.ask(wanted)
        except Exception:
            draw.asked_at = None  # not sent: the next user to come asks again
            raise

    def grant(self, step_id: int, count: int, remaining: int) -> None:
        """The master's answer: `count` more requests of the step, and how many its pool has left."""
        with self._lock:
            draw = self.draw
            if draw is None or draw.step_id != step_id or self.budget is None:
                return  # an answer for a step that has ended here
            self.budget += count
            draw.asked_at, draw.pool_left = None, remaining
            wanted = self._next_ask()
        self._send_ask(wanted)

    def try_start(self, user: object | None = None) -> tuple[bool, int | None]:
        """(may send now, step label) for `user` (default: this thread or greenlet). Outside any
        step there is no limit and no label."""
        waiter = id(user) if user is not None else threading.get_ident()
        with self._lock:
            if not self.spawned:
                return False, self.level
            allowed = self.budget is None or self.started_requests < self.budget
            if allowed:
                self.started_requests += 1
            if self.draw is not None:
                if allowed:
                    self.draw.waiting.discard(waiter)
                else:
                    self.draw.waiting.add(waiter)
            level, wanted = self.level, self._next_ask()
        self._send_ask(wanted)
        return allowed, level

    def reset(self) -> None:
        with self._lock:
            self.level, self.budget, self.started_requests, self.windows = None, None, 0, []
            self.draw, self.spawned = None, True


class TicketPool:
    """On the master: the requests of the current request-counted step beyond every client's first,
    which the workers draw on (loadtest.steps passes the messages). With a share per worker, a
    worker whose share was spent left its users idle while other workers still sent; one pool, as
    `vllm bench serve` has, keeps every user busy until the step's last requests."""

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
