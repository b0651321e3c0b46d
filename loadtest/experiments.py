"""Run the lab's experiments headless against the running stack and print the lab's tables.

  docker compose run --rm locust-master python -m loadtest.experiments [all|concurrency|streaming|prefix|goodput ...]

`all` is the lab's three (concurrency, streaming, prefix); `goodput` (open-loop Poisson arrivals,
a sweep for the highest request rate that meets the latency objective) runs when named.

Load goes through the gateway (LOADTEST_HOST, default http://nginx:8080) with the key(s) in
LOADTEST_API_KEY_FILE, driven by Locust's own runner, users and step shape (loadtest/). vLLM's
metrics (--vllm-metrics-url) are read only as a cross-check. Results (records CSV, JSON, HTML
report, PNG charts) go to --results/<run id>/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from llmstack.cli import add_json_argument, main_exit, parser_from_doc, positive_seconds
from loadtest.settings import RUNNING_SAMPLE_INTERVAL_S, SettingsError, check_host, parse_rates

PROG = "python -m loadtest.experiments"
EXPERIMENTS = ("concurrency", "streaming", "prefix", "goodput")
LAB_EXPERIMENTS = EXPERIMENTS[:3]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument(
        "experiments",
        nargs="*",
        default=["all"],
        metavar="EXPERIMENT",
        help="concurrency, streaming, prefix, goodput, or all = the first three (default: all)",
    )
    parser.add_argument(
        "--host",
        default=(os.environ.get("LOADTEST_HOST") or "http://nginx:8080"),
        help="gateway URL (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="file with one or more API keys, one a line (default: LOADTEST_API_KEY_FILE)",
    )
    parser.add_argument(
        "--model",
        default=(os.environ.get("LOADTEST_MODEL") or ""),
        help="served model name (default: the first of /v1/models)",
    )
    parser.add_argument(
        "--levels",
        default=(os.environ.get("LOADTEST_STEPS") or "1,2,4,8"),
        help="concurrency levels, comma-separated (default: %(default)s)",
    )
    hold = parser.add_mutually_exclusive_group()
    hold.add_argument(
        "--requests-per-client",
        type=int,
        default=None,
        help="hold each level until every client has sent this many requests (default: 4)",
    )
    hold.add_argument("--step-seconds", type=float, default=None, help="hold each level this long instead")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=50,
        help="output tokens per request, concurrency experiment (the lab's 50)",
    )
    parser.add_argument("--streaming-requests", type=int, default=5, help="streamed requests, one at a time")
    parser.add_argument("--streaming-max-tokens", type=int, default=80, help="output tokens (the lab's 80)")
    parser.add_argument("--prefix-requests", type=int, default=10, help="requests with and without a shared prefix")
    parser.add_argument("--prefix-words", type=int, default=600, help="length of the system prompt in words")
    parser.add_argument(
        "--vllm-metrics-url",
        default=(os.environ.get("LOADTEST_VLLM_METRICS_URL") or "http://vllm-replicas:8000/metrics"),
        help="vLLM's /metrics for the cross-check, summed over every replica the name resolves to; "
        "'' to skip (default: %(default)s)",
    )
    parser.add_argument(
        "--running-sample-interval",
        type=positive_seconds,
        default=RUNNING_SAMPLE_INTERVAL_S,
        help="seconds between reads of vLLM's running requests during a run; each read costs the "
        "server's API process a /metrics page (default: %(default)s)",
    )
    parser.add_argument(
        "--results",
        default=(os.environ.get("LOADTEST_RESULTS_DIR") or "results"),
        help="folder for the run's files (default: %(default)s)",
    )
    goodput = parser.add_argument_group("goodput (open-loop arrivals)")
    goodput.add_argument(
        "--rates",
        default="auto",
        help="offered request rates (requests/s), comma-separated, or auto: double from --start-rate "
        "until the objective is missed, then bisect (default: %(default)s)",
    )
    goodput.add_argument("--start-rate", type=float, default=1.0, help="first rate of the auto sweep (1/s)")
    goodput.add_argument("--max-rate", type=float, default=1024.0, help="the auto sweep stops here (1024/s)")
    goodput.add_argument("--bisections", type=int, default=3, help="rates tried between met and missed (3)")
    goodput.add_argument(
        "--rate-seconds", type=float, default=20.0, help="arrivals per rate: this many seconds' worth (20)"
    )
    goodput.add_argument("--rate-min-requests", type=int, default=40, help="but at least this many (40)")
    goodput.add_argument(
        "--sweeps",
        type=int,
        default=1,
        help="run the whole sweep this many times, one after another, and report the goodput's spread "
        "over them (default: 1; one sweep's knee moves with a few seconds of Poisson noise)",
    )
    goodput.add_argument(
        "--slo-ttft-p95-ms",
        type=float,
        default=None,
        help="latency objective: TTFT p95 at most this (default: LOADTEST_SLO_TTFT_P95_MS or 200)",
    )
    goodput.add_argument(
        "--slo-tpot-p95-ms",
        type=float,
        default=None,
        help="latency objective: TPOT p95 at most this (default: LOADTEST_SLO_TPOT_P95_MS or 50)",
    )
    parser.add_argument(
        "--workers",
        default=(os.environ.get("LOADTEST_WORKERS") or "auto"),
        help="load generator processes on this host: a number, or auto = one per 16 clients of the "
        "highest level, at most the usable cores minus one; 1 = this process alone (default: %(default)s)",
    )
    parser.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    chosen: set[str] = set()
    for name in args.experiments:
        if name == "all":
            chosen.update(LAB_EXPERIMENTS)
        elif name in EXPERIMENTS:
            chosen.add(name)
        else:
            parser.error(f"unknown experiment {name!r} (choose from {', '.join(EXPERIMENTS)}, all)")
    args.chosen = [name for name in EXPERIMENTS if name in chosen]
    for flag in (
        "max_tokens",
        "streaming_requests",
        "streaming_max_tokens",
        "prefix_requests",
        "prefix_words",
    ):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.streaming_max_tokens < 2 or args.max_tokens < 2:
        parser.error("--max-tokens and --streaming-max-tokens must be at least 2 (TPOT needs two tokens)")
    if args.requests_per_client is not None and args.requests_per_client < 1:
        parser.error("--requests-per-client must be at least 1")
    if args.step_seconds is not None and args.step_seconds <= 0:
        parser.error("--step-seconds must be positive")
    if args.requests_per_client is None and args.step_seconds is None:
        args.requests_per_client = 4
    try:
        args.host = check_host(args.host, "--host (default: LOADTEST_HOST)")
    except SettingsError as exc:
        parser.error(str(exc))
    if args.rates != "auto":
        try:
            args.fixed_rates = parse_rates(args.rates)
        except SettingsError as exc:
            parser.error(str(exc))
    else:
        args.fixed_rates = None
    if not 0 < args.start_rate <= args.max_rate:
        parser.error("--start-rate must be positive and at most --max-rate")
    if args.bisections < 0 or args.rate_seconds <= 0 or args.rate_min_requests < 1 or args.sweeps < 1:
        parser.error("--bisections must be >= 0, --rate-seconds > 0, --rate-min-requests and --sweeps >= 1")
    for flag in ("slo_ttft_p95_ms", "slo_tpot_p95_ms"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    return args


def worker_count(args: argparse.Namespace, levels: list[int]) -> int:
    from loadtest.distributed import parse_workers

    try:
        return parse_workers(args.workers, max(levels) if "concurrency" in args.chosen else 1)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Locust patches sockets with gevent; it must come after argument parsing (fast --help) and
    # before anything opens a connection.
    from loadtest.settings import parse_levels

    return run(args, parse_levels(args.levels, "--levels"))


def run(args: argparse.Namespace, levels: list[int]) -> int:
    # Locust first: its gevent patches ssl and sockets, which must happen before requests loads them.
    import locust  # noqa: F401

    from loadtest import goodput, metrics, report
    from loadtest.runner import ExperimentRunner
    from loadtest.settings import Settings

    logging.getLogger("locust").setLevel(logging.WARNING)
    environ = dict(os.environ, LOADTEST_HOST=args.host)  # --host wins (its default is LOADTEST_HOST)
    if args.api_key_file:
        environ.pop("LOADTEST_API_KEY", None)
        environ["LOADTEST_API_KEY_FILE"] = args.api_key_file
    settings = Settings.from_environment(environ)
    settings.model = args.model
    settings.prefix_words = args.prefix_words

    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.results) / f"loadtest-{run_id}"
    try:
        out_dir.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise SettingsError(f"cannot create the results folder {out_dir}: {exc.strerror}") from None

    metrics.install_precise_buckets()
    metrics.KEEP_RECORDS = True
    workers = worker_count(args, levels)
    runner = ExperimentRunner(settings, args.vllm_metrics_url, workers, args.running_sample_interval)
    summary: dict = {
        "run_id": run_id,
        "host": settings.host,
        "levels": levels,
        "loader_processes": runner.loader_processes,
        "running_sample_interval_s": args.running_sample_interval,
        "results_dir": str(out_dir),
        "started": datetime.now(UTC).isoformat(),
        "prompt": settings.prompt,  # what every plain request sent (the fidelity benchmark sends it too)
    }
    started = time.perf_counter()
    try:
        runner.warm_up()
        summary["model"] = settings.model
        if "concurrency" in args.chosen:
            summary["concurrency"] = runner.concurrency(
                levels, args.requests_per_client, args.step_seconds, args.max_tokens
            )
        if "streaming" in args.chosen:
            summary["streaming"] = runner.streaming(args.streaming_requests, args.streaming_max_tokens)
        if "prefix" in args.chosen:
            summary["prefix"] = runner.prefix(args.prefix_requests)
        if "goodput" in args.chosen:
            settings.max_tokens = args.max_tokens
            objective = goodput.Objective(
                args.slo_ttft_p95_ms or settings.slo_ttft_p95_ms, args.slo_tpot_p95_ms or settings.slo_tpot_p95_ms
            )
            sweeps = []
            for number in range(1, args.sweeps + 1):
                if args.sweeps > 1:
                    print(f"[goodput] sweep {number} of {args.sweeps}", file=sys.stderr, flush=True)
                search = goodput.RateSearch(args.start_rate, args.max_rate, args.bisections, args.fixed_rates)
                sweep = number if args.sweeps > 1 else None
                sweeps.append(runner.goodput(search, objective, args.rate_seconds, args.rate_min_requests, sweep))
            summary["goodput"] = sweeps[0]
            if len(sweeps) > 1:
                summary["goodput_sweeps"] = sweeps
    finally:
        runner.close()
    summary["duration_s"] = time.perf_counter() - started
    summary["failures"] = sum(1 for record in runner.all_records if not record.ok)
    summary["requests"] = len(runner.all_records)
    summary["failure_reasons"] = report.failure_reasons(runner.all_records)

    report.write_files(out_dir, summary, runner.all_records, charts=not args.no_charts)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(report.render_tables(summary))
        print(f"\nFiles: {out_dir}/ (records.csv, summary.json, report.html{', *.png' if not args.no_charts else ''})")
    if summary["failures"]:
        reasons = "; ".join(f"{count}x {reason}" for reason, count in summary["failure_reasons"].items())
        print(
            f"{PROG}: {summary['failures']} of {summary['requests']} requests failed: {reasons}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
