"""Build every image the stack needs without a container registry (the air-gapped path).

Needs only Debian's package mirror and PyPI. First the Debian base images the builds start from
(llm-stack/debian:<suite>, the tag naming the Debian suite) are made with mmdebstrap and
`docker import`; then each service that has a `build:` section in the merged compose files
(compose.airgap.yaml, and compose.cpu.yaml for machines without a GPU) is built from its
Dockerfile under images/ with `docker build`, with the build args compose sets from versions.env.
Extra CA certificates (for a TLS-inspecting proxy) are copied into every image: by default the
host's own additions in /usr/local/share/ca-certificates, plus any given with --ca-cert.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from llmstack import REPO_ROOT
from llmstack.cli import StackError, UsageError, parser_from_doc, progress

BUILD_DIR = REPO_ROOT / ".build"
LOG_DIR = BUILD_DIR / "logs"
EXTRA_CA_DIR = BUILD_DIR / "extra-ca"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
COMPOSE_FILES = {
    "cpu": ["compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"],
    "gpu": ["compose.yaml", "compose.airgap.yaml"],
}
# Base images this tool makes: the tag is the Debian suite mmdebstrap installs.
DEBIAN_BASE = "llm-stack/debian:"
STEP_PREFIX = "Step "


@dataclass
class ImageBuild:
    services: list[str]
    image: str
    dockerfile: str
    context: str
    args: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.services[0]


def build_args(args: dict[str, Any] | list[str] | None) -> dict[str, str]:
    """Build args as compose writes them: a mapping, or a list of KEY=VALUE."""
    if isinstance(args, list):
        return {key: value for key, _, value in (item.partition("=") for item in args)}
    return {key: "" if value is None else str(value) for key, value in (args or {}).items()}


def plan_builds(config: dict[str, Any]) -> list[ImageBuild]:
    """The image builds a merged compose config asks for, one per distinct image name."""
    builds: dict[str, ImageBuild] = {}
    for name, service in sorted(config.get("services", {}).items()):
        build = service.get("build")
        if not build:
            continue
        image = service.get("image")
        if not image:
            raise StackError(f"service {name} has a build section but no image name to tag")
        if image in builds:
            builds[image].services.append(name)
            continue
        builds[image] = ImageBuild(
            [name],
            image,
            build.get("dockerfile", "Dockerfile"),
            build.get("context", "."),
            build_args(build.get("args")),
        )
    return list(builds.values())


def select_builds(builds: list[ImageBuild], services: Sequence[str]) -> list[ImageBuild]:
    """The builds of the named services (--only); an unknown name is a usage error."""
    if not services:
        return builds
    known = {service for build in builds for service in build.services}
    unknown = sorted(set(services) - known)
    if unknown:
        raise UsageError(f"no image to build for service(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return [build for build in builds if set(build.services) & set(services)]


def base_images(builds: list[ImageBuild]) -> list[str]:
    """The Debian bases (llm-stack/debian:<suite>) the builds start from."""
    return sorted({b.args["BASE_IMAGE"] for b in builds if b.args.get("BASE_IMAGE", "").startswith(DEBIAN_BASE)})


def debian_suite(base_image: str) -> str:
    """llm-stack/debian:trixie -> trixie: the tag names the suite, so no mapping is kept."""
    if not base_image.startswith(DEBIAN_BASE) or len(base_image) == len(DEBIAN_BASE):
        raise StackError(f"{base_image} is not a base this tool makes ({DEBIAN_BASE}<debian suite>)")
    return base_image[len(DEBIAN_BASE) :]


def compose_config(files: Sequence[str]) -> dict[str, Any]:
    """The merged, interpolated compose config (versions from versions.env, .env still wins)."""
    command = ["docker", "compose"]
    for name in files:
        command += ["-f", str(REPO_ROOT / name)]
    command += ["config", "--format", "json"]
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError as err:
        raise StackError(f"cannot run docker: {err.strerror}") from err
    if result.returncode != 0:
        message = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise StackError(f"docker compose config failed: {message}")
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def image_exists(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def stage_ca_certificates(extra: list[Path], use_host: bool) -> list[str]:
    if EXTRA_CA_DIR.exists():
        shutil.rmtree(EXTRA_CA_DIR)
    EXTRA_CA_DIR.mkdir(parents=True)
    sources = sorted(HOST_CA_DIR.glob("*.crt")) if use_host and HOST_CA_DIR.is_dir() else []
    sources += extra
    staged = []
    for index, source in enumerate(sources):
        try:
            text = source.read_text()
        except UnicodeDecodeError:
            raise UsageError(
                f"{source} is not a PEM certificate (a DER one? convert it: "
                f"openssl x509 -inform der -in {source} -out {source.stem}.crt)"
            ) from None
        except OSError as error:
            raise UsageError(f"{source}: {error.strerror}") from None
        if "-----BEGIN CERTIFICATE-----" not in text:
            raise UsageError(f"{source} is not a PEM certificate")
        target = EXTRA_CA_DIR / f"{index:02d}-{source.stem}.crt"
        target.write_text(text)
        staged.append(source.name)
    # Keep the folder in the build context even when empty; the text is part of every image's
    # cache key, so it does not change.
    (EXTRA_CA_DIR / "README").write_text("CA certificates staged by scripts/build_images.py\n")
    return staged


def progress_line(label: str, step: int, total: int, started: float) -> str:
    width = 24
    filled = int(width * step / total) if total else 0
    bar = "#" * filled + "-" * (width - filled)
    return f"\r  {label:<34} [{bar}] {step:>2}/{total:<2} {time.monotonic() - started:6.0f}s"


def docker_step(line: str) -> tuple[int, int] | None:
    """(step, total) from the classic builder's "Step 3/12 : ..." lines."""
    if not line.startswith(STEP_PREFIX):
        return None
    counts = line[len(STEP_PREFIX) :].split(" ", 1)[0].split("/")
    if len(counts) != 2 or not all(c.isdigit() for c in counts):
        return None
    return int(counts[0]), int(counts[1])


def run_logged(
    command: list[str], log_path: Path, label: str, stdin: IO[bytes] | None = None, bar: bool = True
) -> None:
    """Run a command with its output in a log file, showing its progress from docker's steps:
    a bar on a terminal (one build at a time), else a line per step."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    interactive = bar and sys.stderr.isatty()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            step = docker_step(line)
            if step is None:
                continue
            if interactive:
                sys.stderr.write(progress_line(label, *step, started))
            else:
                progress(f"{label}: step {step[0]}/{step[1]} at {time.monotonic() - started:.0f}s")
        code = process.wait()
    if interactive:
        sys.stderr.write("\n")
    if code != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise StackError(f"{label} failed (exit {code}); last lines of {log_path}:\n{tail}")


def build_base_image(image: str, mirror: str, security_mirror: str) -> None:
    if shutil.which("mmdebstrap") is None:
        raise StackError("mmdebstrap is not installed (scripts/install-tools.sh --build)")
    suite = debian_suite(image)
    sources = [
        f"deb {mirror} {suite} main",
        f"deb {mirror} {suite}-updates main",
        f"deb {security_mirror} {suite}-security main",
    ]
    with tempfile.TemporaryDirectory(prefix="llm-stack-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        run_logged(
            ["mmdebstrap", "--variant=minbase", "--include=ca-certificates", suite, str(rootfs), *sources],
            LOG_DIR / f"base-{suite}.log",
            f"{image} (mmdebstrap)",
        )
        with open(rootfs, "rb") as tar:
            import_command = ["docker", "import", "--change", 'CMD ["/bin/bash"]', "--change", "ENV LANG=C.UTF-8"]
            run_logged(
                [*import_command, "-", image], LOG_DIR / f"base-{suite}-import.log", f"{image} (import)", stdin=tar
            )


def build_image(build: ImageBuild, bar: bool = True) -> None:
    # compose resolves the context to an absolute path and keeps the Dockerfile relative to it.
    dockerfile = Path(build.context) / build.dockerfile
    command = ["docker", "build", "-f", str(dockerfile), "-t", build.image]
    for key, value in build.args.items():
        command += ["--build-arg", f"{key}={value}"]
    command.append(build.context)
    run_logged(command, LOG_DIR / f"{build.name}.log", build.image, bar=bar)


def build_all(builds: list[ImageBuild], jobs: int) -> None:
    """Build several images at once: the vLLM image waits mostly on downloads and disk, so the
    small images fit beside it."""
    if jobs <= 1 or len(builds) <= 1:
        for build in builds:
            build_image(build)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(build_image, build, False) for build in builds]
        errors = [error for error in (f.exception() for f in futures) if error]
    if errors:
        raise StackError("\n".join(str(e) for e in errors))


def image_size(image: str) -> str:
    result = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Size}}", image], capture_output=True, text=True
    )
    return f"{int(result.stdout) / 1e9:.2f} GB" if result.returncode == 0 else "?"


def parse_args(argv: list[str] | None) -> Any:
    parser = parser_from_doc("build_images", __doc__)
    parser.add_argument(
        "--variant",
        choices=sorted(COMPOSE_FILES),
        default="cpu",
        help="cpu: vLLM's CPU build and the tiny model (default); gpu: vLLM's CUDA build",
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="SERVICE", help="build only this service's image (repeatable)"
    )
    parser.add_argument(
        "--ca-cert",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="an extra PEM CA certificate to trust while building (repeatable)",
    )
    parser.add_argument(
        "--no-host-ca", action="store_true", help=f"do not copy the host's {HOST_CA_DIR}/*.crt into the images"
    )
    parser.add_argument(
        "--rebuild-base", action="store_true", help="make the Debian base images again even if they exist"
    )
    parser.add_argument("--mirror", default="http://deb.debian.org/debian")
    parser.add_argument("--security-mirror", default="http://deb.debian.org/debian-security")
    parser.add_argument("--jobs", type=int, default=2, help="images built at once (default 2)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and build nothing")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    for cert in args.ca_cert:
        if not cert.is_file():
            parser.error(f"--ca-cert {cert}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    builds = select_builds(plan_builds(compose_config(COMPOSE_FILES[args.variant])), args.only)
    bases = base_images(builds)
    plan = ", ".join(f"{'/'.join(b.services)} -> {b.image}" for b in builds)
    print(f"Plan ({args.variant}): base {', '.join(bases) or '-'}; {plan}", file=sys.stderr)
    if args.dry_run:
        return 0
    staged = stage_ca_certificates(args.ca_cert, use_host=not args.no_host_ca)
    if staged:
        print(f"Extra CA certificates: {', '.join(staged)}", file=sys.stderr)
    for base in bases:
        if args.rebuild_base or not image_exists(base):
            build_base_image(base, args.mirror, args.security_mirror)
        else:
            print(f"  {base}: present (use --rebuild-base to make it again)", file=sys.stderr)
    # The largest build first, so the others overlap with it.
    builds.sort(key=lambda b: not b.name.startswith("vllm"))
    build_all(builds, args.jobs)
    for build in builds:
        print(f"  {build.image}: {image_size(build.image)}", file=sys.stderr)
    print(f"Built {len(builds)} image(s) in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0
