"""torch's CPU code held to one bitkern instruction-set level, so a baseline measured on a higher CPU is the one a
CPU of that level would run (torch bf16 on an AVX2-only machine has no AVX512-BF16 path in oneDNN).

torch reads both variables once, at its first matmul and its first dispatch, so they are set before torch is imported:
`environment(level)` for a child process, `run_at(level)` to restart this script with them.
"""

from __future__ import annotations

import os
import sys

# bitkern level -> (oneDNN's ONEDNN_MAX_CPU_ISA, ATen's ATEN_CPU_CAPABILITY)
TORCH_ISA = {
    "x86-64": ("SSE41", "default"),
    "x86-64-v3": ("AVX2", "avx2"),
    "avx-vnni": ("AVX2_VNNI", "avx2"),
    "avx512": ("AVX512_CORE", "avx512"),
    "avx512-vnni": ("AVX512_CORE_VNNI", "avx512"),
    "avx512-bf16": ("AVX512_CORE_BF16", "avx512"),
    "amx": ("AVX512_CORE_AMX", "avx512"),
}


def environment(level: str) -> dict[str, str]:
    """The variables that hold torch (oneDNN and ATen) and bitkern (BITKERN_CPU_LEVEL) to `level`."""
    if level not in TORCH_ISA:
        raise ValueError(f"level {level!r} is not known; accepted: {list(TORCH_ISA)}")
    onednn, aten = TORCH_ISA[level]
    return {"ONEDNN_MAX_CPU_ISA": onednn, "ATEN_CPU_CAPABILITY": aten, "BITKERN_CPU_LEVEL": level}


def run_at(level: str | None) -> None:
    """Restart this process with `environment(level)` unless it already has it (nothing for level None)."""
    if level is None:
        return
    wanted = environment(level)
    if any(os.environ.get(key) != value for key, value in wanted.items()):
        if "torch" in sys.modules:
            raise RuntimeError("run_at() must run before torch is imported")
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **wanted})
