"""Read vLLM's Prometheus metrics (the cross-check for the client's figures)."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass


@dataclass
class Snapshot:
    values: dict[str, float]

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def delta(self, later: "Snapshot", name: str) -> float:
        return later.get(name) - self.get(name)

    def histogram_mean(self, later: "Snapshot", name: str) -> float | None:
        """Mean of the observations between two snapshots (Δsum / Δcount)."""
        count = self.delta(later, name + "_count")
        return self.delta(later, name + "_sum") / count if count > 0 else None


def parse(text: str) -> Snapshot:
    """Each metric's samples summed over label sets (buckets keyed by their `le`)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            series, value = line.rsplit(" ", 1)
            number = float(value)
        except ValueError:
            continue
        name = series.split("{", 1)[0]
        if name.endswith("_bucket") and 'le="' in series:
            name += "{le=" + series.split('le="', 1)[1].split('"', 1)[0] + "}"
        values[name] = values.get(name, 0.0) + number
    return Snapshot(values)


class VllmMetrics:
    def __init__(self, url: str | None):
        self.url = url or None

    @property
    def available(self) -> bool:
        return self.url is not None

    def snapshot(self) -> Snapshot | None:
        if not self.url:
            return None
        try:
            with urllib.request.urlopen(self.url, timeout=5) as response:
                return parse(response.read().decode())
        except OSError:
            return None
