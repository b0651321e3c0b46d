#!/usr/bin/env python3
"""The stack's vLLM, nginx gateway and gateway exporter on a host without Docker, for measurements.

Runs the very commands and config files that compose.yaml runs, so numbers taken here are the
stack's: vLLM's command line and its defaults are read from compose.yaml (plus any override files,
and your environment wins, as with compose); nginx gets nginx/nginx.conf, nginx/snippets and the
templates rendered by the air-gapped image's own entrypoint script; the gateway exporter is
images/gateway-exporter/gateway_exporter.py. Only addresses differ: the service names (vllm,
gateway-exporter, nginx) are mapped to 127.0.0.1 in /etc/hosts, and secrets go to /run/secrets as
compose mounts them. Needs root (for /etc/hosts, /etc/nginx, /run/secrets) on a throwaway machine.

  bare_stack.py start --model /path/to/model [--nginx-root DIR] [-f compose.yaml ...]
  bare_stack.py stop

The processes outlive this command (their own sessions); logs and pids are in --workdir.
nginx comes from --nginx-root, a folder where Debian's nginx and gettext-base packages were
unpacked (`dpkg -x`), or from PATH. The gateway key for the load tests is created in
<workdir>/loadtest_api_key. docs/gpu-results.md shows the whole procedure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVICE_NAMES = ("vllm", "gateway-exporter", "nginx")
HOSTS_MARK = "# llm-stack bare_stack"
DEFAULT_WORKDIR = "/tmp/llm-stack"


class BareStackError(Exception):
    """Something on this host is missing or failed: one line (or a log tail), exit code 1."""


class UsageError(BareStackError):
    """Bad arguments: exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="bare_stack.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--model", help="model folder (or Hugging Face id) served as MODEL")
    parser.add_argument("-f", "--compose-file", action="append",
                        help="compose file(s) whose vllm/nginx settings apply, in order (default: compose.yaml)")
    parser.add_argument("--nginx-root", help="folder where nginx's .deb files were unpacked (default: nginx on PATH)")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR, help="logs, pids and keys (default: %(default)s)")
    parser.add_argument("--vllm-timeout", type=float, default=900, help="seconds to wait for vLLM's /health")
    args = parser.parse_args(argv)
    args.compose_file = [Path(f) for f in (args.compose_file or ["compose.yaml"])]
    if args.action == "start" and not args.model:
        raise UsageError("start needs --model")
    return args


# --- compose.yaml as the single source of the settings ------------------------------------------

class ComposeLoader:
    """yaml.safe_load that accepts compose's own tags (!reset, !override) as plain values."""

    @staticmethod
    def load(path: Path) -> dict:
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        def any_tag(loader, _suffix, node):
            if isinstance(node, yaml.MappingNode):
                return loader.construct_mapping(node)
            if isinstance(node, yaml.SequenceNode):
                return loader.construct_sequence(node)
            return loader.construct_scalar(node)

        Loader.add_multi_constructor("!", any_tag)
        try:
            return yaml.load(path.read_text(), Loader=Loader) or {}
        except OSError as err:
            raise BareStackError(f"cannot read {path}: {err.strerror}") from err


INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}")


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?message} against our environment."""
    def replace(match: re.Match) -> str:
        name, op, default = match["name"], match["op"], match["default"] or ""
        current = environ.get(name)
        if op in (":-", "-"):
            if current is None or (op == ":-" and current == ""):
                return interpolate(default, environ)
            return current
        if op in (":?", "?") and not current:
            raise BareStackError(f"{name} must be set: {default}")
        return current or ""
    return INTERPOLATION.sub(replace, str(value))


def service_settings(files: list[Path], service: str, environ: dict[str, str]) -> tuple[dict[str, str], list]:
    """(environment, command) of a service after merging the compose files in order."""
    env: dict[str, str] = {}
    command: list = []
    for path in files:
        spec = (ComposeLoader.load(REPO_ROOT / path).get("services") or {}).get(service) or {}
        raw = spec.get("environment") or {}
        if isinstance(raw, list):
            raw = dict(item.split("=", 1) for item in raw)
        env.update({key: interpolate(value, environ) for key, value in raw.items()})
        if spec.get("command"):
            command = spec["command"]
    return env, command


# --- the processes ------------------------------------------------------------------------------

def spawn(name: str, command: list[str], workdir: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(workdir / f"{name}.log", "ab")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                               start_new_session=True)
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
            raise BareStackError(f"{what} exited before it was healthy ({log}):\n" + "\n".join(errors))
        time.sleep(2)
    raise BareStackError(f"{what} not healthy at {url} after {timeout:.0f} s (log: {log})")


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
        env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")]).strip(":")
        env["PATH"] = f"{root / 'usr/bin'}:{env['PATH']}"
        if not binary.is_file():
            raise BareStackError(f"no usr/sbin/nginx under {root} (unpack Debian's nginx .deb files there)")
        return str(binary), env
    found = shutil.which("nginx")
    if not found:
        raise BareStackError("nginx is not on PATH; pass --nginx-root")
    return found, env


def prepare_nginx(args: argparse.Namespace, workdir: Path, environ: dict[str, str]) -> tuple[str, dict[str, str]]:
    binary, env = nginx_tools(args.nginx_root)
    if not shutil.which("envsubst", path=env["PATH"]):
        raise BareStackError("envsubst is not on PATH (Debian's gettext-base package)")
    settings, _ = service_settings(args.compose_file, "nginx", environ)
    etc = Path("/etc/nginx")
    etc.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "nginx/nginx.conf", etc / "nginx.conf")
    shutil.copytree(REPO_ROOT / "nginx/snippets", etc / "snippets", dirs_exist_ok=True)
    if not (etc / "mime.types").exists():
        source = Path(args.nginx_root or "/") / "etc/nginx/mime.types"
        if not source.exists():
            raise BareStackError(f"no mime.types at {source}")
        shutil.copy(source, etc / "mime.types")
    shutil.rmtree(etc / "conf.d", ignore_errors=True)
    render_env = env | settings | {"NGINX_ENVSUBST_TEMPLATE_DIR": str(REPO_ROOT / "nginx/templates"),
                                   "NGINX_ENVSUBST_OUTPUT_DIR": str(etc / "conf.d")}
    subprocess.run(["sh", str(REPO_ROOT / "images/nginx/render-templates-and-start.sh"), "true"],
                   env=render_env, check=True)
    for folder in ("/var/lib/nginx/body", "/var/lib/nginx/proxy", "/var/log/nginx"):
        Path(folder).mkdir(parents=True, exist_ok=True)
    return binary, env


def make_secrets(workdir: Path) -> Path:
    """The api_keys secret with one key for the load tests, as scripts/up.sh makes it."""
    secrets = Path("/run/secrets")
    secrets.mkdir(parents=True, exist_ok=True)
    keys_file, key_file = secrets / "api_keys", workdir / "loadtest_api_key"
    if not key_file.exists() or not keys_file.exists():
        keys_file.unlink(missing_ok=True)
        created = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/apikeys.py"), "--file", str(keys_file),
                                  "--no-reload", "create", "loadtest"], capture_output=True, text=True)
        key = re.search(r"sk-[0-9a-f]{48}", created.stdout)
        if created.returncode != 0 or not key:
            raise BareStackError(f"scripts/apikeys.py failed: {created.stderr.strip()}")
        key_file.write_text(key.group(0) + "\n")
        key_file.chmod(0o600)
    for name in ("prometheus_htpasswd", "locust_htpasswd"):
        (secrets / name).touch()
    return key_file


def start(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    environ = dict(os.environ) | {"MODEL": args.model}
    map_service_names()
    key_file = make_secrets(workdir)
    nginx, nginx_env = prepare_nginx(args, workdir, environ)

    vllm_env, vllm_command = service_settings(args.compose_file, "vllm", environ)
    if not vllm_command:
        raise BareStackError("compose.yaml's vllm service has no command")
    script = vllm_command[0].replace("$$", "$")
    print(f"vLLM:  {' '.join(f'{k}={v}' for k, v in vllm_env.items() if k.isupper() and 'TOKEN' not in k)}",
          flush=True)
    vllm = spawn("vllm", ["/bin/sh", "-c", script], workdir, dict(os.environ) | vllm_env)
    exporter = spawn("gateway-exporter", [sys.executable, str(REPO_ROOT / "images/gateway-exporter/gateway_exporter.py")],
                         workdir, dict(os.environ))
    wait_for("http://127.0.0.1:9113/healthz", 30, "the gateway exporter", workdir / "gateway-exporter.log",
             exporter)
    started = time.monotonic()
    wait_for("http://127.0.0.1:8000/health", args.vllm_timeout, "vLLM", workdir / "vllm.log", vllm)
    print(f"vLLM healthy after {time.monotonic() - started:.0f} s", flush=True)
    check = subprocess.run([nginx, "-t", "-q"], env=nginx_env, capture_output=True, text=True)
    if check.returncode != 0:
        raise BareStackError(f"nginx -t: {check.stderr.strip()}")
    nginx_process = spawn("nginx", [nginx, "-g", "daemon off;"], workdir, nginx_env)
    wait_for("http://127.0.0.1:8080/healthz", 30, "nginx", workdir / "nginx.log", nginx_process)
    print(f"gateway http://127.0.0.1:8080 (key in {key_file}), vLLM http://127.0.0.1:8000, "
          f"logs in {workdir}/", flush=True)
    return 0


def stop(args: argparse.Namespace) -> int:
    for pid_file in Path(args.workdir).glob("*.pid"):
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError, PermissionError):
            pass
        pid_file.unlink()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        return start(args) if args.action == "start" else stop(args)
    except BareStackError as err:
        print(f"bare_stack.py: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"bare_stack.py: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
