"""TTFT at one client on the CPU stack under different core placements of its vLLM replicas.

Each replica's model worker binds its OpenMP threads to cores of its own (llmstack.replicas): on a
2-core host the default two replicas take a core each, leaving none free of a busy worker for vLLM's
API servers and engine cores, nginx and the router; one replica takes both; one replica with
VLLM_CPU_RESERVED_CORES=1 takes one and leaves the other free. Each --config is a set of .env
settings (NAME=VALUE, comma-separated). For each round and each config, interleaved, the settings are
written into .env, the stack restarted (scripts/up.sh --cpu, which removes replicas no longer
listed), and the packet-timing benchmark (llmstack.bench.packet_timing) run at one client: vLLM's
TTFT histogram, the gateway port's packets and the client, over the same requests. The table gives
the client's TTFT mean over the histogram's against the issue's 25 % target, per run and per config
(median and range of the rounds). .env's settings are put back at the end (the stack keeps the last
config until scripts/up.sh --cpu runs again). Needs a CPU stack started once and root for tshark.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from llmstack import REPO_ROOT
from llmstack.bench import packet_timing
from llmstack.bench.gateway_report import fmt, md_table
from llmstack.cli import StackError, UsageError, main_exit, parser_from_doc, progress, results_path, write_json
from llmstack.stats import percentile, spread

PROG = "cpu_placement.py"
TARGET_RATIO = 1.25  # issue 14: client TTFT mean within 25 % of vLLM's histogram at 1 client
ENV_FILE = REPO_ROOT / ".env"
DEFAULT_CONFIGS = ["VLLM_CPU_REPLICAS=2", "VLLM_CPU_REPLICAS=1", "VLLM_CPU_REPLICAS=1,VLLM_CPU_RESERVED_CORES=1"]
SETTING = re.compile(r"^[A-Z][A-Z0-9_]*$")


def parse_config(text: str) -> dict[str, str]:
    settings = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or not SETTING.match(name):
            raise UsageError(f"--config {text!r}: give .env settings as NAME=VALUE[,NAME=VALUE]")
        settings[name] = value
    return settings


def set_settings(env_file: Path, settings: Mapping[str, str]) -> dict[str, str | None]:
    """Write the settings into the env file; each one's line before (None: it had none)."""
    text = env_file.read_text()
    before: dict[str, str | None] = {}
    for name, value in settings.items():
        pattern = re.compile(rf"^{name}=.*$", re.M)
        found = pattern.search(text)
        before[name] = found.group(0) if found else None
        line = f"{name}={value}"
        text = pattern.sub(line, text) if found else text.rstrip("\n") + f"\n{line}\n"
    env_file.write_text(text)
    return before


def restore(env_file: Path, before: Mapping[str, str | None]) -> None:
    text = env_file.read_text()
    for name, line in before.items():
        pattern = re.compile(rf"^{name}=.*\n?", re.M)
        text = pattern.sub(f"{line}\n" if line is not None else "", text)
    env_file.write_text(text)


def restart_stack() -> None:
    result = subprocess.run(["scripts/up.sh", "--cpu"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise StackError(f"scripts/up.sh --cpu failed (exit {result.returncode}): {tail}")


def measure(args: argparse.Namespace, config: str, round_number: int) -> dict:
    """One packet-timing run; its summary and the per-request TTFT medians (the mean hides bursts)."""
    with tempfile.TemporaryDirectory(prefix="cpu-placement-") as tmp:
        output = Path(tmp) / "run.json"
        with contextlib.redirect_stdout(io.StringIO()):  # its own tables; the combined one is printed
            code = packet_timing.main([*args.packet_timing, "--no-chart", "--output", str(output)])
        if code != 0:
            raise StackError(f"the packet-timing run ({config}, round {round_number}) failed")
        run = json.loads(output.read_text())
    requests = run.get("requests") or []
    client = [r["client_ttft_ms"] for r in requests if r["client_ttft_ms"] is not None]
    wire = [r["wire_ttft_ms"] for r in requests if r["wire_ttft_ms"] is not None]
    return {
        "config": config,
        "round": round_number,
        "command": run["command"],
        "environment": run["environment"],
        "summary": run["summary"],
        "client_ttft_p50_ms": percentile(client, 50),
        "wire_ttft_p50_ms": percentile(wire, 50),
    }


def ratio(run: dict) -> float | None:
    means = run["summary"]["ttft_means_ms"]
    return means["client"] / means["vllm"] if means.get("vllm") else None


def table(data: dict) -> str:
    """Each run, then each config's median and range of client / histogram."""
    runs = data["runs"]
    per_run = md_table(
        ["Config", "Round", "vLLM histogram mean (ms)", "Wire mean", "Client mean", "Client p50", "Client / vLLM"],
        [
            [
                run["config"],
                str(run["round"]),
                fmt(run["summary"]["ttft_means_ms"]["vllm"], 2),
                fmt(run["summary"]["ttft_means_ms"]["wire"], 2),
                fmt(run["summary"]["ttft_means_ms"]["client"], 2),
                fmt(run["client_ttft_p50_ms"], 2),
                f"{fmt(ratio(run), 2)}x",
            ]
            for run in runs
        ],
    )
    rows = []
    for config in dict.fromkeys(run["config"] for run in runs):
        ratios = [r for run in runs if run["config"] == config and (r := ratio(run)) is not None]
        summary = spread(ratios)
        met = summary.max is not None and summary.max <= TARGET_RATIO
        rows.append(
            [
                config,
                str(summary.n),
                f"{fmt(summary.p50, 2)}x ({fmt(summary.min, 2)}-{fmt(summary.max, 2)})",
                "met" if met else "MISSED",
            ]
        )
    overall = md_table(["Config", "Rounds", "Client / vLLM, median (range)", f"Target <= {TARGET_RATIO:.2f}x"], rows)
    return f"{per_run}\n\n{overall}\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument(
        "--config",
        action="append",
        dest="configs",
        help="one placement as .env settings, NAME=VALUE[,NAME=VALUE]; repeat for each "
        f"(default: {' and '.join(DEFAULT_CONFIGS)})",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every config (default: 3)")
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds between requests (default: 0, back to back like the headless experiments); "
        "any other option goes to packet_timing.py, e.g. --requests, --max-tokens",
    )
    parser.add_argument("--output", type=Path, help="save the JSON here (default: results/cpu_placement.json)")
    args, rest = parser.parse_known_args(argv)
    args.configs = args.configs or DEFAULT_CONFIGS
    args.settings = [parse_config(config) for config in args.configs]
    if args.rounds < 1:
        raise UsageError("--rounds must be at least 1")
    args.packet_timing = ["--pause", str(args.pause), *rest]
    packet_timing.parse_args(args.packet_timing)  # its usage errors now, not after the first restart
    return args


def stop_on_term(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # .env is put back, as on Ctrl-C


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not ENV_FILE.exists():
        raise UsageError(f"no {ENV_FILE.name}: start the CPU stack once first (scripts/up.sh --cpu)")
    names = {name: "" for settings in args.settings for name in settings}
    before = set_settings(ENV_FILE, names)  # every name the configs touch, put back at the end
    signal.signal(signal.SIGTERM, stop_on_term)
    runs = []
    try:
        for round_number in range(1, args.rounds + 1):
            for config, settings in zip(args.configs, args.settings, strict=True):
                progress(f"round {round_number}/{args.rounds}: {config}, restarting the stack")
                set_settings(ENV_FILE, {**names, **settings})
                restart_stack()
                runs.append(measure(args, config, round_number))
    finally:
        restore(ENV_FILE, before)
    data = {"command": f"python3 benchmarks/{PROG} " + shlex.join(argv), "runs": runs}
    output = args.output or results_path("cpu_placement.json")
    write_json(output, data)
    print(table(data), end="")
    progress(f"wrote {output}; the stack keeps the last config until scripts/up.sh --cpu runs again")
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
