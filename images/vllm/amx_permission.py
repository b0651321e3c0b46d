"""Ask Linux for Intel AMX tiles in every Python process of the vLLM image (a .pth file imports this).

vLLM's CPU attention kernel runs on AMX tiles where the CPU has them (bfloat16, Sapphire Rapids and
later), but never asks the kernel for them (arch_prctl ARCH_REQ_XCOMP_PERM). Linux kills a process
that uses AMX without that permission with SIGILL. With a real model oneDNN's bfloat16 matmuls ask
first; with the tiny model nothing does, and the engine died on its first request. The permission
is per process and vLLM spawns its workers, hence a .pth file rather than a flag.
"""

from __future__ import annotations

import ctypes
import platform

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx() -> bool:
    """True if the kernel granted AMX tile data; False where there is none (or not x86_64 Linux)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


request_amx()
