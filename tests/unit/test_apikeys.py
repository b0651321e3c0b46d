import hashlib
import os
import stat
import subprocess
import sys

import pytest

from llmstack import REPO_ROOT, apikeys

SCRIPT = REPO_ROOT / "scripts" / "apikeys.py"


def run(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)


def test_create_writes_the_keys_hash_only_and_prints_the_key_once(tmp_path):
    keys_file = tmp_path / "keys"
    result = run("--file", str(keys_file), "--no-reload", "create", "alice", "n=2", "tpm=1000")
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert apikeys.KEY_PATTERN.match(key)
    text = keys_file.read_text()
    assert key not in text and key[3:] not in text
    assert f'{hashlib.sha256(key.encode()).hexdigest()} "alice n=2 tpm=1000";' in text
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o644  # nginx reads it unprivileged
    listing = run("--file", str(keys_file), "list")
    assert "alice" in listing.stdout and key not in listing.stdout


def test_keys_are_unique_and_random():
    keys = {apikeys.new_key() for _ in range(200)}
    assert len(keys) == 200
    assert all(k == k.lower() for k in keys)


def test_revoke_removes_only_that_owner(tmp_path):
    keys_file = tmp_path / "keys"
    alice = apikeys.create(keys_file, "alice")
    bob = apikeys.create(keys_file, "bob")
    apikeys.revoke(keys_file, "alice")
    text = keys_file.read_text()
    assert apikeys.digest(alice) not in text and apikeys.digest(bob) in text


def test_rewrite_keeps_the_inode_for_bind_mounts(tmp_path):
    keys_file = tmp_path / "keys"
    apikeys.create(keys_file, "alice")
    inode = keys_file.stat().st_ino
    apikeys.create(keys_file, "bob")
    apikeys.revoke(keys_file, "alice")
    assert keys_file.stat().st_ino == inode


@pytest.mark.parametrize("owner", ["bad name", "", "-leading-dash", "x" * 65, "semi;colon", "quote'"])
def test_invalid_owner_is_a_one_line_error(tmp_path, owner):
    result = run("--file", str(tmp_path / "keys"), "--no-reload", "create", "--", owner)
    assert result.returncode == 2
    assert result.stderr.startswith("apikeys.py: error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


def test_duplicate_owner_and_unknown_revoke_fail_cleanly(tmp_path):
    keys_file = tmp_path / "keys"
    run("--file", str(keys_file), "--no-reload", "create", "alice")
    again = run("--file", str(keys_file), "--no-reload", "create", "alice")
    assert again.returncode == 2 and "already has a key" in again.stderr
    missing = run("--file", str(keys_file), "--no-reload", "revoke", "carol")
    assert missing.returncode == 2 and "no key for owner" in missing.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        (f"sk-{'a' * 48} alice;\n", "apikeys.py migrate"),
        ("garbage\n", "expected '<sha256>"),
        ('abc "alice";\n', "SHA-256 hex digest"),
        (f'{"a" * 64} "alice n=x";\n', "setting=integer"),
        (f'{"a" * 64} "alice colour=2";\n', "setting=integer"),
        (f'{"a" * 64} "alice";\n{"b" * 64} "alice";\n', "must be unique"),
    ],
)
def test_a_hand_edited_broken_file_is_reported_with_its_line(tmp_path, content, message):
    keys_file = tmp_path / "keys"
    keys_file.write_text(content)
    result = run("--file", str(keys_file), "list")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_folder_instead_of_a_file_is_an_error(tmp_path):
    result = run("--file", str(tmp_path), "list")
    assert result.returncode == 2 and "is a folder" in result.stderr


def test_keys_file_comes_from_the_environment(tmp_path):
    keys_file = tmp_path / "from-env"
    result = run("--no-reload", "create", "carol", env_extra={"API_KEYS_FILE": str(keys_file)})
    assert result.returncode == 0
    assert '"carol";' in keys_file.read_text()


def test_reload_without_a_running_gateway_is_not_an_error(tmp_path):
    result = run(
        "--file",
        str(tmp_path / "keys"),
        "create",
        "dave",
        env_extra={"COMPOSE_PROJECT_NAME": "llmstack-no-such-project"},
    )
    assert result.returncode == 0
    assert "not running" in result.stderr or "not reloaded" in result.stderr


def test_help():
    result = run("--help")
    assert result.returncode == 0 and "create" in result.stdout and "revoke" in result.stdout


def test_migrate_hashes_plain_keys_in_place_and_keeps_them_working(tmp_path):
    keys_file = tmp_path / "keys"
    alice, bob = apikeys.new_key(), apikeys.new_key()
    keys_file.write_text(f"# old file\n{alice} alice;  # created 2026-01-01\n{bob} bob;\n")
    inode = keys_file.stat().st_ino
    result = run("--file", str(keys_file), "--no-reload", "migrate")
    assert result.returncode == 0 and "hashed 2 plain keys" in result.stderr
    text = keys_file.read_text()
    assert alice not in text and bob not in text
    assert {k.owner: k.digest for k in apikeys.read_keys(keys_file)} == {
        "alice": apikeys.digest(alice),
        "bob": apikeys.digest(bob),
    }
    assert "created 2026-01-01" in text and keys_file.stat().st_ino == inode
    again = run("--file", str(keys_file), "--no-reload", "migrate")
    assert again.returncode == 0 and "no plain keys" in again.stderr


def test_set_changes_one_owners_limits(tmp_path):
    keys_file = tmp_path / "keys"
    apikeys.create(keys_file, "alice", {"n": 2})
    apikeys.create(keys_file, "bob")
    assert run("--file", str(keys_file), "--no-reload", "set", "alice", "tpd=500", "--clear", "n").returncode == 0
    settings = {k.owner: k.settings for k in apikeys.read_keys(keys_file)}
    assert settings == {"alice": {"tpd": 500}, "bob": {}}
    bad = run("--file", str(keys_file), "--no-reload", "set", "alice", "speed=9")
    assert bad.returncode == 2 and "setting=integer" in bad.stderr


def test_usage_needs_a_prometheus_duration(tmp_path):
    result = run("usage", "--since", "yesterday", "--prometheus", "http://127.0.0.1:9")
    assert result.returncode == 2 and "Prometheus duration" in result.stderr
    unreachable = run("usage", "--prometheus", "http://127.0.0.1:9")
    assert unreachable.returncode == 1 and "Traceback" not in unreachable.stderr
