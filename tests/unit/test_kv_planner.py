"""The KV planner's arithmetic on published architectures (configs in tests/data/model_configs,
copied from the models' Hugging Face config.json) and its command-line behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kv_planner
from kv_planner import NotUnderstood, analyse, estimate_parameters, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "tests" / "data" / "model_configs"
PLANNER = REPO_ROOT / "scripts" / "kv_planner.py"
GiB = 1024 ** 3


def model(name: str, **kwargs):
    return analyse(load_config(CONFIGS / f"{name}.json"), **kwargs)


def groups(m) -> dict:
    return {g.kind: g for g in m.groups}


def test_llama3_8b_grouped_query_attention():
    m = model("llama-3-8b")
    # 32 layers x 8 KV heads x 128 dim x 2 (K, V) x 2 bytes
    assert m.growing_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072
    assert m.bytes_per_request(4096) == 512 * 1024 ** 2
    assert any("8 KV heads for 32 query heads" in note for note in m.notes)


def test_llama3_8b_fp8_kv_cache_halves_the_bytes():
    assert model("llama-3-8b", kv_cache_dtype="fp8").growing_bytes_per_token == 65_536


def test_qwen3_uses_config_head_dim_not_hidden_over_heads():
    m = model("qwen3-0.6b")
    # head_dim 128 while hidden_size / heads = 1024 / 16 = 64
    assert m.growing_bytes_per_token == 28 * 8 * 128 * 2 * 2 == 114_688
    assert any("head_dim 128 differs" in note for note in m.notes)


def test_mistral_sliding_window_bounds_every_layer():
    m = model("mistral-7b-v0.1")
    assert list(groups(m)) == ["sliding_attention"]
    assert groups(m)["sliding_attention"].window == 4096
    per_token = 32 * 8 * 128 * 2 * 2
    # vLLM reserves, per sliding layer, the window - 1 plus one step's 8192 tokens (capped by the
    # request's length) in 16-token blocks, plus one block: the window need not start on a boundary.
    assert m.bytes_per_request(2048) == (2048 + 16) * per_token
    assert m.bytes_per_request(32768) == (768 + 1) * 16 * per_token  # cdiv(4095 + 8192, 16) = 768
    assert analyse(load_config(CONFIGS / "mistral-7b-v0.1.json"),
                   max_num_batched_tokens=2048).bytes_per_request(32768) == (384 + 1) * 16 * per_token
    assert m.full_bytes_per_token == 0


def test_gemma2_alternates_sliding_and_global_layers():
    m = model("gemma-2-9b")
    g = groups(m)
    assert g["full_attention"].layers == 21 and g["sliding_attention"].layers == 21
    per_layer = 8 * 256 * 2 * 2
    # At 8k the 4k window saves nothing: window + one 8192-token step covers the whole request.
    assert m.bytes_per_request(8192) == 21 * per_layer * 8192 + 21 * per_layer * (8192 + 16)


def test_gemma3_one_global_layer_in_six():
    m = model("gemma-3-1b-it")
    g = groups(m)
    assert g["full_attention"].layers == 4 and g["sliding_attention"].layers == 22
    assert g["sliding_attention"].window == 512
    per_layer = 1 * 256 * 2 * 2
    # cdiv(511 + 8192, 16) = 544 blocks, plus one
    assert m.bytes_per_request(32768) == 4 * per_layer * 32768 + 22 * per_layer * 545 * 16


def test_qwen3_next_linear_attention_keeps_a_fixed_state():
    m = model("qwen3-next-80b-a3b-instruct")
    g = groups(m)
    assert g["full_attention"].layers == 12 and g["linear_attention"].layers == 36
    assert m.growing_bytes_per_token == 12 * 2 * 256 * 2 * 2 == 24_576
    # conv state (16*128*2 + 32*128) x (4 - 1) plus recurrent state 32 x 128 x 128, bf16
    state = ((16 * 128 * 2 + 32 * 128) * 3 + 32 * 128 * 128) * 2
    assert state == 1_097_728
    # vLLM unifies page sizes: the attention block grows to 544 tokens (16 x cdiv(state, 16 x 2,048 B))
    # and the state is padded to that page.
    assert g["full_attention"].block_size == 544
    assert g["linear_attention"].state_bytes == 544 * 2048 == 1_114_112
    assert m.bytes_per_request(4096) == 12 * 2048 * 8 * 544 + 36 * 1_114_112


def test_jamba_attention_every_eighth_layer_rest_mamba():
    m = model("jamba-v0.1")
    g = groups(m)
    assert g["full_attention"].layers == 4 and g["mamba"].layers == 28
    assert m.growing_bytes_per_token == 4 * 8 * 128 * 2 * 2
    inner = 2 * 4096
    state = (inner * 3 + inner * 16) * 2  # 311,296 B
    assert g["full_attention"].block_size == 16 * 5  # cdiv(state, 16 x 4,096 B) = 5
    assert g["mamba"].state_bytes == 80 * 4096 >= state


def test_hybrid_with_float32_ssm_state_matches_the_labs_vllm_log():
    """The lab's Qwen3.5-0.8B run: vLLM logged 3.06 GiB of KV space and 44.73x concurrency at 4,096
    tokens. The dimensions below are that model's as we read them (3 Gated DeltaNet layers to 1
    attention layer, recurrent state in float32 as its mamba_ssm_dtype says)."""
    config = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 1024,
              "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"], "full_attention_interval": 4,
              "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_num_key_heads": 16, "linear_num_value_heads": 16, "mamba_ssm_dtype": "float32",
              "torch_dtype": "bfloat16"}
    config["layer_types"] = config["layer_types"] * 6
    m = analyse(config)
    g = groups(m)
    # conv (16*128*2 + 16*128) x 3 in bf16 + recurrent 16 x 128 x 128 in fp32 = 1,085,440 B -> 544-token blocks
    assert g["full_attention"].block_size == 544
    concurrency, _ = m.capacity(3.06 * GiB, 4096)
    assert concurrency == pytest.approx(44.73, rel=0.005)
    # Without the fp32 state and the padding the estimate was 54.4x, 22% too many requests.
    assert analyse(config, state_dtype="bfloat16").capacity(3.06 * GiB, 4096)[0] > 47


@pytest.mark.parametrize("fields, kv_heads", [
    ({"num_kv_heads": 8, "new_decoder_architecture": True}, 8),  # Falcon-40B/180B
    ({"multi_query": True}, 1),                                  # Falcon-7B, GPT-BigCode
    ({}, 64),
])
def test_falcon_style_kv_head_fields(fields, kv_heads):
    config = {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 8192,
              "num_hidden_layers": 60, "num_attention_heads": 64, "torch_dtype": "bfloat16", **fields}
    assert analyse(config).growing_bytes_per_token == 60 * kv_heads * 128 * 2 * 2


def test_deepseek_v3_mla_stores_one_latent_per_layer():
    m = model("deepseek-v3")
    assert list(groups(m)) == ["mla"]
    # kv_lora_rank 512 + qk_rope_head_dim 64, not 128 heads x (192 + 128)
    assert m.growing_bytes_per_token == 61 * (512 + 64) * 2 == 70_272


def test_tiny_cpu_model_512_bytes_per_token():
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "torch_dtype": "bfloat16", "use_sliding_window": False}
    m = analyse(config)
    assert m.growing_bytes_per_token == 512
    concurrency, tokens = m.capacity(1 * GiB, 4096)
    assert tokens == GiB // 512 and concurrency == 512


def test_multimodal_wrapper_reads_text_config():
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"model_type": "gemma3_text", "head_dim": 256, "hidden_size": 2560,
                              "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
                              "sliding_window": 1024, "sliding_window_pattern": 6},
              "torch_dtype": "bfloat16"}
    g = groups(analyse(config))
    assert g["full_attention"].layers == 5 and g["sliding_attention"].layers == 29


def test_layer_types_list_is_followed():
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
              "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
              "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12}
    g = groups(analyse(config))
    assert g["full_attention"].layers == 12 and g["sliding_attention"].window == 128


@pytest.mark.parametrize("config, reason", [
    ({"model_type": "rwkv", "architectures": ["RwkvForCausalLM"], "num_hidden_layers": 24}, "rwkv"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*", "num_hidden_layers": 4}, "Nemotron-H"),
    ({"model_type": "deepseek_v32", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048,
      "num_hidden_layers": 61}, "indexer"),
    ({"model_type": "mystery", "layer_types": ["full_attention", "chunked_attention"], "num_hidden_layers": 2,
      "hidden_size": 64, "num_attention_heads": 4}, "chunked_attention"),
])
def test_unknown_architectures_are_refused_not_guessed(config, reason):
    with pytest.raises(NotUnderstood, match=reason):
        analyse(config)


def test_parameter_estimates_match_published_sizes():
    assert round(estimate_parameters(load_config(CONFIGS / "llama-3-8b.json")) / 1e9, 2) == 8.03
    assert round(estimate_parameters(load_config(CONFIGS / "qwen3-0.6b.json")) / 1e9, 2) == 0.60
    assert round(estimate_parameters(load_config(CONFIGS / "mistral-7b-v0.1.json")) / 1e9, 2) == 7.24
    assert estimate_parameters(load_config(CONFIGS / "jamba-v0.1.json")) is None


def test_plan_rows_follow_the_lab_formula():
    m = model("qwen3-0.6b")
    overhead = {"weights": 1.0, "activation_peak": 0.5, "runtime": 0.5, "cuda_graphs": 0.0}
    rows = kv_planner.plan_rows(m, 8.0, [0.75, 0.95, 0.80], 4096, overhead)
    assert rows[0]["kv_space_gib"] == pytest.approx(8 * 0.75 - 2.0)
    assert rows[0]["tokens"] == int(4.0 * GiB / 114_688 / 4096 * 4096)
    assert rows[0]["max_concurrency"] == int(4.0 * GiB // (114_688 * 4096))
    # 8 GiB card: 2 GiB left outside vLLM at 75 %, 1.6 GiB at 80 %, 0.4 GiB at 95 %
    assert [r["risk"] for r in rows] == ["Low", "High", "Medium"]


def run_planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PLANNER), *args], capture_output=True, text=True, timeout=60)


def test_cli_help():
    result = run_planner("--help")
    assert result.returncode == 0 and "gpu_memory_utilization" in result.stdout


def test_cli_json_and_chart(tmp_path):
    chart = tmp_path / "plan.png"
    result = run_planner(str(CONFIGS / "llama-3-8b.json"), "--gpu-memory-gib", "80", "--json",
                         "--chart", str(chart), "--output", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"]["bytes_per_token"] == 131_072
    assert [r["gpu_memory_utilization"] for r in report["rows"]] == [0.75, 0.8, 0.85, 0.9, 0.95]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "plan.json").read_text()) == report


def test_cli_model_folder_and_kv_space(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "qwen3-0.6b.json").read_text())
    result = run_planner(str(tmp_path), "--kv-space-gib", "1", "--json", "--output", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)["rows"][0]
    assert row["tokens"] == int(GiB / 114_688 / 4096 * 4096)


@pytest.mark.parametrize("make_args, message", [
    (lambda d: [str(d / "missing.json"), "--gpu-memory-gib", "80"], "no such file"),
    (lambda d: [str(d / "list.json"), "--gpu-memory-gib", "80"], "not a model config"),
    (lambda d: [str(d / "broken.json"), "--gpu-memory-gib", "80"], "not a JSON model config"),
    (lambda d: [str(CONFIGS / "llama-3-8b.json"), "--gpu-memory-gib", "80", "--kv-cache-dtype", "fp5"],
     "unknown KV cache dtype"),
    (lambda d: [str(CONFIGS / "llama-3-8b.json"), "--gpu-memory-gib", "80", "--utilization", "0.9,1.2"],
     "outside (0, 1]"),
    (lambda d: [str(CONFIGS / "llama-3-8b.json"), "--gpu-memory-gib", "80", "--utilization", "0"],
     "outside (0, 1]"),
    (lambda d: [str(CONFIGS / "llama-3-8b.json")], "--gpu-memory-gib"),
    (lambda d: [str(CONFIGS / "llama-3-8b.json"), "--gpu-memory-gib", "many"], "invalid float"),
    (lambda d: [str(d / "head_dim.json"), "--kv-space-gib", "1"], "'head_dim' is 'x', not a positive number"),
    (lambda d: [str(d / "no_vocab.json"), "--gpu-memory-gib", "80"], "pass --weights-gib"),
    (lambda d: [str(CONFIGS / "llama-3-8b.json"), "--gpu-memory-gib", "80", "--block-size", "0"],
     "--block-size must be positive"),
])
def test_cli_bad_input_one_line_exit_2(tmp_path, make_args, message):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{not json")
    llama = json.loads((CONFIGS / "llama-3-8b.json").read_text())
    (tmp_path / "head_dim.json").write_text(json.dumps({**llama, "head_dim": "x"}))
    (tmp_path / "no_vocab.json").write_text(json.dumps({k: v for k, v in llama.items() if k != "vocab_size"}))
    result = run_planner(*make_args(tmp_path))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_unknown_architecture_exit_3(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "rwkv", "architectures": ["RwkvForCausalLM"],
                                "num_hidden_layers": 24}))
    result = run_planner(str(path), "--gpu-memory-gib", "80")
    assert result.returncode == 3
    assert "architecture not understood" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_parameter_estimate_of_the_cpu_stack_model():
    from make_tiny_model import model_config

    config = model_config(vocab_size=2048, hidden_size=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                          max_positions=40960)
    attention = 128 * 32 * (4 + 2 * 2) + 4 * 32 * 128 + 2 * 32  # q, k, v, o projections; q/k norms
    mlp = 3 * 128 * 384
    # Tied embeddings counted once; 2 norms per layer and a final norm. transformers counts the
    # same model (built on the meta device in the vLLM image) at 656,128 parameters.
    assert estimate_parameters(config) == 2048 * 128 + 2 * (attention + mlp + 2 * 128) + 128 == 656_128
