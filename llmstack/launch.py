"""The stack's vLLM replicas, router, nginx gateway and gateway exporter on a host without Docker.

Runs the very commands and config files that the compose files run, so numbers taken here are the
stack's: vLLM's command line and its defaults are read from compose.yaml and what it includes
(plus any override files; your environment and .env win, as with compose); nginx gets
nginx/nginx.conf, nginx/snippets and the templates rendered by the air-gapped image's own
entrypoint script; the gateway exporter is images/gateway-exporter/gateway_exporter.py; the router
runs the router service's command (vllm-router on PATH). Only addresses differ: the service names
(vllm, router, gateway-exporter, nginx) are mapped to 127.0.0.1 in /etc/hosts; the router listens on
8000 and the replicas on 8001, 8002, ... (VLLM_GPUS pins replica i to the i-th listed GPU; without it
they share the visible GPUs: split GPU_MEMORY_UTILIZATION). With --no-router one replica listens on
8000 itself and nginx reaches it directly (the gateway alone, as before scale-out). Secrets go to
/run/secrets as compose mounts them, made by the same set-up as scripts/up.sh's (llmstack.secrets).
Needs root (for /etc/hosts, /etc/nginx, /run/secrets) on a throwaway machine.

  python3 scripts/bare_host.py start --model /path/to/model [--replicas 2] [--nginx-root DIR] [-f ...]
  python3 scripts/bare_host.py router --policy round_robin [--replicas 1]   # restart the router only
  python3 scripts/bare_host.py stop

The processes outlive this command (their own sessions); logs and pids are in --workdir.
nginx comes from --nginx-root, a folder where Debian's nginx and gettext-base packages were
unpacked (`dpkg -x`), or from PATH. The load generator's gateway key is
/run/secrets/loadtest_api_key. docs/gpu-results.md shows the whole procedure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from llmstack import REPO_ROOT, composefile, replicas
from llmstack.cli import StackError, UsageError, main_exit, parser_from_doc, progress
from llmstack.secrets import ensure_secrets, read_env_file

PROG = "bare_host.py"
SERVICE_NAMES = ("vllm", "router", "gateway-exporter", "nginx")
ROUTER_PORT = 8000
ROUTER_METRICS_PORT = 29000
FIRST_REPLICA_PORT = 8001
PORT_FLAG = re.compile(r"--port \d+")
# vLLM's KV-cache events (--kv-events): replica i publishes on this port + i, for the router's kv_aware.
FIRST_KV_EVENTS_PORT = 5557
HOSTS_MARK = "# llm-stack bare host"
DEFAULT_WORKDIR = "/tmp/llm-stack"
SECRETS_DIR = Path("/run/secrets")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("action", choices=("start", "router", "stop"))
    parser.add_argument("--model", help="model folder (or Hugging Face id) served as MODEL")
    parser.add_argument("--replicas", type=int, default=1, help="vLLM replicas behind the router (default: 1)")
    parser.add_argument("--no-router", action="store_true", help="one replica on 8000, nginx straight to it")
    parser.add_argument("--policy", help="the router's policy (default: ROUTER_POLICY of the compose files)")
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="replicas publish KV-cache events over ZMQ (needed by the router's kv_aware policy)",
    )
    parser.add_argument(
        "-f",
        "--compose-file",
        action="append",
        help="compose file(s) whose vllm/nginx settings apply, in order (default: compose.yaml)",
    )
    parser.add_argument("--nginx-root", help="folder where nginx's .deb files were unpacked (default: nginx on PATH)")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR, help="logs and pids (default: %(default)s)")
    parser.add_argument("--vllm-timeout", type=float, default=900, help="seconds to wait for vLLM's /health")
    args = parser.parse_args(argv)
    args.compose_file = [Path(f) for f in (args.compose_file or ["compose.yaml"])]
    if args.action == "start" and not args.model:
        raise UsageError("start needs --model")
    if not 1 <= args.replicas <= replicas.MAX_REPLICAS:
        raise UsageError(f"--replicas {args.replicas}: give a number from 1 to {replicas.MAX_REPLICAS}")
    if args.no_router and args.replicas != 1:
        raise UsageError("--no-router serves one replica; drop --replicas")
    return args


# --- the processes ------------------------------------------------------------------------------


def spawn(name: str, command: list[str], workdir: Path, env: Mapping[str, str]) -> subprocess.Popen:
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps writing after we return
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=dict(env), cwd=REPO_ROOT, start_new_session=True
    )
    (workdir / f"{name}.pid").write_text(str(process.pid))
    return process


def wait_for(url: str, timeout: float, what: str, log: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if process.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines()
            # The root cause, not the last frames of a traceback.
            errors = [line for line in lines if "Error:" in line][-3:] or lines[-10:]
            raise StackError(f"{what} exited before it was healthy ({log}):\n" + "\n".join(errors))
        time.sleep(2)
    raise StackError(f"{what} not healthy at {url} after {timeout:.0f} s (log: {log})")


def health_url(spec: dict, service: str) -> str:
    url = composefile.health_url(spec["healthcheck"])
    if not url:
        raise StackError(f"the compose files give the {service} service no HTTP healthcheck")
    return url


def map_service_names() -> None:
    hosts = Path("/etc/hosts")
    text = hosts.read_text()
    if HOSTS_MARK not in text:
        hosts.write_text(text.rstrip("\n") + f"\n127.0.0.1 {' '.join(SERVICE_NAMES)} {HOSTS_MARK}\n")


def nginx_tools(nginx_root: str | None) -> tuple[str, dict[str, str]]:
    """The nginx binary and the environment that finds its libraries and envsubst."""
    env = dict(os.environ)
    if nginx_root:
        root = Path(nginx_root)
        binary = root / "usr/sbin/nginx"
        libs = [str(root / d) for d in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu") if (root / d).is_dir()]
        env["LD_LIBRARY_PATH"] = ":".join([*libs, env.get("LD_LIBRARY_PATH", "")]).strip(":")
        env["PATH"] = f"{root / 'usr/bin'}:{env['PATH']}"
        if not binary.is_file():
            raise StackError(f"no usr/sbin/nginx under {root} (unpack Debian's nginx .deb files there)")
        return str(binary), env
    found = shutil.which("nginx")
    if not found:
        raise StackError("nginx is not on PATH; pass --nginx-root")
    return found, env


def prepare_nginx(args: argparse.Namespace, settings: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    binary, env = nginx_tools(args.nginx_root)
    if not shutil.which("envsubst", path=env["PATH"]):
        raise StackError("envsubst is not on PATH (Debian's gettext-base package)")
    nginx_env = composefile.service(args.compose_file, "nginx", settings)["environment"]
    etc = Path("/etc/nginx")
    etc.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "nginx/nginx.conf", etc / "nginx.conf")
    shutil.copytree(REPO_ROOT / "nginx/snippets", etc / "snippets", dirs_exist_ok=True)
    shutil.copytree(REPO_ROOT / "nginx/njs", etc / "njs", dirs_exist_ok=True)
    if args.nginx_root:
        # nginx.conf loads modules/ngx_http_js_module.so from nginx's compiled-in prefix.
        modules = Path("/usr/share/nginx/modules")
        if not modules.exists():
            modules.parent.mkdir(parents=True, exist_ok=True)
            modules.symlink_to(Path(args.nginx_root).resolve() / "usr/lib/nginx/modules")
    if not (etc / "mime.types").exists():
        source = Path(args.nginx_root or "/") / "etc/nginx/mime.types"
        if not source.exists():
            raise StackError(f"no mime.types at {source}")
        shutil.copy(source, etc / "mime.types")
    shutil.rmtree(etc / "conf.d", ignore_errors=True)
    render_env = (
        env
        | nginx_env
        | {
            "NGINX_ENVSUBST_TEMPLATE_DIR": str(REPO_ROOT / "nginx/templates"),
            "NGINX_ENVSUBST_OUTPUT_DIR": str(etc / "conf.d"),
        }
    )
    subprocess.run(
        ["sh", str(REPO_ROOT / "images/nginx/render-templates-and-start.sh"), "true"], env=render_env, check=True
    )
    for folder in ("/var/lib/nginx/body", "/var/lib/nginx/proxy", "/var/log/nginx"):
        Path(folder).mkdir(parents=True, exist_ok=True)
    return binary, env


def make_secrets(args: argparse.Namespace, settings: Mapping[str, str]) -> Path:
    """Every secret the compose files declare, where compose would mount it, by the one set-up."""
    paths = {name: SECRETS_DIR / name for name in composefile.secret_names(args.compose_file, settings)}
    for line in ensure_secrets(paths).messages(paths):
        print(line, flush=True)
    return paths["loadtest_api_key"]


def with_port(url: str, port: int) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts._replace(netloc=f"{parts.hostname}:{port}").geturl()


def read_settings(args: argparse.Namespace) -> dict[str, str]:
    # As compose: the environment wins over .env; MODEL from the command line over both.
    settings = read_env_file(REPO_ROOT / ".env") | dict(os.environ)
    return settings | {"MODEL": args.model} if args.model else settings


def replica_urls(count: int) -> list[str]:
    return [f"http://127.0.0.1:{FIRST_REPLICA_PORT + i}" for i in range(count)]


def kv_events_config(index: int) -> str:
    endpoint = f"tcp://*:{FIRST_KV_EVENTS_PORT + index}"
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})


def kv_aware_router_args(count: int, model: str) -> str:
    """The router's kv_aware flags for replicas started with --kv-events: each one's event source,
    and the model they share (0.1.17 refuses static sources without it)."""
    sources = [
        f"--kv-event-source {url}=tcp://127.0.0.1:{FIRST_KV_EVENTS_PORT + i}"
        for i, url in enumerate(replica_urls(count))
    ]
    return " ".join([*sources, "--kv-event-block-size 16", f"--kv-event-model {model}"])


def start_replicas(args: argparse.Namespace, settings: Mapping[str, str], workdir: Path) -> None:
    spec = composefile.service(args.compose_file, "vllm", settings)
    if not spec["command"]:
        raise StackError("the compose files give the vllm service no command")
    script = spec["command"][0].replace("$$", "$")
    if not PORT_FLAG.search(script):
        raise StackError("the vllm service's command has no --port to move the replicas to their own ports")
    gpus = [g.strip() for g in (settings.get("VLLM_GPUS") or "").split(",") if g.strip()]
    if gpus and len(gpus) < args.replicas:
        raise UsageError(f"VLLM_GPUS lists {len(gpus)} GPUs for {args.replicas} replicas")
    shown = " ".join(f"{k}={v}" for k, v in spec["environment"].items() if k.isupper() and "TOKEN" not in k)
    progress(f"vLLM: {shown}")
    ports = [ROUTER_PORT] if args.no_router else [FIRST_REPLICA_PORT + i for i in range(args.replicas)]
    started = time.monotonic()
    pending = []
    for index, port in enumerate(ports):
        name = replicas.replica_name(index)
        env = os.environ | spec["environment"] | ({"CUDA_VISIBLE_DEVICES": gpus[index]} if gpus else {})
        command = PORT_FLAG.sub(f"--port {port}", script)
        if args.kv_events:
            command += f" --kv-events-config '{kv_events_config(index)}'"
        process = spawn(name, ["/bin/sh", "-c", command], workdir, env)
        pending.append((name, port, process))
        if not gpus:
            # Replicas sharing a GPU start one at a time: vLLM sizes its KV cache from the memory
            # free when it starts, and two profiling at once would each count the other's as taken.
            wait_replica(spec, name, port, process, args.vllm_timeout, workdir, started)
    for name, port, process in pending if gpus else []:
        wait_replica(spec, name, port, process, args.vllm_timeout, workdir, started)


def wait_replica(
    spec: dict, name: str, port: int, process: subprocess.Popen, timeout: float, workdir: Path, started: float
) -> None:
    wait_for(with_port(health_url(spec, "vllm"), port), timeout, f"vLLM ({name})", workdir / f"{name}.log", process)
    progress(f"{name} healthy on port {port} after {time.monotonic() - started:.0f} s")


def start_router(
    args: argparse.Namespace,
    settings: Mapping[str, str],
    workdir: Path,
    name: str = "router",
    port: int = ROUTER_PORT,
    metrics_port: int = ROUTER_METRICS_PORT,
) -> str:
    """The router service's command over the replicas; another name and ports run a second one
    beside it (a benchmark comparing policies side by side). Returns its URL."""
    spec = composefile.service(args.compose_file, "router", settings)
    if not shutil.which("vllm-router"):
        raise StackError("vllm-router is not on PATH (pip install vllm-router, version in versions.env)")
    env = os.environ | spec["environment"] | {"ROUTER_WORKER_URLS": " ".join(replica_urls(args.replicas))}
    if args.policy:
        env["ROUTER_POLICY"] = args.policy
    if env["ROUTER_POLICY"] == "kv_aware":
        model = settings.get("SERVED_MODEL_NAME") or composefile.service(args.compose_file, "vllm", settings)[
            "environment"
        ].get("SERVED_MODEL_NAME", "")
        extra = kv_aware_router_args(args.replicas, model)
        env["ROUTER_EXTRA_ARGS"] = f"{env.get('ROUTER_EXTRA_ARGS', '')} {extra}".strip()
    command = spec["command"][0].replace("$$", "$")
    command = PORT_FLAG.sub(f"--port {port}", command).replace(
        f"--prometheus-port {ROUTER_METRICS_PORT}", f"--prometheus-port {metrics_port}"
    )
    process = spawn(name, ["/bin/sh", "-c", command], workdir, env)
    wait_for(with_port(health_url(spec, "router"), port), 120, name, workdir / f"{name}.log", process)
    progress(f"{name}: {env['ROUTER_POLICY']} over {env['ROUTER_WORKER_URLS']} on port {port}")
    return f"http://127.0.0.1:{port}"


def stop_process(workdir: Path, name: str, timeout: float = 30) -> None:
    pid_file = workdir / f"{name}.pid"
    if not pid_file.exists():
        return
    pgid = int(pid_file.read_text())
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.2)
    pid_file.unlink()


def restart_router(args: argparse.Namespace) -> int:
    """The router alone, with another policy or fewer replicas; vLLM and nginx keep running."""
    workdir = Path(args.workdir)
    stop_process(workdir, "router")
    start_router(args, read_settings(args), workdir)
    return 0


def start(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    settings = read_settings(args)
    map_service_names()
    key_file = make_secrets(args, settings)
    nginx, nginx_env = prepare_nginx(args, settings)

    exporter_spec = composefile.service(args.compose_file, "gateway-exporter", settings)
    nginx_spec = composefile.service(args.compose_file, "nginx", settings)
    exporter = spawn(
        "gateway-exporter",
        [sys.executable, str(REPO_ROOT / "images/gateway-exporter/gateway_exporter.py")],
        workdir,
        os.environ,
    )
    wait_for(
        health_url(exporter_spec, "gateway-exporter"),
        30,
        "the gateway exporter",
        workdir / "gateway-exporter.log",
        exporter,
    )
    start_replicas(args, settings, workdir)
    if not args.no_router:
        start_router(args, settings, workdir)
    check = subprocess.run([nginx, "-t", "-q"], env=nginx_env, capture_output=True, text=True)
    if check.returncode != 0:
        raise StackError(f"nginx -t: {check.stderr.strip()}")
    nginx_process = spawn("nginx", [nginx, "-g", "daemon off;"], workdir, nginx_env)
    wait_for(health_url(nginx_spec, "nginx"), 30, "nginx", workdir / "nginx.log", nginx_process)
    backends = "vLLM" if args.no_router else f"router, replicas {', '.join(replica_urls(args.replicas))}"
    print(
        f"gateway http://127.0.0.1:8080 (key in {key_file}), {backends} on http://127.0.0.1:{ROUTER_PORT}, "
        f"logs in {workdir}/",
        flush=True,
    )
    return 0


def stop(args: argparse.Namespace) -> int:
    for pid_file in Path(args.workdir).glob("*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
        pid_file.unlink()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        actions = {"start": start, "router": restart_router, "stop": stop}
        return actions[args.action](args)
    except (OSError, subprocess.CalledProcessError) as err:
        raise StackError(str(err)) from err


if __name__ == "__main__":
    main_exit(PROG, main)
