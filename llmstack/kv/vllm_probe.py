"""vLLM's own KV-cache figures for model configs, without weights: runs INSIDE the vllm-cpu image.

Started by llmstack.kv.vllm_compare (`docker run ... python3 /src/llmstack/kv/vllm_probe.py`); it
imports only the standard library and vllm, and prints one line, VLLM_PROBE_RESULT and a JSON object, on stdout.

For each config and max_model_len it builds vLLM's VllmConfig (engine/arg_utils.py,
EngineArgs.create_engine_config), the per-layer KV-cache specs the model runner would collect, and
calls vLLM's allocation exactly as the engine core does (v1/engine/core.py,
EngineCore._initialize_kv_caches): v1/core/kv_cache_utils.py get_kv_cache_configs ->
generate_scheduler_kv_cache_config -> get_kv_cache_capacity (the figures of the "KV cache size: N
tokens, Maximum concurrency ..." log line, update_kv_cache_capacity).

Per-layer specs, as the layers' get_kv_cache_spec build them (the layers themselves need the weights):
- attention: model_executor/layers/attention/attention.py Attention.get_kv_cache_spec: FullAttentionSpec,
  or SlidingWindowSpec where the layer has a window. The window per layer follows the model files
  (llama.py, gemma2.py, gemma3.py: `sliding_window` where hf_config.layer_types says
  "sliding_attention") and Attention.__init__'s fallback to CacheConfig.sliding_window, which
  EngineArgs.create_engine_config sets only when every layer slides (or layer_types is absent).
- MLA: model_executor/layers/attention/mla_attention.py MLAAttention.get_kv_cache_spec
  (MLAAttentionSpec, one KV head of kv_lora_rank + qk_rope_head_dim: ModelConfig.get_head_size).
- Mamba / linear attention: model_executor/layers/mamba/abstract.py MambaBase.get_kv_cache_spec, with
  the model class's get_mamba_state_shape_from_config / get_mamba_state_dtype_from_config.

GPU-like settings on the CPU build (the figures are the GPU stack's): block_size 16 as given; for hybrid
attention + state models the attention block is re-aligned by vLLM's own
platforms/interface.py Platform._align_hybrid_block_size with FlashAttention's kernel block sizes
(v1/attention/backends/flash_attn.py: MultipleOf(16)) instead of the CPU backend's MultipleOf(32);
the SSM state dtype stays "auto" (the CPU platform resets it to float32, platforms/cpu.py); the KV
layout is the default preference's first, LBNHC (v1/attention/backends/utils.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

GiB = 1 << 30


def specs_for(vllm_config, model_cls) -> dict:
    """Layer name -> KVCacheSpec, as the model runner would collect them (see the module doc)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    hf = model_config.hf_text_config
    layers = model_config.get_num_layers(parallel_config)
    kinds = getattr(hf, "layer_types", None) or getattr(hf, "layers_block_type", None) or ["attention"] * layers
    if len(kinds) != layers:
        raise SystemExit(f"{model_config.model}: {len(kinds)} layer types for {layers} layers")
    block_size, dtype = cache_config.block_size, model_config.dtype
    specs: dict = {}
    for index, kind in enumerate(kinds):
        name = f"model.layers.{index}"
        if kind in ("mamba", "linear_attention"):
            specs[name] = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                block_size=cache_config.mamba_block_size,
                page_size_padded=cache_config.mamba_page_size_padded,
                mamba_cache_mode=cache_config.mamba_cache_mode,
            )
        elif model_config.use_mla:
            specs[name] = MLAAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=model_config.get_head_size(),
                dtype=dtype,
                cache_dtype_str=cache_config.cache_dtype,
            )
        else:
            common = dict(
                block_size=block_size,
                num_kv_heads=model_config.get_num_kv_heads(parallel_config),
                head_size=model_config.get_head_size(),
                dtype=dtype,
            )
            window = hf.sliding_window if kind == "sliding_attention" else cache_config.sliding_window
            specs[name] = SlidingWindowSpec(**common, sliding_window=window) if window else FullAttentionSpec(**common)
    return specs


def align_hybrid_like_gpu(vllm_config, block_size: int) -> None:
    """Undo the CPU platform's hybrid settings and apply vLLM's alignment with FlashAttention's kernels."""
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    class FlashAttentionKernelBlocks(CPUAttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
            return [MultipleOf(16)]

    cache_config = vllm_config.cache_config
    cache_config.block_size = block_size
    cache_config.mamba_page_size_padded = None
    cache_config.mamba_ssm_cache_dtype = "auto"
    Platform._align_hybrid_block_size(vllm_config, FlashAttentionKernelBlocks)
    if cache_config.mamba_cache_mode == "align":
        cache_config.mamba_block_size = cache_config.block_size


def capacity(config_dir: Path, max_len: int, kv_bytes: int, block_size: int, batched: int, gpu_defaults: bool):
    """vLLM's figures with the planner's assumptions (prefix caching off, so Mamba cache mode "none"; one
    batch in flight), or with 0.32.0's defaults on a GPU (prefix caching on, so mode "align"; async
    scheduling, config/vllm.py VllmConfig: two batches in flight, VllmConfig.max_in_flight_tokens)."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
    )

    vllm_config = EngineArgs(
        model=str(config_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=max_len,
        block_size=block_size,
        max_num_batched_tokens=batched,
        enable_prefix_caching=None if gpu_defaults else False,
        enforce_eager=True,
    ).create_engine_config()
    model_config = vllm_config.model_config
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    vllm_config.scheduler_config.async_scheduling = gpu_defaults  # the CPU platform turns it off
    with set_current_vllm_config(vllm_config):
        model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
        if model_config.is_hybrid:
            align_hybrid_like_gpu(vllm_config, block_size)
        specs = specs_for(vllm_config, model_cls)
        configs = get_kv_cache_configs(vllm_config, [specs], [kv_bytes])
        scheduler_config = generate_scheduler_kv_cache_config(configs)
        tokens, concurrency = get_kv_cache_capacity(vllm_config, scheduler_config)
    groups = scheduler_config.kv_cache_groups
    return {
        "max_model_len": max_len,
        "gpu_defaults": gpu_defaults,
        "prefix_caching": vllm_config.cache_config.enable_prefix_caching,
        "mamba_cache_mode": vllm_config.cache_config.mamba_cache_mode if model_config.is_hybrid else None,
        "max_in_flight_tokens": vllm_config.max_in_flight_tokens,
        "block_size": min(g.kv_cache_spec.block_size for g in groups),
        "num_groups": len(groups),
        "group_sizes": [len(g.layer_names) for g in groups],
        "group_kinds": [type(g.kv_cache_spec).__name__ for g in groups],
        "page_bytes": max(g.kv_cache_spec.page_size_bytes for g in groups),
        "num_blocks": scheduler_config.num_blocks,
        "tokens": tokens,
        "concurrency": concurrency,
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="vllm_probe.py", description=__doc__.partition("\n")[0])
    parser.add_argument("configs", nargs="+", type=Path, help="config.json files")
    parser.add_argument("--kv-space-gib", type=float, required=True)
    parser.add_argument("--max-model-len", required=True, help="comma-separated lengths")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    import vllm

    results: dict = {"vllm_version": vllm.__version__, "configs": {}}
    with tempfile.TemporaryDirectory() as work:
        for config in args.configs:
            model_dir = Path(work) / config.stem
            model_dir.mkdir()
            shutil.copy(config, model_dir / "config.json")
            rows = []
            for max_len in (int(text) for text in args.max_model_len.split(",")):
                for gpu_defaults in (False, True):
                    rows.append(
                        capacity(
                            model_dir,
                            max_len,
                            int(args.kv_space_gib * GiB),
                            args.block_size,
                            args.max_num_batched_tokens,
                            gpu_defaults,
                        )
                    )
            results["configs"][config.name] = rows
            print(f"vllm_probe: {config.name} done", file=sys.stderr, flush=True)
    print("VLLM_PROBE_RESULT " + json.dumps(results))  # vLLM logs to stdout too
    return 0


if __name__ == "__main__":
    sys.exit(main())
