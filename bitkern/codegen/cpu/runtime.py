"""Process-level prerequisites of the CPU kernels."""

from __future__ import annotations

import ctypes
import functools

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.lru_cache(maxsize=None)
def enable_amx() -> None:
    """Ask Linux for permission to use AMX tile data in this process (needed once before any tile op)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        raise RuntimeError(f"the kernel refused AMX tile data to this process (errno {ctypes.get_errno()}); "
                           f"the AMX template needs Linux 5.16 or newer")
