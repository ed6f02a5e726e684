"""tTile-device descriptions (LADDER §3.1): what a target's memory levels and compute units prefer.

`host_cpu()` reads the machine this process runs on (instruction sets from /proc/cpuinfo, cache sizes
from sysfs, usable cores from the scheduler) and gives the TVM LLVM target that compiles for it.
`cuda_device(arch)` describes an NVIDIA architecture by name (for cross-compiling on a machine without
it); `cuda_device()` reads the present GPU through torch's device properties.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import platform
import re
from dataclasses import dataclass

from ..codegen.cpu import isa
from ..codegen.cpu.isa import IsaLevel

log = logging.getLogger("bitkern")

LEVEL_VARIABLE = "BITKERN_CPU_LEVEL"  # names a lower instruction-set level for this process's kernels


@dataclass(frozen=True)
class CpuDevice:
    """An x86-64 CPU at one instruction-set level (`codegen.cpu.isa`): the level, cache capacities, cores."""

    name: str
    level: IsaLevel
    cores: int
    l1_bytes: int
    l2_bytes: int
    llc_bytes: int
    clock_hz: float = 3.0e9
    prefetch_bytes: int = 4096  # memory latency x per-core bandwidth: how far ahead streams must prefetch

    @property
    def kind(self) -> str:
        return "cpu"

    @property
    def flags(self) -> frozenset:
        """The CPU features the kernels may use: the level's (/proc/cpuinfo names)."""
        return self.level.features

    @property
    def vector_bytes(self) -> int:
        return self.level.vector_bytes

    @property
    def has_amx_bf16(self) -> bool:
        return "amx_bf16" in self.level.features

    def memory_bandwidth(self) -> float:
        """DRAM read bandwidth with all cores (bytes/s), measured once per process."""
        return _measured_bandwidth(self.cores)

    @property
    def key(self) -> str:
        """Identifies the code this device runs: the cache key's target part."""
        return f"cpu-{self.level.name}-{self.cores}c"

    def at_level(self, name: str) -> CpuDevice:
        """This CPU with its kernels compiled for the level `name` (a lower one runs here; a higher one only
        compiles, for another machine)."""
        return dataclasses.replace(self, level=isa.level(name))

    def runs_here(self) -> bool:
        """Whether this machine's CPU runs code of this device's level."""
        return self.level.runs_on(_cpu_flags())

    def tvm_target(self):
        """The TVM LLVM target for this CPU's level."""
        import tvm

        return tvm.target.Target(self.level.target_dict(self.cores))


@functools.lru_cache(maxsize=None)
def host_cpu() -> CpuDevice:
    """The CPU this process runs on, at its highest instruction-set level, or at the lower level that
    $BITKERN_CPU_LEVEL names (refused, naming what is missing, where this CPU cannot run it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"bitkern's CPU kernels need an x86-64 CPU; this machine is {platform.machine()}")
    flags = _cpu_flags()
    device = CpuDevice(name=_cpu_model(), level=isa.best_level(flags), cores=_usable_cores(),
                       l1_bytes=_cache_bytes(1, "Data", 48 << 10), l2_bytes=_cache_bytes(2, "Unified", 2 << 20),
                       llc_bytes=_cache_bytes(3, "Unified", 32 << 20), clock_hz=_cpu_mhz() * 1e6)
    forced = os.environ.get(LEVEL_VARIABLE)
    if not forced:
        return device
    device = device.at_level(forced)
    if not device.runs_here():
        missing = sorted(device.level.features - flags)
        runnable = [level.name for level in isa.LEVELS if level.runs_on(flags)]
        raise ValueError(f"{LEVEL_VARIABLE}={forced!r}: this CPU ({device.name}) lacks {', '.join(missing)}; "
                         f"it runs the levels {runnable}")
    log.info("bitkern: CPU kernels compiled for %s (%s=%s)", forced, LEVEL_VARIABLE, forced)
    return device


def unrunnable(target: str) -> str | None:
    """Why kernels of the cache target `target` ("cpu-<level>-<cores>c") cannot run on this machine's CPU (the
    features it lacks), or None (they can, or it is not a CPU target)."""
    match = re.fullmatch(r"cpu-(.+)-\d+c", target)
    if match is None:
        return None
    try:
        level = isa.level(match[1])
    except ValueError:
        return f"the level {match[1]!r} is not one this bitkern knows"
    missing = level.features - _cpu_flags()
    return f"this CPU lacks {', '.join(sorted(missing))}" if missing else None


@functools.lru_cache(maxsize=None)
def _measured_bandwidth(cores: int) -> float:
    """Best of three streaming reads of 256 MiB (beyond any per-core cache) with `cores` threads."""
    import time

    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        buffer = torch.ones(64 << 20, dtype=torch.float32)
        buffer.sum()
        best = 0.0
        for _ in range(3):
            start = time.perf_counter()
            buffer.sum()
            best = max(best, buffer.numel() * 4 / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(previous)


def _cpu_mhz() -> float:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("cpu MHz"):
                    return float(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return 3000.0


def _usable_cores() -> int:
    import torch

    return max(1, min(len(os.sched_getaffinity(0)), torch.get_num_threads()))


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


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


@dataclass(frozen=True)
class MmaShape:
    """A TensorCore mma.sync instruction: m x n x k for one input type."""

    m: int
    n: int
    k: int


@dataclass(frozen=True)
class CudaDevice:
    """An NVIDIA GPU architecture: memory levels with their transaction granularity and capacity, and
    the TensorCore instruction shapes per input type."""

    name: str
    arch: str
    sm_count: int
    global_transaction_bytes: int
    shared_banks: int
    shared_bank_bytes: int
    shared_bytes_per_block: int
    shared_bytes_per_sm: int
    ldmatrix_bytes: int
    registers_per_thread: int
    registers_per_sm: int
    max_threads_per_block: int
    l2_bytes: int
    mma: dict
    memory_bytes_per_s: float = 1.5e12  # HBM bandwidth of the reference part
    tensor_flops: float = 3.0e14  # dense fp16/bf16 mma throughput of the reference part
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    has_cp_async: bool = True

    @property
    def kind(self) -> str:
        return "cuda"

    @property
    def key(self) -> str:
        return f"cuda-{self.arch}"

    def tvm_target(self):
        import tvm

        return tvm.target.Target({"kind": "cuda", "arch": self.arch})

    def memory_bandwidth(self) -> float:
        return self.memory_bytes_per_s


_F16_MMA = {"float16": MmaShape(16, 8, 16), "bfloat16": MmaShape(16, 8, 16), "int8": MmaShape(16, 8, 32)}
_FP8_MMA = {**_F16_MMA, "float8_e4m3": MmaShape(16, 8, 32)}

# Per-architecture limits from NVIDIA's CUDA C++ Programming Guide (compute capabilities table); SM counts,
# HBM bandwidth and dense fp16 tensor throughput of the reference data-center parts (A100 40GB, A10, L40S,
# H100 SXM datasheets); a present GPU reports its own SM count and memory limits.
CUDA_ARCHS = {
    "sm_80": CudaDevice("A100", "sm_80", 108, 32, 32, 4, 163 << 10, 164 << 10, 16, 255, 65536, 1024, 40 << 20,
                        _F16_MMA, 1.555e12, 3.12e14),
    "sm_86": CudaDevice("A10", "sm_86", 72, 32, 32, 4, 99 << 10, 100 << 10, 16, 255, 65536, 1024, 6 << 20,
                        _F16_MMA, 6.0e11, 1.25e14, threads_per_sm=1536, blocks_per_sm=16),
    "sm_89": CudaDevice("L40S", "sm_89", 142, 32, 32, 4, 99 << 10, 100 << 10, 16, 255, 65536, 1024, 96 << 20,
                        _FP8_MMA, 8.64e11, 3.62e14, threads_per_sm=1536, blocks_per_sm=24),
    "sm_90": CudaDevice("H100", "sm_90", 132, 32, 32, 4, 227 << 10, 228 << 10, 16, 255, 65536, 1024, 50 << 20,
                        _FP8_MMA, 3.35e12, 9.89e14),
}


@functools.lru_cache(maxsize=None)
def cuda_device(arch: str | None = None) -> CudaDevice:
    """The description of `arch` ("sm_80", "sm_86", "sm_89", "sm_90"), or of the present GPU."""
    if arch is not None:
        if arch not in CUDA_ARCHS:
            raise ValueError(f"arch={arch!r} is not a known CUDA target; accepted: {sorted(CUDA_ARCHS)}")
        return CUDA_ARCHS[arch]
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is present; name an arch (e.g. 'sm_90') to cross-compile for it")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    detected = f"sm_{props.major}{props.minor}"
    base = CUDA_ARCHS.get(detected) or CUDA_ARCHS["sm_90" if props.major >= 9 else "sm_80"]
    return CudaDevice(props.name, detected, props.multi_processor_count, base.global_transaction_bytes,
                      base.shared_banks, base.shared_bank_bytes,
                      getattr(props, "shared_memory_per_block_optin", base.shared_bytes_per_block),
                      getattr(props, "shared_memory_per_multiprocessor", base.shared_bytes_per_sm),
                      base.ldmatrix_bytes, base.registers_per_thread,
                      getattr(props, "regs_per_multiprocessor", base.registers_per_sm),
                      base.max_threads_per_block, getattr(props, "L2_cache_size", base.l2_bytes), base.mma,
                      base.memory_bytes_per_s, base.tensor_flops, base.threads_per_sm, base.blocks_per_sm)


def device_for(target: str):
    """A device description from a target name: "cpu" (the host), "cpu:<level>" (the host's cores and caches at
    an instruction-set level of `codegen.cpu.isa.LEVELS`, e.g. "cpu:x86-64-v3" to prebuild for a fleet), or a CUDA
    arch like "sm_90"."""
    if target == "cpu":
        return host_cpu()
    if target.startswith("cpu:"):
        return host_cpu().at_level(target[len("cpu:"):])
    if target == "cuda":
        return cuda_device()
    return cuda_device(target)
