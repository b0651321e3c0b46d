"""The one secrets set-up: the files compose mounts as secrets, made once, never overwritten.

scripts/up.sh, the integration tests' stack and the bare-host launcher all call `ensure_secrets`.
Which files: compose.yaml's top-level `secrets:` section, where each is `file: ${SETTING:-default}`
(or `${SETTING:?why}`), so the setting names and default paths are written only there.

  python -m llmstack.secrets [--env-file .env]   # make what is missing, print what to keep once
  python -m llmstack.secrets --path tls_certificate   # where one secret's file is
"""

from __future__ import annotations

import argparse
import os
import re
import secrets as token_source
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmstack import REPO_ROOT, apikeys
from llmstack.cli import StackError, UsageError, parser_from_doc

COMPOSE_FILE = REPO_ROOT / "compose.yaml"
_FILE_SETTING = re.compile(r"^\$\{(?P<name>[A-Z_][A-Z0-9_]*)(?::-(?P<default>[^}]*)|:\?[^}]*)?\}$")
# Secrets read by non-root users inside their containers: 644 inside a 700 folder.
SHARED_WITH_CONTAINER_USERS = {
    "grafana_admin_password",
    "prometheus_htpasswd",
    "locust_htpasswd",
    "loadtest_api_key",
    "api_keys",  # hashes only
    "tls_certificate",
    "tls_key",  # nginx runs unprivileged; the secrets folder itself is 700
}
FIRST_KEY_OWNER = "admin"
LOADTEST_KEY_OWNER = "loadtest"
BASIC_AUTH_USER = "admin"


@dataclass(frozen=True)
class SecretFile:
    name: str  # the compose secret's name
    setting: str  # the .env setting that names its file
    default: str | None  # the file when the setting is unset (None: the setting is required)


def _secret_sections(compose_file: Path) -> dict:
    """The top-level `secrets:` of a compose file and of the files it includes."""
    try:
        document = yaml.safe_load(compose_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise StackError(f"cannot read the secrets section of {compose_file}: {err}") from err
    sections = dict(document.get("secrets") or {})
    for item in document.get("include") or []:
        included = item.get("path") if isinstance(item, dict) else item
        for path in [included] if isinstance(included, str) else included or []:
            sections |= _secret_sections(compose_file.parent / path)
    return sections


def compose_secrets(compose_file: Path = COMPOSE_FILE) -> list[SecretFile]:
    """The secrets compose.yaml declares, with their settings and default files."""
    found = []
    for name, spec in _secret_sections(compose_file).items():
        match = _FILE_SETTING.match(str((spec or {}).get("file", "")))
        if not match:
            raise StackError(f"{compose_file}: secret {name} is not `file: ${{SETTING:-default}}`")
        found.append(SecretFile(name, match["name"], match["default"] or None))
    if not found:
        raise StackError(f"{compose_file} declares no secrets")
    return found


def secret_paths(
    settings: Mapping[str, str], base: Path = REPO_ROOT, compose_file: Path = COMPOSE_FILE
) -> dict[str, Path]:
    """Each secret's file from the settings (the environment, .env), else its default."""
    paths = {}
    for secret in compose_secrets(compose_file):
        value = settings.get(secret.setting) or secret.default
        if not value:
            value = f"./secrets/{secret.name}"
        path = Path(value)
        paths[secret.name] = path if path.is_absolute() else base / path
    return paths


def htpasswd_line(user: str, password: str) -> str:
    """One htpasswd line with a SHA-512 crypt hash (what nginx's auth_basic reads)."""
    try:
        hashed = subprocess.run(
            ["openssl", "passwd", "-6", "-stdin"], input=password, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as err:
        raise StackError(f"openssl passwd failed ({err}); is openssl installed?") from err
    return f"{user}:{hashed}\n"


def self_signed_names() -> list[str]:
    """Names a self-signed certificate is made for: this host as clients on it and beside it
    reach it, and the gateway's name inside the stack."""
    names = ["DNS:localhost", "IP:127.0.0.1", "DNS:nginx"]
    for name in {socket.gethostname(), socket.getfqdn()}:
        if name and f"DNS:{name}" not in names and re.fullmatch(r"[A-Za-z0-9.-]+", name):
            names.append(f"DNS:{name}")
    return names


def make_self_signed(certificate: Path, key: Path) -> None:
    """A self-signed certificate (P-256, 825 days) and its key, for the gateway's HTTPS."""
    try:
        subprocess.run(
            [
                "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-days", "825", "-subj", "/CN=llm-stack gateway",
                "-addext", "subjectAltName=" + ",".join(self_signed_names()),
                "-keyout", str(key), "-out", str(certificate),
            ],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or err
        raise StackError(f"openssl could not make a self-signed certificate: {detail}") from err


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    path.chmod(mode)


@dataclass
class Created:
    """What ensure_secrets made this time: shown to the user once, never stored in clear elsewhere."""

    admin_key: str | None = None
    loadtest_key: str | None = None
    self_signed: bool = False  # a self-signed certificate was made for the gateway
    migrated_keys: int = 0  # plain keys hashed in place (a keys file from before hashing)
    passwords: dict[str, str] | None = None  # secret name -> password (grafana, prometheus, locust)

    def messages(self, paths: Mapping[str, Path]) -> list[str]:
        lines = []
        if self.self_signed:
            lines.append(
                f"Made a self-signed HTTPS certificate for the gateway: clients trust {paths['tls_certificate']} "
                "(curl --cacert, SSL_CERT_FILE); put a real one in its place (README.md, TLS)"
            )
        if self.migrated_keys:
            lines.append(f"Hashed the {self.migrated_keys} plain keys in {paths['api_keys']}; the keys keep working")
        if self.admin_key:
            lines.append(f"Created the first API key (owner '{FIRST_KEY_OWNER}'), shown only now: {self.admin_key}")
        for name, password in (self.passwords or {}).items():
            if name == "grafana_admin_password":
                lines.append(f"Grafana: user {BASIC_AUTH_USER}, password in {paths[name]}")
            else:
                where = "/prometheus/" if name == "prometheus_htpasswd" else "/locust/"
                lines.append(f"{where}: user {BASIC_AUTH_USER}, password {password} (shown only now)")
        return lines


def ensure_secrets(paths: Mapping[str, Path]) -> Created:
    """Make every secret file that is missing or empty; leave existing ones alone."""
    created = Created(passwords={})
    folders = {path.parent for path in paths.values()}
    for folder in folders:
        fresh = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        if fresh:
            folder.chmod(0o700)

    def missing(name: str) -> bool:
        path = paths[name]
        return not path.exists() or path.stat().st_size == 0

    def mode(name: str) -> int:
        return 0o644 if name in SHARED_WITH_CONTAINER_USERS else 0o600

    keys_file = paths["api_keys"]
    try:
        if keys_file.is_file():
            created.migrated_keys = apikeys.migrate(keys_file)
            keys_file.chmod(mode("api_keys"))  # older set-ups made it 600; nginx runs unprivileged
        owners = {key.owner for key in apikeys.read_keys(keys_file)}
        if not owners:
            created.admin_key = apikeys.create(keys_file, FIRST_KEY_OWNER)
        if "loadtest_api_key" in paths and missing("loadtest_api_key"):
            if LOADTEST_KEY_OWNER in owners:
                apikeys.revoke(keys_file, LOADTEST_KEY_OWNER)
            created.loadtest_key = apikeys.create(keys_file, LOADTEST_KEY_OWNER)
            _write(paths["loadtest_api_key"], created.loadtest_key + "\n", mode("loadtest_api_key"))
    except apikeys.KeysFileError as err:
        raise UsageError(str(err)) from None
    if "tls_certificate" in paths and missing("tls_certificate") != missing("tls_key"):
        given, absent = ("tls_certificate", "tls_key") if missing("tls_key") else ("tls_key", "tls_certificate")
        raise UsageError(
            f"{paths[given]} is there but {paths[absent]} is not: give both, or neither for a self-signed pair"
        )
    if "tls_certificate" in paths and missing("tls_certificate"):
        make_self_signed(paths["tls_certificate"], paths["tls_key"])
        for name in ("tls_certificate", "tls_key"):
            paths[name].chmod(mode(name))
        created.self_signed = True
    for name in paths:
        if name == "hf_token" and not paths[name].exists():
            _write(paths[name], "", mode(name))  # may stay empty: only gated models need a token
        elif name in ("grafana_admin_password", "prometheus_htpasswd", "locust_htpasswd") and missing(name):
            password = token_source.token_urlsafe(18)
            text = password + "\n" if name == "grafana_admin_password" else htpasswd_line(BASIC_AUTH_USER, password)
            _write(paths[name], text, mode(name))
            assert created.passwords is not None
            created.passwords[name] = password
    return created


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines as compose reads .env (no shell expansion; quotes around a value dropped)."""
    values: dict[str, str] = {}
    if not path.is_file():
        return values
    for line in path.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$", line)
        if not match:
            continue
        value = match.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[match.group(1)] = value
    return values


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc("python -m llmstack.secrets", __doc__)
    parser.add_argument(
        "--env-file",
        type=Path,
        default=REPO_ROOT / ".env",
        help="settings file (default: .env; the environment wins over it, as with compose)",
    )
    parser.add_argument(
        "--path", metavar="SECRET", help="only print where this secret's file is (e.g. tls_certificate)"
    )
    args: argparse.Namespace = parser.parse_args(argv)
    settings = {**read_env_file(args.env_file), **os.environ}
    paths = secret_paths(settings)
    if args.path:
        if args.path not in paths:
            raise UsageError(f"no secret {args.path!r}; compose.yaml declares {', '.join(sorted(paths))}")
        print(paths[args.path])
        return 0
    for line in ensure_secrets(paths).messages(paths):
        print(line)
    return 0


if __name__ == "__main__":
    from llmstack.cli import main_exit

    main_exit("python -m llmstack.secrets", main)
