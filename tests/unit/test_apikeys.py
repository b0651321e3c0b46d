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


def test_create_writes_an_nginx_map_line_and_prints_the_key_once(tmp_path):
    keys_file = tmp_path / "keys"
    result = run("--file", str(keys_file), "--no-reload", "create", "alice")
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert apikeys.KEY_PATTERN.match(key)
    text = keys_file.read_text()
    assert f"{key} alice;" in text
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
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
    assert alice not in text and bob in text


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
        ("sk-123 alice;\n", "48 lower-case hex"),
        ("garbage\n", "expected '<key> <owner>;'"),
        (f"sk-{'a' * 48} alice;\nsk-{'b' * 48} alice;\n", "must be unique"),
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
    assert "carol;" in keys_file.read_text()


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
