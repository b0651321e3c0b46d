"""Several goodput sweeps of the same server side by side: the goodput's spread over the sweeps,
each offered rate's figures across them (median (min–max)), and a chart of TTFT p95 and TPOT p95
against the offered rate with one line per sweep.

Each input is what `python -m loadtest.experiments goodput --json` printed, or its summary.json, or
a folder of such files (read in name order); a run with --sweeps N gives its N sweeps. One sweep's
knee moves with the noise of a few seconds of Poisson arrivals; repeat the sweep (>= 3) and read
the spread (`experiments goodput --sweeps 3` prints these tables itself).

  python -m loadtest.goodput_sweeps docs/loadtest/goodput-h100-sweeps --chart docs/loadtest/goodput-h100-sweeps.png
"""

from __future__ import annotations

import json
from pathlib import Path

from llmstack.bench.gateway_report import md_table
from llmstack.cli import UsageError, add_json_argument, main_exit, parser_from_doc
from loadtest import goodput

PROG = "python -m loadtest.goodput_sweeps"


def read_sweeps(paths: list[str]) -> list[dict]:
    """Every goodput sweep in `paths` (summaries as files, or folders of *.json files), in order."""
    files: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            files += sorted(path.glob("*.json"))
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{name}: no such file or folder")
    summaries = []
    for file in files:
        try:
            summary = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"{file}: not a goodput summary ({exc})") from None
        problem = summary_problem(summary)
        if problem:
            raise UsageError(f"{file}: not a goodput summary ({problem}; made by `experiments goodput --json`?)")
        summaries.append(summary)
    if not summaries:
        raise UsageError(f"no goodput summaries in {', '.join(paths)}")
    sweeps = sweeps_of(summaries)
    objectives = {json.dumps(sweep["objective"], sort_keys=True) for sweep in sweeps}
    if len(objectives) > 1:
        raise UsageError(f"the sweeps have different latency objectives ({' vs '.join(sorted(objectives))})")
    return sweeps


def sweeps_of(summaries: list[dict]) -> list[dict]:
    """Every goodput sweep of the experiment summaries, in order."""
    return [sweep for summary in summaries for sweep in goodput.summary_sweeps(summary)]


def summary_problem(summary: object) -> str:
    """What keeps `summary` from holding goodput sweeps, or ''."""
    if not isinstance(summary, dict) or not isinstance(summary.get("goodput"), dict):
        return "no 'goodput' result"
    for result in goodput.summary_sweeps(summary):
        problem = sweep_problem(result)
        if problem:
            return problem
    return ""


def sweep_problem(result: object) -> str:
    if not isinstance(result, dict):
        return "a sweep is not an object"
    missing = [key for key in ("objective", "goodput_rps", "rows") if key not in result]
    if missing:
        return f"its goodput result lacks {', '.join(missing)}"
    rows = result["rows"]
    if not isinstance(rows, list) or not all(
        isinstance(row, dict) and {"offered_rate", "meets_objective"} <= row.keys() for row in rows
    ):
        return "a rate's row lacks offered_rate or meets_objective"
    return ""


def report(results: list[dict]) -> str:
    """The two tables and the verdict, as markdown (python -m llmstack.docs renders the same)."""
    return goodput.sweeps_report(results, md_table) + "\n"


def docs_report(summaries: list[dict]) -> str:
    """report() of the summaries in a folder, as llmstack.docs reads it."""
    return report(sweeps_of(summaries))


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("inputs", nargs="+", metavar="FILE_OR_FOLDER", help="goodput summaries (JSON)")
    parser.add_argument("--chart", help="write the PNG chart here")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    results = read_sweeps(args.inputs)
    if args.chart:
        from llmstack.cli import load_pyplot
        from loadtest.report import goodput_sweeps_chart

        try:
            goodput_sweeps_chart(load_pyplot(), results, Path(args.chart))
        except OSError as exc:
            raise UsageError(f"--chart {args.chart}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps({"sweeps": len(results), "goodput_rps": [r["goodput_rps"] for r in results]}, indent=2))
    else:
        print(report(results))
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
