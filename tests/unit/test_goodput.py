"""The goodput sweep's logic: which rate next, a rate's figures, and when the generator fell behind."""

from __future__ import annotations

import pytest

from llmstack.sse import COMPLETIONS, RequestRecord
from loadtest.goodput import Objective, RateSearch, generator_limited, rate_label, rate_row, requests_for_rate
from loadtest.settings import SettingsError, parse_rates

OBJECTIVE = Objective(ttft_p95_ms=200, tpot_p95_ms=50)


def sweep(search: RateSearch, knee: float) -> list[float]:
    """Rates the search tries against a server that meets the objective up to `knee`."""
    tried = []
    while (rate := search.next_rate()) is not None:
        tried.append(rate)
        search.record(rate, rate <= knee)
        assert len(tried) < 50
    return tried


def test_auto_sweep_doubles_until_a_miss_then_bisects():
    search = RateSearch(start=1, highest=1024, bisections=3)
    assert sweep(search, knee=5.5) == [1, 2, 4, 8, 6, 5, 5.5]
    assert search.goodput == 5.5 and search.lowest_miss == 6


def test_sweep_stops_at_the_highest_rate_and_when_the_first_rate_misses():
    search = RateSearch(start=1, highest=6, bisections=3)
    assert sweep(search, knee=100) == [1, 2, 4, 6]
    assert search.goodput == 6 and search.lowest_miss is None
    search = RateSearch(start=2, highest=64, bisections=3)
    assert sweep(search, knee=1) == [2]
    assert search.goodput is None


def test_a_fixed_list_runs_every_rate_lowest_first():
    search = RateSearch(start=1, highest=1024, bisections=3, fixed=[8, 2, 4])
    assert sweep(search, knee=3) == [2, 4, 8]
    assert search.goodput == 2 and search.lowest_miss == 4


def streamed(started: float, ttft: float, e2e: float, tokens: int = 11) -> RequestRecord:
    return RequestRecord(
        "open-loop", COMPLETIONS, True, started=started, started_wall=0, e2e=e2e, ttft=ttft, output_tokens=tokens
    )


def test_rate_row_from_records():
    records = [streamed(i * 0.5, 0.05, 0.05 + 10 * 0.02) for i in range(11)]  # 2/s, TPOT 20 ms
    row = rate_row(2, records, OBJECTIVE)
    assert row["requests"] == 11 and row["failures"] == 0
    assert row["arrival_rate"] == pytest.approx(2.0)
    assert row["ttft_ms"]["p95"] == pytest.approx(50.0)
    assert row["tpot_ms"]["p50"] == pytest.approx(20.0)
    assert row["max_in_flight"] == 1
    assert row["meets_objective"] and not row["generator_limited"]
    records[3].error = "HTTP 503"
    assert not rate_row(2, records, OBJECTIVE)["meets_objective"]
    slow = [streamed(i * 0.5, 0.25, 0.5) for i in range(11)]
    assert not rate_row(2, slow, OBJECTIVE)["meets_objective"]


def test_a_generator_behind_its_rate_is_no_pass():
    # 100 arrivals spread over 2 s were offered at 100/s: the generator sent 50/s.
    assert generator_limited(100, 50, 100)
    # A Poisson sample of 24 arrivals strays: 10.0/s measured for 8/s offered, or 6/s, is normal.
    assert not generator_limited(8, 6, 24)
    records = [streamed(i * 0.02, 0.05, 0.3) for i in range(100)]
    row = rate_row(100, records, OBJECTIVE)
    assert row["generator_limited"] and not row["meets_objective"]


def test_rates_labels_and_counts():
    assert parse_rates("0.5, 2,8") == [0.5, 2.0, 8.0]
    for bad in ("", "x", "0", "-1", "inf"):
        with pytest.raises(SettingsError):
            parse_rates(bad)
    assert rate_label(2.0) == "rate 2/s" and rate_label(0.5) == "rate 0.5/s"
    assert requests_for_rate(1, 20, 40, 1) == 40
    assert requests_for_rate(10, 20, 40, 3) == 201
