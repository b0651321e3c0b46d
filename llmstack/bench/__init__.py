"""Benchmarks: measurements that print figures (thin entry points in benchmarks/)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from datetime import UTC, datetime


@functools.cache
def _machine() -> dict:
    info: dict = {
        "client_python": platform.python_version(),
        "client_cpus": os.cpu_count(),
        # Leases of one GPU model served the same workload up to 3.7x apart; the kernel tells
        # runtimes apart (gVisor reports 4.4.0, Firecracker its own build).
        "kernel": platform.release(),
    }
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if gpu.returncode == 0:
            info["gpu"] = "; ".join(line.strip() for line in gpu.stdout.splitlines() if line.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def host_environment() -> dict:
    """What a result file says of the machine the benchmark ran on (the client's; with --vllm-url
    elsewhere, not the server's): the date, Python, CPUs, kernel and GPUs."""
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), **_machine()}
