"""Reaching a running vLLM: through `docker compose` (the stack), or by URL and log file (a vLLM
run without Docker: a bare GPU host, a Kubernetes port-forward). Both give the same interface:
get(path), metrics(), logs(), python(code), container_env(), read_file(path).

Also what vLLM tells about itself: its startup log's figures, the served model and its config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from llmstack import REPO_ROOT, promtext
from llmstack.cli import StackError, UsageError
from llmstack.promtext import Sample

VLLM_PORT = 8000
REPLICA_SERVICE = re.compile(r"^vllm(-[0-9]+)?$")
GiB = 1024**3


# --- vLLM's startup log ----------------------------------------------------------------------------

_NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
STARTUP_PATTERNS = {
    # "GPU KV cache size: 183,202 tokens, Maximum concurrency for 4,096 tokens per request: 44.73x"
    "kv_cache_tokens": re.compile(r"KV cache size: " + _NUMBER + " tokens"),
    "kv_cache_device": re.compile(r"\] (\S+(?: \+ host)?) KV cache size:"),
    "max_concurrency": re.compile(r"Maximum concurrency for [0-9,]+ tokens per request: " + _NUMBER + "x"),
    "max_concurrency_tokens": re.compile(r"Maximum concurrency for " + _NUMBER + " tokens per request"),
    "model_loading_gib": re.compile(r"Model loading took " + _NUMBER + " GiB"),
    "model_loading_seconds": re.compile(r"Model loading took [0-9.]+ GiB(?: memory)? and " + _NUMBER + " s"),
    "available_kv_gib": re.compile(r"Available KV cache memory: " + _NUMBER + " GiB"),
    "cuda_graph_gib": re.compile(r"CUDA graph pool memory: " + _NUMBER + " GiB"),
    "graph_capture_gib": re.compile(r"Graph capturing finished in [0-9]+ secs, took " + _NUMBER + " GiB"),
    # CPU build: "Explicitly set (1.00/23.47) GiB for KV cache" / "Auto set (...) GiB for KV cache"
    "cpu_kv_gib": re.compile(r"(?:Explicitly|Auto) set \(" + _NUMBER + r"/[0-9.]+\) GiB for KV cache"),
    "cpu_total_gib": re.compile(r"(?:Explicitly|Auto) set \([0-9.]+/" + _NUMBER + r"\) GiB for KV cache"),
    "model_init_seconds": re.compile(r"Initializing model took " + _NUMBER + " s"),
    "num_blocks_override": re.compile(r"with num_gpu_blocks_override=" + _NUMBER),
    # The banner's "█  version 0.24.0" or "V1 LLM engine (v0.24.0)", not "FlashAttention version 3".
    "vllm_version": re.compile(r"(?:█\s+version |LLM engine \(v)([0-9]+\.[0-9][0-9a-z.+-]*)"),
}


def parse_startup_log(text: str) -> dict[str, float | str]:
    """The figures vLLM logs while it starts; the last start wins where it restarted."""
    facts: dict[str, float | str] = {}
    for line in text.splitlines():
        for key, pattern in STARTUP_PATTERNS.items():
            match = pattern.search(line)
            if match:
                raw = match.group(1)
                if key in ("kv_cache_device", "vllm_version"):
                    facts[key] = raw
                else:
                    facts[key] = float(raw.replace(",", ""))
    return facts


# --- A running stack, through docker compose -------------------------------------------------------


@dataclass
class ComposeStack:
    """The stack as `docker compose` sees it from the repo root: project and files come from the
    options, else from the environment and .env, exactly like a plain `docker compose` command."""

    project_name: str | None = None
    compose_files: list[str] = field(default_factory=list)
    env_file: str | None = None
    service: str = "vllm"

    def base_command(self) -> list[str]:
        command = ["docker", "compose"]
        if self.project_name:
            command += ["--project-name", self.project_name]
        for name in self.compose_files:
            command += ["--file", name]
        if self.env_file:
            command += ["--env-file", self.env_file]
        return command

    def run(self, *args: str, timeout: float = 120, stdin: str | None = None) -> str:
        command = [*self.base_command(), *args]
        try:
            result = subprocess.run(
                command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, input=stdin
            )
        except FileNotFoundError as err:
            raise StackError("docker is not installed or not on PATH") from err
        except subprocess.TimeoutExpired as err:
            raise StackError(f"`{' '.join(command)}` took more than {timeout:.0f} s") from err
        if result.returncode != 0:
            message = (result.stderr.strip().splitlines() or [f"exit {result.returncode}, no output"])[-1]
            raise StackError(f"`docker compose {' '.join(args[:2])}` failed: {message}")
        return result.stdout

    def replicas(self) -> list[str]:
        """The stack's vLLM replica services: vllm, vllm-2, ... (llmstack.replicas)."""
        names = self.run("config", "--services").split()
        return sorted((n for n in names if REPLICA_SERVICE.match(n)), key=lambda n: (len(n), n))

    def replica(self, service: str) -> ComposeStack:
        return dataclasses.replace(self, service=service)

    def replicas_total(self, name: str, replicas: list[str] | None = None) -> float:
        """A vLLM metric summed over every replica (all label sets): what vLLM as a whole counted."""
        total = 0.0
        for service in replicas or self.replicas() or [self.service]:
            value = promtext.total(self.replica(service).metrics(), name)
            if value is None:
                raise StackError(f"{service} exports no {name}")
            total += value
        return total

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--no-log-prefix", self.service, timeout=120)

    def python(self, code: str, timeout: float = 120) -> str:
        """Run Python inside the vLLM container (its port is not published)."""
        return self.run("exec", "-T", self.service, "python3", "-", timeout=timeout, stdin=code)

    def get(self, path: str, timeout: float = 30) -> str:
        code = (
            "import sys, urllib.request\n"
            f"sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:{VLLM_PORT}{path}', "
            f"timeout={timeout}).read().decode())\n"
        )
        return self.python(code, timeout=timeout + 30)

    def metrics(self) -> list[Sample]:
        return promtext.parse(self.get("/metrics"))

    def container_env(self) -> dict[str, str]:
        code = "import json, os; print(json.dumps(dict(os.environ)))"
        return json.loads(self.python(code))

    def read_file(self, path: str) -> str:
        code = f"import sys; sys.stdout.write(open({path!r}).read())"
        return self.python(code)


@dataclass
class HostVllm:
    """A vLLM run without Docker (a bare GPU host, a Kubernetes pod with a port-forward): read over
    its URL and from its log file; Python runs here, so the model folder must be readable here.
    Settings that compose passes as the container's environment (DTYPE, ...) come from ours."""

    url: str
    log_file: Path

    def logs(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError as err:
            raise StackError(f"cannot read vLLM's log {self.log_file}: {err.strerror}") from err

    def python(self, code: str, timeout: float = 120) -> str:
        try:
            result = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise StackError(f"a local Python step took more than {timeout:.0f} s") from err
        if result.returncode != 0:
            message = (result.stderr.strip().splitlines() or [f"exit {result.returncode}, no output"])[-1]
            raise StackError(f"a local Python step failed: {message}")
        return result.stdout

    def get(self, path: str, timeout: float = 30) -> str:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.read().decode()
        except (urllib.error.URLError, OSError) as err:
            raise StackError(f"cannot read {self.url + path}: {getattr(err, 'reason', err)}") from err

    def metrics(self) -> list[Sample]:
        return promtext.parse(self.get("/metrics"))

    def container_env(self) -> dict[str, str]:
        return dict(os.environ)

    def read_file(self, path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as err:
            raise StackError(f"cannot read {path}: {err.strerror}") from err


def stack_from_args(args) -> ComposeStack | HostVllm:
    """The vLLM that add_stack_arguments' options name: a compose stack, or one given by URL."""
    if args.vllm_url:
        if not args.vllm_log:
            raise UsageError("--vllm-url needs --vllm-log (vLLM's startup log, for its memory lines)")
        return HostVllm(args.vllm_url.rstrip("/"), Path(args.vllm_log))
    files = [f for item in (args.compose_file or []) for f in item.split(":") if f]
    return ComposeStack(project_name=args.project_name, compose_files=files, env_file=args.env_file)


def add_stack_arguments(parser) -> None:
    group = parser.add_argument_group("stack (read through docker compose, from the repo root)")
    group.add_argument(
        "--project-name",
        "-p",
        default=os.environ.get("COMPOSE_PROJECT_NAME"),
        help="compose project name (default: COMPOSE_PROJECT_NAME, else .env / the compose files)",
    )
    group.add_argument(
        "--compose-file",
        "-f",
        action="append",
        help="compose file(s), repeatable or ':'-separated (default: COMPOSE_FILE from the environment or .env)",
    )
    group.add_argument("--env-file", help="compose env file (default: .env in the repo root)")
    host = parser.add_argument_group("a vLLM run without Docker (instead of the compose options)")
    host.add_argument("--vllm-url", help="vLLM's own URL, e.g. http://127.0.0.1:8000 (not the gateway)")
    host.add_argument("--vllm-log", help="the file vLLM's output went to since its start")


def cache_config_labels(samples: list[Sample]) -> dict[str, str]:
    labels = promtext.labels_of(samples, "vllm:cache_config_info")
    if labels is None:
        raise StackError("vLLM exports no vllm:cache_config_info metric")
    return labels


def label_number(labels: dict[str, str], key: str) -> float | None:
    value = labels.get(key)
    if value in (None, "", "None"):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def served_model(stack: ComposeStack | HostVllm) -> dict:
    """The served model's id, root (path or repo) and max_model_len from /v1/models."""
    data = json.loads(stack.get("/v1/models"))
    models = data.get("data") or []
    if not models:
        raise StackError("vLLM serves no model")
    return models[0]


def model_config_from_stack(stack: ComposeStack | HostVllm, root: str) -> dict:
    """config.json of the served model, read inside the container (a folder, or the HF cache)."""
    code = (
        "import json, os, sys\n"
        f"root = {root!r}\n"
        "path = os.path.join(root, 'config.json')\n"
        "if not os.path.isfile(path):\n"
        "    from huggingface_hub import hf_hub_download\n"
        "    path = hf_hub_download(root, 'config.json')\n"
        "sys.stdout.write(open(path).read())\n"
    )
    try:
        return json.loads(stack.python(code))
    except json.JSONDecodeError as err:
        raise StackError(f"the served model's config.json ({root}) is not JSON") from err


def parameter_count_in_stack(stack: ComposeStack | HostVllm, root: str) -> int | None:
    """Exact parameter count: the model built on PyTorch's meta device (no memory) by transformers."""
    code = (
        "import json, os, sys, warnings\n"
        "warnings.filterwarnings('ignore')\n"
        "import torch\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        f"config = AutoConfig.from_pretrained({root!r}, trust_remote_code=False)\n"
        "with torch.device('meta'):\n"
        "    model = AutoModelForCausalLM.from_config(config)\n"
        "print(sum(p.numel() for p in model.parameters()))\n"
    )
    try:
        return int(stack.python(code, timeout=180).strip().splitlines()[-1])
    except (StackError, ValueError, IndexError):
        return None
