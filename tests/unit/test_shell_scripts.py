"""The shell scripts' command-line contract: --help prints the usage (exit 0, nothing on stderr) and
explains every option the usage line shows; an unknown option is one line on stderr and exit 2."""

import re
import subprocess

import pytest

from llmstack import REPO_ROOT

SCRIPTS = ["scripts/up.sh", "scripts/test.sh", "scripts/install-tools.sh"]


def run(script, *args):
    return subprocess.run([str(REPO_ROOT / script), *args], capture_output=True, text=True, timeout=60)


def unexplained_options(help_text):
    """Options the usage line (the first) shows that no later line starts by explaining."""
    first, *rest = help_text.splitlines()
    explained = "\n".join(rest)
    return [o for o in re.findall(r"--[a-z][a-z-]*", first) if not re.search(rf"^\s+{o}\b", explained, re.M)]


def usage_line(script):
    return run(script, "--help").stdout.splitlines()[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_usage_and_explains_each_option(script):
    result = run(script, "--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith(f"usage: {script}")
    assert unexplained_options(result.stdout) == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unknown_option_is_one_line_and_exit_2(script):
    if "ARGS" in usage_line(script):
        pytest.skip(f"{script} hands its arguments on (its usage says so)")
    result = run(script, "--no-such-option")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "'--no-such-option'" in result.stderr, result.stderr


def test_the_help_check_fails_on_help_that_explains_nothing(tmp_path):
    """The usage contract above is checked on a script whose help lists an option it never explains."""
    script = tmp_path / "bad.sh"
    script.write_text("#!/bin/sh\necho 'usage: bad.sh [--fast]'\necho 'runs the tests'\n")
    script.chmod(0o755)
    help_text = subprocess.run([str(script), "--help"], capture_output=True, text=True).stdout
    assert unexplained_options(help_text) == ["--fast"]


def test_install_tools_is_a_no_op_when_compose_v2_is_there():
    result = run("scripts/install-tools.sh")
    assert result.returncode == 0 and result.stderr == ""
