"""Bring the real stack up with testcontainers, on the CPU path, for integration tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests
from testcontainers.compose import DockerCompose

from llmstack import REPO_ROOT, apikeys, replicas, secrets
from llmstack.vllm import ComposeStack

CPU_COMPOSE_FILES = ["compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"]
KEY_OWNERS = ("alice", "bob", "burst", "streams", "capped", "inflight", "budget", "daily", "neighbour", "soak")
# Keys with their own limits beside them in the keys file (tests/integration/test_gateway_policy.py).
KEY_SETTINGS = {
    "capped": {"n": 2, "max_tokens": 64, "prompts": 3, "prompt_bytes": 2000},
    "inflight": {"sequences": 4},
    "budget": {"tpm": 60},
    "daily": {"tpd": 40},
}
# Tight limits so the tests can reach them quickly; everything else is the shipped default.
TEST_SETTINGS = {
    "GATEWAY_BIND_ADDRESS": "127.0.0.1",
    "RATE_LIMIT_PER_KEY": "20r/s",
    "RATE_LIMIT_BURST": "20",
    "RATE_LIMIT_RETRY_AFTER": "3",
    "MAX_CONCURRENT_REQUESTS_PER_KEY": "8",
    "MAX_REQUEST_BODY_SIZE": "64k",
    "RATE_LIMIT_WITHOUT_KEY": "5r/s",
    "RATE_LIMIT_WITHOUT_KEY_BURST": "10",
    "CORS_ALLOWED_ORIGINS": "https://app.example.test",
    # Short, so tests/integration/test_faults.py's frozen vLLM is found out in seconds.
    "UPSTREAM_READ_TIMEOUT": "20s",
    "UPSTREAM_STREAM_IDLE_TIMEOUT": "8s",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    def __init__(
        self,
        workdir: Path,
        extra_settings: dict[str, str] | None = None,
        services: list[str] | None = None,
        name: str = "llmstack-test",
    ):
        self.workdir = workdir
        self.project = f"{name}-{uuid.uuid4().hex[:8]}"
        self.extra_settings = dict(extra_settings or {})
        self.port = free_port()
        self.https_port = free_port()
        self.keys: dict[str, str] = {}
        files = os.environ.get("LLM_STACK_COMPOSE_FILES", ":".join(CPU_COMPOSE_FILES)).split(":")
        # The vLLM replicas beyond the first and the router's list of them (llmstack.replicas), written
        # by prepare(): two replicas on the CPU path unless extra_settings says otherwise.
        self.replicas_file = workdir / "compose.replicas.yaml"
        files = [*files, str(self.replicas_file)]
        self.replicas: list[str] = []
        # A developer may start part of the stack, e.g. LLM_STACK_SERVICES=nginx,vllm.
        services = services or [s for s in os.environ.get("LLM_STACK_SERVICES", "").split(",") if s] or None
        self.compose_files = files
        self.env_file = workdir / "stack.env"
        self.compose = DockerCompose(
            REPO_ROOT,
            compose_file_name=files,
            env_file=str(self.env_file),
            wait=True,
            build=False,
            pull=False,
            services=services,
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def auth(self, owner: str = "alice") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[owner]}"}

    def prepare(self) -> None:
        """The secrets as scripts/up.sh makes them (llmstack.secrets), plus a key per test owner."""
        secrets_dir = self.workdir / "secrets"
        settings = {secret.setting: str(secrets_dir / secret.name) for secret in secrets.compose_secrets()}
        paths = secrets.secret_paths(settings)
        created = secrets.ensure_secrets(paths)
        assert created.loadtest_key and created.passwords is not None
        self.keys = {owner: apikeys.create(paths["api_keys"], owner, KEY_SETTINGS.get(owner)) for owner in KEY_OWNERS}
        self.keys["loadtest"] = created.loadtest_key
        self.passwords = {name.split("_")[0]: password for name, password in created.passwords.items()}
        models = self.workdir / "models"
        models.mkdir()
        # The project name travels in the env file, so every compose command of this stack uses it.
        settings |= {
            "COMPOSE_PROJECT_NAME": self.project,
            "MODELS_DIR": str(models),
            "GATEWAY_PORT": str(self.port),
            "GATEWAY_HTTPS_PORT": str(self.https_port),
            **TEST_SETTINGS,
            **self.extra_settings,
        }
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        written = replicas.write(settings, [REPO_ROOT / name for name in self.compose_files[:-1]], self.replicas_file)
        self.replicas = [replica.name for replica in written]

    def compose_command(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        command = [*self.compose.compose_command_property, *args]
        return subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, check=check, timeout=timeout, env=self.environment()
        )

    def environment(self) -> dict[str, str]:
        return {**os.environ, "COMPOSE_PROJECT_NAME": self.project}

    def user_environment(self) -> dict[str, str]:
        """What a user's shell has after up.sh: the stack's settings and compose files, so plain
        `docker compose ...` (and scripts that call it) reach this stack."""
        settings = dict(line.split("=", 1) for line in self.env_file.read_text().splitlines() if "=" in line)
        return {**os.environ, **settings, "COMPOSE_FILE": ":".join(self.compose_files)}

    def apikeys(self, *args: str) -> subprocess.CompletedProcess:
        """scripts/apikeys.py on this stack's keys file, as a user runs it after up.sh."""
        keys_file = self.workdir / "secrets" / "api_keys"
        return subprocess.run(
            [sys.executable, str(REPO_ROOT / "scripts" / "apikeys.py"), "--file", str(keys_file), *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=self.user_environment(),
        )

    def start(self) -> None:
        self.prepare()
        self.compose.start()

    def stop(self) -> None:
        self.compose_command("down", "--volumes", "--timeout", "10", check=False, timeout=300)

    def exec(self, service: str, *command: str, timeout: float = 60) -> str:
        return self.compose_command("exec", "-T", service, *command, timeout=timeout).stdout

    @property
    def vllm(self) -> ComposeStack:
        """The first vLLM replica, reached as the lab scripts reach it (llmstack.vllm)."""
        return self.replica("vllm")

    def replica(self, service: str) -> ComposeStack:
        """One vLLM replica's own server, from inside its container (its port is not published)."""
        return ComposeStack(
            project_name=self.project, compose_files=self.compose_files, env_file=str(self.env_file), service=service
        )

    def vllm_get(self, path: str) -> str:
        """GET a path on the first vLLM replica directly."""
        return self.vllm.get(path)

    def replica_metric(self, service: str, name: str) -> float:
        """Sum of one replica's samples of a vLLM metric (all label sets)."""
        return self.vllm.replicas_total(name, [service])

    def vllm_metric(self, name: str) -> float:
        """Sum of a vLLM metric's samples over every replica: what vLLM as a whole counted."""
        return self.vllm.replicas_total(name, self.replicas)

    def locust_swarm(
        self,
        user_classes: list[str],
        users: int,
        seconds: float,
        host: str = "http://nginx:8080",
        shape_class: str = "Default",
    ) -> dict:
        """A load test started and stopped in Locust's web UI, through nginx with its login, as a
        person would; returns the web UI's statistics taken just before the stop."""
        auth = ("admin", self.passwords["locust"])

        def wait_until_idle() -> None:
            # A stop takes effect on the workers a moment later; a new run must not start before.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                state = requests.get(self.url("/locust/stats/requests"), auth=auth, timeout=30).json()["state"]
                if state in ("ready", "stopped"):
                    return
                time.sleep(0.5)
            raise AssertionError(f"Locust still '{state}' a minute after the stop")

        wait_until_idle()
        form = [
            ("user_count", str(users)),
            ("spawn_rate", str(users)),
            ("host", host),
            ("shape_class", shape_class),
            *(("user_classes", name) for name in user_classes),
        ]
        started = requests.post(self.url("/locust/swarm"), data=form, auth=auth, timeout=30)
        started.raise_for_status()
        assert started.json()["success"], started.text
        try:
            time.sleep(seconds)
            stats = requests.get(self.url("/locust/stats/requests"), auth=auth, timeout=30).json()
        finally:
            requests.post(self.url("/locust/stop"), auth=auth, timeout=30).raise_for_status()
        wait_until_idle()
        return stats

    def nginx_access_log(self) -> list[dict]:
        lines = self.compose_command("logs", "--no-color", "--no-log-prefix", "nginx").stdout.splitlines()
        entries = []
        for line in lines:
            line = line.strip()
            if line.startswith("{"):
                entries.append(json.loads(line))
        return entries

    def diagnostics(self) -> str:
        ps = self.compose_command("ps", "-a", check=False).stdout
        logs = self.compose_command("logs", "--no-color", "--timestamps", check=False, timeout=300)
        return f"== docker compose ps\n{ps}\n== docker compose logs\n{logs.stdout}{logs.stderr}"
