"""The compose files as compose itself merges them: the rules every service follows."""

import json
import re
import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {
    "gpu": ["compose.yaml"],
    "airgap": ["compose.yaml", "compose.airgap.yaml"],
    "cpu": ["compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"],
}
COMPOSE_TEXT = "".join((REPO_ROOT / f).read_text() for f in VARIANTS["cpu"])
# Variables compose refuses to run without (${VAR:?message}): the secrets' files.
REQUIRED_SECRETS = sorted(set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):\?", COMPOSE_TEXT)))


def rendered(files, extra_env=None, profiles=("*",)):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    env.update({name: "/dev/null" for name in REQUIRED_SECRETS})
    env.update(extra_env or {})
    command = ["docker", "compose", "--env-file", "/dev/null"]
    for profile in profiles:
        command += ["--profile", profile]
    for f in files:
        command += ["-f", f]
    result = subprocess.run([*command, "config", "--format", "json"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def config(request):
    return rendered(VARIANTS[request.param])


def test_only_the_gateway_publishes_ports(config):
    assert {n for n, s in config["services"].items() if s.get("ports")} == {"nginx"}


def test_every_service_has_a_healthcheck_and_a_pinned_image(config):
    for name, service in config["services"].items():
        assert service.get("healthcheck", {}).get("test"), name
        image = service["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), (name, image)


def test_no_container_names_and_dependencies_wait_for_health(config):
    for name, service in config["services"].items():
        assert "container_name" not in service, name
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition["condition"] == "service_healthy", (name, dependency)


def test_gpu_path_reserves_the_gpu_and_cpu_path_does_not():
    gpu = rendered(VARIANTS["gpu"])["services"]["vllm"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert gpu["image"].startswith("vllm/vllm-openai:v")
    cpu = rendered(VARIANTS["cpu"])["services"]["vllm"]
    assert "deploy" not in cpu or not cpu["deploy"].get("resources")
    assert cpu["image"].startswith("llm-stack/vllm-cpu:")


def test_lab_settings_are_overridable_defaults():
    env = rendered(VARIANTS["gpu"])["services"]["vllm"]["environment"]
    assert env["GPU_MEMORY_UTILIZATION"] == "0.85" and env["MAX_MODEL_LEN"] == "4096"
    command = " ".join(rendered(VARIANTS["gpu"])["services"]["vllm"]["command"])
    for flag in ("--gpu-memory-utilization", "--max-model-len", "--enable-prefix-caching", "--served-model-name",
                 "--dtype"):
        assert flag in command
    changed = rendered(VARIANTS["gpu"], {"GPU_MEMORY_UTILIZATION": "0.9", "MAX_MODEL_LEN": "8192"})
    assert changed["services"]["vllm"]["environment"]["GPU_MEMORY_UTILIZATION"] == "0.9"
    assert changed["services"]["vllm"]["environment"]["MAX_MODEL_LEN"] == "8192"


def test_cpu_path_only_changes_defaults_and_env_still_wins():
    cpu = rendered(VARIANTS["cpu"])["services"]["vllm"]
    assert cpu["environment"]["LOAD_FORMAT"] == "dummy" and cpu["environment"]["MODEL"] == "/opt/models/tiny-qwen3"
    assert cpu["command"] == rendered(VARIANTS["gpu"])["services"]["vllm"]["command"]
    chosen = rendered(VARIANTS["cpu"], {"MODEL": "/models/mine", "LOAD_FORMAT": "auto"})["services"]["vllm"]
    assert chosen["environment"]["MODEL"] == "/models/mine" and chosen["environment"]["LOAD_FORMAT"] == "auto"


def test_secrets_are_files_not_environment():
    config = rendered(VARIANTS["gpu"])
    nginx = config["services"]["nginx"]
    assert any(s["source"] == "api_keys" for s in nginx["secrets"])
    for service in config["services"].values():
        for key, value in (service.get("environment") or {}).items():
            assert "sk-" not in str(value) and "PASSWORD=" not in key, key
    assert config["services"]["vllm"]["environment"]["HF_TOKEN_PATH"] == "/run/secrets/hf_token"


def test_required_secrets_are_files():
    assert "API_KEYS_FILE" in REQUIRED_SECRETS
    assert all(name.endswith("_FILE") for name in REQUIRED_SECRETS)


def test_api_keys_file_is_required():
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_") and k not in REQUIRED_SECRETS}
    env.update({name: "/dev/null" for name in REQUIRED_SECRETS if name != "API_KEYS_FILE"})
    result = subprocess.run(["docker", "compose", "--env-file", "/dev/null", "-f", "compose.yaml", "config"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "API_KEYS_FILE" in result.stderr


def test_env_example_names_every_variable_compose_reads():
    variables = set()
    for name in ("compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"):
        variables |= set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (REPO_ROOT / name).read_text()))
    documented = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", (REPO_ROOT / ".env.example").read_text(), re.M))
    assert variables <= documented, sorted(variables - documented)
