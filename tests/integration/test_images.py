"""The locally built images' own scripts, run inside those images."""

import json
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_CPU_IMAGE = "llm-stack/vllm-cpu:0.32.0"
NGINX_IMAGE = "llm-stack/nginx:1.22-debian12"


def docker_run(image, *args, volumes=(), env=(), entrypoint=None):
    command = ["docker", "run", "--rm"]
    for volume in volumes:
        command += ["-v", volume]
    for item in env:
        command += ["-e", item]
    if entrypoint:
        command += ["--entrypoint", entrypoint]
    return subprocess.run([*command, image, *args], capture_output=True, text=True, timeout=300)


def test_nginx_image_renders_only_set_variables(tmp_path):
    templates = tmp_path / "templates"
    (templates / "sub").mkdir(parents=True)
    (templates / "a.conf.template").write_text("rate ${RATE}; keep $uri ${UNSET_VARIABLE};\n")
    (templates / "sub" / "b.conf.template").write_text("burst ${BURST};\n")
    result = docker_run(NGINX_IMAGE, "sh", "-c", "cat /etc/nginx/conf.d/a.conf /etc/nginx/conf.d/sub/b.conf",
                        volumes=[f"{templates}:/etc/nginx/templates:ro"], env=["RATE=5r/s", "BURST=7"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "rate 5r/s; keep $uri ${UNSET_VARIABLE};\nburst 7;\n"


def test_tiny_model_maker_makes_a_consistent_model(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    out.chmod(0o777)
    result = docker_run(VLLM_CPU_IMAGE, "/opt/llm-stack/make_tiny_model.py", "/out/m", "--vocab-size", "600",
                        "--layers", "1", "--corpus", "/usr/lib/python3.11/json", volumes=[f"{out}:/out"],
                        entrypoint="python3")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "m" / "config.json").read_text())
    tokenizer = json.loads((out / "m" / "tokenizer.json").read_text())
    tokenizer_config = json.loads((out / "m" / "tokenizer_config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_hidden_layers"] == 1
    # Every id the tokenizer can produce has a row in the embedding.
    ids = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    # ... and the tokenizer covers the whole embedding (a small corpus is padded up to the vocab size).
    assert max(ids) == config["vocab_size"] - 1 and len(ids) == config["vocab_size"]
    # transformers 5 writes the chat template beside the tokenizer config.
    template_file = out / "m" / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else tokenizer_config["chat_template"]
    assert "<|im_start|>" in template
    assert config["eos_token_id"] == next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_end|>")


@pytest.mark.parametrize("args, message", [
    (["/tmp/m", "--heads", "3", "--kv-heads", "2"], "multiple of --kv-heads"),
    (["/tmp/m", "--layers", "0"], "--layers must be a positive integer"),
    (["/tmp/m", "--corpus", "/nonexistent"], "no .py files"),
])
def test_tiny_model_maker_rejects_bad_input_in_one_line(args, message):
    result = docker_run(VLLM_CPU_IMAGE, "/opt/llm-stack/make_tiny_model.py", *args, entrypoint="python3")
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
