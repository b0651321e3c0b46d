"""The headless experiments' load spread over local worker processes, with Locust's own distribution.

One process streams about 4,000 tokens/s of a fast GPU server (16 clients) before its own timings
drift (docs/gpu-results.md, "Loader CPU"), so the experiments run Locust's master in their own
process and start `python -m loadtest.worker` processes on this host that connect to it, as
`--scale locust-worker=N` does for the web UI. The master runs the step shape; each worker runs its
share of the users and keeps every request's record, which the master collects after each phase
(Locust's custom messages), so the tables and charts are made from the same raw records as with
one process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmstack.cli import StackError
from llmstack.sse import RequestRecord
from loadtest.step_state import StepWindow

PHASE_MESSAGE = "loadtest_phase"
COLLECT_MESSAGE = "loadtest_collect"
RECORDS_MESSAGE = "loadtest_records"
# Clients one worker process drives before its timings drift on a fast GPU server (measured on
# the H200: +22 % over vLLM's TTFT at 1-2 clients, +47-51 % at 16, +65-85 % at 32 in one process).
STREAMS_PER_WORKER = 16
# Workers report their statistics this often (Locust's default is 3 s): the master ends a
# request-counted step on those counts, so a long interval only adds idle time between steps.
WORKER_REPORT_INTERVAL_S = 0.5
CONNECT_TIMEOUT_S = 60.0
COLLECT_TIMEOUT_S = 60.0


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_workers(max_level: int, cpus: int | None = None) -> int:
    """Enough processes for STREAMS_PER_WORKER clients each, leaving one core to the master and
    the rest of the host; 1 means Locust's local runner in this process."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, min(cpus - 1, math.ceil(max_level / STREAMS_PER_WORKER)))


def parse_workers(text: str, max_level: int) -> int:
    if text == "auto":
        return auto_workers(max_level)
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"--workers takes 'auto' or a positive number, got {text!r}")
    return count


def record_to_message(record: RequestRecord) -> dict[str, Any]:
    return dataclasses.asdict(record)


def record_from_message(data: dict[str, Any]) -> RequestRecord:
    return RequestRecord(**data)


def window_from_message(data: dict[str, Any]) -> StepWindow:
    return StepWindow(**data)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalWorkers:
    """Worker processes on this host, connected to a master runner in this process."""

    def __init__(self, environment, count: int, worker_env: dict[str, str], log_dir: Path):
        self.environment = environment
        self.count = count
        port = free_port()
        self.runner = environment.create_master_runner(master_bind_host="127.0.0.1", master_bind_port=port)
        from loadtest.steps import serve_tickets

        serve_tickets(self.runner)
        self._replies: list[dict[str, Any]] = []
        self.runner.register_message(RECORDS_MESSAGE, self._on_records)
        self.logs = [log_dir / f"worker-{index + 1}.log" for index in range(count)]
        self.processes = []
        for log in self.logs:
            with open(log, "wb") as output:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "loadtest.worker", "--master-port", str(port)],
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        env=worker_env,
                    )
                )
        self._wait_connected()

    def _on_records(self, environment, msg, **_kwargs) -> None:
        self._replies.append(msg.data)

    def _wait_connected(self) -> None:
        import gevent

        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while len(self.runner.clients.ready) < self.count:
            self.check_alive()
            if time.monotonic() > deadline:
                self.close()
                raise StackError(
                    f"{len(self.runner.clients.ready)} of {self.count} worker processes connected in "
                    f"{CONNECT_TIMEOUT_S:.0f} s (logs: {', '.join(map(str, self.logs))})"
                )
            gevent.sleep(0.1)

    def check_alive(self) -> None:
        for process, log in zip(self.processes, self.logs, strict=True):
            if process.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise StackError(f"a worker process exited ({process.returncode}): " + " | ".join(tail))

    def start_phase(self, settings: dict[str, Any]) -> None:
        """What the users of the next phase send (output tokens, model, prefix mode)."""
        self.runner.send_message(PHASE_MESSAGE, settings)

    def collect(self) -> tuple[list[RequestRecord], list[StepWindow], str]:
        """Every worker's records and step windows since the phase began, and the model a worker
        discovered (the warm-up finds it there, not in the master)."""
        import gevent

        self._replies = []
        self.runner.send_message(COLLECT_MESSAGE, {})
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while len(self._replies) < self.count:
            self.check_alive()
            if time.monotonic() > deadline:
                raise StackError(f"{len(self._replies)} of {self.count} workers sent their records")
            gevent.sleep(0.02)
        records = [record_from_message(r) for reply in self._replies for r in reply["records"]]
        windows = [window_from_message(w) for reply in self._replies for w in reply["windows"]]
        model = next((reply["model"] for reply in self._replies if reply.get("model")), "")
        records.sort(key=lambda record: record.started)
        return records, windows, model

    def close(self) -> None:
        import gevent

        try:
            self.runner.quit()
        finally:
            deadline = time.monotonic() + 10
            for process in self.processes:
                while process.poll() is None and time.monotonic() < deadline:
                    gevent.sleep(0.05)
                if process.poll() is None:
                    process.kill()
