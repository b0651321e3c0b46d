import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["scripts/up.sh", "scripts/test.sh", "scripts/install-tools.sh"])
def test_help(script):
    result = subprocess.run([str(REPO_ROOT / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "usage" in result.stdout.lower() or "test" in result.stdout.lower()


def test_up_rejects_an_unknown_mode_with_one_line():
    result = subprocess.run([str(REPO_ROOT / "scripts/up.sh"), "--tpu"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == "up.sh: unknown option '--tpu' (see --help)"


def test_install_compose_is_a_no_op_when_compose_v2_is_there():
    result = subprocess.run([str(REPO_ROOT / "scripts/install-tools.sh")], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""


def test_install_tools_rejects_an_unknown_option_with_one_line():
    result = subprocess.run([str(REPO_ROOT / "scripts/install-tools.sh"), "--all"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == "install-tools: unknown option '--all' (see --help)"
