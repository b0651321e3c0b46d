"""Command-line conventions shared by every script and benchmark.

- Bad input: one line `<prog>: error: ...` on stderr and exit code 2 (UsageError, argparse errors).
- The stack missing or answering wrongly: one line and exit code 1 (StackError).
- Ctrl-C: `<prog>: interrupted` and exit code 130. Never a traceback.
- Progress on stderr (a bar on a terminal, plain lines otherwise), so stdout stays clean for --json.
- Results under results/ as JSON, PNG charts beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from llmstack import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "results"
T = TypeVar("T")


class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit code 2."""


class StackError(Exception):
    """The stack could not be reached or answered wrongly: one line on stderr, exit code 1."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors become UsageError, so `run` prints one line and exits 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parser_from_doc(prog: str, doc: str | None) -> ArgumentParser:
    """A parser whose description is the docstring's first paragraph and epilog the rest."""
    text = (doc or "").strip()
    description, _, epilog = text.partition("\n\n")
    return ArgumentParser(prog=prog, description=description, epilog=epilog or None)


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def add_output_arguments(parser: argparse.ArgumentParser, name: str, chart: bool = True) -> None:
    """--json, --output and (with chart) --chart / --no-chart, defaulting to results/<name>.json|png."""
    add_json_argument(parser)
    parser.add_argument("--output", type=Path, help=f"also save the JSON here (default: results/{name}.json)")
    if chart:
        parser.add_argument("--chart", type=Path, help=f"PNG path (default: results/{name}.png)")
        parser.add_argument("--no-chart", action="store_true", help="skip the PNG chart")


def read_saved_run(path: str | Path) -> dict:
    """A benchmark's saved JSON (for --render): a one-line error when it is missing or not JSON."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--render {path}: {err}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--render {path}: not a saved run (a JSON object)")
    return data


def render_saved_run(argv: list[str], chart: Callable[[dict, Path], None], render: Callable[[dict], str]) -> int | None:
    """`--render FILE` as a benchmark's only arguments: its chart again beside FILE and its tables
    printed, nothing measured. None when argv asks for something else."""
    if not argv or argv[0] != "--render":
        return None
    if len(argv) != 2:
        raise UsageError("--render takes the path of a run's JSON and nothing else")
    summary = read_saved_run(argv[1])
    chart(summary, Path(argv[1]).with_suffix(".png"))
    print(render(summary), end="")
    return 0


def run(prog: str, main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Call main(argv) under the error convention above; returns the exit code."""
    try:
        return main(argv)
    except UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except StackError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main_exit(prog: str, main: Callable[[list[str] | None], int]) -> NoReturn:
    """For `if __name__ == "__main__":` blocks and entry-point scripts."""
    sys.exit(run(prog, main))


def progress(message: str) -> None:
    """A progress line on stderr, time-stamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def progress_bar(items: Sequence[T] | Iterable[T], label: str, total: int | None = None) -> Iterator[T]:
    """Yield the items while showing how far along the work is: a redrawn bar on a terminal, a
    line per item otherwise (logs stay readable)."""
    sequence = list(items)
    count = total if total is not None else len(sequence)
    interactive = sys.stderr.isatty()
    started = time.monotonic()
    for index, item in enumerate(sequence):
        yield item
        done = index + 1
        elapsed = time.monotonic() - started
        if interactive:
            width = 24
            filled = int(width * done / count) if count else width
            sys.stderr.write(f"\r  {label:<30} [{'#' * filled}{'-' * (width - filled)}] {done}/{count} {elapsed:5.0f}s")
            if done == count:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            progress(f"{label}: {done}/{count} ({elapsed:.0f} s)")


def results_path(name: str, directory: Path | None = None) -> Path:
    directory = directory or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def write_json(path: Path, data: object) -> None:
    """Written beside, then renamed over: a process stopped mid-write leaves the old file, never half a new one."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)


def load_pyplot() -> Any:
    """matplotlib without a display; a one-line error where it is not installed."""
    try:
        import matplotlib
    except ImportError as err:
        raise UsageError(
            "matplotlib is needed for the chart (pip install -e '.[charts]' -c constraints.txt), or pass --no-chart"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_chart(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def repeated_values(values: list) -> list:
    """The values given more than once, sorted: a list of steps where each must be one step."""
    return sorted({value for value in values if values.count(value) > 1})


def positive_seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds (not nan, inf, 0 or below)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def parse_levels(text: str, what: str = "--levels") -> list[int]:
    """Concurrency levels (concurrent clients): comma-separated positive integers, each once, since
    each level is one step of a run and one row of its table. `what` names the setting in errors."""
    try:
        levels = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise UsageError(f"{what} must be positive integers, not {text!r}")
    repeated = repeated_values(levels)
    if repeated:
        raise UsageError(
            f"{what} gives {', '.join(map(str, repeated))} more than once: each level is one step and one row"
        )
    return levels
