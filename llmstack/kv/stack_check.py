"""The planner against a running vLLM: the same KV space, the planner's tokens next to vLLM's own."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from llmstack.cli import StackError, progress
from llmstack.kv.grouping import plan_layout
from llmstack.kv.model import KVModel, analyse
from llmstack.vllm import (
    ComposeStack,
    GiB,
    HostVllm,
    cache_config_labels,
    label_number,
    model_config_from_stack,
    parse_startup_log,
    served_model,
)

OverheadGiB = Callable[[dict, KVModel], float]


def cross_check(
    stack: ComposeStack | HostVllm, args: argparse.Namespace, config: dict | None, overhead_gib: OverheadGiB
) -> dict:
    """Compare the planner's KV tokens with what the running vLLM reports for the same KV space."""
    progress("reading vLLM's metrics, served model and startup log ...")
    labels = cache_config_labels(stack.metrics())
    model_info = served_model(stack)
    max_len = int(model_info.get("max_model_len") or args.max_model_len)
    if config is None:
        config = model_config_from_stack(stack, model_info.get("root") or model_info["id"])
    log = parse_startup_log(stack.logs())
    env = stack.container_env()
    kv_dtype = labels.get("cache_dtype", "auto")
    block_size = int(label_number(labels, "block_size") or 16)
    batched = int(label_number(labels, "max_num_batched_tokens") or args.max_num_batched_tokens)
    model = analyse(config, env.get("DTYPE") or "auto", kv_dtype, args.state_dtype)
    layout = plan_layout(model, block_size, batched)
    num_blocks = label_number(labels, "num_gpu_blocks")
    explicit = label_number(labels, "kv_cache_memory_bytes")
    override = label_number(labels, "num_gpu_blocks_override")
    util = label_number(labels, "gpu_memory_utilization")
    kv_space: float | None = None
    if override:
        basis = f"--num-gpu-blocks-override {int(override)} blocks of {layout.block_size} tokens"
    elif explicit:
        kv_space = explicit
        basis = f"kv_cache_memory_bytes {explicit / GiB:.2f} GiB" + (
            " (VLLM_CPU_KVCACHE_SPACE)" if env.get("VLLM_CPU_KVCACHE_SPACE") else ""
        )
    elif args.gpu_memory_gib and util:
        kv_space = (args.gpu_memory_gib * util - overhead_gib(config, model)) * GiB
        basis = f"gpu_memory_utilization {util} of {args.gpu_memory_gib} GiB minus the estimated overhead"
    elif "available_kv_gib" in log:
        kv_space = float(log["available_kv_gib"]) * GiB
        basis = f"vLLM's logged 'Available KV cache memory: {log['available_kv_gib']} GiB'"
    else:
        raise StackError(
            "cannot tell the KV space vLLM was given: no kv_cache_memory_bytes, no "
            "'Available KV cache memory' log line; pass --gpu-memory-gib"
        )
    if override:
        capacity = layout.capacity(max_len, num_blocks=int(override))
        kv_space = capacity.num_blocks * layout.block_bytes
    else:
        capacity = layout.capacity(max_len, kv_space or 0)
    # The startup log line, else the same figure among cache_config_info's labels (logs rotate).
    reported = log.get("kv_cache_tokens") or label_number(labels, "kv_cache_size_tokens")
    result = {
        "served_model": model_info["id"],
        "max_model_len": max_len,
        "basis": basis,
        "kv_space_bytes": int(kv_space or 0),
        "block_size": layout.block_size,
        "num_blocks_reported": num_blocks,
        "kv_cache_dtype": model.kv_cache_dtype,
        "bytes_per_token": model.growing_bytes_per_token,
        "predicted_num_blocks": capacity.num_blocks,
        "predicted_tokens": capacity.tokens,
        "predicted_max_concurrency": round(capacity.concurrency, 2),
        "reported_tokens": int(reported) if reported is not None else None,
        "reported_max_concurrency": log.get("max_concurrency") or label_number(labels, "kv_cache_max_concurrency"),
        "reported_tokens_from_blocks": int(num_blocks * layout.block_size) if num_blocks else None,
    }
    if reported:
        result["difference_tokens"] = capacity.tokens - int(reported)
        result["difference_percent"] = round(100 * (capacity.tokens - float(reported)) / float(reported), 4)
    return result


def print_cross_check(check: dict) -> None:
    print(
        f"\nCross-check against the running vLLM ({check['served_model']}, max_model_len {check['max_model_len']:,}):"
    )
    print(f"  KV space basis:        {check['basis']}")
    print(
        f"  Planner:               {check['predicted_tokens']:,} tokens "
        f"({check['bytes_per_token']:,} B/token, {check['kv_cache_dtype']}), "
        f"max concurrency {check['predicted_max_concurrency']:.2f}x"
    )
    if check.get("reported_tokens") is not None:
        reported_concurrency = check.get("reported_max_concurrency")
        print(
            f"  vLLM reports:          {check['reported_tokens']:,} tokens"
            + (f", max concurrency {reported_concurrency:.2f}x" if reported_concurrency is not None else "")
        )
        print(
            f"  Difference:            {check['difference_tokens']:+,} tokens "
            f"({check['difference_percent']:+.4f} %)  [vLLM counts whole blocks of {check['block_size']} tokens]"
        )
    else:
        print("  vLLM reports:          no KV cache size (neither in its log nor in vllm:cache_config_info)")
    if check.get("num_blocks_reported"):
        print(
            f"  vLLM num_gpu_blocks:   {int(check['num_blocks_reported']):,} x {check['block_size']} = "
            f"{check['reported_tokens_from_blocks']:,} token slots"
        )
