"""Open-loop figures and the goodput search (no Locust import, so unit tests can use it).

Goodput here is the highest offered request rate (Poisson arrivals, as `vllm bench serve
--request-rate`) at which every request succeeds and TTFT p95 and TPOT p95 stay within the latency
objective (LOADTEST_SLO_TTFT_P95_MS, LOADTEST_SLO_TPOT_P95_MS), with the arrivals really sent at
that rate (a load generator that falls behind would report its own limit as the server's). The
sweep doubles the rate from a start until the objective is missed, then bisects between the last
rate that met it and the first that did not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llmstack.bench.gateway_report import fmt, median_range_of
from llmstack.sse import RequestRecord
from llmstack.stats import percentiles, spread
from loadtest.results import span
from loadtest.step_state import max_overlap

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Objective:
    ttft_p95_ms: float
    tpot_p95_ms: float

    def describe(self) -> str:
        return f"TTFT p95 <= {self.ttft_p95_ms:g} ms and TPOT p95 <= {self.tpot_p95_ms:g} ms, no failed request"


def tag_sweep(records: list[RequestRecord], number: int) -> None:
    """Name one sweep's requests in records.csv ('sweep 2, rate 8/s'): the sweeps of a run offer
    the same rates, so the rate alone would not tell them apart."""
    for record in records:
        record.tag = f"sweep {number}, {record.tag}"


def requests_for_rate(rate: float, seconds: float, minimum: int, generators: int) -> int:
    """Arrivals at one rate: `seconds` worth, at least `minimum`, a multiple of the generators."""
    count = max(minimum, math.ceil(rate * seconds))
    return math.ceil(count / generators) * generators


def rate_row(rate: float, records: list[RequestRecord], objective: Objective) -> dict:
    """One offered rate's figures from its records."""
    ok = [r for r in records if r.ok]
    starts = sorted(r.started for r in records)
    row: dict = {
        "offered_rate": rate,
        "requests": len(records),
        "failures": len(records) - len(ok),
        # What the generator really sent: arrivals - 1 gaps over the first to the last arrival.
        "arrival_rate": (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 2 else None,
        "max_in_flight": max_overlap([(r.started, r.started + r.e2e) for r in records]),
    }
    row["generator_limited"] = generator_limited(rate, row["arrival_rate"], len(records))
    if ok:
        begin, end, tokens = span(ok)
        row.update(
            {
                "output_tokens": tokens,
                "completed_rate": len(ok) / (end - begin) if end > begin else None,
                "throughput_tok_s": tokens / (end - begin) if end > begin else None,
                "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None], PERCENTILES, 1000),
                "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None], PERCENTILES, 1000),
                "e2e_ms": spread([r.e2e for r in ok]).scaled(1000).as_dict(),
            }
        )
    row["meets_objective"] = meets(row, objective)
    return row


def generator_limited(offered: float, arrived: float | None, count: int) -> bool:
    """The load generator did not send at the offered rate: the measured arrival rate is further
    below it than a Poisson sample of `count` arrivals strays (3 standard deviations, 1/sqrt(n))."""
    if arrived is None or count < 3:
        return False
    return arrived < offered * (1 - 3 / math.sqrt(count))


def meets(row: dict, objective: Objective) -> bool:
    ttft = (row.get("ttft_ms") or {}).get("p95")
    tpot = (row.get("tpot_ms") or {}).get("p95")
    return (
        row["requests"] > 0
        and row["failures"] == 0
        and not row.get("generator_limited")
        and ttft is not None
        and tpot is not None
        and ttft <= objective.ttft_p95_ms
        and tpot <= objective.tpot_p95_ms
    )


class RateSearch:
    """Which rate to try next: doubling from `start` until the objective is missed (or `highest` is
    reached), then `bisections` midpoints between the best rate that met it and the lowest that
    missed. With a fixed list, each rate of the list in turn, lowest first."""

    def __init__(self, start: float, highest: float, bisections: int, fixed: list[float] | None = None):
        self.start, self.highest, self.bisections = start, highest, bisections
        self.fixed = sorted(fixed) if fixed else None
        self.tried: list[tuple[float, bool]] = []

    def record(self, rate: float, met: bool) -> None:
        self.tried.append((rate, met))

    @property
    def goodput(self) -> float | None:
        passing = [rate for rate, met in self.tried if met]
        return max(passing) if passing else None

    @property
    def lowest_miss(self) -> float | None:
        missing = [rate for rate, met in self.tried if not met]
        return min(missing) if missing else None

    def next_rate(self) -> float | None:
        if self.fixed is not None:
            done = {rate for rate, _ in self.tried}
            return next((rate for rate in self.fixed if rate not in done), None)
        if not self.tried:
            return self.start
        best, miss = self.goodput, self.lowest_miss
        if miss is None:
            last = self.tried[-1][0]
            return None if last >= self.highest else min(last * 2, self.highest)
        first_miss = next(index for index, (_, met) in enumerate(self.tried) if not met)
        if best is None or len(self.tried) - first_miss - 1 >= self.bisections:
            return None
        return round((best + miss) / 2, 3)


TABLE_HEADERS = [
    "Offered req/s",
    "Arrived req/s",
    "Requests",
    "Failed",
    "Completed req/s",
    "Output tok/s",
    "TTFT p50/p95/p99 ms",
    "TPOT p50/p95/p99 ms",
    "Most in flight",
    "Meets objective",
]


def _trio(values: dict | None) -> str:
    if not values or values.get("p50") is None:
        return "-"
    return "/".join(fmt(values[key], 2) for key in ("p50", "p95", "p99"))


def table_rows(result: dict) -> list[list[str]]:
    """The goodput table's cells, one row per offered rate (the terminal and the docs both show these)."""
    return [
        [
            f"{r['offered_rate']:g}",
            fmt(r.get("arrival_rate"), 2),
            f"{r['requests']:,}",
            str(r["failures"]),
            fmt(r.get("completed_rate"), 2),
            fmt(r.get("throughput_tok_s"), 0),
            _trio(r.get("ttft_ms")),
            _trio(r.get("tpot_ms")),
            str(r["max_in_flight"]),
            "yes" if r["meets_objective"] else ("no (generator behind)" if r.get("generator_limited") else "no"),
        ]
        for r in result["rows"]
    ]


def verdict(result: dict) -> str:
    objective = result["objective"]
    objective_text = (
        f"TTFT p95 <= {objective['ttft_p95_ms']:g} ms and TPOT p95 <= {objective['tpot_p95_ms']:g} ms, no failure"
    )
    if result["goodput_rps"] is None:
        text = f"Goodput: below the lowest rate tried ({objective_text})."
    else:
        miss = result.get("lowest_miss_rps")
        beyond = f"; missed at {miss:g}" if miss is not None else "; never missed up to the highest rate tried"
        text = f"Goodput: {result['goodput_rps']:g} requests/s met {objective_text}{beyond}."
    behind = [r for r in result["rows"] if r.get("generator_limited")]
    if behind:
        text += (
            f" The load generator could not send {behind[0]['offered_rate']:g} requests/s (it sent "
            f"{fmt(behind[0]['arrival_rate'])}): rates from there measure it, not the server; add --workers."
        )
    return text


# --- Several sweeps of the same server (repeats): the goodput's spread, and each rate across sweeps ---

SWEEP_HEADERS = [
    "Sweep",
    "Rates tried (req/s)",
    "Goodput req/s",
    "Lowest miss req/s",
    "Output tok/s at the goodput",
    "TTFT p95 ms at the goodput",
    "TPOT p95 ms at the goodput",
    "Requests (client / vLLM)",
]
RATE_HEADERS = [
    "Offered req/s",
    "Sweeps that tried it",
    "Met the objective in",
    "Arrived req/s",
    "Output tok/s",
    "TTFT p95 ms",
    "TPOT p95 ms",
    "Most in flight",
]


def summary_sweeps(summary: dict) -> list[dict]:
    """An experiment summary's goodput sweeps: all of a --sweeps run's, else its one."""
    return summary.get("goodput_sweeps") or [summary["goodput"]]


def sweep_rows(results: list[dict]) -> list[list[str]]:
    """One row per sweep (a goodput result, summary["goodput"]): what it tried and found."""
    rows = []
    for number, result in enumerate(results, 1):
        at_goodput: dict = next((r for r in result["rows"] if r["offered_rate"] == result["goodput_rps"]), {})
        check = result.get("vllm") or {}
        rows.append(
            [
                str(number),
                ", ".join(f"{r['offered_rate']:g}" for r in result["rows"]),
                "-" if result["goodput_rps"] is None else f"{result['goodput_rps']:g}",
                "-" if result.get("lowest_miss_rps") is None else f"{result['lowest_miss_rps']:g}",
                fmt(at_goodput.get("throughput_tok_s"), 0),
                fmt((at_goodput.get("ttft_ms") or {}).get("p95"), 1),
                fmt((at_goodput.get("tpot_ms") or {}).get("p95"), 2),
                f"{check.get('client_requests') or 0:,} / {check.get('vllm_requests') or 0:,.0f}",
            ]
        )
    return rows


def rows_by_rate(results: list[dict]) -> dict[float, list[dict]]:
    """Every sweep's row of each offered rate, lowest rate first. Rates are keyed as the bisection
    rounds them (3 decimals), so one rate reached two ways is one rate."""
    by_rate: dict[float, list[dict]] = {}
    for result in results:
        for row in result["rows"]:
            by_rate.setdefault(round(row["offered_rate"], 3), []).append(row)
    return dict(sorted(by_rate.items()))


def rate_rows(results: list[dict]) -> list[list[str]]:
    """One row per offered rate that any sweep tried: median (min–max) over the sweeps that tried it."""

    def over(rows: list[dict], figure: Callable[[dict], float | None], digits: int) -> str:
        values = [value for row in rows if (value := figure(row)) is not None]
        return median_range_of(values, digits)

    return [
        [
            f"{rate:g}",
            str(len(rows)),
            f"{sum(1 for row in rows if row['meets_objective'])} of {len(rows)}",
            over(rows, lambda row: row.get("arrival_rate"), 1),
            over(rows, lambda row: row.get("throughput_tok_s"), 0),
            over(rows, lambda row: (row.get("ttft_ms") or {}).get("p95"), 0),
            over(rows, lambda row: (row.get("tpot_ms") or {}).get("p95"), 1),
            over(rows, lambda row: row.get("max_in_flight"), 0),
        ]
        for rate, rows in rows_by_rate(results).items()
    ]


def repeats_verdict(results: list[dict]) -> str:
    """The goodput over the sweeps, median (min–max), and where the knee lies: up to which rate every
    sweep met the objective, the rates above it that only some met, and those none met."""
    found = [result["goodput_rps"] for result in results if result["goodput_rps"] is not None]
    sweeps = f"{len(results)} sweep{'s' if len(results) != 1 else ''}"
    if found:
        text = f"Goodput over {sweeps}: {median_range_of(found, 0, lambda v: f'{v:g}')} requests/s"
        if len(found) < len(results):
            text += f" ({len(results) - len(found)} met the objective at no rate, left out)"
    else:
        text = f"Goodput over {sweeps}: none (no rate met the objective)"
    met = {rate: [row["meets_objective"] for row in rows] for rate, rows in rows_by_rate(results).items()}
    held = None  # the highest rate up to which every rate tried was met by every sweep that tried it
    for rate, outcomes in met.items():
        if not all(outcomes):
            break
        held = rate
    above = {rate: outcomes for rate, outcomes in met.items() if held is None or rate > held}
    again = [rate for rate, outcomes in above.items() if all(outcomes)]  # met above a rate that was missed
    sometimes = [rate for rate, outcomes in above.items() if any(outcomes) and not all(outcomes)]
    never = [rate for rate, outcomes in above.items() if not any(outcomes)]
    parts = [text]
    if held is not None:
        parts.append(f"every sweep met it at every rate up to {held:g}/s")
    if again:
        parts.append(f"every sweep that tried it met it again at {', '.join(f'{rate:g}' for rate in again)}/s")
    if sometimes:
        parts.append(f"only some met it at {', '.join(f'{rate:g}' for rate in sometimes)}/s")
    if never and found:
        parts.append(f"none met it at {', '.join(f'{rate:g}' for rate in never)}/s")
    return "; ".join(parts) + "."


def sweeps_report(results: list[dict], render_table: Callable[[list[str], list[list[str]]], str]) -> str:
    """Each sweep's goodput, each rate across the sweeps, and the verdict, in `render_table`'s
    format (markdown for the docs, plain columns for the terminal)."""
    return (
        render_table(SWEEP_HEADERS, sweep_rows(results))
        + "\n\n"
        + render_table(RATE_HEADERS, rate_rows(results))
        + f"\n\n{repeats_verdict(results)}"
    )
