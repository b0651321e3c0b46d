"""The tables in README.md and docs/ that come from committed result files, generated from them.

Each table sits between two marker comments that name it, its source and this command:

  <!-- generated: NAME from SOURCE by `python -m llmstack.docs`; do not edit -->
  ...
  <!-- end generated: NAME -->

  python -m llmstack.docs           # rewrite every block from its source
  python -m llmstack.docs --check   # exit 1 naming each block that differs from its source (CI)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmstack import REPO_ROOT
from llmstack.bench import (
    cpu_placement,
    gateway_overhead,
    hop_timing,
    loadtest_fidelity,
    noisy_neighbour,
    packet_timing,
    routing,
    soak,
)
from llmstack.bench.gateway_report import md_table, median_range_of, memory_table
from llmstack.bench.loadtest_fidelity import markdown_table as fidelity_table
from llmstack.cli import StackError, main_exit, parser_from_doc
from llmstack.stats import difference
from loadtest import goodput, goodput_sweeps, report

PROG = "python -m llmstack.docs"
GPU_SUMMARY = "docs/gpu-results/summary.json"
GPU_FIDELITY = "docs/gpu-results/fidelity.json"
BLOCK = re.compile(
    r"(?P<head><!-- generated: (?P<name>[\w-]+) from (?P<source>\S+) by `python -m llmstack.docs`; do not edit -->\n)"
    r"(?P<body>.*?)"
    r"(?P<tail><!-- end generated: (?P=name) -->)",
    re.S,
)


def three_figures(value: float | None) -> str:
    """Three significant figures, thousands separated: 18.2, 114, 2.42, 3.10, 1,423."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:#.3g}"


def signed(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def p50_pair(row: dict, metric: str) -> str:
    return " / ".join(three_figures((row[path][metric] or {}).get("p50")) for path in ("direct", "gateway"))


def throughput_with_runs(path: dict) -> str:
    """Mean tok/s of the path's runs with their range: 354 (348–361)."""
    runs = path.get("throughput_runs") or []
    mean = f"{path['throughput_tok_s']:,.0f}"
    return f"{mean} ({min(runs):,.0f}–{max(runs):,.0f})" if len(runs) > 1 else mean


def ratio_with_verdict(row: dict) -> str:
    """Gateway over direct tok/s; ~ where the paths differ by less than either's runs do."""
    delta, beyond = difference(row["direct"].get("throughput_runs") or [], row["gateway"].get("throughput_runs") or [])
    return f"{row['throughput_ratio']:.2f}" + ("" if delta is None or beyond else " ~")


def h200_short(summary: dict) -> str:
    """README's table: throughput and p50 latencies per level, both paths."""
    rows = [
        [
            str(r["concurrency"]),
            throughput_with_runs(r["direct"]),
            throughput_with_runs(r["gateway"]),
            p50_pair(r, "ttft_ms"),
            three_figures((r["direct"]["tpot_ms"] or {}).get("p50")),
        ]
        for r in summary["concurrency"]
    ]
    return md_table(
        [
            "Clients",
            "Direct tok/s (two runs' range)",
            "Through gateway (two runs' range)",
            "TTFT p50 direct / gateway (ms)",
            "TPOT p50 (ms)",
        ],
        rows,
    )


def h200_summary(summary: dict) -> str:
    """docs/gpu-results.md's table: the README's, with the gateway's cost and the loader's CPU."""
    rows = []
    for r in summary["concurrency"]:
        cpu = " / ".join(f"{r[path]['client_cpu_pct']:.0f}" for path in ("direct", "gateway"))
        rows.append(
            [
                str(r["concurrency"]),
                throughput_with_runs(r["direct"]),
                throughput_with_runs(r["gateway"]),
                ratio_with_verdict(r),
                p50_pair(r, "ttft_ms"),
                signed(r.get("added_ttft_p50_ms")),
                signed(r.get("added_ttft_p99_ms")),
                three_figures((r["direct"]["tpot_ms"] or {}).get("p50")),
                cpu,
            ]
        )
    return md_table(
        [
            "Concurrency",
            "Direct tok/s (runs' range)",
            "Through gateway (runs' range)",
            "Ratio (~: inside the runs' spread)",
            "TTFT p50 direct / gateway (ms)",
            "Added p50 (ms)",
            "Added p99 (ms)",
            "TPOT p50 direct (ms)",
            "Client CPU % (direct / gateway)",
        ],
        rows,
    )


@dataclass(frozen=True)
class Generator:
    source: str  # a JSON file, or a folder whose *.json files are read, in name order, as a list
    render: Callable[[object], str]
    # A folder's files as {file name: result} instead, where the name says what the result alone
    # does not (e.g. which version of the harness made it).
    by_name: bool = False


def read_source(path: Path, by_name: bool = False) -> object:
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise StackError(f"{path} holds no result file (*.json)")
        results = {file.name: json.loads(file.read_text()) for file in files}
        return results if by_name else list(results.values())
    return json.loads(path.read_text())


def goodput_report(summary: dict) -> str:
    """The goodput experiment's table (loadtest.experiments goodput --json) and its verdict."""
    result = summary["goodput"]
    check = result.get("vllm") or {}
    counts = (
        f"vLLM counted {check.get('vllm_requests') or 0:,.0f} requests, "
        f"the client {check.get('client_requests') or 0:,}; "
        f"{summary.get('loader_processes', 1)} load generator process(es)."
    )
    return md_table(goodput.TABLE_HEADERS, goodput.table_rows(result)) + f"\n{goodput.verdict(result)} {counts}\n"


def experiments_sample(runs: list[dict]) -> str:
    """The README's sample of the headless experiments: what `loadtest.experiments` printed for the
    first of several runs of the same command (from their --json), then how far the runs differ."""
    return "```text\n" + report.render_tables(runs[0]) + "\n```\n\n" + experiments_spread(runs)


def experiments_spread(runs: list[dict]) -> str:
    """How far several runs of the headless experiments differ, in one sentence."""

    def figures(pick: Callable[[dict], float | None], digits: int = 0) -> str:
        return " / ".join(f"{value:.{digits}f}" if (value := pick(run)) is not None else "-" for run in runs)

    return (
        f"The same command {len(runs)} times: client TTFT mean "
        f"{figures(lambda run: run['concurrency']['vllm']['client_ttft_mean_ms'])} ms against vLLM's "
        f"{figures(lambda run: run['concurrency']['vllm']['vllm_ttft_mean_ms'])} ms over the same requests; "
        f"client TPOT mean {figures(lambda run: run['concurrency']['vllm']['client_tpot_mean_ms'], 2)} ms "
        f"against vLLM's {figures(lambda run: run['concurrency']['vllm']['vllm_tpot_mean_ms'], 2)} ms; "
        f"streaming TTFT median {figures(lambda run: run['streaming']['median']['ttft_ms'])} ms."
    )


GENERATORS: dict[str, Generator] = {
    "h200-short": Generator(GPU_SUMMARY, lambda data: h200_short(data)),  # type: ignore[arg-type]
    "h200-summary": Generator(GPU_SUMMARY, lambda data: h200_summary(data)),  # type: ignore[arg-type]
    "h200-memory": Generator(GPU_SUMMARY, lambda data: memory_table(data["memory"])),  # type: ignore[index]
    "h200-fidelity": Generator(GPU_FIDELITY, lambda data: fidelity_table(data)),  # type: ignore[arg-type]
}
POLICY_RESULTS = "docs/gateway-policy"
for _stem in (
    "noisy-neighbour-cpu",
    "noisy-neighbour-cpu-sequences8",
    "noisy-neighbour-h200",
    "noisy-neighbour-h200-before-fixes",
):
    GENERATORS[_stem] = Generator(f"{POLICY_RESULTS}/{_stem}.json", noisy_neighbour.markdown_table)  # type: ignore[arg-type]
    GENERATORS[f"{_stem}-key-a"] = Generator(f"{POLICY_RESULTS}/{_stem}.json", noisy_neighbour.a_table)  # type: ignore[arg-type]
for _stem in (
    "gateway-overhead-cpu",
    "gateway-overhead-cpu-previous-gateway",
    "gateway-overhead-h200",
    "gateway-overhead-h200-before-fixes",
    "gateway-overhead-h200-one-client-6-repeats",
    "gateway-overhead-h200-no-body-filter",
    "gateway-overhead-h200-flush",
    "gateway-overhead-h100-256",
):
    GENERATORS[_stem] = Generator(f"{POLICY_RESULTS}/{_stem}.json", gateway_overhead.markdown_table)  # type: ignore[arg-type]
GENERATORS["soak-cpu"] = Generator("docs/soak/soak-cpu.json", soak.markdown_table)  # type: ignore[arg-type]
for _stem in ("h100", "h100-kv", "cpu"):
    GENERATORS[f"routing-{_stem}"] = Generator(f"docs/routing/{_stem}.json", routing.markdown_table)  # type: ignore[arg-type]
    GENERATORS[f"routing-{_stem}-targets"] = Generator(f"docs/routing/{_stem}.json", routing.targets_table)  # type: ignore[arg-type]
for _stem in ("packet-timing-cpu-before", "packet-timing-cpu"):
    GENERATORS[_stem] = Generator(f"docs/loadtest/{_stem}.json", packet_timing.tables)  # type: ignore[arg-type]
GENERATORS["cpu-placement"] = Generator("docs/loadtest/cpu-placement.json", cpu_placement.table)  # type: ignore[arg-type]
for _stem in (
    "fidelity-h100",
    "fidelity-h100-saturation",
    "fidelity-h100-512-8-workers",
    "fidelity-h100-512-12-per-client",
    "fidelity-h100-shared-pool",
):
    _source = f"docs/loadtest/{_stem}.json"
    GENERATORS[_stem] = Generator(_source, loadtest_fidelity.repeats_table)  # type: ignore[arg-type]
    GENERATORS[f"{_stem}-server"] = Generator(_source, loadtest_fidelity.server_view_table)  # type: ignore[arg-type]


# One lease's ladder, run as several commands (a level or a few each): one table.
def merged(table: Callable[[dict], str], pool_levels: bool = False) -> Callable[[object], str]:
    """A fidelity table of a folder's results read as one (loadtest_fidelity.merge_results)."""
    return lambda parts: table(loadtest_fidelity.merge_results(parts, pool_levels))  # type: ignore[arg-type]


# The tables of a fidelity ladder run as several commands (each level's repeats pooled).
LADDER_TABLES = (
    ("", loadtest_fidelity.repeats_table),
    ("-paired", loadtest_fidelity.paired_table),
    ("-server", loadtest_fidelity.server_view_table),
)


for _folder in ("fidelity-h100-pooled", "fidelity-h100-first-wave"):
    _source = f"docs/loadtest/{_folder}"
    GENERATORS[_folder] = Generator(_source, merged(loadtest_fidelity.repeats_table))
    GENERATORS[f"{_folder}-server"] = Generator(_source, merged(loadtest_fidelity.server_view_table))
# The first results with TTFT deciles.
GENERATORS["fidelity-h100-first-wave-deciles"] = Generator(
    "docs/loadtest/fidelity-h100-first-wave", merged(loadtest_fidelity.ttft_deciles_table)
)

# At 512 clients, the harness before and after each user opened its connection at start (the file
# names say which), interleaved; and the ladder with it, the two 512-client commands pooled.
CONNECTIONS = "docs/loadtest/fidelity-h100-connections"
WITH_FIRST_REQUEST = "opened-with-first-request"


def connections_ab(results: dict[str, dict]) -> str:
    return loadtest_fidelity.connections_table(
        [(name, data) for name, data in results.items() if "level-512" in name], WITH_FIRST_REQUEST
    )


def opened_at_start(table: Callable[[dict], str]) -> Callable[[object], str]:
    def render(results: dict[str, dict]) -> str:
        kept = [data for name, data in results.items() if WITH_FIRST_REQUEST not in name]
        return table(loadtest_fidelity.merge_results(kept, pool_levels=True))

    return render  # type: ignore[return-value]


GENERATORS["fidelity-h100-connections-ab"] = Generator(CONNECTIONS, connections_ab, by_name=True)  # type: ignore[arg-type]
for _suffix, _table in (
    ("", loadtest_fidelity.repeats_table),
    ("-server", loadtest_fidelity.server_view_table),
    ("-deciles", loadtest_fidelity.ttft_deciles_table),
):
    GENERATORS[f"fidelity-h100-connections{_suffix}"] = Generator(CONNECTIONS, opened_at_start(_table), by_name=True)

# Greedy `vllm bench serve` (as the harness samples) against its server-default sampling at 8 and
# 64 clients, interleaved; and the ladder with greedy bench (its three commands pooled).
GREEDY = "docs/loadtest/fidelity-h100-greedy"


def sampling_ab(results: list[dict]) -> str:
    return loadtest_fidelity.sampling_table([data for data in results if len(data["settings"]["levels"]) == 1])


def greedy_ladder(table: Callable[[dict], str]) -> Callable[[object], str]:
    def render(results: list[dict]) -> str:
        ladder = [data for data in results if len(data["settings"]["levels"]) > 1]
        return table(loadtest_fidelity.merge_results(ladder, pool_levels=True))

    return render  # type: ignore[return-value]


GENERATORS["fidelity-h100-greedy-ab"] = Generator(GREEDY, sampling_ab)  # type: ignore[arg-type]
for _suffix, _table in LADDER_TABLES:
    GENERATORS[f"fidelity-h100-greedy{_suffix}"] = Generator(GREEDY, greedy_ladder(_table))


def by_command(folder: str, table: Callable[[list[tuple[str, dict]], int], str], level: int) -> Generator:
    """A table of one level, command by command: a folder's results read with their file names."""
    return Generator(folder, lambda results: table(list(results.items()), level), by_name=True)  # type: ignore[attr-defined]


# With both clients sending the same requests, each client against vLLM's record of its own ones too.
SAME_REQUESTS_TABLES = (*LADDER_TABLES, ("-against-server", loadtest_fidelity.against_server_table))

# Both clients sending the same requests (bench greedy, with the harness's prompt): the ladder run
# twice and 1 client once more with 6 repeats, every command pooled; and 1 client by command.
SAME_PROMPT = "docs/loadtest/fidelity-h100-same-prompt"
for _suffix, _table in SAME_REQUESTS_TABLES:
    GENERATORS[f"fidelity-h100-same-prompt{_suffix}"] = Generator(SAME_PROMPT, merged(_table, pool_levels=True))
GENERATORS["fidelity-h100-same-prompt-1-client"] = by_command(SAME_PROMPT, loadtest_fidelity.paired_by_command_table, 1)

# Runs 15 to 30 times as long (8 and 64 clients, 960 and 3,840 requests a run): the ladder's
# tables, each client against the server, and 8 clients by command and by repeat.
LONG_RUNS = "docs/loadtest/fidelity-h100-long-runs"
for _suffix, _table in SAME_REQUESTS_TABLES:
    GENERATORS[f"fidelity-h100-long-runs{_suffix}"] = Generator(LONG_RUNS, merged(_table, pool_levels=True))
GENERATORS["fidelity-h100-long-runs-8-clients"] = by_command(LONG_RUNS, loadtest_fidelity.paired_by_command_table, 8)
GENERATORS["fidelity-h100-long-runs-8-clients-by-repeat"] = by_command(
    LONG_RUNS, loadtest_fidelity.runs_by_command_table, 8
)

# Long runs at 256 and 512 clients (16 requests a client), a command a level with the default
# loader processes, pooled as a ladder; and 512 again with 8 loader processes, command by command.
LONG_RUNS_HIGH = "docs/loadtest/fidelity-h100-long-runs-256-512"


def default_workers(table: Callable[[dict], str]) -> Callable[[object], str]:
    def render(results: dict[str, dict]) -> str:
        parts = [data for name, data in results.items() if data["settings"]["workers"] == "auto"]
        return table(loadtest_fidelity.merge_results(parts, pool_levels=True))

    return render  # type: ignore[return-value]


for _suffix, _table in SAME_REQUESTS_TABLES:
    GENERATORS[f"fidelity-h100-long-runs-256-512{_suffix}"] = Generator(
        LONG_RUNS_HIGH, default_workers(_table), by_name=True
    )
GENERATORS["fidelity-h100-long-runs-512-workers"] = by_command(
    LONG_RUNS_HIGH, loadtest_fidelity.paired_by_command_table, 512
)
GENERATORS["fidelity-h100-long-runs-512-workers-by-repeat"] = by_command(
    LONG_RUNS_HIGH, loadtest_fidelity.runs_by_command_table, 512
)

# The compose CPU stack (2 cores): the harness in Locust's container, bench in vLLM's, two commands pooled.
FIDELITY_CPU = "docs/loadtest/fidelity-cpu"
for _suffix, _table in SAME_REQUESTS_TABLES:
    GENERATORS[f"fidelity-cpu{_suffix}"] = Generator(FIDELITY_CPU, merged(_table, pool_levels=True))


def by_setting(results: dict[str, dict], marker: str) -> dict[str, list[dict]]:
    """An A/B folder's results grouped by the setting its file names give after `marker`
    (e.g. 03-shares-1024.json, marker "-shares-": "1024"), in file order within each group."""
    groups: dict[str, list[dict]] = {}
    for name, data in results.items():
        groups.setdefault(name.removesuffix(".json").split(marker)[1], []).append(data)
    return groups


# The Locust containers' CPU weight on the CPU stack, A/B interleaved (file names: NN-shares-N.json),
# each setting's commands pooled.
CPU_SHARES = "docs/loadtest/locust-cpu-shares"


def cpu_shares_ab(results: dict[str, dict]) -> str:
    groups = by_setting(results, "-shares-")
    return loadtest_fidelity.settings_table(
        [
            (f"LOCUST_CPU_SHARES={shares}", loadtest_fidelity.merge_results(parts, pool_levels=True))
            for shares, parts in sorted(groups.items(), key=lambda item: -int(item[0]))
        ]
    )


GENERATORS["locust-cpu-shares"] = Generator(CPU_SHARES, cpu_shares_ab, by_name=True)  # type: ignore[arg-type]
# The gateway's and the router's CPU weight on the CPU stack, A/B interleaved (NN-shares-N.json):
# the README's headless experiments, each setting's runs side by side.
GATEWAY_CPU_SHARES = "docs/loadtest/gateway-cpu-shares"


def gateway_cpu_shares_ab(results: dict[str, dict]) -> str:
    groups = by_setting(results, "-shares-")

    def ratio(run: dict) -> float:
        check = run["concurrency"]["vllm"]
        return check["client_ttft_mean_ms"] / check["vllm_ttft_mean_ms"]

    rows, ratios = [], []
    for shares, runs in sorted(groups.items(), key=lambda item: -int(item[0])):
        checks = [run["concurrency"]["vllm"] for run in runs]
        ratios.append([ratio(run) for run in runs])
        rows.append(
            [
                f"NGINX_CPU_SHARES=ROUTER_CPU_SHARES={shares}",
                str(len(runs)),
                median_range_of([check["client_ttft_mean_ms"] for check in checks], 1),
                median_range_of([check["vllm_ttft_mean_ms"] for check in checks], 1),
                median_range_of(ratios[-1], 2, show=lambda value: f"{value:.2f}x"),
                median_range_of([check["client_tpot_mean_ms"] / check["vllm_tpot_mean_ms"] for check in checks], 2),
                median_range_of([run["streaming"]["median"]["ttft_ms"] for run in runs], 1),
            ]
        )
    table = md_table(
        [
            "Setting",
            "Runs",
            "client TTFT mean ms",
            "vLLM hist TTFT mean ms (same requests)",
            "client / vLLM hist",
            "client TPOT / vLLM hist",
            "streaming TTFT median ms",
        ],
        rows,
    )
    delta, beyond = difference(ratios[1], ratios[0]) if len(ratios) == 2 else (None, False)
    if delta is None:
        return table
    verdict = "larger than" if beyond else "inside"
    return (
        f"{table}\n\nClient / vLLM hist, the first setting's median minus the second's: "
        f"{delta:+.2f}x, {verdict} the runs' spread."
    )


GENERATORS["gateway-cpu-shares"] = Generator(GATEWAY_CPU_SHARES, gateway_cpu_shares_ab, by_name=True)  # type: ignore[arg-type]
# The harness's interval between reads of vLLM's running requests, A/B interleaved
# (NN-interval-S.json), each setting's commands pooled.
SAMPLE_INTERVAL_CPU = "docs/loadtest/running-sample-interval-cpu"


def sample_interval_ab(results: dict[str, dict]) -> str:
    groups = [
        (f"--running-sample-interval {interval}", loadtest_fidelity.merge_results(parts, pool_levels=True))
        for interval, parts in sorted(by_setting(results, "-interval-").items(), key=lambda item: float(item[0]))
    ]
    tables = (loadtest_fidelity.settings_table, loadtest_fidelity.settings_paired_table)
    return "\n\n".join(table(groups) for table in (*tables, loadtest_fidelity.settings_phases_table))


GENERATORS["running-sample-interval-cpu"] = Generator(SAMPLE_INTERVAL_CPU, sample_interval_ab, by_name=True)  # type: ignore[arg-type]
# The same A/B at saturation on an H100: 512 clients (8 requests a client), 256 clients (4).
for _folder in ("running-sample-interval-h100", "running-sample-interval-h100-256"):
    GENERATORS[_folder] = Generator(f"docs/loadtest/{_folder}", sample_interval_ab, by_name=True)  # type: ignore[arg-type]
# What a /metrics read costs vLLM's API server on the CPU stack: the page and the gauge alone.
GAUGE_READ_CPU = "docs/loadtest/gauge-read-cpu"
GENERATORS["gauge-read-cpu"] = Generator(
    GAUGE_READ_CPU,
    lambda results: loadtest_fidelity.metrics_read_table(list(results.items())),  # type: ignore[attr-defined]
    by_name=True,
)
# The gauge-alone poll at 0.1 s against 0.5 s on the CPU stack, A/B interleaved (NN-interval-S.json).
GENERATORS["gauge-interval-cpu"] = Generator("docs/loadtest/gauge-interval-cpu", sample_interval_ab, by_name=True)  # type: ignore[arg-type]
# The ladder at the 0.5 s default on that lease, with each client's phases on the server.
POLL_LADDER = "docs/loadtest/fidelity-h100-poll-0.5.json"
for _suffix, _table in (*SAME_REQUESTS_TABLES, ("-phases", loadtest_fidelity.server_phases_table)):
    GENERATORS[f"fidelity-h100-half-second-poll{_suffix}"] = Generator(POLL_LADDER, _table)  # type: ignore[arg-type]
# The gateway path hop by hop on the CPU stack, router policies interleaved (NN-policy-P.json).
HOP_TIMING = "docs/loadtest/hop-timing-cpu"


def hop_timing_policies(results: dict[str, dict]) -> str:
    groups = by_setting(results, "-policy-")
    return hop_timing.settings_table([(f"ROUTER_POLICY={policy}", runs) for policy, runs in groups.items()])


GENERATORS["hop-timing-cpu"] = Generator(HOP_TIMING, hop_timing_policies, by_name=True)  # type: ignore[arg-type]
# The README's sample of the headless experiments (docs/loadtest/experiments-cpu/run-N.json).
GENERATORS["experiments-cpu"] = Generator("docs/loadtest/experiments-cpu", experiments_sample)  # type: ignore[arg-type]
# The same, before the Locust containers' CPU weight was raised (LOCUST_CPU_SHARES).
GENERATORS["experiments-cpu-before"] = Generator("docs/loadtest/experiments-cpu-before", experiments_spread)  # type: ignore[arg-type]
# The same command interleaved with experiments-cpu's, at the old 50 ms poll of vLLM's running requests.
GENERATORS["experiments-cpu-old-poll"] = Generator("docs/loadtest/experiments-cpu-old-poll", experiments_spread)  # type: ignore[arg-type]
GENERATORS["goodput-h100"] = Generator("docs/loadtest/goodput-h100.json", goodput_report)  # type: ignore[arg-type]
GENERATORS["goodput-h100-sweeps"] = Generator("docs/loadtest/goodput-h100-sweeps", goodput_sweeps.docs_report)  # type: ignore[arg-type]
DOCUMENTS = (
    *("README.md", "docs/gpu-results.md", "docs/loadtest.md", "docs/gateway-policy.md", "docs/soak.md"),
    "docs/routing.md",
)


def regenerate(text: str, root: Path = REPO_ROOT) -> str:
    """The document with every generated block rewritten from its source."""
    # A marker the pattern does not read (a name with a dot, a missing start or end) would be left
    # alone silently. Documents hold markers only as real blocks, never as quoted text.
    edges = {edge for match in BLOCK.finditer(text) for edge in (match.start("head"), match.start("tail"))}
    for marker in re.finditer(r"<!--\s*(end\s+)?generated\s*:", text, re.I):
        if marker.start() not in edges:
            line = text.count("\n", 0, marker.start()) + 1
            raise StackError(f"line {line}: a generated block's marker is malformed or has no matching start or end")

    def replace(match: re.Match) -> str:
        name, source = match["name"], match["source"]
        generator = GENERATORS.get(name)
        if generator is None:
            raise StackError(f"unknown generated block {name!r} (known: {', '.join(GENERATORS)})")
        if source != generator.source:
            raise StackError(f"block {name} names {source}, but it is made from {generator.source}")
        data = read_source(root / source, generator.by_name)
        return match["head"] + generator.render(data) + "\n" + match["tail"]

    return BLOCK.sub(replace, text)


def stale_blocks(root: Path = REPO_ROOT) -> list[str]:
    """'document: block' for each generated block that differs from what its source gives."""
    stale = []
    for document in DOCUMENTS:
        text = (root / document).read_text()
        fresh = {m["name"]: m["body"] for m in BLOCK.finditer(regenerate(text, root))}
        stale += [f"{document}: {m['name']}" for m in BLOCK.finditer(text) if fresh[m["name"]] != m["body"]]
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_blocks()
        if stale:
            raise StackError(f"generated blocks differ from their sources (run {PROG}): {', '.join(stale)}")
        return 0
    for document in DOCUMENTS:
        path = REPO_ROOT / document
        text = path.read_text()
        fresh = regenerate(text)
        if fresh != text:
            path.write_text(fresh)
            print(f"rewrote {document}")
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
