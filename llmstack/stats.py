"""The one statistics module: every table, chart and report takes its percentiles from here.

Percentile definition: linear interpolation between the closest ranks of the sorted values
(Hyndman & Fan type 7, numpy's default "linear" method, `statistics.quantiles(method="inclusive")`),
with q from 0 to 100. p0 is the minimum, p100 the maximum, and p50 of an even count is the mean of
the middle two.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100) of raw values, linearly interpolated; None when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Spread:
    """How a set of values (one per request, or one per repeat) is spread."""

    n: int
    mean: float | None
    stdev: float | None
    min: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)

    def scaled(self, factor: float) -> Spread:
        """The same spread in another unit (e.g. seconds to milliseconds)."""

        def scale(value: float | None) -> float | None:
            return None if value is None else value * factor

        return Spread(
            self.n,
            scale(self.mean),
            scale(self.stdev),
            scale(self.min),
            scale(self.p50),
            scale(self.p90),
            scale(self.p99),
            scale(self.max),
        )

    @property
    def range(self) -> float | None:
        """max - min: the spread this project compares differences with."""
        return None if self.min is None or self.max is None else self.max - self.min


def spread(values: Iterable[float]) -> Spread:
    data = list(values)
    if not data:
        return Spread(0, None, None, None, None, None, None, None)
    return Spread(
        n=len(data),
        mean=statistics.fmean(data),
        stdev=statistics.stdev(data) if len(data) > 1 else 0.0,
        min=min(data),
        p50=percentile(data, 50),
        p90=percentile(data, 90),
        p99=percentile(data, 99),
        max=max(data),
    )


def difference(first: Sequence[float], second: Sequence[float]) -> tuple[float | None, bool]:
    """(median(second) - median(first), whether it exceeds the spread).

    Each sequence holds one figure per repeat. The difference counts only when it is larger than
    the range (max - min) of either side's repeats; a smaller one is reported as "none".
    """
    a, b = spread(first), spread(second)
    if a.p50 is None or b.p50 is None:
        return None, False
    delta = b.p50 - a.p50
    noise = max(a.range or 0.0, b.range or 0.0)
    return delta, abs(delta) > noise


def paired_difference(pairs: Iterable[tuple[float, float]]) -> tuple[Spread, bool]:
    """(spread of (second - first) / first * 100 over the pairs, whether it exceeds the spread).

    For repeats run as pairs back to back (e.g. ABBA), where a drift over the run moves both sides
    of a pair alike and so widens each side's range, not their difference. The difference counts
    only when every pair differs the same way (its range leaves out zero); otherwise "none".
    """
    percents = spread((second - first) / first * 100 for first, second in pairs if first)
    return percents, one_way(percents)


def one_way(differences: Spread) -> bool:
    """Whether signed differences (one per repeat) all go the same way: their range leaves out zero."""
    return differences.n > 0 and ((differences.min or 0.0) > 0 or (differences.max or 0.0) < 0)


def percentiles(values: Iterable[float], qs: Iterable[float], scale: float = 1.0) -> dict[str, float | None]:
    """{"p50": ..., ...}: each q-th percentile of raw values times `scale` (e.g. 1000 for seconds
    to milliseconds); None when there are no values."""
    data = sorted(values)
    result: dict[str, float | None] = {}
    for q in qs:
        value = percentile(data, q)
        result[f"p{q}"] = value * scale if value is not None else None
    return result


def deciles(values: Iterable[float]) -> list[float]:
    """p10, p20, ..., p90 of raw values (empty when there are none): the shape of a distribution,
    e.g. the two groups of TTFTs at saturation (a batch slot at once, or a wait), which a median
    between them hides."""
    data = sorted(values)
    return [value for q in range(10, 100, 10) if (value := percentile(data, q)) is not None]


def mean_in_flight_by_part(intervals: list[tuple[float, float]], parts: int = 4) -> list[float]:
    """Requests at once on average in each of `parts` equal slices of the (start, end) intervals'
    span: shows where a level did not hold its load (its first requests, its last ones). Their mean
    is mean_in_flight's."""
    if not intervals:
        return []
    begin, end = min(start for start, _ in intervals), max(stop for _, stop in intervals)
    width = (end - begin) / parts
    if width <= 0:
        return []
    slices = [begin + index * width for index in range(parts)]
    return [
        sum(max(0.0, min(stop, low + width) - max(start, low)) for start, stop in intervals) / width for low in slices
    ]


def first_wave_split(requests: Iterable[tuple[float, float]], level: int) -> tuple[float | None, float | None]:
    """Mean of a value over the first `level` requests by start (every client's first: a closed loop's
    step opens with all of them at once) and over the rest. Requests are (start, value) pairs."""
    ordered = [value for _start, value in sorted(requests)]
    first, rest = ordered[:level], ordered[level:]
    return (statistics.fmean(first) if first else None, statistics.fmean(rest) if rest else None)
