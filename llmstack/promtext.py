"""The one Prometheus text-format reader, on `prometheus_client.parser` (the library's own).

`parse` gives every sample with its labels; `Snapshot` sums each metric over its label sets (and
keeps histogram buckets apart by `le`), which is what the cross-checks between two moments need.
"""

from __future__ import annotations

import socket
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


class MetricsFormatError(ValueError):
    """The text is not in Prometheus' exposition format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """Every sample in a /metrics page (counters keep their `_total` sample names)."""
    try:
        return [
            Sample(sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except (ValueError, TypeError, IndexError) as err:
        raise MetricsFormatError(f"not Prometheus text format: {err}") from err


def fetch(url: str, timeout: float) -> str:
    """A /metrics page. Where the URL's host name stands for several addresses (every vLLM replica
    under one network alias), the pages of all of them, one after another: `parse`, `total` and
    `Snapshot` then sum over the replicas."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    infos = socket.getaddrinfo(parts.hostname or "", port, type=socket.SOCK_STREAM)
    addresses = sorted({str(info[4][0]) for info in infos})
    if len(addresses) <= 1:
        urls = [url]
    else:
        hosts = [f"[{a}]" if ":" in a else a for a in addresses]
        urls = [urllib.parse.urlunsplit(parts._replace(netloc=f"{host}:{port}")) for host in hosts]
    pages = []
    for one in urls:
        with urllib.request.urlopen(one, timeout=timeout) as response:
            pages.append(response.read().decode())
    return "\n".join(pages)


def parse_family(text: str, name: str) -> list[Sample]:
    """The samples of one gauge or counter (exact sample name; not a histogram's _bucket/_count lines),
    picked out before parsing, so a poller
    that reads one gauge many times a second does not parse the whole page each time."""
    wanted = [
        line
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ", f"# HELP {name} ", f"# TYPE {name} "))
    ]
    return parse("\n".join(wanted) + "\n") if wanted else []


def select(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float | None:
    """Sum of a metric's samples (those with the given labels); None when it has none."""
    chosen = select(samples, name, **labels)
    return sum(s.value for s in chosen) if chosen else None


def labels_of(samples: Iterable[Sample], name: str) -> dict[str, str] | None:
    """The labels of a metric's first sample (info-style metrics such as vllm:cache_config_info)."""
    for sample in samples:
        if sample.name == name:
            return sample.labels
    return None


def bucket_bounds(samples: Iterable[Sample], histogram: str) -> list[float]:
    """The finite upper bounds of a histogram's buckets, ascending."""
    bounds = {float(s.labels["le"]) for s in samples if s.name == histogram + "_bucket" and "le" in s.labels}
    return sorted(b for b in bounds if b != float("inf"))


def bucket_key(name: str, le: str) -> str:
    """How Snapshot keys one histogram bucket: `<name>_bucket{le=<bound>}` (bound as parsed)."""
    return f"{name}_bucket{{le={float(le)!r}}}"


@dataclass
class Snapshot:
    """A /metrics page at one moment: each sample name summed over label sets, buckets by `le`."""

    values: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_text(cls, text: str) -> Snapshot:
        values: dict[str, float] = {}
        for sample in parse(text):
            key = sample.name
            if key.endswith("_bucket") and "le" in sample.labels:
                key = bucket_key(key[: -len("_bucket")], sample.labels["le"])
            values[key] = values.get(key, 0.0) + sample.value
        return cls(values)

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def has(self, name: str) -> bool:
        return name in self.values

    def delta(self, later: Snapshot, name: str) -> float:
        return later.get(name) - self.get(name)

    def histogram_mean(self, later: Snapshot, name: str) -> float | None:
        """Mean of a histogram's observations between two snapshots (Δsum / Δcount)."""
        count = self.delta(later, name + "_count")
        return self.delta(later, name + "_sum") / count if count > 0 else None
