"""Create, revoke and list the gateway's API keys; set a key's own limits; show tokens used.

The keys file is an nginx map include, one `<sha256 of the key> "<owner> [setting=value ...]";`
line per key, mounted into the nginx container as a secret: it never holds a usable key. The
settings override the gateway's defaults from .env for that key (0: no limit): n (n/best_of per
request), max_tokens, prompts (per request), prompt_bytes, sequences (in flight), tpm and tpd
(tokens per minute and per UTC day), priority (vLLM's; lower is served first). nginx reads the
file at start and on reload; this script reloads a running gateway after each change (use
--no-reload to skip). The key itself is printed once, at creation. `migrate` turns a keys file of
plain keys (`<key> <owner>;`, before hashing) into hashes in place.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from llmstack import REPO_ROOT
from llmstack.cli import StackError, UsageError, parser_from_doc

DEFAULT_KEYS_FILE = "secrets/api_keys"
HEADER = (
    "# API keys for the llm-stack gateway: one '<sha256 of the key> \"<owner> [setting=value ...]\";' line per\n"
    "# key (an nginx map include; no usable key is stored). Managed by scripts/apikeys.py.\n"
)
# The per-key settings nginx/njs/gateway.js reads (its SETTINGS).
SETTINGS = ("n", "max_tokens", "prompts", "prompt_bytes", "sequences", "tpm", "tpd", "priority")
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
KEY_PATTERN = re.compile(r"^sk-[0-9a-f]{48}$")
DIGEST_PATTERN = re.compile(r"^[0-9a-f]{64}$")
LINE_PATTERN = re.compile(r'^\s*(?P<digest>\S+)\s+"(?P<entry>[^"]*)"\s*;\s*(?:#\s*(?P<comment>.*))?$')
PLAIN_LINE_PATTERN = re.compile(r"^\s*(?P<key>sk-\S+)\s+(?P<owner>\S+?)\s*;\s*(?:#\s*(?P<comment>.*))?$")
SETTING_PATTERN = re.compile(r"^(?P<name>[a-z_]+)=(?P<value>-?\d+)$")


class KeysFileError(Exception):
    """The keys file or a request against it is invalid; the message is for the user."""


def digest(key: str) -> str:
    """What the gateway compares: nginx/njs/gateway.js's keyHash."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_settings(words: list[str], source: str) -> dict[str, int]:
    settings: dict[str, int] = {}
    for word in words:
        match = SETTING_PATTERN.match(word)
        if not match or match.group("name") not in SETTINGS:
            raise KeysFileError(
                f"{source}: expected setting=integer with a setting among {', '.join(SETTINGS)}, got {word!r}"
            )
        settings[match.group("name")] = int(match.group("value"))
    return settings


@dataclass
class ApiKey:
    digest: str
    owner: str
    settings: dict[str, int] = field(default_factory=dict)
    comment: str = ""

    def line(self) -> str:
        entry = " ".join([self.owner, *(f"{name}={value}" for name, value in self.settings.items())])
        suffix = f"  # {self.comment}" if self.comment else ""
        return f'{self.digest} "{entry}";{suffix}\n'


def new_key() -> str:
    return "sk-" + secrets.token_hex(24)


def parse_keys(text: str, source: str = "keys file") -> list[ApiKey]:
    keys: list[ApiKey] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        where = f"{source}:{number}"
        if PLAIN_LINE_PATTERN.match(raw):
            raise KeysFileError(f"{where}: a plain key; hash the file with `scripts/apikeys.py migrate`")
        match = LINE_PATTERN.match(raw)
        if not match:
            raise KeysFileError(f"{where}: expected '<sha256> \"<owner> [setting=value ...]\";'")
        if not DIGEST_PATTERN.match(match.group("digest")):
            raise KeysFileError(f"{where}: the first field must be a SHA-256 hex digest (64 lower-case hex digits)")
        owner, *words = match.group("entry").split()
        if not OWNER_PATTERN.match(owner):
            raise KeysFileError(f"{where}: invalid owner name {owner!r}")
        keys.append(ApiKey(match.group("digest"), owner, parse_settings(words, where), match.group("comment") or ""))
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
    """Rewrite in place: the file is bind-mounted, and a rename would leave nginx the old inode.
    Mode 644: nginx reads it as a non-root user; it holds hashes only (secrets/ itself is 700)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "r+") as handle:
        handle.seek(0)
        handle.write(render_keys(keys))
        handle.truncate()


def create(path: Path, owner: str, settings: dict[str, int] | None = None) -> str:
    if not OWNER_PATTERN.match(owner):
        raise KeysFileError(f"invalid owner name {owner!r}: use letters, digits and . _ @ - (at most 64 characters)")
    keys = read_keys(path)
    if any(k.owner == owner for k in keys):
        raise KeysFileError(f"owner {owner!r} already has a key; revoke it first or pick another name")
    key = new_key()
    created = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    write_keys(path, [*keys, ApiKey(digest(key), owner, dict(settings or {}), f"created {created}")])
    return key


def revoke(path: Path, owner: str) -> None:
    keys = read_keys(path)
    kept = [k for k in keys if k.owner != owner]
    if len(kept) == len(keys):
        raise KeysFileError(f"no key for owner {owner!r} in {path}")
    write_keys(path, kept)


def set_limits(path: Path, owner: str, settings: dict[str, int], clear: list[str]) -> ApiKey:
    keys = read_keys(path)
    for key in keys:
        if key.owner == owner:
            for name in clear:
                key.settings.pop(name, None)
            key.settings.update(settings)
            write_keys(path, keys)
            return key
    raise KeysFileError(f"no key for owner {owner!r} in {path}")


def migrate(path: Path) -> int:
    """Hash a keys file of plain keys in place; returns how many keys were hashed (0: already done)."""
    if not path.is_file():
        raise KeysFileError(f"{path}: no such keys file")
    keys: list[ApiKey] = []
    plain = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        match = PLAIN_LINE_PATTERN.match(raw)
        if match:
            if not KEY_PATTERN.match(match.group("key")):
                raise KeysFileError(f"{path}:{number}: a key must be 'sk-' and 48 lower-case hex digits")
            keys.append(ApiKey(digest(match.group("key")), match.group("owner"), {}, match.group("comment") or ""))
            plain += 1
        else:
            keys.extend(parse_keys(raw, f"{path}:{number}"))
    parse_keys(render_keys(keys), str(path))  # owners valid and unique
    if plain:
        write_keys(path, keys)
    return plain


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


def gateway_prometheus_url() -> str:
    """Prometheus behind the running stack's gateway (/prometheus/), at the port compose published."""
    try:
        found = subprocess.run(
            ["docker", "compose", "port", "nginx", "8080"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        found = None
    address = found.stdout.strip().splitlines()[-1] if found and found.returncode == 0 and found.stdout.strip() else ""
    if not address:
        raise UsageError("no running gateway found with docker compose; pass --prometheus URL")
    return f"http://{address.replace('0.0.0.0', '127.0.0.1')}/prometheus"


def usage(prometheus_url: str, user: str | None, password: str | None, since: str) -> list[dict]:
    """Prompt and completion tokens per key owner and model over the last `since` (a Prometheus
    duration), from the gateway's counters (rounded: increase() extrapolates at the edges)."""
    from llmstack.observability.panel_queries import Prometheus, PrometheusError

    prometheus = Prometheus(prometheus_url, user, password)
    rows: dict[tuple[str, str], dict] = {}
    for kind in ("prompt", "completion"):
        expr = f"sum by (key_owner, model) (increase(gateway_{kind}_tokens_total[{since}]))"
        try:
            result = prometheus.get("/api/v1/query", {"query": expr})["result"]
        except PrometheusError as err:
            raise StackError(f"Prometheus: {err}") from None
        for series in result:
            labels = series["metric"]
            key = (labels.get("key_owner", ""), labels.get("model", ""))
            row = rows.setdefault(key, {"key_owner": key[0], "model": key[1], "prompt": 0, "completion": 0})
            row[kind] = round(float(series["value"][1]))
    return sorted(rows.values(), key=lambda row: -(row["prompt"] + row["completion"]))


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
    create_cmd = commands.add_parser("create", help="create a key for an owner and print it (once)")
    create_cmd.add_argument("owner")
    create_cmd.add_argument(
        "settings", nargs="*", metavar="SETTING=VALUE", help=f"the key's own limits: {', '.join(SETTINGS)}"
    )
    revoke_cmd = commands.add_parser("revoke", help="revoke an owner's key")
    revoke_cmd.add_argument("owner")
    set_cmd = commands.add_parser("set", help="set (or --clear) an owner's own limits")
    set_cmd.add_argument("owner")
    set_cmd.add_argument("settings", nargs="*", metavar="SETTING=VALUE", help=f"among {', '.join(SETTINGS)}")
    set_cmd.add_argument("--clear", action="append", default=[], choices=SETTINGS, help="back to the default")
    commands.add_parser("list", help="list owners, their own limits and when their keys were created (never keys)")
    commands.add_parser("migrate", help="hash a keys file of plain keys in place (the keys keep working)")
    usage_cmd = commands.add_parser("usage", help="tokens used per key owner and model, from Prometheus")
    usage_cmd.add_argument("--since", default="24h", help="a Prometheus duration: 1h, 24h, 7d (default: %(default)s)")
    usage_cmd.add_argument(
        "--prometheus", help="Prometheus URL (default: /prometheus on the running stack's gateway, via docker compose)"
    )
    usage_cmd.add_argument("--user", default="admin", help="basic-auth user for /prometheus/ (default: %(default)s)")
    usage_cmd.add_argument(
        "--password-file", type=Path, help="file with that user's password (default: $PROMETHEUS_PASSWORD)"
    )
    usage_cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser.parse_args(argv)


def print_usage(args: argparse.Namespace) -> int:
    if not re.fullmatch(r"\d+[smhdwy]", args.since):
        raise UsageError(f"--since {args.since!r}: expected a Prometheus duration such as 1h, 24h or 7d")
    if args.password_file and not args.password_file.is_file():
        raise UsageError(f"--password-file {args.password_file}: no such file")
    password = args.password_file.read_text().strip() if args.password_file else os.environ.get("PROMETHEUS_PASSWORD")
    rows = usage(args.prometheus or gateway_prometheus_url(), args.user, password, args.since)
    if args.json:
        import json

        print(json.dumps({"since": args.since, "usage": rows}, indent=2))
        return 0
    print(f"{'key owner':<24} {'model':<32} {'prompt':>12} {'completion':>12}   (last {args.since})")
    for row in rows:
        print(f"{row['key_owner']:<24} {row['model']:<32} {row['prompt']:>12,} {row['completion']:>12,}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "usage":
        return print_usage(args)
    path = args.file or default_keys_file()
    try:
        if args.command == "list":
            for k in read_keys(path):
                limits = " ".join(f"{name}={value}" for name, value in k.settings.items()) or "defaults"
                print(f"{k.owner}\t{limits}\t{k.comment}")
            return 0
        if args.command == "create":
            print(create(path, args.owner, parse_settings(args.settings, "command line")))
        elif args.command == "set":
            key = set_limits(path, args.owner, parse_settings(args.settings, "command line"), args.clear)
            print(
                f"{key.owner}: {' '.join(f'{n}={v}' for n, v in key.settings.items()) or 'defaults'}", file=sys.stderr
            )
        elif args.command == "migrate":
            hashed = migrate(path)
            print(f"hashed {hashed} plain keys in {path}" if hashed else f"{path} holds no plain keys", file=sys.stderr)
            if not hashed:
                return 0
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
