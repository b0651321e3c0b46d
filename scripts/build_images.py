#!/usr/bin/env python3
"""Build every image the stack needs without a container registry (the air-gapped path).

Needs only Debian's package mirror and PyPI. First a Debian base image is made with mmdebstrap
and `docker import`; then each service that has a `build:` section in the merged compose files
(compose.airgap.yaml, and compose.cpu.yaml for machines without a GPU) is built from its
Dockerfile under images/ with `docker build`. Extra CA certificates (for a TLS-inspecting proxy)
are copied into every image: by default the host's own additions in
/usr/local/share/ca-certificates, plus any given with --ca-cert.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO_ROOT / ".build"
EXTRA_CA_DIR = BUILD_DIR / "extra-ca"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
COMPOSE_FILES = {
    "cpu": ["compose.yaml", "compose.airgap.yaml", "compose.cpu.yaml"],
    "gpu": ["compose.yaml", "compose.airgap.yaml"],
}
DEBIAN_SUITE = "bookworm"
STEP_PATTERN = re.compile(r"^Step (\d+)/(\d+) :")


class BuildError(Exception):
    """A build step failed; the message is for the user."""


@dataclass
class ImageBuild:
    service: str
    image: str
    dockerfile: str
    context: str
    args: dict[str, str] = field(default_factory=dict)


def build_args(args: dict | list | None) -> dict[str, str]:
    """Build args as compose writes them: a mapping, or (uninterpolated) a list of KEY=VALUE."""
    if isinstance(args, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in args)
    return {k: "" if v is None else str(v) for k, v in (args or {}).items()}


def plan_builds(compose_config: dict) -> list[ImageBuild]:
    """The image builds a merged compose config asks for, one per distinct image name."""
    builds: dict[str, ImageBuild] = {}
    for name, service in sorted(compose_config.get("services", {}).items()):
        build = service.get("build")
        if not build:
            continue
        image = service.get("image")
        if not image:
            raise BuildError(f"service {name} has a build section but no image name to tag")
        context = build.get("context", ".")
        args = build_args(build.get("args"))
        builds.setdefault(image, ImageBuild(name, image, build.get("dockerfile", "Dockerfile"),
                                            context, args))
    return list(builds.values())


def base_images(builds: list[ImageBuild]) -> list[str]:
    return sorted({b.args["BASE_IMAGE"] for b in builds if b.args.get("BASE_IMAGE")})


def compose_config(files: list[str]) -> dict:
    command = ["docker", "compose"]
    for f in files:
        command += ["-f", str(REPO_ROOT / f)]
    # Uninterpolated: builds need no settings, so a machine without .env or secrets can build.
    command += ["config", "--no-interpolate", "--format", "json"]
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError as err:
        raise BuildError(f"cannot run docker: {err.strerror}") from err
    if result.returncode != 0:
        message = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise BuildError(f"docker compose config failed: {message}")
    return json.loads(result.stdout)


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
            raise BuildError(f"{source} is not a PEM certificate (a DER one? convert it: "
                             f"openssl x509 -inform der -in {source} -out {source.stem}.crt)") from None
        except OSError as error:
            raise BuildError(f"{source}: {error.strerror}") from None
        if "-----BEGIN CERTIFICATE-----" not in text:
            raise BuildError(f"{source} is not a PEM certificate")
        target = EXTRA_CA_DIR / f"{index:02d}-{source.stem}.crt"
        target.write_text(text)
        staged.append(source.name)
    # Keep the folder in the build context even when empty.
    (EXTRA_CA_DIR / "README").write_text("CA certificates staged by scripts/build_images.py\n")
    return staged


def progress_line(label: str, step: int, total: int, started: float) -> str:
    width = 24
    filled = int(width * step / total) if total else 0
    bar = "#" * filled + "-" * (width - filled)
    return f"\r  {label:<34} [{bar}] {step:>2}/{total:<2} {time.monotonic() - started:6.0f}s"


def run_logged(command: list[str], log_path: Path, label: str, stdin=None, bar: bool = True) -> None:
    """Run a command with its output in a log file, showing its progress from docker's steps:
    a bar on a terminal (one build at a time), else a line per step."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    step, total = 0, 0
    interactive = bar and sys.stderr.isatty()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdin=stdin, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace")
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            match = STEP_PATTERN.match(line)
            if match:
                step, total = int(match.group(1)), int(match.group(2))
                if interactive:
                    sys.stderr.write(progress_line(label, step, total, started))
                else:
                    print(f"  {label}: step {step}/{total} at {time.monotonic() - started:.0f}s",
                          file=sys.stderr)
        code = process.wait()
    if interactive:
        sys.stderr.write("\n")
    if code != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise BuildError(f"{label} failed (exit {code}); last lines of {log_path}:\n{tail}")


def build_base_image(image: str, mirror: str, security_mirror: str) -> None:
    if shutil.which("mmdebstrap") is None:
        raise BuildError("mmdebstrap is not installed (apt-get install mmdebstrap)")
    sources = [
        f"deb {mirror} {DEBIAN_SUITE} main",
        f"deb {mirror} {DEBIAN_SUITE}-updates main",
        f"deb {security_mirror} {DEBIAN_SUITE}-security main",
    ]
    with tempfile.TemporaryDirectory(prefix="llm-stack-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        run_logged(["mmdebstrap", "--variant=minbase", "--include=ca-certificates",
                    DEBIAN_SUITE, str(rootfs), *sources],
                   BUILD_DIR / "logs" / "base.log", f"{image} (mmdebstrap)")
        with open(rootfs, "rb") as tar:
            run_logged(["docker", "import", "--change", 'CMD ["/bin/bash"]',
                        "--change", "ENV LANG=C.UTF-8", "-", image],
                       BUILD_DIR / "logs" / "base-import.log", f"{image} (import)", stdin=tar)


def build_image(build: ImageBuild, bar: bool = True) -> None:
    # compose resolves the context to an absolute path and keeps the Dockerfile relative to it.
    dockerfile = Path(build.context) / build.dockerfile
    command = ["docker", "build", "-f", str(dockerfile), "-t", build.image]
    for key, value in build.args.items():
        command += ["--build-arg", f"{key}={value}"]
    command.append(build.context)
    run_logged(command, BUILD_DIR / "logs" / f"{build.service}.log", build.image, bar=bar)


def build_all(builds: list[ImageBuild], jobs: int) -> None:
    """Build several images at once: the vLLM image waits mostly on downloads and disk, so the
    small images fit beside it."""
    if jobs <= 1 or len(builds) <= 1:
        for build in builds:
            build_image(build)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(build_image, build, False) for build in builds]
        errors = [f.exception() for f in futures if f.exception()]
    if errors:
        raise BuildError("\n".join(str(e) for e in errors))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(COMPOSE_FILES), default="cpu",
                        help="cpu: vLLM's CPU build and the tiny model (default); gpu: vLLM's CUDA build")
    parser.add_argument("--only", action="append", default=[], metavar="SERVICE",
                        help="build only this service's image (repeatable)")
    parser.add_argument("--ca-cert", action="append", default=[], type=Path, metavar="FILE",
                        help="an extra PEM CA certificate to trust while building (repeatable)")
    parser.add_argument("--no-host-ca", action="store_true",
                        help=f"do not copy the host's {HOST_CA_DIR}/*.crt into the images")
    parser.add_argument("--rebuild-base", action="store_true",
                        help="make the Debian base image again even if it exists")
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
    try:
        builds = plan_builds(compose_config(COMPOSE_FILES[args.variant]))
        if args.only:
            unknown = sorted(set(args.only) - {b.service for b in builds})
            if unknown:
                raise BuildError(f"no image to build for service(s): {', '.join(unknown)}")
            builds = [b for b in builds if b.service in args.only]
        bases = base_images(builds)
        print(f"Plan ({args.variant}): base {', '.join(bases) or '-'}; "
              + ", ".join(f"{b.service} -> {b.image}" for b in builds), file=sys.stderr)
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
        builds.sort(key=lambda b: not b.service.startswith("vllm"))
        build_all(builds, args.jobs)
    except BuildError as err:
        print(f"build_images: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build_images: interrupted", file=sys.stderr)
        return 130
    print(f"Built {len(builds)} image(s) in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
