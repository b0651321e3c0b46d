"""How a running vLLM's memory is composed (the lab's first experiment, against the stack).

Reads vLLM's startup log and its vllm:cache_config_info metric through `docker compose` (or, for a
vLLM run without Docker, from --vllm-url and --vllm-log), counts the served model's parameters
exactly (transformers builds it on PyTorch's meta device inside the vLLM container, or here for
--vllm-url, using no memory), and reports: model weights (measured where vLLM logs it, beside the
theoretical parameters x bytes per dtype), the KV cache pool (GiB and tokens), the CUDA graph pool
where there is one, and the maximum concurrency at the configured max length.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmstack.cli import (
    add_output_arguments,
    load_pyplot,
    parser_from_doc,
    progress,
    results_path,
    save_chart,
    write_json,
)
from llmstack.kv.model import DTYPE_BYTES, NotUnderstood, analyse, config_dtype, estimate_parameters
from llmstack.vllm import (
    ComposeStack,
    GiB,
    HostVllm,
    add_stack_arguments,
    cache_config_labels,
    label_number,
    model_config_from_stack,
    parameter_count_in_stack,
    parse_startup_log,
    served_model,
    stack_from_args,
)


def collect(stack: ComposeStack | HostVllm) -> dict:
    progress("reading vLLM's metrics and served model ...")
    labels = cache_config_labels(stack.metrics())
    model_info = served_model(stack)
    root = model_info.get("root") or model_info["id"]
    progress("reading vLLM's startup log ...")
    log = parse_startup_log(stack.logs())
    env = stack.container_env()
    config = model_config_from_stack(stack, root)
    progress("counting the model's parameters (on PyTorch's meta device) ...")
    params = parameter_count_in_stack(stack, root)
    params_source = "transformers on the meta device"
    if params is None:
        params, params_source = estimate_parameters(config), "estimated from config.json"
    dtype = env.get("DTYPE") or "auto"
    if dtype == "auto":
        dtype = config_dtype(config)
    dtype_size = DTYPE_BYTES.get(str(dtype).replace("torch.", ""), None)
    block_size = label_number(labels, "block_size")
    num_blocks = label_number(labels, "num_gpu_blocks")
    explicit = label_number(labels, "kv_cache_memory_bytes")
    device = str(log.get("kv_cache_device", "GPU"))
    kv_gib = log.get("available_kv_gib") or log.get("cpu_kv_gib") or (explicit / GiB if explicit else None)
    try:
        kv_model = analyse(config, dtype, labels.get("cache_dtype", "auto"))
        bytes_per_token = kv_model.growing_bytes_per_token
    except NotUnderstood:
        bytes_per_token = None
    return {
        "served_model": model_info["id"],
        "model_root": root,
        "device": device,
        "vllm_version": log.get("vllm_version"),
        "dtype": dtype,
        "kv_cache_dtype": labels.get("cache_dtype"),
        "max_model_len": model_info.get("max_model_len"),
        "gpu_memory_utilization": label_number(labels, "gpu_memory_utilization"),
        "weights": {
            "parameters": params,
            "parameters_source": params_source,
            "theoretical_gib": params * dtype_size / GiB if params and dtype_size else None,
            "measured_gib": log.get("model_loading_gib"),
            "load_seconds": log.get("model_loading_seconds") or log.get("model_init_seconds"),
        },
        "kv_cache": {
            "gib": kv_gib,
            "tokens": log.get("kv_cache_tokens") or label_number(labels, "kv_cache_size_tokens"),
            "block_size": block_size,
            "num_blocks": num_blocks,
            "bytes_per_token": bytes_per_token,
            "source": (
                "VLLM_CPU_KVCACHE_SPACE / kv_cache_memory_bytes"
                if explicit
                else "profiled: gpu_memory_utilization minus weights, activations, graphs"
            ),
        },
        "cuda_graph_gib": log.get("cuda_graph_gib") or log.get("graph_capture_gib"),
        "max_concurrency": log.get("max_concurrency") or label_number(labels, "kv_cache_max_concurrency"),
        "max_concurrency_tokens": log.get("max_concurrency_tokens") or model_info.get("max_model_len"),
        "cache_config_info": labels,
    }


def gib(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f} GiB" if value is not None else "not logged"


def print_report(r: dict) -> None:
    w, kv = r["weights"], r["kv_cache"]
    print(
        f"vLLM {r['vllm_version'] or '?'} serving {r['served_model']} ({r['model_root']}) on {r['device']}, "
        f"dtype {r['dtype']}, KV cache dtype {r['kv_cache_dtype']}, max_model_len {r['max_model_len']}"
    )
    print("\n--- Memory composition ---")
    params = f"{w['parameters']:,} parameters ({w['parameters_source']})" if w["parameters"] else "parameters unknown"
    print(f"Model weights (theoretical): {gib(w['theoretical_gib'], 4)}  = {params} x {r['dtype']}")
    measured = gib(w["measured_gib"], 4)
    if w["measured_gib"] is None and r["device"] == "CPU":
        measured += " (the CPU build does not log the weights' size)"
    print(
        f"Model weights (measured):    {measured}"
        + (f", loaded in {w['load_seconds']:.2f} s" if w["load_seconds"] else "")
    )
    print(
        f"KV cache pool:               {gib(kv['gib'])}, "
        + (f"{int(kv['tokens']):,} tokens" if kv["tokens"] else "tokens not logged")
        + (f" ({int(kv['num_blocks']):,} blocks x {int(kv['block_size'])} tokens)" if kv["num_blocks"] else "")
        + f"  [{kv['source']}]"
    )
    if kv["bytes_per_token"]:
        print(f"KV bytes per token:          {kv['bytes_per_token']:,} B (from the architecture, kv_planner.py)")
    graphs = r["cuda_graph_gib"]
    print(
        f"CUDA graph pool:             {gib(graphs)}"
        + (" (none: CPU build, or --enforce-eager)" if graphs is None else "")
    )
    if r["max_concurrency"]:
        print(
            f"Maximum concurrency for {int(r['max_concurrency_tokens']):,} tokens per request: "
            f"{r['max_concurrency']:.2f}x"
        )
    if r["gpu_memory_utilization"] and r["device"] != "CPU":
        print(f"gpu_memory_utilization:      {r['gpu_memory_utilization']}")


def chart(r: dict, path: Path) -> None:
    parts = [
        ("weights", r["weights"]["measured_gib"] or r["weights"]["theoretical_gib"]),
        ("KV cache", r["kv_cache"]["gib"]),
        ("CUDA graphs", r["cuda_graph_gib"]),
    ]
    parts = [(name, value) for name, value in parts if value]
    if not parts:
        return
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = 0.0
    for name, value in parts:
        ax.barh([0], [value], left=left, label=f"{name} {value:.3f} GiB")
        left += value
    ax.set_yticks([])
    ax.set_xlabel("GiB")
    ax.set_title(f"{r['served_model']}: memory held by vLLM ({r['device']})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8)
    save_chart(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc("memory_report.py", __doc__)
    add_stack_arguments(parser)
    add_output_arguments(parser, "memory_report")
    args = parser.parse_args(argv)
    report = collect(stack_from_args(args))
    if not args.no_chart:
        path = args.chart or results_path("memory_report.png")
        chart(report, path)
        report["chart"] = str(path)
    output = args.output or results_path("memory_report.json")
    write_json(output, report)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print_report(report)
    if report.get("chart"):
        print(f"\nChart: {report['chart']}")
    print(f"JSON:  {output}")
    return 0
