"""The vLLM replicas' override (llmstack.replicas): rendered by compose itself on top of each path's
files, every replica is the one definition in compose/stack.yaml (with the path's overrides) and
differs only in what is its own; the router gets their addresses and waits for them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from llmstack import REPO_ROOT, replicas
from llmstack.cli import UsageError

PATHS = {
    "gpu": ["compose.yaml"],
    "airgap": ["compose.yaml", "compose.airgap.yaml"],
    "cpu": ["compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"],
}
# What a replica sets for itself; everything else must equal the first replica's.
OWN_KEYS = {"build", "deploy"}
OWN_ENVIRONMENT = {"VLLM_CPU_OMP_THREADS_BIND"}


def render(files: list[str], override: Path, settings: dict[str, str] | None = None) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    command = ["docker", "compose", "--env-file", os.devnull]
    for name in [*files, str(override)]:
        command += ["-f", name]
    result = subprocess.run(
        [*command, "config", "--format", "json"],
        cwd=REPO_ROOT,
        env={**environment, **(settings or {})},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    services: dict = json.loads(result.stdout)["services"]
    return services


def write(tmp_path: Path, path: str, settings: dict[str, str], cores: int = 2) -> tuple[Path, list]:
    output = tmp_path / "compose.replicas.yaml"
    written = replicas.write(settings, [REPO_ROOT / name for name in PATHS[path]], output, cores=cores)
    return output, written


def shared(service: dict) -> dict:
    environment = {k: v for k, v in service["environment"].items() if k not in OWN_ENVIRONMENT}
    return {**{k: v for k, v in service.items() if k not in OWN_KEYS}, "environment": environment}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_replica_is_the_one_definition(tmp_path, path):
    settings = {"VLLM_GPUS": "0,1,2"} if path != "cpu" else {"VLLM_CPU_REPLICAS": "3"}
    output, written = write(tmp_path, path, settings)
    services = render(PATHS[path], output)
    names = ["vllm", "vllm-2", "vllm-3"]
    assert [r.name for r in written] == names
    for name in names[1:]:
        assert shared(services[name]) == shared(services["vllm"]), name
        assert "build" not in services[name]
    for name in names:
        assert "vllm-replicas" in services[name]["networks"]["backend"]["aliases"]
    router = services["router"]
    assert router["environment"]["ROUTER_WORKER_URLS"] == " ".join(f"http://{n}:8000" for n in names)
    assert router["depends_on"] == {n: {"condition": "service_healthy", "required": True} for n in names}
    # The router is not restarted with a replica: that would cut the streams on the others.
    assert not any(dependency.get("restart") for dependency in router["depends_on"].values())
    assert services["nginx"]["depends_on"]["router"]["restart"] is True
    assert "vllm" not in services["nginx"]["depends_on"]


@pytest.mark.parametrize("path", ["gpu", "airgap"])
def test_gpu_replicas_are_pinned_one_gpu_each(tmp_path, path):
    output, _ = write(tmp_path, path, {"VLLM_GPUS": "0,3"})
    services = render(PATHS[path], output)
    for name, gpu in (("vllm", "0"), ("vllm-2", "3")):
        assert services[name]["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}
        ], name


def test_no_gpu_list_keeps_one_replica_with_gpu_count(tmp_path):
    output, written = write(tmp_path, "gpu", {})
    services = render(PATHS["gpu"], output, {"GPU_COUNT": "2"})
    assert [r.name for r in written] == ["vllm"]
    assert not [name for name in services if name.startswith("vllm-")]
    assert services["vllm"]["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 2, "capabilities": ["gpu"]}
    ]
    assert services["router"]["environment"]["ROUTER_WORKER_URLS"] == "http://vllm:8000"


def test_cpu_replicas_bind_their_own_cores_and_reserve_no_gpu(tmp_path):
    output, _ = write(tmp_path, "cpu", {})
    services = render(PATHS["cpu"], output)
    assert [n for n in services if n.startswith("vllm")] == ["vllm", "vllm-2"]
    assert services["vllm"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert services["vllm-2"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "deploy" not in services["vllm"] and "deploy" not in services["vllm-2"]
    assert services["vllm-2"]["image"] == services["vllm"]["image"] == "llm-stack/vllm:cpu"


def test_settings_still_reach_every_replica(tmp_path):
    """Nothing is interpolated when the file is written: .env decides at `docker compose up`."""
    output, _ = write(tmp_path, "cpu", {})
    services = render(PATHS["cpu"], output, {"MAX_MODEL_LEN": "1024", "VLLM_VERSION": "9.9.9"})
    assert {services[n]["environment"]["MAX_MODEL_LEN"] for n in ("vllm", "vllm-2")} == {"1024"}
    gpu_output, _ = write(tmp_path, "gpu", {"VLLM_GPUS": "0,1"})
    gpu = render(PATHS["gpu"], gpu_output, {"VLLM_VERSION": "9.9.9"})
    assert gpu["vllm-2"]["image"] == gpu["vllm"]["image"] == "vllm/vllm-openai:v9.9.9"
    assert render(PATHS["gpu"], gpu_output)["vllm-2"]["image"] == render(PATHS["gpu"], gpu_output)["vllm"]["image"]


@pytest.mark.parametrize(
    ("replicas_count", "cores", "binds"),
    [
        (2, 2, ["0", "1"]),
        (2, 8, ["0-3", "4-7"]),
        (3, 2, ["0", "1", "0"]),
        (1, 4, ["0-3"]),
        (3, 7, ["0-1", "2-3", "4-5"]),
    ],
)
def test_core_binds(replicas_count, cores, binds):
    assert replicas.core_binds(replicas_count, cores) == binds


@pytest.mark.parametrize(
    "settings",
    [{"VLLM_GPUS": "0,0"}, {"VLLM_GPUS": "a"}, {"VLLM_GPUS": ",".join(str(i) for i in range(9))}],
)
def test_bad_gpu_lists_are_usage_errors(settings):
    with pytest.raises(UsageError):
        replicas.plan(settings, cpu_path=False, cores=2)


@pytest.mark.parametrize("count", ["0", "9", "two"])
def test_bad_cpu_replica_counts_are_usage_errors(count):
    with pytest.raises(UsageError):
        replicas.plan({"VLLM_CPU_REPLICAS": count}, cpu_path=True, cores=2)


def test_metrics_of_every_replica_behind_one_name_are_summed(monkeypatch):
    """The load tests read vLLM's counters at http://vllm-replicas:8000/metrics: every address the
    alias resolves to is read, and the counts add up."""
    import http.server
    import socket
    import threading

    from llmstack import promtext

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"# TYPE vllm:request_success counter\nvllm:request_success_total {self.server.server_port % 7}\n"
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    seen = []

    def two_addresses(host, port, *args, **kwargs):
        seen.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("127.0.0.1", "127.0.0.2")]

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    try:
        text = promtext.fetch(f"http://vllm-replicas:{port}/metrics", timeout=5)
    finally:
        server.shutdown()
    assert seen[0] == "vllm-replicas"
    assert promtext.total(promtext.parse(text), "vllm:request_success_total") == 2 * (port % 7)


@pytest.mark.parametrize(
    "count, reserved, binds",
    [("2", "", ["0-1", "2-3"]), ("1", "1", ["0-2"]), ("2", "2", ["0", "1"]), ("3", "2", ["0", "1", "0"])],
)
def test_reserved_cores_are_kept_out_of_every_replicas_binding(count, reserved, binds):
    settings = {"VLLM_CPU_REPLICAS": count, "VLLM_CPU_RESERVED_CORES": reserved}
    assert [r.cpu_bind for r in replicas.plan(settings, cpu_path=True, cores=4)] == binds


@pytest.mark.parametrize("reserved", ["2", "-1", "one"])
def test_reserving_every_core_or_a_non_number_is_a_usage_error(reserved):
    with pytest.raises(UsageError, match="VLLM_CPU_RESERVED_CORES"):
        replicas.plan({"VLLM_CPU_RESERVED_CORES": reserved}, cpu_path=True, cores=2)
