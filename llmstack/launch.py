"""The stack's vLLM, nginx gateway and gateway exporter on a host without Docker, for measurements.

Runs the very commands and config files that the compose files run, so numbers taken here are the
stack's: vLLM's command line and its defaults are read from compose.yaml and what it includes
(plus any override files; your environment and .env win, as with compose); nginx gets
nginx/nginx.conf, nginx/snippets and the templates rendered by the air-gapped image's own
entrypoint script; the gateway exporter is images/gateway-exporter/gateway_exporter.py. Only
addresses differ: the service names (vllm, gateway-exporter, nginx) are mapped to 127.0.0.1 in
/etc/hosts, and secrets go to /run/secrets as compose mounts them, made by the same set-up as
scripts/up.sh's (llmstack.secrets). Needs root (for /etc/hosts, /etc/nginx, /run/secrets) on a
throwaway machine.

  python3 scripts/bare_host.py start --model /path/to/model [--nginx-root DIR] [-f compose.yaml ...]
  python3 scripts/bare_host.py stop

The processes outlive this command (their own sessions); logs and pids are in --workdir.
nginx comes from --nginx-root, a folder where Debian's nginx and gettext-base packages were
unpacked (`dpkg -x`), or from PATH. The load generator's gateway key is
/run/secrets/loadtest_api_key. docs/gpu-results.md shows the whole procedure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from llmstack import REPO_ROOT, composefile
from llmstack.cli import StackError, UsageError, main_exit, parser_from_doc, progress
from llmstack.secrets import ensure_secrets, read_env_file

PROG = "bare_host.py"
SERVICE_NAMES = ("vllm", "gateway-exporter", "nginx")
HOSTS_MARK = "# llm-stack bare host"
DEFAULT_WORKDIR = "/tmp/llm-stack"
SECRETS_DIR = Path("/run/secrets")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--model", help="model folder (or Hugging Face id) served as MODEL")
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


def start(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # As compose: the environment wins over .env; MODEL from the command line over both.
    settings = read_env_file(REPO_ROOT / ".env") | dict(os.environ) | {"MODEL": args.model}
    map_service_names()
    key_file = make_secrets(args, settings)
    nginx, nginx_env = prepare_nginx(args, settings)

    vllm_spec = composefile.service(args.compose_file, "vllm", settings)
    exporter_spec = composefile.service(args.compose_file, "gateway-exporter", settings)
    nginx_spec = composefile.service(args.compose_file, "nginx", settings)
    if not vllm_spec["command"]:
        raise StackError("the compose files give the vllm service no command")
    script = vllm_spec["command"][0].replace("$$", "$")
    shown = " ".join(f"{k}={v}" for k, v in vllm_spec["environment"].items() if k.isupper() and "TOKEN" not in k)
    progress(f"vLLM: {shown}")
    vllm = spawn("vllm", ["/bin/sh", "-c", script], workdir, os.environ | vllm_spec["environment"])
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
    started = time.monotonic()
    wait_for(health_url(vllm_spec, "vllm"), args.vllm_timeout, "vLLM", workdir / "vllm.log", vllm)
    progress(f"vLLM healthy after {time.monotonic() - started:.0f} s")
    check = subprocess.run([nginx, "-t", "-q"], env=nginx_env, capture_output=True, text=True)
    if check.returncode != 0:
        raise StackError(f"nginx -t: {check.stderr.strip()}")
    nginx_process = spawn("nginx", [nginx, "-g", "daemon off;"], workdir, nginx_env)
    wait_for(health_url(nginx_spec, "nginx"), 30, "nginx", workdir / "nginx.log", nginx_process)
    print(
        f"gateway http://127.0.0.1:8080 (key in {key_file}), vLLM http://127.0.0.1:8000, logs in {workdir}/", flush=True
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
        return start(args) if args.action == "start" else stop(args)
    except (OSError, subprocess.CalledProcessError) as err:
        raise StackError(str(err)) from err


if __name__ == "__main__":
    main_exit(PROG, main)
