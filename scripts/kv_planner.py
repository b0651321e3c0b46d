#!/usr/bin/env python3
"""KV cache capacity planner: how many tokens and full-length requests fit, per gpu_memory_utilization.

Reads a model's config.json and computes the KV cache bytes per token from the architecture
(full-attention layers x KV heads x head dim x 2 for K and V x bytes; MLA latents; sliding-window
layers bounded by their window; linear-attention / state-space layers as a fixed state per request),
then prints the lab's table (utilisation | KV space | tokens | max concurrency | risk) with that
computation in place of the lab's 0.2 GB-per-request guess. --check-stack compares the prediction
with the KV cache a running vLLM reports.

Exit codes: 0 ok, 1 the stack could not be read, 2 bad input, 3 architecture not understood.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lablib import (ComposeStack, GiB, HostVllm, ScriptArgumentParser, StackError, UsageError,
                    add_stack_arguments, cache_config_labels, label_number, load_pyplot,
                    model_config_from_stack, parse_startup_log, progress, results_path, run_main,
                    save_chart, served_model, stack_from_args, write_json)

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1, "int8": 1,
}
DEFAULT_UTILISATIONS = [0.75, 0.80, 0.85, 0.90, 0.95]

# Decoder families whose every layer is full (global) attention unless the config says otherwise.
FULL_ATTENTION_TYPES = {
    "llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "mixtral", "gemma", "phi3",
    "granite", "olmo", "olmo2", "internlm2", "baichuan", "yi", "deepseek", "starcoder2", "cohere",
    "exaone", "glm", "glm4", "stablelm", "opt", "gpt_neox", "falcon", "gpt_bigcode",
}
# Families that apply `sliding_window` to every layer when it is set (and not switched off).
ALL_SLIDING_TYPES = {"mistral", "mixtral", "starcoder2", "phi3"}
# Families whose parameter count this script can estimate from the config (llama-style blocks).
PARAMETER_ESTIMATE_TYPES = {"llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mistral", "mixtral",
                            "gemma", "gemma2", "gemma3_text", "granite", "olmo2"}
# Config keys that mark an architecture this planner does not model; refusing beats guessing.
UNMODELLED_MARKERS = {
    "index_topk": "DeepSeek sparse-attention indexer cache",
    "hybrid_override_pattern": "Nemotron-H style Mamba2 hybrid",
    "num_kv_shared_layers": "cross-layer KV sharing",
    "attention_chunk_size": "chunked local attention",
}


class NotUnderstood(Exception):
    """The config describes an architecture whose KV cache this planner does not model."""


@dataclass
class LayerGroup:
    kind: str                    # full_attention | sliding_attention | mla | linear_attention | mamba
    layers: int
    bytes_per_token: int = 0     # per layer, K and V (or the MLA latent)
    window: int | None = None    # sliding_attention only
    state_bytes: int = 0         # per layer, fixed per request (linear attention / SSM), as vLLM pads it
    detail: str = ""
    block_size: int = 16         # tokens per KV block (vLLM enlarges it beside big SSM states)
    in_flight_tokens: int = 8192  # tokens one scheduler step may add (max_num_batched_tokens)

    @property
    def keeps_state(self) -> bool:
        """A fixed-size state per request (linear attention / SSM), not a per-token cache."""
        return self.kind in ("linear_attention", "mamba")

    def tokens_per_request(self, length: int) -> int:
        """Token slots vLLM reserves per layer for a request of `length` tokens: whole blocks; a
        sliding window keeps its window plus one step's tokens, and one block more because the
        window need not start at a block boundary (vLLM's SlidingWindowSpec)."""
        if self.window:
            kept = min(self.window - 1 + self.in_flight_tokens, length)
            return (-(-kept // self.block_size) + 1) * self.block_size
        return -(-length // self.block_size) * self.block_size

    def bytes_per_request(self, length: int) -> int:
        if self.keeps_state:
            return self.layers * self.state_bytes
        return self.layers * self.bytes_per_token * self.tokens_per_request(length)


@dataclass
class KVModel:
    name: str
    model_type: str
    dtype: str
    kv_cache_dtype: str
    groups: list[LayerGroup]
    notes: list[str] = field(default_factory=list)

    @property
    def growing_bytes_per_token(self) -> int:
        """Bytes one more token costs across all layers while inside every window."""
        return sum(g.layers * g.bytes_per_token for g in self.groups)

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes per token of the layers that keep every token (full attention and MLA)."""
        return sum(g.layers * g.bytes_per_token for g in self.groups if g.kind in ("full_attention", "mla"))

    def bytes_per_request(self, length: int) -> int:
        return sum(g.bytes_per_request(length) for g in self.groups)

    def capacity(self, kv_bytes: float, length: int) -> tuple[float, int]:
        """(concurrency, tokens) as vLLM counts them: how many requests of `length` tokens fit, and
        that concurrency times the length (vLLM's "KV cache size: N tokens")."""
        per_request = self.bytes_per_request(length)
        concurrency = max(kv_bytes, 0) / per_request
        return concurrency, int(concurrency * length)


def dtype_bytes(name: str, what: str) -> int:
    key = str(name).lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise UsageError(f"unknown {what} '{name}' (known: {', '.join(sorted(DTYPE_BYTES))})")
    return DTYPE_BYTES[key]


def load_config(path: Path) -> dict:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{path}: not a JSON model config ({err.__class__.__name__})") from err
    if not isinstance(config, dict) or not ("model_type" in config or "architectures" in config):
        raise UsageError(f"{path}: not a model config (no model_type or architectures)")
    return config


def text_config(config: dict) -> dict:
    """The language model's part of a config; multimodal wrappers keep it under text_config."""
    inner = config.get("text_config")
    if isinstance(inner, dict):
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(inner)
        return merged
    return config


def config_dtype(config: dict) -> str:
    text = text_config(config)
    return str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise NotUnderstood(f"the config has no '{key}'")
    if not isinstance(value, (int, float)) or value <= 0:
        raise UsageError(f"the model config's '{key}' is {value!r}, not a positive number")
    return int(value)


def layer_kinds(cfg: dict) -> list[str]:
    """One of full_attention / sliding_attention / linear_attention / mamba per layer."""
    model_type = str(cfg.get("model_type", ""))
    layers = _int(cfg, "num_hidden_layers")
    if isinstance(cfg.get("layer_types"), list):
        mapping = {"full_attention": "full_attention", "attention": "full_attention",
                   "sliding_attention": "sliding_attention", "linear_attention": "linear_attention",
                   "mamba": "mamba"}
        unknown = sorted({t for t in cfg["layer_types"] if t not in mapping})
        if unknown:
            raise NotUnderstood(f"layer types {unknown} are not modelled")
        if len(cfg["layer_types"]) != layers:
            raise NotUnderstood("layer_types does not list num_hidden_layers layers")
        kinds = [mapping[t] for t in cfg["layer_types"]]
        if "linear_attention" in kinds and model_type not in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
            raise NotUnderstood(f"linear-attention layers of model_type '{model_type}' are not modelled")
        return kinds
    if "full_attention_interval" in cfg:  # Qwen3-Next / Qwen3.5: Gated DeltaNet, every Nth layer full
        interval = _int(cfg, "full_attention_interval")
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if model_type == "jamba":
        period, offset = _int(cfg, "attn_layer_period"), int(cfg.get("attn_layer_offset", 0))
        return ["full_attention" if i % period == offset else "mamba" for i in range(layers)]
    if model_type == "gemma2":  # even layers slide, odd layers are global
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if model_type in ("gemma3", "gemma3_text"):
        pattern = _int(cfg, "sliding_window_pattern", 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers", layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if model_type in ALL_SLIDING_TYPES and cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        return ["sliding_attention"] * layers
    if model_type in FULL_ATTENTION_TYPES or model_type.startswith("deepseek"):
        return ["full_attention"] * layers
    raise NotUnderstood(f"model_type '{model_type or '?'}' is not in the planner's list of known families")


def analyse(config: dict, dtype: str = "auto", kv_cache_dtype: str = "auto",
            state_dtype: str = "auto", max_num_batched_tokens: int = 8192, block_size: int = 16) -> KVModel:
    """The model's KV cache as vLLM lays it out. A field the model needs but lacks raises
    NotUnderstood (exit 3); a field of the wrong type, UsageError (exit 2)."""
    try:
        model = _analyse(config, dtype, kv_cache_dtype, state_dtype)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise UsageError(f"the model config has a malformed field ({err.__class__.__name__}: {err})") from None
    for group in model.groups:
        group.block_size, group.in_flight_tokens = block_size, max_num_batched_tokens
    pad_state_pages(model, block_size)
    return model


def pad_state_pages(model: KVModel, block_size: int) -> None:
    """Hybrid models: vLLM gives every layer the same page size. An SSM / linear-attention state is
    bigger than one attention block, so the attention block grows (in multiples of 16 tokens)
    until its page holds the state, and the state is padded to that page."""
    states = [g for g in model.groups if g.keeps_state]
    attention = [g for g in model.groups if not g.keeps_state]
    if not states or not attention:
        return
    per_token = max(g.bytes_per_token for g in attention)
    state = max(g.state_bytes for g in states)
    if state > block_size * per_token:
        block_size = 16 * -(-state // (16 * per_token))
    for group in attention:
        group.block_size = block_size
    for group in states:
        group.state_bytes = block_size * per_token
    model.notes.append(f"hybrid layout: attention blocks of {block_size} tokens, each state padded to one "
                       f"block's page of {block_size * per_token:,} B, as vLLM unifies page sizes")


def _analyse(config: dict, dtype: str, kv_cache_dtype: str, state_dtype: str) -> KVModel:
    cfg = text_config(config)
    model_type = str(cfg.get("model_type", ""))
    name = (config.get("architectures") or [model_type])[0]
    for marker, what in UNMODELLED_MARKERS.items():
        if cfg.get(marker):
            raise NotUnderstood(f"{name}: {what} ('{marker}') is not modelled")
    dtype = config_dtype(config) if dtype == "auto" else dtype
    dtype_bytes(dtype, "dtype")
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    kv_bytes = dtype_bytes(kv_dtype, "KV cache dtype")
    state_bytes = dtype_bytes(dtype if state_dtype == "auto" else state_dtype, "state dtype")
    # The recurrent (SSM) state's own dtype: Qwen3.5 configs name it (often float32), NemotronH's default is
    # float32; the convolution state stays in state_bytes.
    ssm_dtype = cfg.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_cache_dtype")
    ssm_bytes = dtype_bytes(ssm_dtype, "mamba_ssm_dtype") if state_dtype == "auto" and ssm_dtype else state_bytes
    notes: list[str] = []

    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi): one compressed latent + RoPE key per token
        layers = _int(cfg, "num_hidden_layers")
        latent = _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim")
        notes.append(f"MLA: one latent of kv_lora_rank + qk_rope_head_dim = {latent} values per layer and "
                     "token (no separate K and V, no per-head copies)")
        group = LayerGroup("mla", layers, latent * kv_bytes, detail=f"{latent} latent values")
        return KVModel(name, model_type, dtype, kv_dtype, [group], notes)

    kinds = layer_kinds(cfg)
    heads = _int(cfg, "num_attention_heads")
    # Falcon names its KV heads num_kv_heads; Falcon-7B and GPT-BigCode share one (multi_query).
    kv_heads = _int(cfg, "num_key_value_heads", cfg.get("num_kv_heads") or (1 if cfg.get("multi_query") else heads))
    hidden = _int(cfg, "hidden_size")
    head_dim = _int(cfg, "head_dim", hidden // heads)
    if cfg.get("head_dim") and head_dim != hidden // heads:
        notes.append(f"head_dim {head_dim} differs from hidden_size / heads = {hidden // heads}; "
                     "the config's head_dim is used")
    if kv_heads != heads:
        notes.append(f"grouped-query attention: {kv_heads} KV heads for {heads} query heads")
    per_token = kv_heads * head_dim * 2 * kv_bytes
    groups: list[LayerGroup] = []
    count = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    if count.get("full_attention"):
        groups.append(LayerGroup("full_attention", count["full_attention"], per_token,
                                 detail=f"{kv_heads} KV heads x {head_dim} dim x 2"))
    if count.get("sliding_attention"):
        window = _int(cfg, "sliding_window")
        groups.append(LayerGroup("sliding_attention", count["sliding_attention"], per_token, window=window,
                                 detail=f"{kv_heads} KV heads x {head_dim} dim x 2, window {window}"))
        notes.append(f"sliding-window layers keep their {window}-token window plus one scheduler step's "
                     "tokens (--max-num-batched-tokens) and one block, as vLLM reserves them")
    if count.get("linear_attention"):
        key_dim, value_dim = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
        key_heads, value_heads = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
        kernel = _int(cfg, "linear_conv_kernel_dim")
        conv_channels = key_heads * key_dim * 2 + value_heads * value_dim
        conv_values, recurrent_values = conv_channels * (kernel - 1), value_heads * key_dim * value_dim
        groups.append(LayerGroup("linear_attention", count["linear_attention"],
                                 state_bytes=conv_values * state_bytes + recurrent_values * ssm_bytes,
                                 detail=f"Gated DeltaNet state: conv {conv_channels}x{kernel - 1} + "
                                        f"recurrent {value_heads}x{key_dim}x{value_dim}"))
        notes.append("linear-attention layers keep a fixed-size state per request, not a per-token cache")
    if count.get("mamba"):
        inner = _int(cfg, "mamba_expand") * hidden
        conv, state = _int(cfg, "mamba_d_conv"), _int(cfg, "mamba_d_state")
        groups.append(LayerGroup("mamba", count["mamba"],
                                 state_bytes=inner * (conv - 1) * state_bytes + inner * state * ssm_bytes,
                                 detail=f"Mamba state: conv {inner}x{conv - 1} + SSM {inner}x{state}"))
        notes.append("Mamba layers keep a fixed-size state per request, not a per-token cache")
    return KVModel(name, model_type, dtype, kv_dtype, groups, notes)


def estimate_parameters(config: dict) -> int | None:
    """Parameters of a llama-style decoder from its config; None for families not modelled."""
    cfg = text_config(config)
    if cfg.get("model_type") not in PARAMETER_ESTIMATE_TYPES or "num_hidden_layers" not in cfg:
        return None
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    if cfg.get("attention_bias") or cfg["model_type"] in ("qwen2", "qwen2_moe"):
        attention += head_dim * (heads + 2 * kv_heads)
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):
        attention += 2 * head_dim  # q_norm and k_norm
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        expert_size = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        mlp = experts * 3 * hidden * expert_size + hidden * experts
        shared = cfg.get("shared_expert_intermediate_size") or 0
        if shared:
            mlp += 3 * hidden * shared + hidden
    else:
        mlp = 3 * hidden * cfg["intermediate_size"]
    norms = 2 * hidden if cfg["model_type"] not in ("gemma2", "gemma3_text") else 4 * hidden
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return embeddings + layers * (attention + mlp + norms) + hidden


def activation_bytes(config: dict, act_bytes: int, batched_tokens: int, max_seqs: int) -> int:
    """Peak activation of vLLM's profiling run (one batch of max_num_batched_tokens): the MLP's
    gate/up output, the residual, Q/K/V and attention output per token, plus fp32 logits for
    max_num_seqs sampled rows. A planning estimate; memory_report.py shows the measured split."""
    cfg = text_config(config)
    hidden = cfg.get("hidden_size", 0)
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    intermediate = cfg.get("intermediate_size") or 4 * hidden
    if cfg.get("num_experts_per_tok") and cfg.get("moe_intermediate_size"):
        intermediate = cfg["num_experts_per_tok"] * cfg["moe_intermediate_size"]
    per_token = 2 * intermediate + 3 * hidden + head_dim * (2 * heads + 2 * kv_heads)
    return batched_tokens * per_token * act_bytes + max_seqs * cfg.get("vocab_size", 0) * 4


def risk(utilisation: float, headroom_gib: float) -> str:
    """The lab's thresholds (0.88 / 0.93), made stricter where little memory is left outside vLLM."""
    if utilisation >= 0.93 or headroom_gib < 1.0:
        return "High"
    if utilisation >= 0.88 or headroom_gib < 2.0:
        return "Medium"
    return "Low"


def plan_rows(model: KVModel, gpu_gib: float, utilisations: list[float], max_len: int,
              overhead: dict[str, float]) -> list[dict]:
    fixed = sum(overhead.values())
    rows = []
    for util in utilisations:
        kv_gib = gpu_gib * util - fixed
        concurrency, tokens = model.capacity(kv_gib * GiB, max_len)
        rows.append({
            "gpu_memory_utilization": util, "kv_space_gib": round(kv_gib, 3), "tokens": tokens,
            "max_concurrency": math.floor(concurrency), "concurrency_exact": round(concurrency, 2),
            "risk": "Does not fit" if kv_gib <= 0 else risk(util, gpu_gib * (1 - util)),
        })
    return rows


def describe(model: KVModel, max_len: int) -> list[str]:
    lines = [f"Model: {model.name} ({model.model_type}), dtype {model.dtype}, KV cache dtype {model.kv_cache_dtype}"]
    for g in model.groups:
        if g.keeps_state:
            lines.append(f"  {g.layers:3d} {g.kind:<17} layers: {g.detail} = {g.state_bytes:,} B per layer "
                         f"per request (fixed)")
        else:
            lines.append(f"  {g.layers:3d} {g.kind:<17} layers: {g.detail} = {g.bytes_per_token:,} B per layer "
                         f"per token")
    lines.append(f"KV cache per token (all layers, inside every window): {model.growing_bytes_per_token:,} B"
                 f" ({model.growing_bytes_per_token / 1024:.1f} KiB)")
    per_request = model.bytes_per_request(max_len)
    lines.append(f"KV cache per full-length request ({max_len:,} tokens): {per_request / GiB:.4f} GiB"
                 f" ({per_request:,} B)")
    lines += [f"Note: {note}" for note in model.notes]
    return lines


def print_table(rows: list[dict]) -> None:
    print(f"{'Utilisation':<12} | {'KV space (GiB)':>14} | {'KV tokens':>12} | {'Max concurrency':>15} | Risk")
    print("-" * 74)
    for row in rows:
        print(f"{row['gpu_memory_utilization']:>10.0%}   | {row['kv_space_gib']:>14.2f} | {row['tokens']:>12,} | "
              f"{row['max_concurrency']:>15,} | {row['risk']}")


def chart(rows: list[dict], model: KVModel, max_len: int, path: Path) -> None:
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    utils = [r["gpu_memory_utilization"] * 100 for r in rows]
    ax.plot(utils, [r["concurrency_exact"] for r in rows], marker="o")
    for u, r in zip(utils, rows):
        ax.annotate(f"{r['max_concurrency']} ({r['risk']})", (u, r["concurrency_exact"]),
                    textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.set_xlabel("gpu_memory_utilization (%)")
    ax.set_ylabel(f"max concurrent {max_len:,}-token requests")
    ax.set_title(f"{model.name}: KV capacity vs utilisation")
    ax.grid(alpha=0.3)
    save_chart(plt, fig, path)


def cross_check(stack: ComposeStack | HostVllm, args, config: dict | None) -> dict:
    """Compare the planner's KV tokens with what the running vLLM reports for the same KV space."""
    progress("reading vLLM's metrics, served model and startup log ...")
    labels = cache_config_labels(stack.metrics())
    model_info = served_model(stack)
    max_len = int(model_info.get("max_model_len") or args.max_model_len)
    if config is None:
        config = model_config_from_stack(stack, model_info.get("root") or model_info["id"])
    log = parse_startup_log(stack.logs())
    env = stack.container_env()
    dtype = env.get("DTYPE") or "auto"
    kv_dtype = labels.get("cache_dtype", "auto")
    block_size = int(label_number(labels, "block_size") or 16)
    batched = int(label_number(labels, "max_num_batched_tokens") or args.max_num_batched_tokens)
    model = analyse(config, dtype if dtype != "auto" else "auto", kv_dtype, args.state_dtype, batched, block_size)
    num_blocks = label_number(labels, "num_gpu_blocks")
    explicit = label_number(labels, "kv_cache_memory_bytes")
    override = label_number(labels, "num_gpu_blocks_override")
    util = label_number(labels, "gpu_memory_utilization")
    if override:
        kv_space, basis = override * block_size * model.growing_bytes_per_token, \
            f"--num-gpu-blocks-override {int(override)} blocks of {block_size} tokens"
    elif explicit:
        kv_space, basis = explicit, (f"kv_cache_memory_bytes {explicit / GiB:.2f} GiB"
                                     + (" (VLLM_CPU_KVCACHE_SPACE)" if env.get("VLLM_CPU_KVCACHE_SPACE") else ""))
    elif args.gpu_memory_gib:
        kv_space = (args.gpu_memory_gib * util - overhead_gib(args, config, model)["total"]) * GiB
        basis = f"gpu_memory_utilization {util} of {args.gpu_memory_gib} GiB minus the estimated overhead"
    elif "available_kv_gib" in log:
        kv_space = log["available_kv_gib"] * GiB
        basis = f"vLLM's logged 'Available KV cache memory: {log['available_kv_gib']} GiB'"
    else:
        raise StackError("cannot tell the KV space vLLM was given: no kv_cache_memory_bytes, no "
                         "'Available KV cache memory' log line; pass --gpu-memory-gib")
    concurrency, predicted = model.capacity(kv_space, max_len)
    # The startup log line, else the same figure among cache_config_info's labels (logs rotate).
    reported = log.get("kv_cache_tokens") or label_number(labels, "kv_cache_size_tokens")
    result = {
        "served_model": model_info["id"], "max_model_len": max_len, "basis": basis,
        "kv_space_bytes": int(kv_space), "block_size": block_size, "num_blocks_reported": num_blocks,
        "kv_cache_dtype": model.kv_cache_dtype, "bytes_per_token": model.growing_bytes_per_token,
        "predicted_tokens": predicted, "predicted_max_concurrency": round(concurrency, 2),
        "reported_tokens": int(reported) if reported is not None else None,
        "reported_max_concurrency": log.get("max_concurrency") or label_number(labels, "kv_cache_max_concurrency"),
        "reported_tokens_from_blocks": int(num_blocks * block_size) if num_blocks else None,
    }
    if reported:
        result["difference_tokens"] = predicted - int(reported)
        result["difference_percent"] = round(100 * (predicted - reported) / reported, 4)
    return result


def print_cross_check(check: dict) -> None:
    print(f"\nCross-check against the running vLLM ({check['served_model']}, max_model_len {check['max_model_len']:,}):")
    print(f"  KV space basis:        {check['basis']}")
    print(f"  Planner:               {check['predicted_tokens']:,} tokens "
          f"({check['bytes_per_token']:,} B/token, {check['kv_cache_dtype']}), "
          f"max concurrency {check['predicted_max_concurrency']:.2f}x")
    if check.get("reported_tokens") is not None:
        reported_concurrency = check.get("reported_max_concurrency")
        print(f"  vLLM reports:          {check['reported_tokens']:,} tokens"
              + (f", max concurrency {reported_concurrency:.2f}x" if reported_concurrency is not None else ""))
        print(f"  Difference:            {check['difference_tokens']:+,} tokens ({check['difference_percent']:+.4f} %)"
              + ("  [vLLM counts whole blocks of %d tokens]" % check["block_size"]))
    else:
        print("  vLLM reports:          no KV cache size (neither in its log nor in vllm:cache_config_info)")
    if check.get("num_blocks_reported"):
        print(f"  vLLM num_gpu_blocks:   {int(check['num_blocks_reported']):,} x {check['block_size']} = "
              f"{check['reported_tokens_from_blocks']:,} token slots")


def overhead_gib(args, config: dict, model: KVModel) -> dict[str, float]:
    act_bytes = dtype_bytes(model.dtype, "dtype")
    if args.weights_gib is not None:
        weights = args.weights_gib
    else:
        try:
            params = estimate_parameters(config)
        except (KeyError, TypeError, ValueError) as err:
            raise UsageError(f"cannot estimate the weight size from the config ({err.__class__.__name__}: {err}); "
                             "pass --weights-gib") from None
        if params is None:
            raise UsageError(f"cannot estimate the weight size of model_type '{model.model_type}' from its "
                             "config; pass --weights-gib")
        weights = params * act_bytes / GiB
    if args.activation_gib is not None:
        activation = args.activation_gib
    else:
        try:
            activation = activation_bytes(config, act_bytes, args.max_num_batched_tokens, args.max_num_seqs) / GiB
        except (TypeError, ValueError, ZeroDivisionError) as err:
            raise UsageError(f"cannot estimate the activation peak from the config ({err.__class__.__name__}); "
                             "pass --activation-gib") from None
    parts = {"weights": weights, "activation_peak": activation, "runtime": args.runtime_overhead_gib,
             "cuda_graphs": args.cuda_graph_gib}
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
    parser = ScriptArgumentParser(prog="kv_planner.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", type=Path,
                        help="config.json or a model folder (optional with --check-stack: the served model's)")
    parser.add_argument("--gpu-memory-gib", type=float, help="GPU memory in GiB (e.g. 140.4 for an H200)")
    parser.add_argument("--dtype", default="auto", help="weights/activations dtype (default: the config's)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype: auto (= dtype), fp8, ...")
    parser.add_argument("--state-dtype", default="auto",
                        help="dtype of linear-attention/SSM state (default: dtype)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="tokens per request (default: 4096)")
    parser.add_argument("--block-size", type=int, default=16, help="vLLM's KV block size in tokens (default: 16)")
    parser.add_argument("--utilization", default=",".join(str(u) for u in DEFAULT_UTILISATIONS),
                        help="comma-separated gpu_memory_utilization values (default: %(default)s)")
    parser.add_argument("--kv-space-gib", type=float,
                        help="KV space given directly (CPU build: VLLM_CPU_KVCACHE_SPACE); skips the GPU model")
    est = parser.add_argument_group("overhead estimate (GPU): KV space = GPU x utilisation - these")
    est.add_argument("--weights-gib", type=float, help="weights in GiB (default: parameters from the config x dtype)")
    est.add_argument("--activation-gib", type=float, help="peak activation in GiB (default: estimated)")
    est.add_argument("--max-num-batched-tokens", type=int, default=8192,
                     help="vLLM's tokens per step: the profiling batch of the activation estimate, and what "
                          "a sliding-window layer keeps beyond its window (default: %(default)s, vLLM's "
                          "online default on GPUs of 70 GiB and more; 2048 on smaller ones)")
    est.add_argument("--max-num-seqs", type=int, default=1024, help="for the logits estimate (default: %(default)s)")
    est.add_argument("--runtime-overhead-gib", type=float, default=0.5,
                     help="CUDA context and other non-torch memory (default: %(default)s, the lab's figure)")
    est.add_argument("--cuda-graph-gib", type=float, default=0.42,
                     help="CUDA graph pool (default: %(default)s, the lab's measured figure; 0 with --enforce-eager)")
    parser.add_argument("--check-stack", action="store_true",
                        help="compare with the KV cache a running vLLM reports (through docker compose, or --vllm-url)")
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
    for value, what in ((args.dtype, "dtype"), (args.kv_cache_dtype, "KV cache dtype"), (args.state_dtype, "state dtype")):
        if value != "auto":
            dtype_bytes(value, what)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = load_config(args.config) if args.config else None
    report: dict = {}
    try:
        model = analyse(config, args.dtype, args.kv_cache_dtype, args.state_dtype, args.max_num_batched_tokens,
                        args.block_size) if config else None
    except NotUnderstood as err:
        print(f"kv_planner.py: architecture not understood: {err}", file=sys.stderr)
        return 3
    lines: list[str] = []
    if model:
        lines = describe(model, args.max_model_len)
        report["model"] = {"name": model.name, "model_type": model.model_type, "dtype": model.dtype,
                           "kv_cache_dtype": model.kv_cache_dtype,
                           "bytes_per_token": model.growing_bytes_per_token,
                           "full_attention_bytes_per_token": model.full_bytes_per_token,
                           "bytes_per_full_length_request": model.bytes_per_request(args.max_model_len),
                           "layer_groups": [asdict(g) for g in model.groups], "notes": model.notes}
        report["max_model_len"] = args.max_model_len
        if args.kv_space_gib is not None:
            concurrency, tokens = model.capacity(args.kv_space_gib * GiB, args.max_model_len)
            report["rows"] = [{"gpu_memory_utilization": None, "kv_space_gib": args.kv_space_gib, "tokens": tokens,
                               "max_concurrency": math.floor(concurrency),
                               "concurrency_exact": round(concurrency, 2), "risk": "n/a"}]
        elif args.gpu_memory_gib is not None:
            overhead = overhead_gib(args, config, model)
            report["gpu_memory_gib"] = args.gpu_memory_gib
            report["overhead_gib"] = {k: round(v, 3) for k, v in overhead.items()}
            report["rows"] = plan_rows(model, args.gpu_memory_gib, args.utilisations, args.max_model_len,
                                       {k: v for k, v in overhead.items() if k != "total"})
    if args.check_stack:
        try:
            report["cross_check"] = cross_check(stack_from_args(args), args, config)
        except NotUnderstood as err:
            print(f"kv_planner.py: architecture not understood: {err}", file=sys.stderr)
            return 3
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
    if "overhead_gib" in report:
        o = report["overhead_gib"]
        print(f"\nGPU {args.gpu_memory_gib} GiB. Outside the KV cache (estimates): weights {o['weights']:.2f} GiB "
              f"(parameters x {model.dtype}), activation peak {o['activation_peak']:.2f} GiB "
              f"({args.max_num_batched_tokens} batched tokens, {args.max_num_seqs} sampled rows of fp32 logits), "
              f"runtime {o['runtime']:.2f} GiB, CUDA graphs {o['cuda_graphs']:.2f} GiB = {o['total']:.2f} GiB")
    if report.get("rows"):
        print()
        if args.kv_space_gib is not None:
            row = report["rows"][0]
            print(f"KV space {args.kv_space_gib} GiB: {row['tokens']:,} tokens, "
                  f"{row['max_concurrency']:,} concurrent {args.max_model_len:,}-token requests "
                  f"({row['concurrency_exact']:.2f}x)")
        else:
            print_table(report["rows"])
    if chart_path:
        print(f"\nChart: {chart_path}")
    if "cross_check" in report:
        print_cross_check(report["cross_check"])
    return 0


if __name__ == "__main__":
    sys.exit(run_main("kv_planner.py", main))
