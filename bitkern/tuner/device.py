"""tTile-device descriptions (LADDER §3.1): what a target's memory levels and compute units prefer.

`host_cpu()` reads the machine this process runs on (instruction sets from /proc/cpuinfo, cache sizes
from sysfs, usable cores from the scheduler) and gives the TVM LLVM target that compiles for it.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

# LLVM CPU names that enable the features bitkern's CPU templates use, most capable first.
_LLVM_CPUS = (
    ({"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"}, "sapphirerapids"),
    ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "icelake-server"),
    ({"avx512f", "avx512bw"}, "skylake-avx512"),
    ({"avx2", "fma"}, "haswell"),
)


@dataclass(frozen=True)
class CpuDevice:
    """An x86-64 CPU: vector width, cache capacities, matrix units, cores."""

    name: str
    llvm_cpu: str
    cores: int
    vector_bytes: int
    l1_bytes: int
    l2_bytes: int
    llc_bytes: int
    has_amx_bf16: bool
    flags: frozenset

    @property
    def kind(self) -> str:
        return "cpu"

    @property
    def key(self) -> str:
        """Identifies the code this device runs: the cache key's target part."""
        return f"cpu-{self.llvm_cpu}-{self.cores}c"

    def tvm_target(self):
        """The TVM LLVM target for this CPU (triple and CPU given explicitly, as TVM needs)."""
        import tvm

        return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": self.llvm_cpu,
                                  "num-cores": self.cores})


@functools.lru_cache(maxsize=None)
def host_cpu() -> CpuDevice:
    """The CPU this process runs on."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"bitkern's CPU kernels need an x86-64 CPU; this machine is {platform.machine()}")
    flags = _cpu_flags()
    llvm_cpu = next((cpu for needed, cpu in _LLVM_CPUS if needed <= flags), "x86-64")
    vector_bytes = 64 if "avx512f" in flags else 32 if "avx2" in flags else 16
    return CpuDevice(
        name=_cpu_model(), llvm_cpu=llvm_cpu, cores=_usable_cores(), vector_bytes=vector_bytes,
        l1_bytes=_cache_bytes(1, "Data", 48 << 10), l2_bytes=_cache_bytes(2, "Unified", 2 << 20),
        llc_bytes=_cache_bytes(3, "Unified", 32 << 20),
        has_amx_bf16={"amx_tile", "amx_bf16"} <= flags, flags=frozenset(flags))


def _usable_cores() -> int:
    import torch

    return max(1, min(len(os.sched_getaffinity(0)), torch.get_num_threads()))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "x86-64"


def _cache_bytes(level: int, kind: str, default: int) -> int:
    """Size of the CPU's cache of `level` and `kind` from sysfs (per core for L1/L2)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(root)):
            path = os.path.join(root, index)
            if not index.startswith("index"):
                continue
            with open(os.path.join(path, "level")) as f_level, open(os.path.join(path, "type")) as f_type:
                if int(f_level.read()) != level or f_type.read().strip() != kind:
                    continue
            with open(os.path.join(path, "size")) as f_size:
                text = f_size.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            return int(text.rstrip("KMG")) * scale
    except (OSError, ValueError):
        pass
    return default
