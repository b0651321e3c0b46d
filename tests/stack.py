"""Bring the real stack up with testcontainers, on the CPU path, for integration tests."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests
from testcontainers.compose import DockerCompose

REPO_ROOT = Path(__file__).resolve().parent.parent
CPU_COMPOSE_FILES = ["compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"]
KEY_OWNERS = ("alice", "bob", "burst", "streams", "loadtest")
# Tight limits so the tests can reach them quickly; everything else is the shipped default.
TEST_SETTINGS = {
    "GATEWAY_BIND_ADDRESS": "127.0.0.1",
    "RATE_LIMIT_PER_KEY": "20r/s",
    "RATE_LIMIT_BURST": "20",
    "RATE_LIMIT_RETRY_AFTER": "3",
    "MAX_CONCURRENT_REQUESTS_PER_KEY": "8",
    "MAX_REQUEST_BODY_SIZE": "64k",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    def __init__(self, workdir: Path, extra_settings: dict[str, str] | None = None,
                 services: list[str] | None = None, name: str = "llmstack-test"):
        self.workdir = workdir
        self.project = f"{name}-{uuid.uuid4().hex[:8]}"
        self.extra_settings = dict(extra_settings or {})
        self.port = free_port()
        self.keys: dict[str, str] = {}
        files = os.environ.get("LLM_STACK_COMPOSE_FILES", ":".join(CPU_COMPOSE_FILES)).split(":")
        # A developer may start part of the stack, e.g. LLM_STACK_SERVICES=nginx,vllm.
        services = services or [s for s in os.environ.get("LLM_STACK_SERVICES", "").split(",") if s] or None
        self.compose_files = files
        self.env_file = workdir / "stack.env"
        self.compose = DockerCompose(REPO_ROOT, compose_file_name=files, env_file=str(self.env_file),
                                     wait=True, build=False, pull=False, services=services)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def auth(self, owner: str = "alice") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[owner]}"}

    def prepare(self) -> None:
        secrets_dir = self.workdir / "secrets"
        secrets_dir.mkdir(mode=0o700)
        keys_file = secrets_dir / "api_keys"
        for owner in KEY_OWNERS:
            # The real helper script makes the keys, as a user would.
            result = subprocess.run(
                [sys.executable, str(REPO_ROOT / "scripts" / "apikeys.py"), "--file", str(keys_file),
                 "--no-reload", "create", owner], capture_output=True, text=True, check=True)
            self.keys[owner] = result.stdout.strip()
        hf_token = secrets_dir / "hf_token"
        hf_token.touch(mode=0o600)
        self.passwords = {name: secrets.token_urlsafe(16) for name in ("grafana", "prometheus", "locust")}
        grafana_password = secrets_dir / "grafana_admin_password"
        grafana_password.write_text(self.passwords["grafana"] + "\n")
        htpasswd_files = {}
        for name in ("prometheus", "locust"):
            hashed = subprocess.run(["openssl", "passwd", "-6", "-stdin"], input=self.passwords[name],
                                    capture_output=True, text=True, check=True).stdout.strip()
            htpasswd_files[name] = secrets_dir / f"{name}_htpasswd"
            htpasswd_files[name].write_text(f"admin:{hashed}\n")
        loadtest_key = secrets_dir / "loadtest_api_key"
        loadtest_key.write_text(self.keys["loadtest"] + "\n")
        for secret in (grafana_password, loadtest_key, *htpasswd_files.values()):
            secret.chmod(0o644)  # read by non-root users inside the containers; the folder is 700
        models = self.workdir / "models"
        models.mkdir()
        # The project name travels in the env file, so every compose command of this stack uses it.
        settings = {"COMPOSE_PROJECT_NAME": self.project, "API_KEYS_FILE": str(keys_file), "HF_TOKEN_FILE": str(hf_token),
                    "GRAFANA_ADMIN_PASSWORD_FILE": str(grafana_password),
                    "PROMETHEUS_HTPASSWD_FILE": str(htpasswd_files["prometheus"]),
                    "LOCUST_HTPASSWD_FILE": str(htpasswd_files["locust"]),
                    "LOADTEST_API_KEY_FILE": str(loadtest_key),
                    "MODELS_DIR": str(models), "GATEWAY_PORT": str(self.port), **TEST_SETTINGS,
                    **self.extra_settings}
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))

    def compose_command(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        command = [*self.compose.compose_command_property, *args]
        return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=check,
                              timeout=timeout, env=self.environment())

    def environment(self) -> dict[str, str]:
        return {**os.environ, "COMPOSE_PROJECT_NAME": self.project}

    def user_environment(self) -> dict[str, str]:
        """What a user's shell has after up.sh: the stack's settings and compose files, so plain
        `docker compose ...` (and scripts that call it) reach this stack."""
        settings = dict(line.split("=", 1) for line in self.env_file.read_text().splitlines() if "=" in line)
        return {**os.environ, **settings, "COMPOSE_FILE": ":".join(self.compose_files)}

    def start(self) -> None:
        self.prepare()
        self.compose.start()

    def stop(self) -> None:
        self.compose_command("down", "--volumes", "--timeout", "10", check=False, timeout=300)

    def exec(self, service: str, *command: str, timeout: float = 60) -> str:
        return self.compose_command("exec", "-T", service, *command, timeout=timeout).stdout

    def vllm_get(self, path: str) -> str:
        """GET a path on vLLM directly, from inside its container (its port is not published)."""
        script = ("import sys, urllib.request; "
                  f"sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8000{path}', timeout=10).read().decode())")
        return self.exec("vllm", "python3", "-c", script)

    def vllm_metric(self, name: str) -> float:
        """Sum of a vLLM metric's samples (all label sets)."""
        total, seen = 0.0, False
        for line in self.vllm_get("/metrics").splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        if not seen:
            raise KeyError(f"vLLM exports no metric {name}")
        return total

    def locust_swarm(self, user_classes: list[str], users: int, seconds: float) -> dict:
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
        form = [("user_count", str(users)), ("spawn_rate", str(users)), ("host", "http://nginx:8080"),
                ("shape_class", "Default"), *(("user_classes", name) for name in user_classes)]
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
