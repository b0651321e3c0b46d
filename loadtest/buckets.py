"""Plain statistics for the tables (no Locust import, so unit tests can use it)."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of raw values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def precise_bucket(response_time: float) -> float:
    """Three significant figures, at least 0.01 ms resolution."""
    if response_time < 10:
        return round(response_time, 2)
    if response_time < 100:
        return round(response_time, 1)
    if response_time < 1000:
        return float(round(response_time))
    return float(round(response_time, -1)) if response_time < 10000 else float(round(response_time, -2))


def scaled(values: dict, factor: float) -> dict:
    return {key: (value * factor if value is not None and key != "n" else value) for key, value in values.items()}


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most (start, end) intervals open at one moment; one ending as another starts is not an overlap."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = current = 0
    for _moment, change in events:
        current += change
        most = max(most, current)
    return most
