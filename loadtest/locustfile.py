"""Locust entry point for the web UI (master + workers) and plain headless `locust` runs.

Pick the users and the shape in the web UI (--class-picker):
  CompletionUser, StreamingCompletionUser, StreamingChatUser, PrefixCacheUser, and
  StepLoadShape (concurrency steps; none picked = the user count typed in the UI); or
  RateStepShape: open-loop Poisson arrivals at LOADTEST_RATES requests/s (PoissonArrivalUser).
Streamed requests add entries TTFT, TPOT, ITL (every inter-chunk gap) and E2E, in milliseconds
with 0.01 ms resolution, beside Locust's own POST entry (which stops at the response headers).
"""

from locust import events
from locust.runners import MasterRunner, WorkerRunner

from loadtest import metrics
from loadtest.arrivals import RATE_MESSAGE, PoissonArrivalUser, RateStepShape, on_rate_message
from loadtest.steps import StepLoadShape, follow_steps, serve_tickets
from loadtest.users import CompletionUser, PrefixCacheUser, StreamingChatUser, StreamingCompletionUser

__all__ = [
    "CompletionUser",
    "PoissonArrivalUser",
    "PrefixCacheUser",
    "RateStepShape",
    "StepLoadShape",
    "StreamingChatUser",
    "StreamingCompletionUser",
]

metrics.install_precise_buckets()


@events.init.add_listener
def on_init(environment, **_kwargs):
    if isinstance(environment.runner, WorkerRunner):
        follow_steps(environment.runner)
        environment.runner.register_message(RATE_MESSAGE, on_rate_message)
    if isinstance(environment.runner, MasterRunner):
        serve_tickets(environment.runner)
    if not isinstance(environment.runner, MasterRunner):
        # Workers (and a standalone locust) make the requests, so they export the client metrics.
        metrics.start_exporter()
