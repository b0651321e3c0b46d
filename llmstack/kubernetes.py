"""The stack on Kubernetes (deploy/kubernetes): render every overlay with `kubectl kustomize` and check
it against the Kubernetes API schemas of the supported versions, offline (kubernetes-validate).

The compose files stay the one definition: tests/unit/test_kubernetes.py compares the rendered
manifests with them (settings, commands, health checks, mounted config files, images) through the
helpers here. No cluster is needed or reached.

  python -m llmstack.kubernetes            # render and validate every overlay and example
  python -m llmstack.kubernetes --json     # the same, as JSON
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from llmstack import REPO_ROOT, composefile
from llmstack.cli import StackError, add_json_argument, main_exit, parser_from_doc

KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
SUPPORTED_VERSIONS = ("1.35", "1.36", "1.37")
"""The Kubernetes releases the manifests are validated against (kubernetes-validate's schemas)."""

OVERLAYS: dict[str, tuple[str, ...]] = {
    # Each overlay and the compose files of the path it mirrors.
    "gpu": ("compose.yaml",),
    "cpu": ("compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"),
}
EXAMPLES: dict[str, str] = {
    # deploy/kubernetes/examples/<name> -> the overlay it builds on.
    "gpu-ingress-keda": "gpu",
    "gpu-loadbalancer-hpa": "gpu",
    "cpu-gateway-api": "cpu",
}
CRD_KINDS = {
    # Kinds of optional add-ons (components/) whose schemas are CRDs kubernetes-validate does not ship:
    # skipped by the validation, and named in its report.
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}
NOT_DEPLOYED = {
    # compose services with no Kubernetes counterpart, and why.
    "locust-master": "the load generator: run it against the gateway from outside the cluster",
    "locust-worker": "the load generator: run it against the gateway from outside the cluster",
    "dcgm-exporter": "on Kubernetes NVIDIA's GPU operator runs the DCGM exporter on every GPU node",
}
EXPOSED_SERVICE = "gateway"
"""The one Service that may be exposed (LoadBalancer, NodePort, an Ingress or an HTTPRoute backend)."""

DURATION = re.compile(r"(\d+)(ms|h|m|s)")
SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        raise StackError("kubectl is not installed: deploy/kubernetes is rendered with `kubectl kustomize`")
    return found


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR` (default load restrictor, as a user runs it), as a list of objects."""
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"kubectl kustomize {directory} failed: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def is_crd_kind(obj: Mapping[str, Any]) -> bool:
    return (obj.get("apiVersion"), obj.get("kind")) in CRD_KINDS


@functools.cache
def _definitions(version: str) -> Any:
    from kubernetes_validate import utils
    from referencing import Resource

    return Resource.from_contents(
        utils.schema_contents(f"kubernetes-json-schema/v{version}.0-local-strict/_definitions.json", version)
    )


@functools.cache
def _validator(version: str, api_version: str, kind: str) -> Any:
    """A strict validator of one kind for one Kubernetes version, built once from kubernetes-validate's
    schemas (its own validate() reloads every schema per call: minutes for all the overlays)."""
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{version}.0-local-strict"
    try:
        schema = utils.schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        return None
    registry: Registry = _definitions(version) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def validate(objects: Sequence[Mapping[str, Any]], versions: Sequence[str] = SUPPORTED_VERSIONS) -> list[str]:
    """Strict schema errors of every object for every version (empty: all valid), as
    `kubernetes-validate --strict -k VERSION` finds them; CRD kinds are skipped (is_crd_kind)."""
    errors = []
    for obj in objects:
        if not is_crd_kind(obj):
            text = json.dumps(obj, sort_keys=True)
            errors += [error for version in versions for error in _object_errors(text, version)]
    return errors


@functools.cache
def _object_errors(text: str, version: str) -> tuple[str, ...]:
    """One object's errors (cached: the overlays and examples share most of their objects)."""
    obj = json.loads(text)
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    validator = _validator(version, str(obj.get("apiVersion")), str(obj.get("kind")))
    if validator is None:
        return (f"{name}: Kubernetes {version} has no {obj.get('apiVersion')} {obj.get('kind')}",)
    return tuple(
        f"{name} (Kubernetes {version}): {error.message} at {'/'.join(map(str, error.absolute_path))}"
        for error in validator.iter_errors(obj)
    )


# --- The compose side --------------------------------------------------------------------------


def _interpolated(value: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return composefile.interpolate(value, environ)
    if isinstance(value, dict):
        return {k: _interpolated(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolated(v, environ) for v in value]
    return value


def _merged(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in override.items()}}
    return override


@functools.cache
def compose_services(files: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every service as the files define it with no .env (compose's defaults), merged in order and
    interpolated; `raw_volumes` keeps the volumes as written (a literal ./path is a repo file)."""
    services: dict[str, dict[str, Any]] = {}
    for layer in composefile.layers([Path(f) for f in files], {}):
        for name, spec in (layer.document.get("services") or {}).items():
            spec = spec or {}
            current = services.setdefault(name, {})
            merged = _merged(current, _interpolated(spec, layer.environ))
            if "volumes" in spec:
                merged["raw_volumes"] = spec["volumes"]
            services[name] = merged
    return services


def compose_environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's environment as the container gets it ($$ is compose's escape of $)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: "" if v is None else str(v).replace("$$", "$") for k, v in raw.items()}


def compose_words(value: Any) -> list[str]:
    """An entrypoint or command as the words the container runs ($$ unescaped)."""
    if value is None:
        return []
    words = [value] if isinstance(value, str) else list(value)
    return [str(w).replace("$$", "$") for w in words]


def seconds(duration: str) -> float:
    """compose's durations: 5s, 30m, 1m30s, 500ms."""
    parts = DURATION.findall(duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise StackError(f"not a duration: {duration!r}")
    return sum(int(n) * SECONDS[u] for n, u in parts)


@dataclass(frozen=True)
class Probe:
    """What compose's healthcheck asks, in Kubernetes' terms."""

    path: str
    port: int
    period: int
    timeout: int
    failures: int
    startup_failures: int
    """start_period spent in checks of `period`, then `failures` more: compose ignores failures
    during start_period, then counts `retries` consecutive ones."""


def probe_from_healthcheck(healthcheck: Mapping[str, Any]) -> Probe:
    url = composefile.health_url(dict(healthcheck))
    match = re.match(r"https?://[^/:]+:(\d+)(/\S*)", url or "")
    if not match:
        raise StackError(f"no http://host:port/path in the healthcheck {healthcheck.get('test')}")
    period = seconds(healthcheck["interval"])
    retries = int(healthcheck["retries"])
    start = seconds(healthcheck.get("start_period", "0s"))
    return Probe(
        path=match.group(2),
        port=int(match.group(1)),
        period=int(period),
        timeout=int(seconds(healthcheck["timeout"])),
        failures=retries,
        startup_failures=math.ceil(start / period) + retries,
    )


def config_mounts(service: Mapping[str, Any]) -> list[tuple[Path, str]]:
    """The repository files and folders compose bind-mounts into a service: (path under the repo,
    path in the container). A source written as a setting (${MODELS_DIR:-./models}) is the user's
    data, not the stack's config."""
    mounts = []
    for volume in service.get("raw_volumes") or []:
        source, target = volume.split(":")[:2] if isinstance(volume, str) else (volume["source"], volume["target"])
        if source.startswith("./"):
            mounts.append((Path(source[2:]), target))
    return mounts


def repo_files(path: Path) -> list[Path]:
    """The files compose mounts for a mounted path: the file itself, or the folder's files
    (recursively; a deploy/kubernetes kustomization.yaml beside them is not config)."""
    full = REPO_ROOT / path
    if full.is_file():
        return [path]
    return sorted(
        p.relative_to(REPO_ROOT)
        for p in full.rglob("*")
        if p.is_file() and p.name != "kustomization.yaml" and "__pycache__" not in p.parts
    )


# --- The Kubernetes side -----------------------------------------------------------------------


def workloads(objects: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Deployments and StatefulSets by name (each named as its compose service)."""
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def _configmaps(objects: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, str]]:
    return {o["metadata"]["name"]: o.get("data") or {} for o in objects if o["kind"] == "ConfigMap"}


def _volume_files(volume: Mapping[str, Any], configmaps: Mapping[str, Mapping[str, str]]) -> dict[str, str] | None:
    """path in the volume -> content, for a configMap or projected-configMap volume; None for others."""

    def from_configmap(source: Mapping[str, Any]) -> dict[str, str]:
        data = configmaps.get(source["name"])
        if data is None:
            raise StackError(f"volume {volume['name']} names ConfigMap {source['name']}, which is not rendered")
        items = source.get("items")
        if items is None:
            return dict(data)
        return {item["path"]: data[item["key"]] for item in items if item["key"] in data}

    if "configMap" in volume:
        return from_configmap(volume["configMap"])
    if "projected" in volume:
        files: dict[str, str] = {}
        sources = volume["projected"].get("sources") or []
        if not any("configMap" in s for s in sources):
            return None
        for source in sources:
            if "configMap" in source:
                files |= from_configmap(source["configMap"])
        return files
    return None


def container_files(
    objects: Sequence[Mapping[str, Any]], workload: Mapping[str, Any], container: Mapping[str, Any]
) -> dict[str, str]:
    """Every file a container sees from a ConfigMap: absolute path -> content."""
    configmaps = _configmaps(objects)
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes") or []}
    files: dict[str, str] = {}
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in volumes:  # a StatefulSet's volumeClaimTemplates
            continue
        content = _volume_files(volumes[mount["name"]], configmaps)
        if content is None:
            continue
        if "subPath" in mount:
            if mount["subPath"] in content:
                files[mount["mountPath"]] = content[mount["subPath"]]
        else:
            files |= {f"{mount['mountPath'].rstrip('/')}/{path}": text for path, text in content.items()}
    return files


def container_environment(objects: Sequence[Mapping[str, Any]], container: Mapping[str, Any]) -> dict[str, str]:
    """The environment a container gets from its ConfigMaps (envFrom) and its own literal env values,
    the latter winning as in Kubernetes; values from Secrets or fields are left out."""
    configmaps = _configmaps(objects)
    environment: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        if "configMapRef" in source:
            environment |= configmaps[source["configMapRef"]["name"]]
    for item in container.get("env") or []:
        if "value" in item:
            environment[item["name"]] = item["value"]
    return environment


@dataclass(frozen=True)
class Report:
    directory: str
    objects: int
    skipped_crd_kinds: list[str]
    errors: list[str]


def check_all() -> list[Report]:
    """Every overlay and example, rendered and validated against every supported version."""
    directories = [KUBERNETES_DIR / "overlays" / name for name in OVERLAYS]
    directories += [KUBERNETES_DIR / "examples" / name for name in EXAMPLES]
    reports = []
    for directory in directories:
        objects = render(directory)
        skipped = sorted({f"{o['apiVersion']} {o['kind']}" for o in objects if is_crd_kind(o)})
        reports.append(Report(str(directory.relative_to(REPO_ROOT)), len(objects), skipped, validate(objects)))
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc("python -m llmstack.kubernetes", __doc__)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    reports = check_all()
    if args.json:
        print(json.dumps({"validated_against": SUPPORTED_VERSIONS, "reports": [asdict(r) for r in reports]}, indent=2))
    else:
        versions = ", ".join(SUPPORTED_VERSIONS)
        for report in reports:
            verdict = f"{len(report.errors)} errors" if report.errors else "valid"
            print(f"{report.directory}: {report.objects} objects, {verdict} for Kubernetes {versions}")
            if report.skipped_crd_kinds:
                print(f"  not validated (CRDs): {', '.join(report.skipped_crd_kinds)}")
            for error in report.errors:
                print(f"  {error}")
    return 1 if any(r.errors for r in reports) else 0


if __name__ == "__main__":
    main_exit("python -m llmstack.kubernetes", main)
