"""KV cache capacity planner: how many tokens and full-length requests fit, per gpu_memory_utilization.

Reads a model's config.json and computes the KV cache bytes per token from the architecture
(full-attention layers x KV heads x head dim x 2 for K and V x bytes; MLA latents; sliding-window
layers bounded by their window; linear-attention / state-space layers as a fixed state per request),
then prints the lab's table (utilisation | KV space | tokens | max concurrency | risk) with that
computation in place of the lab's 0.2 GB-per-request guess. --check-stack compares the prediction
with the KV cache a running vLLM reports.

Capacity follows vLLM's own allocation: layers in KV-cache groups of equal size (padding the
last), one block pool shared by the groups, whole blocks per request (llmstack.kv.grouping).

Exit codes: 0 ok, 1 the stack could not be read, 2 bad input, 3 architecture not understood.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from llmstack.cli import (
    ArgumentParser,
    UsageError,
    load_pyplot,
    results_path,
    save_chart,
    write_json,
)
from llmstack.kv.grouping import KVCacheLayout, plan_layout
from llmstack.kv.model import (
    KVModel,
    NotUnderstood,
    activation_bytes,
    analyse,
    dtype_bytes,
    estimate_parameters,
    load_config,
)
from llmstack.kv.stack_check import cross_check, print_cross_check
from llmstack.vllm import GiB, add_stack_arguments, stack_from_args

PROG = "kv_planner.py"
DEFAULT_UTILISATIONS = [0.75, 0.80, 0.85, 0.90, 0.95]
EXIT_NOT_UNDERSTOOD = 3


def risk(utilisation: float, headroom_gib: float) -> str:
    """The lab's thresholds (0.88 / 0.93), made stricter where little memory is left outside vLLM."""
    if utilisation >= 0.93 or headroom_gib < 1.0:
        return "High"
    if utilisation >= 0.88 or headroom_gib < 2.0:
        return "Medium"
    return "Low"


def capacity_row(layout: KVCacheLayout, kv_gib: float, max_len: int) -> dict:
    capacity = layout.capacity(max_len, kv_gib * GiB)
    return {
        "kv_space_gib": round(kv_gib, 3),
        "num_blocks": capacity.num_blocks,
        "tokens": capacity.tokens,
        "max_concurrency": math.floor(capacity.concurrency),
        "concurrency_exact": round(capacity.concurrency, 2),
    }


def plan_rows(
    layout: KVCacheLayout, gpu_gib: float, utilisations: list[float], max_len: int, overhead: dict[str, float]
) -> list[dict]:
    fixed = sum(overhead.values())
    rows = []
    for util in utilisations:
        kv_gib = gpu_gib * util - fixed
        rows.append(
            {
                "gpu_memory_utilization": util,
                **capacity_row(layout, kv_gib, max_len),
                "risk": "Does not fit" if kv_gib <= 0 else risk(util, gpu_gib * (1 - util)),
            }
        )
    return rows


def describe(model: KVModel, layout: KVCacheLayout, max_len: int) -> list[str]:
    lines = [f"Model: {model.name} ({model.model_type}), dtype {model.dtype}, KV cache dtype {model.kv_cache_dtype}"]
    for g in model.groups:
        if g.keeps_state:
            lines.append(
                f"  {g.layers:3d} {g.kind:<17} layers: {g.detail} = {g.state_bytes:,} B per layer per request (fixed)"
            )
        else:
            lines.append(
                f"  {g.layers:3d} {g.kind:<17} layers: {g.detail} = {g.bytes_per_token:,} B per layer per token"
            )
    lines.append(
        f"KV cache per token (all layers, inside every window): {model.growing_bytes_per_token:,} B"
        f" ({model.growing_bytes_per_token / 1024:.1f} KiB)"
    )
    lines.append(layout.describe())
    per_request = layout.bytes_per_request(max_len)
    lines.append(
        f"KV cache per full-length request ({max_len:,} tokens): {per_request / GiB:.4f} GiB"
        f" ({per_request:,} B, {layout.blocks_per_request(max_len):,} block ids)"
    )
    lines += [f"Note: {note}" for note in model.notes]
    return lines


def print_table(rows: list[dict]) -> None:
    print(f"{'Utilisation':<12} | {'KV space (GiB)':>14} | {'KV tokens':>12} | {'Max concurrency':>15} | Risk")
    print("-" * 74)
    for row in rows:
        print(
            f"{row['gpu_memory_utilization']:>10.0%}   | {row['kv_space_gib']:>14.2f} | {row['tokens']:>12,} | "
            f"{row['max_concurrency']:>15,} | {row['risk']}"
        )


def chart(rows: list[dict], model: KVModel, max_len: int, path: Path) -> None:
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    utils = [r["gpu_memory_utilization"] * 100 for r in rows]
    ax.plot(utils, [r["concurrency_exact"] for r in rows], marker="o")
    for u, r in zip(utils, rows, strict=True):
        ax.annotate(
            f"{r['max_concurrency']} ({r['risk']})",
            (u, r["concurrency_exact"]),
            textcoords="offset points",
            xytext=(0, 7),
            ha="center",
            fontsize=8,
        )
    ax.set_xlabel("gpu_memory_utilization (%)")
    ax.set_ylabel(f"max concurrent {max_len:,}-token requests")
    ax.set_title(f"{model.name}: KV capacity vs utilisation")
    ax.grid(alpha=0.3)
    save_chart(plt, fig, path)


def overhead_gib(args, config: dict, model: KVModel) -> dict[str, float]:
    act_bytes = dtype_bytes(model.dtype, "dtype")
    if args.weights_gib is not None:
        weights = args.weights_gib
    else:
        try:
            params = estimate_parameters(config)
        except (KeyError, TypeError, ValueError) as err:
            raise UsageError(
                f"cannot estimate the weight size from the config ({err.__class__.__name__}: {err}); pass --weights-gib"
            ) from None
        if params is None:
            raise UsageError(
                f"cannot estimate the weight size of model_type '{model.model_type}' from its "
                "config; pass --weights-gib"
            )
        weights = params * act_bytes / GiB
    if args.activation_gib is not None:
        activation = args.activation_gib
    else:
        try:
            activation = activation_bytes(config, act_bytes, args.max_num_batched_tokens, args.max_num_seqs) / GiB
        except (TypeError, ValueError, ZeroDivisionError) as err:
            raise UsageError(
                f"cannot estimate the activation peak from the config ({err.__class__.__name__}); pass --activation-gib"
            ) from None
    parts = {
        "weights": weights,
        "activation_peak": activation,
        "runtime": args.runtime_overhead_gib,
        "cuda_graphs": args.cuda_graph_gib,
    }
    return {**parts, "total": sum(parts.values())}


def parse_utilisations(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise UsageError(f"--utilization '{text}' is not a comma-separated list of numbers") from err
    if not values:
        raise UsageError("--utilization lists no values")
    for value in values:
        if not 0 < value <= 1:
            raise UsageError(f"gpu_memory_utilization {value} is outside (0, 1]")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument(
        "config",
        nargs="?",
        type=Path,
        help="config.json or a model folder (optional with --check-stack: the served model's)",
    )
    parser.add_argument("--gpu-memory-gib", type=float, help="GPU memory in GiB (e.g. 140.4 for an H200)")
    parser.add_argument("--dtype", default="auto", help="weights/activations dtype (default: the config's)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype: auto (= dtype), fp8, ...")
    parser.add_argument("--state-dtype", default="auto", help="dtype of linear-attention/SSM state (default: dtype)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="tokens per request (default: 4096)")
    parser.add_argument("--block-size", type=int, default=16, help="vLLM's KV block size in tokens (default: 16)")
    parser.add_argument(
        "--utilization",
        default=",".join(str(u) for u in DEFAULT_UTILISATIONS),
        help="comma-separated gpu_memory_utilization values (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-space-gib",
        type=float,
        help="KV space given directly (CPU build: VLLM_CPU_KVCACHE_SPACE); skips the GPU model",
    )
    est = parser.add_argument_group("overhead estimate (GPU): KV space = GPU x utilisation - these")
    est.add_argument("--weights-gib", type=float, help="weights in GiB (default: parameters from the config x dtype)")
    est.add_argument("--activation-gib", type=float, help="peak activation in GiB (default: estimated)")
    est.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="vLLM's tokens per step: the profiling batch of the activation estimate, and what "
        "a sliding-window layer keeps beyond its window (default: %(default)s, vLLM's "
        "online default on GPUs of 70 GiB and more; 2048 on smaller ones)",
    )
    est.add_argument("--max-num-seqs", type=int, default=1024, help="for the logits estimate (default: %(default)s)")
    est.add_argument(
        "--runtime-overhead-gib",
        type=float,
        default=0.5,
        help="CUDA context and other non-torch memory (default: %(default)s, the lab's figure)",
    )
    est.add_argument(
        "--cuda-graph-gib",
        type=float,
        default=0.42,
        help="CUDA graph pool (default: %(default)s, the lab's measured figure; 0 with --enforce-eager)",
    )
    parser.add_argument(
        "--check-stack",
        action="store_true",
        help="compare with the KV cache a running vLLM reports (through docker compose, or --vllm-url)",
    )
    add_stack_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--output", type=Path, help="also save the JSON here (default: results/kv_planner.json)")
    parser.add_argument("--chart", type=Path, help="PNG chart path (default: results/kv_planner.png)")
    parser.add_argument("--no-chart", action="store_true", help="write no chart")
    args = parser.parse_args(argv)
    args.utilisations = parse_utilisations(args.utilization)
    if args.config is None and not args.check_stack:
        raise UsageError("give a config.json or model folder (or --check-stack to use the served model's)")
    for name in ("max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    for name in ("gpu_memory_gib", "kv_space_gib", "weights_gib", "activation_gib"):
        value = getattr(args, name)
        if value is not None and value <= 0 and name not in ("activation_gib",):
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.config is not None and args.gpu_memory_gib is None and args.kv_space_gib is None and not args.check_stack:
        raise UsageError("give --gpu-memory-gib (GPU) or --kv-space-gib (KV space known, e.g. the CPU build)")
    for value, what in (
        (args.dtype, "dtype"),
        (args.kv_cache_dtype, "KV cache dtype"),
        (args.state_dtype, "state dtype"),
    ):
        if value != "auto":
            dtype_bytes(value, what)
    return args


def layout_report(model: KVModel, layout: KVCacheLayout, max_len: int) -> dict:
    return {
        "name": model.name,
        "model_type": model.model_type,
        "dtype": model.dtype,
        "kv_cache_dtype": model.kv_cache_dtype,
        "bytes_per_token": model.growing_bytes_per_token,
        "full_attention_bytes_per_token": model.full_bytes_per_token,
        "bytes_per_full_length_request": layout.bytes_per_request(max_len),
        "blocks_per_full_length_request": layout.blocks_per_request(max_len),
        "layer_groups": [asdict(g) for g in model.groups],
        "kv_cache_groups": {
            "block_size": layout.block_size,
            "page_bytes": layout.page_bytes,
            "group_size": layout.group_size,
            "block_bytes": layout.block_bytes,
            "padding_slots": layout.padding_slots,
            "groups": [asdict(g) for g in layout.groups],
        },
        "notes": model.notes,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        return plan(parse_args(argv))
    except NotUnderstood as err:
        print(f"{PROG}: architecture not understood: {err}", file=sys.stderr)
        return EXIT_NOT_UNDERSTOOD


def plan(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config else None
    report: dict = {}
    model = analyse(config, args.dtype, args.kv_cache_dtype, args.state_dtype) if config else None
    layout = plan_layout(model, args.block_size, args.max_num_batched_tokens) if model else None
    lines: list[str] = []
    if config and model and layout:
        lines = describe(model, layout, args.max_model_len)
        report["model"] = layout_report(model, layout, args.max_model_len)
        report["max_model_len"] = args.max_model_len
        if args.kv_space_gib is not None:
            report["rows"] = [
                {
                    "gpu_memory_utilization": None,
                    **capacity_row(layout, args.kv_space_gib, args.max_model_len),
                    "risk": "n/a",
                }
            ]
            report["rows"][0]["kv_space_gib"] = args.kv_space_gib
        elif args.gpu_memory_gib is not None:
            overhead = overhead_gib(args, config, model)
            report["gpu_memory_gib"] = args.gpu_memory_gib
            report["overhead_gib"] = {k: round(v, 3) for k, v in overhead.items()}
            report["rows"] = plan_rows(
                layout,
                args.gpu_memory_gib,
                args.utilisations,
                args.max_model_len,
                {k: v for k, v in overhead.items() if k != "total"},
            )
    if args.check_stack:
        report["cross_check"] = cross_check(
            stack_from_args(args), args, config, lambda cfg, m: overhead_gib(args, cfg, m)["total"]
        )
    chart_path = None
    if model and report.get("rows") and len(report["rows"]) > 1 and not args.no_chart:
        chart_path = args.chart or results_path("kv_planner.png")
        chart(report["rows"], model, args.max_model_len, chart_path)
        report["chart"] = str(chart_path)
    output = args.output or results_path("kv_planner.json")
    write_json(output, report)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for line in lines:
        print(line)
    if model and "overhead_gib" in report:
        o = report["overhead_gib"]
        print(
            f"\nGPU {args.gpu_memory_gib} GiB. Outside the KV cache (estimates): weights {o['weights']:.2f} GiB "
            f"(parameters x {model.dtype}), activation peak {o['activation_peak']:.2f} GiB "
            f"({args.max_num_batched_tokens} batched tokens, {args.max_num_seqs} sampled rows of fp32 logits), "
            f"runtime {o['runtime']:.2f} GiB, CUDA graphs {o['cuda_graphs']:.2f} GiB = {o['total']:.2f} GiB"
        )
    if report.get("rows"):
        print()
        if args.kv_space_gib is not None:
            row = report["rows"][0]
            print(
                f"KV space {args.kv_space_gib} GiB: {row['tokens']:,} tokens, "
                f"{row['max_concurrency']:,} concurrent {args.max_model_len:,}-token requests "
                f"({row['concurrency_exact']:.2f}x)"
            )
        else:
            print_table(report["rows"])
    if chart_path:
        print(f"\nChart: {chart_path}")
    if "cross_check" in report:
        print_cross_check(report["cross_check"])
    return 0
