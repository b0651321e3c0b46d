"""Locust's response-time bucketing at sub-millisecond resolution (no Locust import, so unit tests
can use it; loadtest.metrics installs it)."""

from __future__ import annotations


def precise_bucket(response_time: float) -> float:
    """Three significant figures, at least 0.01 ms resolution."""
    if response_time < 10:
        return round(response_time, 2)
    if response_time < 100:
        return round(response_time, 1)
    if response_time < 1000:
        return float(round(response_time))
    return float(round(response_time, -1)) if response_time < 10000 else float(round(response_time, -2))
