"""One source for each version and each default (issue 15), checked on the real files.

- A version in versions.env or constraints.txt is written in no other tracked config or code file
  (compose files, Dockerfiles, *.py, *.sh, YAML, *.env*, *.toml, *.ini, *.template). Comments and
  docstrings are prose: they may say which release a rule was read from. README.md and docs/*.md are
  not searched for the same reason: they describe measured runs, which name the versions they ran.
- A setting's default is written once: each `${X:-default}` pair appears once across the compose
  files, and a file gives X at most one default (compose.cpu.yaml may give the CPU path a different
  one: that is a second value, not a copy). .env.example lists every setting compose reads, all with
  empty values (compose's `:-` treats empty as unset), so it repeats no default; only compose's own
  settings (COMPOSE_FILE, which must not be empty) have a value there.
Each check is also run on a planted copy, to show it can fail.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

from llmstack import REPO_ROOT
from llmstack.versions import read_constraints, read_versions

CHECKED_SUFFIXES = (".py", ".sh", ".yml", ".yaml", ".toml", ".ini", ".template")
COMPOSE_FILES = sorted([*REPO_ROOT.glob("compose*.yaml"), *REPO_ROOT.glob("compose/*.yaml")])
# Recorded output, not a pin: vLLM's log lines as the named releases printed them.
RECORDED_OUTPUT = {"tests/unit/test_vllm_logs_and_metrics.py"}
# Checked copies: Kustomize reads no file above a kustomization's folder (versions.env is), so the
# image tags of deploy/kubernetes are written there; tests/unit/test_kubernetes.py fails when any
# differs from the image compose names with versions.env.
CHECKED_COPIES = {"deploy/kubernetes/base/kustomization.yaml", "deploy/kubernetes/overlays/cpu/kustomization.yaml"}
# ${X:-default}, the default possibly holding one level of braces ($$__env{...} for Grafana).
DEFAULT = re.compile(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*):-((?:[^{}]|\{[^{}]*\})*)\}")
VARIABLE = re.compile(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)")
ENV_LINE = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$", re.M)


def checked_files() -> list[Path]:
    """Tracked files and new ones git does not ignore, that hold config or code."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = []
    for name in sorted(set(listed)):
        path = REPO_ROOT / name
        if name in ("versions.env", "constraints.txt") or name in RECORDED_OUTPUT | CHECKED_COPIES:
            continue
        if not path.is_file():
            continue
        if path.name == "Dockerfile" or path.name.startswith(".env") or path.suffix in CHECKED_SUFFIXES:
            files.append(path)
    return files


def python_code(text: str) -> str:
    """The source less comments and docstrings (a string that is a statement of its own)."""
    kept = []
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        is_docstring = token.type == tokenize.STRING and previous in (
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.NL,
        )
        if token.type != tokenize.COMMENT and not is_docstring:
            kept.append(token.string)
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type
    return " ".join(kept)


def config_code(path: Path) -> str:
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        return python_code(text)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def version_copies(files: list[Path], pinned: dict[str, str]) -> list[str]:
    """'file: NAME=VERSION' for each pinned version written in a file's code."""
    copies = []
    for path in files:
        code = config_code(path)
        for name, version in pinned.items():
            if re.search(rf"(?<![\w.]){re.escape(version)}(?![\w]|\.\d)", code):
                copies.append(
                    f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}: {name}={version}"
                )
    return copies


def pinned_versions() -> dict[str, str]:
    return {**read_versions(), **{f"{package} (constraints.txt)": v for package, v in read_constraints().items()}}


def default_copies(files: list[Path]) -> list[str]:
    """Defaults written twice: the same (variable, default) anywhere twice, or two defaults for one
    variable in one file."""
    seen: dict[tuple[str, str], str] = {}
    problems = []
    for path in files:
        in_file: dict[str, str] = {}
        for name, default in DEFAULT.findall(path.read_text()):
            if not default:
                continue
            if (name, default) in seen:
                problems.append(f"{name}:-{default} in {seen[name, default]} and {path.name}")
            seen[name, default] = path.name
            if name in in_file and in_file[name] != default:
                problems.append(f"{name} has two defaults in {path.name}")
            in_file[name] = default
    return problems


def env_example_problems(env_example: str, compose_texts: list[str], version_keys: set[str]) -> list[str]:
    listed = dict(ENV_LINE.findall(env_example))
    read = {name for text in compose_texts for name in VARIABLE.findall(text)}
    # Compose's own settings (COMPOSE_FILE) are not read through `${...}`: they may have a value.
    problems = [
        f"{name}={value} (a default belongs in compose/, or in loadtest/ for LOADTEST_*)"
        for name, value in listed.items()
        if value and name in read
    ]
    problems += [
        f"{name} is read by compose but not in .env.example" for name in sorted(read - version_keys - set(listed))
    ]
    problems += [f"{name} is a version: it belongs in versions.env only" for name in sorted(version_keys & set(listed))]
    return problems


def test_no_version_is_written_outside_versions_env_and_constraints():
    assert version_copies(checked_files(), pinned_versions()) == []


def test_the_version_check_finds_a_planted_copy(tmp_path):
    pinned = pinned_versions()
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        f"# vLLM {pinned['VLLM_CPU_VERSION']} is fine in a comment\nARG VLLM_VERSION={pinned['VLLM_CPU_VERSION']}\n"
    )
    script = tmp_path / "x.py"
    script.write_text(
        f'"""Read from locust {pinned["locust (constraints.txt)"]}."""\n'
        f'IMAGE = "llm-stack/locust:{pinned["locust (constraints.txt)"]}"\n'
    )
    assert version_copies([dockerfile, script], pinned) == [
        f"{dockerfile}: VLLM_CPU_VERSION={pinned['VLLM_CPU_VERSION']}",
        f"{script}: locust (constraints.txt)={pinned['locust (constraints.txt)']}",
    ]


def test_the_checked_files_include_every_kind_that_holds_config():
    names = {path.relative_to(REPO_ROOT).as_posix() for path in checked_files()}
    assert {
        "compose.yaml",
        "compose/stack.yaml",
        "images/vllm/Dockerfile",
        ".env.example",
        "llmstack/images.py",
        "scripts/install-tools.sh",
    } <= names


def test_no_default_is_written_twice_in_the_compose_files():
    assert default_copies(COMPOSE_FILES) == []


@pytest.mark.parametrize(
    "planted",
    [
        "      MAX_MODEL_LEN: ${MAX_MODEL_LEN:-4096}\n",
        "      X: ${GATEWAY_PORT:-8081}\n",
    ],
)
def test_the_default_check_finds_a_planted_copy(tmp_path, planted):
    stack = (REPO_ROOT / "compose/stack.yaml").read_text()
    assert "${MAX_MODEL_LEN:-4096}" in stack and "${GATEWAY_PORT:-8080}" in stack
    copy = tmp_path / "stack.yaml"
    copy.write_text(stack + planted)
    assert len(default_copies([copy])) == 1


def test_env_example_lists_every_setting_empty():
    texts = [path.read_text() for path in COMPOSE_FILES]
    problems = env_example_problems((REPO_ROOT / ".env.example").read_text(), texts, set(read_versions()))
    assert problems == []


def test_the_env_example_check_finds_planted_problems():
    texts = [path.read_text() for path in COMPOSE_FILES]
    env_example = (REPO_ROOT / ".env.example").read_text()
    versions = set(read_versions())
    with_default = env_example.replace("\nMAX_MODEL_LEN=\n", "\nMAX_MODEL_LEN=4096\n")
    assert env_example_problems(with_default, texts, versions) == [
        "MAX_MODEL_LEN=4096 (a default belongs in compose/, or in loadtest/ for LOADTEST_*)"
    ]
    missing = env_example.replace("\nRATE_LIMIT_BURST=\n", "\n")
    assert env_example_problems(missing, texts, versions) == [
        "RATE_LIMIT_BURST is read by compose but not in .env.example"
    ]
    a_version = env_example + "NGINX_VERSION=\n"
    assert env_example_problems(a_version, texts, versions) == [
        "NGINX_VERSION is a version: it belongs in versions.env only"
    ]


def test_versions_env_is_what_a_shell_and_compose_read_alike():
    shell = subprocess.run(
        ["bash", "-c", "set -a; source versions.env; env"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    from_shell = dict(ENV_LINE.findall(shell))
    assert {key: from_shell.get(key) for key in read_versions()} == read_versions()
