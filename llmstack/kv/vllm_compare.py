"""The KV planner's capacity figures against vLLM's own, for every config in tests/data/model_configs.

Two levels of evidence, both from the vllm-cpu image (vLLM 0.32.0):
1. vLLM's allocation code on each config (llmstack/kv/vllm_probe.py, run inside the image): the
   per-layer KV-cache specs, get_kv_cache_configs and get_kv_cache_capacity for a fixed KV space,
   GPU-like block size 16, at each --max-model-len. No weights, no model start.
2. Real vLLM starts on CPU for the small configs (--real-starts): dummy weights, no tokenizer,
   VLLM_CPU_KVCACHE_SPACE, block size 128, max_num_batched_tokens 2048; the "KV cache size: N tokens" /
   "Maximum concurrency" log line (kept in results/kv_planner_vs_vllm-CONFIG.log) against the planner
   at the same KV space, block size, dtype and max_num_batched_tokens.
   Each start holds the stack lock (/tmp/llmstack-stack.lock) so it never runs beside a test stack.

The planner side is computed with the same functions as `scripts/kv_planner.py CONFIG --kv-space-gib
N --max-model-len L --json` (llmstack.kv.model.analyse, llmstack.kv.grouping.plan_layout).
Writes docs/kv-planner-vs-vllm.json and the table in docs/kv-planner-vs-vllm.md;
--render-only rebuilds the Markdown from the JSON.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmstack import REPO_ROOT
from llmstack.cli import StackError, UsageError, parser_from_doc, progress, results_path, write_json
from llmstack.kv.grouping import plan_layout
from llmstack.kv.model import NotUnderstood, analyse, load_config
from llmstack.versions import read_versions
from llmstack.vllm import GiB, parse_startup_log

PROG = "kv_planner_vs_vllm.py"
CONFIG_DIR = REPO_ROOT / "tests" / "data" / "model_configs"
DEFAULT_IMAGE = "llm-stack/vllm:cpu"
DEFAULT_JSON = REPO_ROOT / "docs" / "kv-planner-vs-vllm.json"
DEFAULT_MARKDOWN = REPO_ROOT / "docs" / "kv-planner-vs-vllm.md"
STACK_LOCK = Path("/tmp/llmstack-stack.lock")
PROBE_MARKER = "VLLM_PROBE_RESULT "
# platforms/cpu.py: the CPU build's block size when none is given; passed explicitly to the real starts.
CPU_BLOCK_SIZE = 128
# Passed to the real starts (vLLM's default depends on the platform and usage context): small enough that
# gemma-3's 512-token windows stay below max_model_len 4096, so the start checks the sliding-window rule.
REAL_START_BATCHED_TOKENS = 2048
REAL_START_TIMEOUT_S = 600
COMMAND = "benchmarks/kv_planner_vs_vllm.py"


def planner_figures(
    config_path: Path, kv_space_gib: float, max_len: int, block_size: int, batched: int, dtype: str = "auto"
) -> dict:
    """What `kv_planner.py CONFIG --kv-space-gib ... --json` reports, from the same functions."""
    model = analyse(load_config(config_path), dtype=dtype)
    layout = plan_layout(model, block_size, batched)
    capacity = layout.capacity(max_len, kv_space_gib * GiB)
    return {
        "block_size": layout.block_size,
        "num_groups": len(layout.groups),
        "group_size": layout.group_size,
        "page_bytes": layout.page_bytes,
        "num_blocks": capacity.num_blocks,
        "tokens": capacity.tokens,
        "concurrency": capacity.concurrency,
    }


def percent_difference(planner: float, vllm: float) -> float:
    """(planner - vLLM) / vLLM in percent: positive where the planner overstates capacity."""
    return round(100 * (planner - vllm) / vllm, 3) if vllm else 0.0


def docker_command(image: str, *args: str, mounts: dict[Path, str], env: dict[str, str], name: str) -> list[str]:
    command = ["docker", "run", "--rm", "--pull=never", "--network", "none", "-e", "HF_HUB_OFFLINE=1"]
    for key, value in env.items():
        command += ["-e", f"{key}={value}"]
    for host, inside in mounts.items():
        command += ["-v", f"{host}:{inside}:ro"]
    # Named, so that an interrupted run's container can be found; vLLM's engine core needs more shared
    # memory than Docker's 64 MiB default.
    command += ["--name", name, "--shm-size=4g"]
    return [*command, "--entrypoint", "python3", image, *args]


def run_probe(image: str, configs: list[Path], kv_space_gib: float, lengths: list[int], block_size: int, batched: int):
    """Level 1: vLLM's own grouping and sizing in the image (llmstack/kv/vllm_probe.py)."""
    inside = [f"/configs/{path.name}" for path in configs]
    probe_args = [
        "/src/vllm_probe.py",
        *inside,
        f"--kv-space-gib={kv_space_gib}",
        f"--max-model-len={','.join(map(str, lengths))}",
        f"--block-size={block_size}",
        f"--max-num-batched-tokens={batched}",
    ]
    mounts = {Path(__file__).with_name("vllm_probe.py"): "/src/vllm_probe.py"}
    mounts.update({path.resolve(): f"/configs/{path.name}" for path in configs})
    # Two configs (llama-3-8b, gemma-2-9b) declare 8192 positions; vLLM refuses longer lengths without this.
    command = docker_command(
        image,
        *probe_args,
        mounts=mounts,
        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
        name="kv-planner-vs-vllm-probe",
    )
    progress(f"vLLM's allocation code on {len(configs)} config(s) in {image} (about 20 s each)")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(PROBE_MARKER):
            return json.loads(line[len(PROBE_MARKER) :])
    output = (done.stdout + done.stderr).splitlines()
    cause = [line for line in output if "Error" in line and not line.startswith(" ")][-1:] or output[-1:] or ["?"]
    raise StackError(f"the vLLM probe in {image} failed (exit {done.returncode}): {cause[0].strip()}")


@contextmanager
def stack_lock() -> Iterator[None]:
    """The lock every stack start on this machine takes (the `flock /tmp/llmstack-stack.lock` of the tests)."""
    with STACK_LOCK.open("a") as handle:
        progress(f"waiting for {STACK_LOCK}")
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def real_start_log(image: str, config_path: Path, kv_space_gib: int, max_len: int) -> str:
    """Start vLLM on CPU with dummy weights until it logs its KV cache size; return its log."""
    name = f"kv-planner-vs-vllm-{config_path.stem}".replace(".", "-")
    serve = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model=/model",
        "--load-format=dummy",
        "--skip-tokenizer-init",
        f"--max-model-len={max_len}",
        f"--block-size={CPU_BLOCK_SIZE}",
        f"--max-num-batched-tokens={REAL_START_BATCHED_TOKENS}",
        "--enforce-eager",
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    command = docker_command(image, *serve, mounts={config_path.resolve(): "/model/config.json"}, env=env, name=name)
    with stack_lock():
        progress(f"starting vLLM on CPU for {config_path.name} (2-4 minutes)")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        deadline = time.monotonic() + REAL_START_TIMEOUT_S
        try:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                if "Maximum concurrency" in line or time.monotonic() > deadline:
                    break
        finally:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
            process.wait(timeout=60)
    text = "".join(lines)
    results_path(f"kv_planner_vs_vllm-{config_path.stem}.log").write_text(text)
    if "Maximum concurrency" not in text:
        last = [line for line in lines if "Error" in line][-1:] or lines[-1:] or ["no output"]
        raise StackError(f"vLLM did not start for {config_path.name}: {last[0].strip()}")
    return text


def log_value(text: str, prefix: str) -> str:
    """The value after `prefix` in vLLM's engine-config log line (e.g. 'dtype=')."""
    for line in text.splitlines():
        if prefix in line:
            return line.split(prefix, 1)[1].split(",")[0].split()[0].rstrip(".")
    raise StackError(f"vLLM's log has no '{prefix}'")


def real_start(image: str, config_path: Path, kv_space_gib: int, max_len: int) -> dict:
    """Level 2: a real start's logged figures beside the planner's at the same settings."""
    text = real_start_log(image, config_path, kv_space_gib, max_len)
    logged = parse_startup_log(text)
    batched = REAL_START_BATCHED_TOKENS
    dtype = log_value(text, "dtype=").replace("torch.", "")
    planner = planner_figures(config_path, kv_space_gib, max_len, CPU_BLOCK_SIZE, batched, dtype)
    vllm_tokens = int(logged["kv_cache_tokens"])
    return {
        "config": config_path.name,
        "kv_space_gib": kv_space_gib,
        "max_model_len": max_len,
        "block_size": CPU_BLOCK_SIZE,
        "max_num_batched_tokens": batched,
        "dtype": dtype,
        "vllm_version": logged.get("vllm_version"),
        "vllm": {"tokens": vllm_tokens, "concurrency": float(logged["max_concurrency"])},
        "planner": planner,
        "difference_percent": percent_difference(planner["tokens"], vllm_tokens),
        "log_line": next(line.strip() for line in text.splitlines() if "KV cache size" in line),
    }


def compare_level1(probe: dict, configs: list[Path], kv_space_gib: float, block_size: int, batched: int) -> list[dict]:
    rows = []
    for path in configs:
        for figures in probe["configs"][path.name]:
            if figures["gpu_defaults"]:
                continue
            max_len = figures["max_model_len"]
            default = next(
                f for f in probe["configs"][path.name] if f["gpu_defaults"] and f["max_model_len"] == max_len
            )
            try:
                planner: dict | None = planner_figures(path, kv_space_gib, max_len, block_size, batched)
            except NotUnderstood as err:
                planner = {"not_understood": str(err)}
            row = {
                "config": path.name,
                "max_model_len": max_len,
                "vllm": figures,
                "vllm_gpu_defaults": default,
                "planner": planner,
            }
            if planner and "tokens" in planner:
                row["difference_percent"] = percent_difference(planner["tokens"], figures["tokens"])
                row["difference_percent_gpu_defaults"] = percent_difference(planner["tokens"], default["tokens"])
            rows.append(row)
    return rows


_VERSIONS = read_versions()
NOTES = """## Notes

- Level 1 runs vLLM's code from the CPU wheel with GPU-like settings; the GPU stack itself runs vLLM
  {gpu}, whose rules `llmstack/kv/grouping.py` lists beside {cpu}'s (the same figures where the pages
  are uniform, as here).
- llama-3-8b and gemma-2-9b declare 8192 positions; their 32,768-token rows are vLLM's arithmetic with
  `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`, as a capacity figure, not a claim that the models work that long.
- `tests/unit/test_kv_planner_vs_vllm.py` recomputes the planner's side of every row from this JSON and
  fails when it moves (re-run the command above after a planner change) or when a config is added.
- Re-running needs the `llm-stack/vllm-cpu` image (`scripts/build_images.py`); the real starts take
  the stack lock, so they wait for a running integration test.
"""


def render_markdown(result: dict) -> str:
    level1 = result["level1"]
    settings = level1["settings"]
    lines = [
        "# KV planner vs vLLM's own figures",
        "",
        "Generated by `" + result["command"] + "` from `docs/kv-planner-vs-vllm.json`; do not edit by hand",
        "(`--render-only` rebuilds this page from the JSON).",
        "",
        'Tokens are vLLM\'s "KV cache size: N tokens" (`int(max concurrency x max_model_len)`,',
        "`get_kv_cache_capacity` in `vllm/v1/core/kv_cache_utils.py`). Difference = (planner - vLLM) / vLLM;",
        "positive means the planner promises more than vLLM gives.",
        "",
        f"## 1. vLLM's allocation code, {settings['kv_space_gib']:g} GiB of KV space, block size "
        f"{settings['block_size']} (GPU-like)",
        "",
        f"vLLM {level1['vllm_version']} (`{settings['image']}`): per-layer specs built as the model runner",
        "builds them, then `get_kv_cache_configs` -> `generate_scheduler_kv_cache_config` -> `get_kv_cache_capacity`",
        "(`llmstack/kv/vllm_probe.py` says which vLLM function each step follows). max_num_batched_tokens",
        f"{settings['max_num_batched_tokens']}, synchronous scheduling (one batch in flight), prefix caching off.",
        f"The last columns are vLLM {_VERSIONS['VLLM_CPU_VERSION']} with its defaults on a GPU: prefix caching on,",
        "which puts Mamba /",
        "linear-attention layers in mamba_cache_mode 'align' (two states per request,",
        "`MambaSpec.max_memory_usage_bytes`), and async scheduling, which keeps two batches in flight",
        "(`VllmConfig.max_in_flight_tokens`), so a sliding window reserves window - 1 + 2 x max_num_batched_tokens",
        "tokens (`SlidingWindowSpec.max_admission_blocks_per_request`).",
        "The planner models neither (its grouping.py says so); the CPU build runs without async scheduling.",
        "",
        "| config | max_model_len | vLLM groups | planner tokens | vLLM tokens | difference | "
        f"vLLM tokens, {_VERSIONS['VLLM_CPU_VERSION']} GPU defaults | difference |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in level1["rows"]:
        vllm, default, planner = row["vllm"], row["vllm_gpu_defaults"], row["planner"]
        groups = f"{vllm['num_groups']} x {max(vllm['group_sizes'])} layers, {vllm['block_size']}-token blocks"
        planner_tokens = f"{planner['tokens']:,}" if "tokens" in planner else "not modelled"
        lines.append(
            f"| {row['config']} | {row['max_model_len']:,} | {groups} | {planner_tokens} | {vllm['tokens']:,} | "
            f"{row.get('difference_percent', 0):+.2f}% | {default['tokens']:,} | "
            f"{row.get('difference_percent_gpu_defaults', 0):+.2f}% |"
        )
    real = result.get("real_starts") or []
    if real:
        lines += [
            "",
            "## 2. Real vLLM starts on CPU",
            "",
            "Dummy weights, no tokenizer, `--enforce-eager`, `VLLM_CPU_KVCACHE_SPACE`, block size "
            f"{CPU_BLOCK_SIZE}, max_num_batched_tokens {REAL_START_BATCHED_TOKENS}; the planner at the",
            "same KV space, block size, dtype and max_num_batched_tokens as the start logged.",
            "",
            "| config | KV space | max_model_len | planner tokens | vLLM tokens (logged) | difference "
            "| vLLM log line |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for row in real:
            line = row["log_line"].split("] ", 1)[-1]
            lines.append(
                f"| {row['config']} | {row['kv_space_gib']} GiB | {row['max_model_len']:,} | "
                f"{row['planner']['tokens']:,} | {row['vllm']['tokens']:,} | {row['difference_percent']:+.2f}% | "
                f"`{line}` |"
            )
    notes = NOTES.replace("{gpu}", _VERSIONS["VLLM_VERSION"]).replace("{cpu}", _VERSIONS["VLLM_CPU_VERSION"])
    return "\n".join([*lines, "", notes])


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(value) for value in text.split(",") if value.strip()]
    except ValueError as err:
        raise UsageError(f"--max-model-len '{text}' is not a comma-separated list of integers") from err
    if not lengths or any(length <= 0 for length in lengths):
        raise UsageError("--max-model-len needs positive integers")
    return lengths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("--configs", type=Path, default=CONFIG_DIR, help="folder of config JSON files")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="the vllm-cpu image (default: %(default)s)")
    parser.add_argument("--kv-space-gib", type=float, default=100.0, help="KV space of level 1 (default: 100)")
    parser.add_argument("--max-model-len", default="4096,32768", help="level 1 lengths (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="level 1 block size (default: 16, GPU-like)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="level 1 (default: %(default)s)")
    parser.add_argument(
        "--real-starts",
        default="qwen3-0.6b,gemma-3-1b-it",
        help="configs (file stems) to start for real on CPU, comma-separated; '' for none (default: %(default)s)",
    )
    parser.add_argument("--real-kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (default: 2)")
    parser.add_argument("--real-max-model-len", type=int, default=4096, help="real starts (default: 4096)")
    parser.add_argument("--output", type=Path, default=DEFAULT_JSON, help="result JSON (default: %(default)s)")
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN, help="table page (default: %(default)s)")
    parser.add_argument("--render-only", action="store_true", help="rebuild the Markdown from --output")
    args = parser.parse_args(argv)
    args.lengths = parse_lengths(args.max_model_len)
    for name in ("kv_space_gib", "block_size", "max_num_batched_tokens", "real_kv_space_gib", "real_max_model_len"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if not args.configs.is_dir():
        raise UsageError(f"{args.configs}: not a folder of config JSON files")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        if not args.output.is_file():
            raise UsageError(f"{args.output}: no such file to render")
        args.markdown.write_text(render_markdown(json.loads(args.output.read_text())))
        return 0
    configs = sorted(args.configs.glob("*.json"))
    if not configs:
        raise UsageError(f"{args.configs}: no *.json configs")
    real_names = [name.strip() for name in args.real_starts.split(",") if name.strip()]
    unknown = sorted(set(real_names) - {path.stem for path in configs})
    if unknown:
        raise UsageError(f"--real-starts names configs that {args.configs} lacks: {', '.join(unknown)}")
    probe = run_probe(
        args.image, configs, args.kv_space_gib, args.lengths, args.block_size, args.max_num_batched_tokens
    )
    rows = compare_level1(probe, configs, args.kv_space_gib, args.block_size, args.max_num_batched_tokens)
    real = [
        real_start(args.image, args.configs / f"{name}.json", args.real_kv_space_gib, args.real_max_model_len)
        for name in real_names
    ]
    real_list = ",".join(real_names) or "''"
    command = (
        f"{COMMAND} --kv-space-gib {args.kv_space_gib:g} --max-model-len {args.max_model_len} "
        f"--block-size {args.block_size} --max-num-batched-tokens {args.max_num_batched_tokens} "
        f"--real-starts {real_list} --real-kv-space-gib {args.real_kv_space_gib}"
    )
    result = {
        "command": command,
        "level1": {
            "vllm_version": probe["vllm_version"],
            "settings": {
                "image": args.image,
                "kv_space_gib": args.kv_space_gib,
                "block_size": args.block_size,
                "max_num_batched_tokens": args.max_num_batched_tokens,
            },
            "rows": rows,
        },
        "real_starts": real,
    }
    write_json(args.output, result)
    args.markdown.write_text(render_markdown(result))
    for row in rows:
        print(
            f"{row['config']:<36} {row['max_model_len']:>6}  planner {row['planner'].get('tokens', 'n/a'):>10}  "
            f"vLLM {row['vllm']['tokens']:>10}  {row.get('difference_percent', 0):+.2f}%"
        )
    for row in real:
        print(
            f"{row['config']:<36} real start  planner {row['planner']['tokens']:>10}  "
            f"vLLM {row['vllm']['tokens']:>10}  {row['difference_percent']:+.2f}%"
        )
    print(f"wrote {args.output} and {args.markdown}")
    return 0
