"""The compose files read without Docker (a GPU host without Docker runs the stack's own commands
from them): YAML with compose's tags, `include:` with its env_file, and ${VAR} interpolation.

Interpolation follows compose's rules for ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}
and ${VAR?message}; `$$` stays as written (a literal `$` for the container's shell).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmstack import REPO_ROOT
from llmstack.cli import StackError, UsageError
from llmstack.secrets import read_env_file

# The default may hold one level of braces (Grafana's $$__env{...} in compose/stack.yaml).
INTERPOLATION = re.compile(
    r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>(?:[^{}]|\{[^{}]*\})*))?\}"
)
HEALTH_URL = re.compile(r"https?://[^'\"\s]+")


class _ComposeLoader(yaml.SafeLoader):
    """safe_load that accepts compose's own tags (!reset, !override) as plain values."""


def _any_tag(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


_ComposeLoader.add_multi_constructor("!", _any_tag)


def load(path: Path) -> dict:
    try:
        return yaml.load(path.read_text(), Loader=_ComposeLoader) or {}
    except OSError as err:
        raise StackError(f"cannot read {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise StackError(f"{path} is not YAML: {err}") from err


def interpolate(value: str, environ: Mapping[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?message} against the given settings."""

    def replace(match: re.Match) -> str:
        name, op, default = match["name"], match["op"], match["default"] or ""
        current = environ.get(name)
        if op in (":-", "-"):
            if current is None or (op == ":-" and current == ""):
                return interpolate(default, environ)
            return current
        if op in (":?", "?") and not current:
            raise UsageError(f"{name} must be set: {default}")
        return current or ""

    return INTERPOLATION.sub(replace, str(value))


@dataclass(frozen=True)
class Layer:
    """One compose file and the settings its ${VAR}s are read against."""

    path: Path
    document: dict
    environ: Mapping[str, str]


def layers(files: list[Path], environ: Mapping[str, str], base: Path = REPO_ROOT) -> list[Layer]:
    """The files in merge order: each file's `include:`s (with their env_file, which the given
    settings override) before the file itself."""
    found: list[Layer] = []
    for name in files:
        path = name if name.is_absolute() else base / name
        document = load(path)
        for item in document.get("include") or []:
            spec = {"path": item} if isinstance(item, str) else item
            included_env: dict[str, str] = {}
            env_files = spec.get("env_file") or []
            for env_file in [env_files] if isinstance(env_files, str) else env_files:
                included_env |= read_env_file(path.parent / env_file)
            included = spec["path"] if isinstance(spec["path"], list) else [spec["path"]]
            found += layers([path.parent / p for p in included], included_env | dict(environ), base)
        found.append(Layer(path, document, environ))
    return found


def service(files: list[Path], name: str, environ: Mapping[str, str]) -> dict:
    """A service's environment (interpolated), command and healthcheck after merging the files."""
    merged: dict[str, Any] = {"environment": {}, "command": [], "healthcheck": {}}
    for layer in layers(files, environ):
        spec = (layer.document.get("services") or {}).get(name) or {}
        raw = spec.get("environment") or {}
        if isinstance(raw, list):
            raw = dict(item.split("=", 1) for item in raw)
        merged["environment"].update({key: interpolate(value, layer.environ) for key, value in raw.items()})
        for key in ("command", "healthcheck"):
            if spec.get(key):
                merged[key] = spec[key]
    return merged


def secret_names(files: list[Path], environ: Mapping[str, str]) -> list[str]:
    names: list[str] = []
    for layer in layers(files, environ):
        names += [n for n in (layer.document.get("secrets") or {}) if n not in names]
    return names


def health_url(healthcheck: dict) -> str | None:
    """The URL a service's healthcheck polls (its port is written only there)."""
    match = HEALTH_URL.search(" ".join(map(str, healthcheck.get("test") or [])))
    return match.group(0) if match else None
