"""One worker process of the headless experiments (loadtest.distributed starts them; not for people).

  python -m loadtest.worker --master-port PORT

Connects to the experiments' master on this host, runs the users it is given and keeps every
request's record until the master collects them after a phase. Settings (gateway, keys) come from
the LOADTEST_* environment the master passes on; each phase's output length, model and prefix mode
come in a message.
"""

from __future__ import annotations

import dataclasses

from llmstack.cli import main_exit, parser_from_doc

PROG = "python -m loadtest.worker"


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--master-host", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    args = parser.parse_args(argv)

    import logging

    import locust.runners
    from locust import events
    from locust.env import Environment

    from loadtest import distributed, metrics
    from loadtest.arrivals import RATE_MESSAGE, PoissonArrivalUser, on_rate_message
    from loadtest.step_state import STEP_STATE
    from loadtest.steps import follow_steps
    from loadtest.users import (
        CompletionUser,
        PrefixCacheUser,
        PrefixWorkload,
        StreamingChatUser,
        StreamingCompletionUser,
        settings,
    )

    logging.basicConfig(level=logging.WARNING)
    locust.runners.WORKER_REPORT_INTERVAL = distributed.WORKER_REPORT_INTERVAL_S
    metrics.install_precise_buckets()
    metrics.KEEP_RECORDS = True
    user_classes = [CompletionUser, StreamingCompletionUser, StreamingChatUser, PrefixCacheUser, PoissonArrivalUser]
    environment = Environment(user_classes=user_classes, events=events)
    runner = environment.create_worker_runner(args.master_host, args.master_port)

    def on_phase(environment, msg, **_kwargs) -> None:
        config = settings()
        config.max_tokens = msg.data["max_tokens"]
        config.model = msg.data["model"] or config.model
        config.prefix_words = msg.data["prefix_words"]
        PrefixWorkload.mode = msg.data["prefix_mode"]
        STEP_STATE.reset()
        metrics.RECORDS.clear()

    def on_collect(environment, msg, **_kwargs) -> None:
        runner.send_message(
            distributed.RECORDS_MESSAGE,
            {
                "records": [distributed.record_to_message(r) for r in metrics.RECORDS],
                "windows": [dataclasses.asdict(w) for w in STEP_STATE.windows],
                "model": settings().model,
            },
        )
        metrics.RECORDS.clear()
        STEP_STATE.reset()

    follow_steps(runner)
    runner.register_message(RATE_MESSAGE, on_rate_message)
    runner.register_message(distributed.PHASE_MESSAGE, on_phase)
    runner.register_message(distributed.COLLECT_MESSAGE, on_collect)
    runner.greenlet.join()
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
