"""The locally built images: what they contain (versions as versions.env and constraints.txt
intend, njs in nginx), their own scripts run inside them, and the CPU stack running on them."""

import json
import re
import subprocess

import pytest
import requests

from llmstack import versions

VERSIONS = versions.read_versions()
IMAGES = versions.local_images()
VLLM_CPU_IMAGE = IMAGES["vllm"]
NGINX_IMAGE = IMAGES["nginx"]


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
    result = docker_run(
        NGINX_IMAGE,
        "sh",
        "-c",
        "cat /etc/nginx/conf.d/a.conf /etc/nginx/conf.d/sub/b.conf",
        volumes=[f"{templates}:/etc/nginx/templates:ro"],
        env=["RATE=5r/s", "BURST=7"],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "rate 5r/s; keep $uri ${UNSET_VARIABLE};\nburst 7;\n"


def test_tiny_model_maker_makes_a_consistent_model(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    out.chmod(0o777)
    result = docker_run(
        VLLM_CPU_IMAGE,
        "/opt/llm-stack/make_tiny_model.py",
        "/out/m",
        "--vocab-size",
        "600",
        "--layers",
        "1",
        "--corpus",
        "/usr/lib/python3.11/json",
        volumes=[f"{out}:/out"],
        entrypoint="python3",
    )
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["/tmp/m", "--heads", "3", "--kv-heads", "2"], "multiple of --kv-heads"),
        (["/tmp/m", "--layers", "0"], "--layers must be a positive integer"),
        (["/tmp/m", "--corpus", "/nonexistent"], "no .py files"),
    ],
)
def test_tiny_model_maker_rejects_bad_input_in_one_line(args, message):
    result = docker_run(VLLM_CPU_IMAGE, "/opt/llm-stack/make_tiny_model.py", *args, entrypoint="python3")
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


def test_nginx_image_loads_njs_as_the_official_image_does():
    """The mounted nginx.conf loads njs with `load_module modules/...`, a path both images resolve;
    js_shared_dict_zone needs njs 0.8 (Debian 12's 0.7.9 lacks it)."""
    config = "load_module modules/ngx_http_js_module.so; events {} http { js_shared_dict_zone zone=z:1m; }"
    result = docker_run(
        NGINX_IMAGE, "-c", f"printf '%s' '{config}' > /tmp/n.conf && nginx -t -c /tmp/n.conf", entrypoint="sh"
    )
    assert result.returncode == 0, result.stderr
    assert "syntax is ok" in result.stderr


def test_built_images_carry_the_versions_versions_env_and_constraints_name():
    rows = {row.component: row for row in versions.compare()}
    assert rows["vLLM (CI runs the CPU build, vllm-cpu)"].tested == VERSIONS["VLLM_CPU_VERSION"]
    assert rows["Locust"].tested == versions.read_constraints()["locust"]
    # The official python image is pinned to the Python release Debian's python3 has.
    assert rows["Python (gateway exporter, Locust)"].verdict == "same"
    assert rows["Debian (images' base)"].tested == VERSIONS["DEBIAN_SUITE"]
    # nginx and Prometheus come from Debian: whatever they are, the table can read them.
    for component in ("nginx", "njs (nginx's JavaScript module)", "Prometheus", "promtool used by the rule tests"):
        assert rows[component].tested[0].isdigit(), rows[component]
    torch = docker_run(VLLM_CPU_IMAGE, "-c", "import torch; print(torch.__version__)", entrypoint="python3")
    # PyPI's torch is the CUDA build (2.13.0+cu130): the release is what versions.env pins.
    assert torch.stdout.strip().split("+")[0] == VERSIONS["TORCH_VERSION"], torch.stderr


def test_the_cpu_stack_runs_on_the_locally_built_images(stack):
    """Every running service of the CPU stack uses the image compose names for it, and answers."""
    listed = stack.compose_command("ps", "--format", "json").stdout
    containers = [json.loads(line) for line in listed.splitlines() if line.strip()]
    running = {c["Service"]: c["Image"] for c in containers}
    assert running, listed
    for service, image in running.items():
        # The vLLM replicas beyond the first (vllm-2, ...) run vllm's image.
        assert image == IMAGES[re.sub(r"^vllm-[0-9]+$", "vllm", service)], service
    assert all(c["Health"] == "healthy" for c in containers), containers
    assert requests.get(stack.url("/healthz"), timeout=10).status_code == 200
