"""The goodput sweep's logic: which rate next, a rate's figures, and when the generator fell behind."""

from __future__ import annotations

import json

import pytest

from llmstack.cli import UsageError
from llmstack.sse import COMPLETIONS, RequestRecord
from loadtest import goodput_sweeps
from loadtest.goodput import (
    Objective,
    RateSearch,
    generator_limited,
    rate_row,
    rate_rows,
    repeats_verdict,
    requests_for_rate,
    sweep_rows,
    tag_sweep,
)
from loadtest.settings import SettingsError, parse_rates, rate_label

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
    for bad in ("", "x", "0", "-1", "inf", "nan", "2,8,2", "2,2.0", "1,1.0000001"):
        with pytest.raises(SettingsError):
            parse_rates(bad)
    assert rate_label(2.0) == "rate 2/s" and rate_label(0.5) == "rate 0.5/s"
    records = [RequestRecord("open-loop", COMPLETIONS, True, 0.0, 0.0, tag=rate_label(8.0))]
    tag_sweep(records, 2)
    assert records[0].tag == "sweep 2, rate 8/s"
    assert requests_for_rate(1, 20, 40, 1) == 40
    assert requests_for_rate(10, 20, 40, 3) == 201


def sweep_result(goodput_rps, miss, rows):
    """A goodput result as `experiments goodput` writes it: rows of (rate, met, TTFT p95 ms)."""
    return {
        "objective": {"ttft_p95_ms": 200.0, "tpot_p95_ms": 50.0},
        "goodput_rps": goodput_rps,
        "lowest_miss_rps": miss,
        "vllm": {"client_requests": 10 * len(rows), "vllm_requests": 10.0 * len(rows)},
        "rows": [
            {
                "offered_rate": rate,
                "arrival_rate": rate,
                "requests": 10,
                "failures": 0,
                "throughput_tok_s": 50.0 * rate,
                "ttft_ms": {"p50": ttft / 2, "p95": ttft, "p99": ttft},
                "tpot_ms": {"p50": 3.0, "p95": 5.0, "p99": 6.0},
                "max_in_flight": int(rate),
                "meets_objective": met,
            }
            for rate, met, ttft in rows
        ],
    }


SWEEPS = [
    sweep_result(8, 16, [(8, True, 100), (16, False, 300), (12, False, 250)]),
    sweep_result(12, 16, [(8, True, 120), (16, False, 400), (12, True, 190)]),
    sweep_result(8, 16, [(8, True, 80), (16, False, 350), (12, False, 210)]),
]


def test_sweeps_give_the_goodputs_spread_and_each_rate_across_them():
    rows = sweep_rows(SWEEPS)
    assert rows[1][:4] == ["2", "8, 16, 12", "12", "16"] and rows[1][5] == "190.0" and rows[1][7] == "30 / 30"
    by_rate = {row[0]: row for row in rate_rows(SWEEPS)}
    assert list(by_rate) == ["8", "12", "16"]  # each rate once, lowest first
    assert by_rate["8"][1:3] == ["3", "3 of 3"] and by_rate["8"][5] == "100 (80–120)"
    assert by_rate["12"][2] == "1 of 3" and by_rate["16"][2] == "0 of 3"
    assert repeats_verdict(SWEEPS) == (
        "Goodput over 3 sweeps: 8 (8–12) requests/s; every sweep met it at every rate up to 8/s; "
        "only some met it at 12/s; none met it at 16/s."
    )
    # Met at 8 and 16/s but missed at 12/s: "up to" stops below the first rate not always met.
    bumpy = [sweep_result(16, 12, [(8, True, 100), (12, False, 300), (16, True, 150)])]
    assert repeats_verdict(bumpy) == (
        "Goodput over 1 sweep: 16 requests/s; every sweep met it at every rate up to 8/s; "
        "every sweep that tried it met it again at 16/s; none met it at 12/s."
    )
    # One rate reached two ways (a bisection's rounding) is one row.
    twice = [sweep_result(8, 16, [(152.5, True, 100)]), sweep_result(8, 16, [(152.50000000000003, True, 120)])]
    assert [row[0] for row in rate_rows(twice)] == ["152.5"]
    nothing = sweep_result(None, 8, [(8, False, 900)])
    assert repeats_verdict([nothing, nothing]) == "Goodput over 2 sweeps: none (no rate met the objective)."
    assert repeats_verdict([SWEEPS[0], nothing]).startswith(
        "Goodput over 2 sweeps: 8 requests/s (1 met the objective at no rate, left out)"
    )


def test_sweeps_read_files_and_folders_and_refuse_other_json(tmp_path):
    folder = tmp_path / "sweeps"
    folder.mkdir()
    for number, result in enumerate(SWEEPS, 1):
        (folder / f"sweep-{number}.json").write_text(json.dumps({"goodput": result}))
    assert [sweep["goodput_rps"] for sweep in goodput_sweeps.read_sweeps([str(folder)])] == [8, 12, 8]
    # A run with --sweeps N holds its N sweeps; its "goodput" is the first of them.
    several = tmp_path / "several.json"
    several.write_text(json.dumps({"goodput": SWEEPS[1], "goodput_sweeps": SWEEPS[1:]}))
    assert [sweep["goodput_rps"] for sweep in goodput_sweeps.read_sweeps([str(several)])] == [12, 8]
    summaries = [json.loads(file.read_text()) for file in sorted(folder.glob("*.json"))]
    assert "Goodput over 3 sweeps" in goodput_sweeps.docs_report(summaries)
    several.unlink()
    chart = tmp_path / "sweeps.png"
    assert goodput_sweeps.main([str(folder), "--chart", str(chart)]) == 0
    assert chart.read_bytes().startswith(b"\x89PNG")
    (tmp_path / "other.json").write_text(json.dumps({"concurrency": {}}))
    (tmp_path / "partial.json").write_text(json.dumps({"goodput": {"objective": {}, "goodput_rps": 1}}))
    (tmp_path / "rowless.json").write_text(json.dumps({"goodput": SWEEPS[0] | {"rows": [{"offered_rate": 8}]}}))
    stricter = SWEEPS[0] | {"objective": {"ttft_p95_ms": 100.0, "tpot_p95_ms": 50.0}}
    (tmp_path / "stricter.json").write_text(json.dumps({"goodput": stricter}))
    for paths, message in (
        ([str(tmp_path / "missing")], "no such file or folder"),
        ([str(tmp_path / "other.json")], "no 'goodput' result"),
        ([str(tmp_path / "partial.json")], "lacks rows"),
        ([str(tmp_path / "rowless.json")], "lacks offered_rate or meets_objective"),
        ([str(folder), str(tmp_path / "stricter.json")], "different latency objectives"),
        ([str(tmp_path)], "not a goodput summary"),  # other.json is among the folder's files
    ):
        with pytest.raises(UsageError, match=message):
            goodput_sweeps.read_sweeps(paths)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="no goodput summaries"):
        goodput_sweeps.read_sweeps([str(empty)])


def test_tables_render_several_goodput_sweeps():
    from loadtest import report

    one = {"run_id": "r", "host": "h", "requests": 9, "failures": 0, "duration_s": 1.0}
    one["goodput"] = SWEEPS[0] | {"max_tokens": 50}
    text = report.render_tables(one)
    assert "tokens each)\n" in text and "sweeps" not in text
    several = one | {"goodput_sweeps": SWEEPS}
    text = report.render_tables(several)
    assert "tokens each), sweep 1\n" in text and "== Goodput over 3 sweeps\n" in text
    assert text.endswith("none met it at 16/s.")
