"""A model's KV cache per layer, read from its Hugging Face config.json.

What each layer keeps: full attention K and V per token (grouped-query heads, the config's head_dim),
an MLA latent per token, a sliding window's tokens, or a fixed linear-attention / Mamba state per
request. How vLLM packs those layers into KV-cache groups and blocks is llmstack.kv.grouping.
Also the estimates of what lies outside the KV cache: parameters and the profiling run's activations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from llmstack.cli import UsageError

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}

# Decoder families whose every layer is full (global) attention unless the config says otherwise.
FULL_ATTENTION_TYPES = {
    "llama",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "mistral",
    "mixtral",
    "gemma",
    "phi3",
    "granite",
    "olmo",
    "olmo2",
    "internlm2",
    "baichuan",
    "yi",
    "deepseek",
    "starcoder2",
    "cohere",
    "exaone",
    "glm",
    "glm4",
    "stablelm",
    "opt",
    "gpt_neox",
    "falcon",
    "gpt_bigcode",
}
# Families that apply `sliding_window` to every layer when it is set (and not switched off).
ALL_SLIDING_TYPES = {"mistral", "mixtral", "starcoder2", "phi3"}
# Families whose parameter count this script can estimate from the config (llama-style blocks).
PARAMETER_ESTIMATE_TYPES = {
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mistral",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "olmo2",
}
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
    """The model's layers of one kind (all alike), before vLLM groups them for its block pool."""

    kind: str  # full_attention | sliding_attention | mla | linear_attention | mamba
    layers: int
    bytes_per_token: int = 0  # per layer, K and V (or the MLA latent)
    window: int | None = None  # sliding_attention only
    state_bytes: int = 0  # per layer and request (linear attention / SSM), before vLLM pads it
    detail: str = ""

    @property
    def keeps_state(self) -> bool:
        """A fixed-size state per request (linear attention / SSM), not a per-token cache."""
        return self.kind in ("linear_attention", "mamba")


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
        mapping = {
            "full_attention": "full_attention",
            "attention": "full_attention",
            "sliding_attention": "sliding_attention",
            "linear_attention": "linear_attention",
            "mamba": "mamba",
        }
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


def analyse(config: dict, dtype: str = "auto", kv_cache_dtype: str = "auto", state_dtype: str = "auto") -> KVModel:
    """The model's KV cache per layer kind. A field the model needs but lacks raises NotUnderstood
    (exit 3); a field of the wrong type, UsageError (exit 2)."""
    try:
        return _analyse(config, dtype, kv_cache_dtype, state_dtype)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise UsageError(f"the model config has a malformed field ({err.__class__.__name__}: {err})") from None


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
        notes.append(
            f"MLA: one latent of kv_lora_rank + qk_rope_head_dim = {latent} values per layer and "
            "token (no separate K and V, no per-head copies)"
        )
        group = LayerGroup("mla", layers, latent * kv_bytes, detail=f"{latent} latent values")
        return KVModel(name, model_type, dtype, kv_dtype, [group], notes)

    kinds = layer_kinds(cfg)
    heads = _int(cfg, "num_attention_heads")
    # Falcon names its KV heads num_kv_heads; Falcon-7B and GPT-BigCode share one (multi_query).
    kv_heads = _int(cfg, "num_key_value_heads", cfg.get("num_kv_heads") or (1 if cfg.get("multi_query") else heads))
    hidden = _int(cfg, "hidden_size")
    head_dim = _int(cfg, "head_dim", hidden // heads)
    if cfg.get("head_dim") and head_dim != hidden // heads:
        notes.append(
            f"head_dim {head_dim} differs from hidden_size / heads = {hidden // heads}; the config's head_dim is used"
        )
    if kv_heads != heads:
        notes.append(f"grouped-query attention: {kv_heads} KV heads for {heads} query heads")
    per_token = kv_heads * head_dim * 2 * kv_bytes
    groups: list[LayerGroup] = []
    count = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    if count.get("full_attention"):
        groups.append(
            LayerGroup(
                "full_attention", count["full_attention"], per_token, detail=f"{kv_heads} KV heads x {head_dim} dim x 2"
            )
        )
    if count.get("sliding_attention"):
        window = _int(cfg, "sliding_window")
        groups.append(
            LayerGroup(
                "sliding_attention",
                count["sliding_attention"],
                per_token,
                window=window,
                detail=f"{kv_heads} KV heads x {head_dim} dim x 2, window {window}",
            )
        )
        notes.append(
            f"sliding-window layers keep their {window}-token window plus one scheduler step's "
            "tokens (--max-num-batched-tokens) and one block, as vLLM reserves them"
        )
    if count.get("linear_attention"):
        key_dim, value_dim = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
        key_heads, value_heads = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
        kernel = _int(cfg, "linear_conv_kernel_dim")
        conv_channels = key_heads * key_dim * 2 + value_heads * value_dim
        conv_values, recurrent_values = conv_channels * (kernel - 1), value_heads * key_dim * value_dim
        groups.append(
            LayerGroup(
                "linear_attention",
                count["linear_attention"],
                state_bytes=conv_values * state_bytes + recurrent_values * ssm_bytes,
                detail=f"Gated DeltaNet state: conv {conv_channels}x{kernel - 1} + "
                f"recurrent {value_heads}x{key_dim}x{value_dim}",
            )
        )
        notes.append("linear-attention layers keep a fixed-size state per request, not a per-token cache")
    if count.get("mamba"):
        inner = _int(cfg, "mamba_expand") * hidden
        conv, state = _int(cfg, "mamba_d_conv"), _int(cfg, "mamba_d_state")
        groups.append(
            LayerGroup(
                "mamba",
                count["mamba"],
                state_bytes=inner * (conv - 1) * state_bytes + inner * state * ssm_bytes,
                detail=f"Mamba state: conv {inner}x{conv - 1} + SSM {inner}x{state}",
            )
        )
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
