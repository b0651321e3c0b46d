"""Create, revoke and list the gateway's API keys.

The keys file is an nginx map include, one `<key> <owner>;` line per key, mounted into the nginx
container as a secret. nginx reads it at start and on reload; this script reloads a running
gateway after each change (use --no-reload to skip). The key itself is printed once, at creation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llmstack import REPO_ROOT
from llmstack.cli import UsageError, parser_from_doc

DEFAULT_KEYS_FILE = "secrets/api_keys"
HEADER = (
    "# API keys for the llm-stack gateway: one '<key> <owner>;' line per key (an nginx map include).\n"
    "# Managed by scripts/apikeys.py; keep this file out of version control.\n"
)
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
KEY_PATTERN = re.compile(r"^sk-[0-9a-f]{48}$")
LINE_PATTERN = re.compile(r"^\s*(?P<key>\S+)\s+(?P<owner>\S+?)\s*;\s*(?:#\s*(?P<comment>.*))?$")


class KeysFileError(Exception):
    """The keys file or a request against it is invalid; the message is for the user."""


@dataclass
class ApiKey:
    key: str
    owner: str
    comment: str = ""

    def line(self) -> str:
        suffix = f"  # {self.comment}" if self.comment else ""
        return f"{self.key} {self.owner};{suffix}\n"


def new_key() -> str:
    # Lower-case hex: nginx map lookups ignore case, so the alphabet must not rely on it.
    return "sk-" + secrets.token_hex(24)


def parse_keys(text: str, source: str = "keys file") -> list[ApiKey]:
    keys: list[ApiKey] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        match = LINE_PATTERN.match(raw)
        if not match:
            raise KeysFileError(f"{source}:{number}: expected '<key> <owner>;'")
        key, owner = match.group("key"), match.group("owner")
        if not KEY_PATTERN.match(key):
            raise KeysFileError(f"{source}:{number}: a key must be 'sk-' and 48 lower-case hex digits")
        if not OWNER_PATTERN.match(owner):
            raise KeysFileError(f"{source}:{number}: invalid owner name {owner!r}")
        keys.append(ApiKey(key, owner, match.group("comment") or ""))
    owners = [k.owner for k in keys]
    duplicates = sorted({o for o in owners if owners.count(o) > 1})
    if duplicates:
        raise KeysFileError(f"{source}: owner names must be unique, repeated: {', '.join(duplicates)}")
    return keys


def render_keys(keys: list[ApiKey]) -> str:
    return HEADER + "".join(k.line() for k in keys)


def read_keys(path: Path) -> list[ApiKey]:
    if not path.exists():
        return []
    if path.is_dir():
        raise KeysFileError(f"{path} is a folder, not a keys file")
    return parse_keys(path.read_text(), str(path))


def write_keys(path: Path, keys: list[ApiKey]) -> None:
    """Rewrite in place: the file is bind-mounted, and a rename would leave nginx the old inode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as handle:
        handle.seek(0)
        handle.write(render_keys(keys))
        handle.truncate()


def create(path: Path, owner: str) -> str:
    if not OWNER_PATTERN.match(owner):
        raise KeysFileError(f"invalid owner name {owner!r}: use letters, digits and . _ @ - (at most 64 characters)")
    keys = read_keys(path)
    if any(k.owner == owner for k in keys):
        raise KeysFileError(f"owner {owner!r} already has a key; revoke it first or pick another name")
    key = new_key()
    created = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    write_keys(path, [*keys, ApiKey(key, owner, f"created {created}")])
    return key


def revoke(path: Path, owner: str) -> None:
    keys = read_keys(path)
    kept = [k for k in keys if k.owner != owner]
    if len(kept) == len(keys):
        raise KeysFileError(f"no key for owner {owner!r} in {path}")
    write_keys(path, kept)


def keys_file_from_env_file(env_file: Path) -> str | None:
    if not env_file.is_file():
        return None
    for line in env_file.read_text().splitlines():
        match = re.match(r"^\s*API_KEYS_FILE\s*=\s*(.*?)\s*$", line)
        if match:
            return match.group(1).strip("'\"")
    return None


def default_keys_file() -> Path:
    configured = os.environ.get("API_KEYS_FILE") or keys_file_from_env_file(REPO_ROOT / ".env")
    path = Path(configured or DEFAULT_KEYS_FILE)
    return path if path.is_absolute() else REPO_ROOT / path


def reload_gateway() -> tuple[bool, str]:
    """Ask a running gateway to re-read the keys; a stopped one reads them when it starts.
    (False, why) when nginx is running but would not take the new configuration."""
    nginx = ["docker", "compose", "exec", "-T", "nginx", "nginx"]
    try:
        check = subprocess.run([*nginx, "-t", "-q"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        if check.returncode == 0:
            reload = subprocess.run([*nginx, "-s", "reload"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
            if reload.returncode == 0:
                return True, "gateway reloaded"
            check = reload
    except (OSError, subprocess.TimeoutExpired):
        return True, "gateway not reloaded (docker compose unavailable); it reads the keys when it starts"
    output = (check.stderr + check.stdout).strip()
    if "nginx: [emerg]" in output or "test failed" in output:
        last = output.splitlines()[-1] if output else ""
        return False, f"gateway NOT reloaded, it keeps the previous keys: nginx rejected the configuration ({last})"
    return True, "gateway not running; it reads the keys when it starts"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = parser_from_doc("apikeys.py", __doc__)
    parser.add_argument(
        "--file",
        type=Path,
        default=None,
        help=f"keys file (default: API_KEYS_FILE from the environment or .env, else {DEFAULT_KEYS_FILE})",
    )
    parser.add_argument("--no-reload", action="store_true", help="do not reload a running gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    create_cmd = commands.add_parser("create", help="create a key for an owner and print it")
    create_cmd.add_argument("owner")
    revoke_cmd = commands.add_parser("revoke", help="revoke an owner's key")
    revoke_cmd.add_argument("owner")
    commands.add_parser("list", help="list owners and when their keys were created (never the keys)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = args.file or default_keys_file()
    try:
        if args.command == "list":
            for k in read_keys(path):
                print(f"{k.owner}\t{k.comment}")
            return 0
        if args.command == "create":
            print(create(path, args.owner))
        else:
            revoke(path, args.owner)
            print(f"revoked the key of {args.owner}", file=sys.stderr)
    except KeysFileError as err:
        raise UsageError(str(err)) from None
    except OSError as err:
        raise UsageError(f"{path}: {err.strerror}") from None
    if not args.no_reload:
        reloaded, message = reload_gateway()
        print(message, file=sys.stderr)
        if not reloaded:
            return 1
    return 0


if __name__ == "__main__":
    from llmstack.cli import main_exit

    main_exit("apikeys.py", main)
