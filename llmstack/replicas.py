"""Write the compose override that runs N vLLM replicas behind the router, from one definition.

compose/stack.yaml defines one replica, `vllm`. This writes the others (vllm-2 ... vllm-N) as copies
of that service merged with the mode's override files (compose/airgap.yaml, compose.cpu.yaml), adds
what differs per replica, and gives the router their addresses:

  GPU path:  VLLM_GPUS=0,1 -> one replica per listed GPU, pinned with device_ids. Empty: one replica
             reserving GPU_COUNT GPUs, as compose/stack.yaml alone does.
  CPU path:  VLLM_CPU_REPLICAS replicas (default 2), each binding its OpenMP threads to its own
             cores (VLLM_CPU_OMP_THREADS_BIND; cores shared only when there are fewer than replicas).
             VLLM_CPU_RESERVED_CORES (default 0) keeps the host's last cores out of every binding,
             for vLLM's API servers and engine cores, nginx and the router.

Nothing is interpolated: every other setting in .env still takes effect at `docker compose up`. Run it
again (scripts/up.sh does) after changing the number of replicas or compose/stack.yaml's vllm.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmstack import REPO_ROOT
from llmstack.cli import StackError, UsageError, main_exit, parser_from_doc
from llmstack.secrets import read_env_file
from llmstack.versions import read_versions

OUTPUT = REPO_ROOT / ".build" / "compose.replicas.yaml"
SERVICE = "vllm"
PORT = 8000
MAX_REPLICAS = 8
DEFAULT_CPU_REPLICAS = 2
CPU_OVERRIDE = "compose.cpu.yaml"
GPU_ID = re.compile(r"^(\d+|GPU-[0-9a-fA-F-]+)$")
# ${NAME} without a default: the versions, which compose reads from versions.env only for the files
# compose.yaml includes, not for an override given with -f like this one.
BARE_VARIABLE = re.compile(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)\}")


@dataclass(frozen=True)
class Replica:
    name: str
    gpu: str | None = None
    cpu_bind: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.name}:{PORT}"

    def describe(self) -> str:
        if self.gpu is not None:
            return f"{self.name} (GPU {self.gpu})"
        if self.cpu_bind is not None:
            return f"{self.name} (cores {self.cpu_bind})"
        return self.name


def replica_name(index: int) -> str:
    """vllm, vllm-2, vllm-3, ...: the first keeps the service name tests and scripts use."""
    return SERVICE if index == 0 else f"{SERVICE}-{index + 1}"


def core_binds(replicas: int, cores: int) -> list[str]:
    """Each replica's OpenMP cores, in contiguous blocks ("0-3", "4-7"); with fewer cores than
    replicas, one core each, shared round robin."""
    if cores < replicas:
        return [str(i % cores) for i in range(replicas)]
    block = cores // replicas
    return [f"{i * block}" if block == 1 else f"{i * block}-{(i + 1) * block - 1}" for i in range(replicas)]


def plan(settings: Mapping[str, str], cpu_path: bool, cores: int) -> list[Replica]:
    if cpu_path:
        raw = settings.get("VLLM_CPU_REPLICAS") or str(DEFAULT_CPU_REPLICAS)
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_REPLICAS:
            raise UsageError(f"VLLM_CPU_REPLICAS={raw!r}: give a number from 1 to {MAX_REPLICAS}")
        reserved = settings.get("VLLM_CPU_RESERVED_CORES") or "0"
        if not reserved.isdigit() or int(reserved) >= max(cores, 1):
            raise UsageError(f"VLLM_CPU_RESERVED_CORES={reserved!r}: give a number of cores below this host's {cores}")
        binds = core_binds(int(raw), max(cores, 1) - int(reserved))
        return [Replica(replica_name(i), cpu_bind=bind) for i, bind in enumerate(binds)]
    gpus = [g.strip() for g in (settings.get("VLLM_GPUS") or "").split(",") if g.strip()]
    if not gpus:
        return [Replica(SERVICE)]
    bad = [g for g in gpus if not GPU_ID.match(g)]
    if bad:
        raise UsageError(f"VLLM_GPUS: {', '.join(bad)} is not a GPU index or UUID (e.g. VLLM_GPUS=0,1)")
    if len(set(gpus)) != len(gpus):
        raise UsageError(f"VLLM_GPUS={','.join(gpus)} names a GPU twice: one replica per GPU")
    if len(gpus) > MAX_REPLICAS:
        raise UsageError(f"VLLM_GPUS lists {len(gpus)} GPUs; at most {MAX_REPLICAS} replicas")
    return [Replica(replica_name(i), gpu=gpu) for i, gpu in enumerate(gpus)]


# --- Compose files as written (no interpolation), merged for the vllm service ----------------------


class _Reset:
    """compose's `!reset`: the key goes."""


class _Override(list):
    """compose's `!override` on a list: replaces what earlier files gave."""


class _Loader(yaml.SafeLoader):
    pass


def _override(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return _Override(loader.construct_sequence(node, deep=True))
    return loader.construct_mapping(node, deep=True) if isinstance(node, yaml.MappingNode) else node.value


_Loader.add_constructor("!reset", lambda loader, node: _Reset())
_Loader.add_constructor("!override", _override)


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Override, lambda dumper, data: dumper.represent_sequence("!override", list(data)))


def merge(base: Any, override: Any) -> Any:
    """compose's merge for what the override files set on vllm: mappings merge key by key, anything
    else (scalars, lists) replaces, `!reset` removes."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if isinstance(value, _Reset):
                merged.pop(key, None)
            else:
                merged[key] = merge(merged.get(key), value)
        return merged
    return list(override) if isinstance(override, _Override) else copy.deepcopy(override)


def _load(path: Path) -> dict[str, Any]:
    try:
        document = yaml.load(path.read_text(), Loader=_Loader) or {}
    except (OSError, yaml.YAMLError) as err:
        raise StackError(f"cannot read {path}: {err}") from err
    return document if isinstance(document, dict) else {}


def service_definition(compose_files: Sequence[Path], service: str = SERVICE) -> dict[str, Any]:
    """The service as the files define it, merged in order (included files first), uninterpolated."""
    definition: dict[str, Any] = {}
    for path in compose_files:
        document = _load(path)
        for item in document.get("include") or []:
            included = item.get("path") if isinstance(item, dict) else item
            for name in [included] if isinstance(included, str) else included or []:
                definition = merge(definition, service_definition([path.parent / name], service))
        definition = merge(definition, (document.get("services") or {}).get(service) or {})
    if not definition.get("image"):
        raise StackError(f"no {service} service with an image in {', '.join(str(p) for p in compose_files)}")
    return definition


def _with_version_defaults(value: Any, versions: Mapping[str, str]) -> Any:
    """${VLLM_VERSION} -> ${VLLM_VERSION:-<versions.env>}: .env and the shell still win."""
    if isinstance(value, str):
        return BARE_VARIABLE.sub(
            lambda m: f"${{{m[1]}:-{versions[m[1]]}}}" if m[1] in versions else m[0],
            value,
        )
    if isinstance(value, dict):
        return {k: _with_version_defaults(v, versions) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_version_defaults(v, versions) for v in value]
    return value


def _gpu_devices(gpu: str) -> list[dict[str, Any]]:
    return [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]


def _per_replica(replica: Replica) -> dict[str, Any]:
    """What this replica sets on top of the shared definition."""
    service: dict[str, Any] = {}
    if replica.cpu_bind is not None:
        service["environment"] = {"VLLM_CPU_OMP_THREADS_BIND": replica.cpu_bind}
    if replica.gpu is not None:
        service["deploy"] = {"resources": {"reservations": {"devices": _Override(_gpu_devices(replica.gpu))}}}
    return service


def override(replicas: Sequence[Replica], definition: Mapping[str, Any], versions: Mapping[str, str]) -> dict:
    """The override file's content: per-replica settings on vllm, full copies for the others, and
    the router's worker list and start order."""
    shared = {k: v for k, v in definition.items() if k != "build"}
    shared = _with_version_defaults(shared, versions)
    services: dict[str, Any] = {}
    for index, replica in enumerate(replicas):
        own = _per_replica(replica)
        if index == 0:
            if own:
                services[replica.name] = own
            continue
        services[replica.name] = merge(shared, own)
    services["router"] = {
        "environment": {"ROUTER_WORKER_URLS": " ".join(r.url for r in replicas)},
        "depends_on": {r.name: {"condition": "service_healthy"} for r in replicas},
    }
    return {"services": services}


def render(replicas: Sequence[Replica], definition: Mapping[str, Any], versions: Mapping[str, str]) -> str:
    header = (
        "# Written by `python -m llmstack.replicas` (scripts/up.sh runs it): "
        + ", ".join(r.describe() for r in replicas)
        + ".\n# Do not edit: change VLLM_GPUS / VLLM_CPU_REPLICAS in .env or compose/stack.yaml, then run it again.\n"
    )
    body = yaml.dump(override(replicas, definition, versions), Dumper=_Dumper, sort_keys=False, width=1000)
    return header + body


def compose_files_from(value: str, output: Path) -> list[Path]:
    """COMPOSE_FILE's files (':'-separated, from the repo root), less the file this writes."""
    files = [REPO_ROOT / name for name in value.split(":") if name]
    return [f for f in files if f.resolve() != output.resolve()]


def write(
    settings: Mapping[str, str], compose_files: Sequence[Path], output: Path = OUTPUT, cores: int | None = None
) -> list[Replica]:
    cpu_path = any(path.name == CPU_OVERRIDE for path in compose_files)
    replicas = plan(settings, cpu_path, cores if cores is not None else os.cpu_count() or 1)
    text = render(replicas, service_definition(compose_files), read_versions())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    return replicas


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc("python -m llmstack.replicas", __doc__)
    parser.add_argument(
        "--env-file",
        type=Path,
        default=REPO_ROOT / ".env",
        help="settings file (default: .env; the environment wins over it, as with compose)",
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT.relative_to(REPO_ROOT)}")
    parser.add_argument(
        "--compose-files",
        metavar="A:B:C",
        help="the mode's compose files (default: COMPOSE_FILE from the environment or the env file)",
    )
    args: argparse.Namespace = parser.parse_args(argv)
    settings = {**read_env_file(args.env_file), **os.environ}
    files = compose_files_from(args.compose_files or settings.get("COMPOSE_FILE") or "compose.yaml", args.output)
    replicas = write(settings, files, args.output)
    print(
        f"{len(replicas)} vLLM replica(s): {', '.join(r.describe() for r in replicas)} -> {args.output}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    main_exit("python -m llmstack.replicas", main)
