"""tTile-device descriptions (LADDER §3.1): what a target's memory levels and compute units prefer.

`host_cpu()` reads the machine this process runs on (x86-64 or aarch64: instruction sets from /proc/cpuinfo, or
macOS's sysctl; cache sizes from sysfs or sysctl; usable cores from the scheduler) and gives the TVM LLVM target that
compiles for it.  `named_cpu(part)` describes an aarch64 part by name (Neoverse, Apple M, Cortex-A76), to
cross-compile for it.
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
import sys
from dataclasses import dataclass

from ..codegen.cpu import isa
from ..codegen.cpu.isa import IsaLevel
from .arm_cores import arm_core

log = logging.getLogger("bitkern")

LEVEL_VARIABLE = "BITKERN_CPU_LEVEL"  # names a lower instruction-set level for this process's kernels


@dataclass(frozen=True)
class CpuDevice:
    """A CPU (x86-64 or aarch64) at one instruction-set level (`codegen.cpu.isa`; for a named part, the level with
    the part's LLVM CPU): the level, cache capacities, cores."""

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
        """DRAM read bandwidth with all cores (bytes/s): measured once per process where this device's code runs; for
        aarch64 code compiled elsewhere, its cores' share of the DRAM peak of the core's machine (`arm_cores`)."""
        if self.level.arch == "aarch64" and not self.runs_here():
            return arm_core(self.level.llvm_cpu).share_bytes_per_s * self.cores
        return _measured_bandwidth(self.cores)

    @property
    def key(self) -> str:
        """Identifies the code this device runs: the cache key's target part ("+<llvm cpu>" where a named part's
        LLVM CPU tunes the level's code; a directory name, as `cache.entry.TARGET` accepts)."""
        tuned = "" if self.level.llvm_cpu == isa.level(self.level.name).llvm_cpu else f"+{self.level.llvm_cpu}"
        return f"cpu-{self.level.name}{tuned}-{self.cores}c"

    def at_level(self, name: str) -> CpuDevice:
        """This CPU with its kernels compiled for the level `name` (a lower one runs here; a higher one only
        compiles, for another machine)."""
        return dataclasses.replace(self, level=isa.level(name))

    def runs_here(self) -> bool:
        """Whether this machine's CPU runs code of this device's level (its architecture and features)."""
        return _not_here(self.level) is None

    def tvm_target(self):
        """The TVM LLVM target for this CPU's level."""
        import tvm

        return tvm.target.Target(self.level.target_dict(self.cores))


@functools.lru_cache(maxsize=None)
def host_cpu() -> CpuDevice:
    """The CPU this process runs on, at its highest instruction-set level, or at the lower level that
    $BITKERN_CPU_LEVEL names (refused, naming what is missing, where this CPU cannot run it)."""
    arch = _host_arch()
    flags = _cpu_flags()
    if sys.platform == "darwin":
        values = parse_sysctl(_sysctl_text())
        name, caches = values.get("machdep.cpu.brand_string", "Apple silicon"), sysctl_caches(values)
    else:
        name, caches = _cpu_model(), (_cache_bytes(1, "Data", 48 << 10), _cache_bytes(2, "Unified", 2 << 20),
                                      _cache_bytes(3, "Unified", 32 << 20))
    level = isa.best_level(flags, arch)
    part = CPU_TARGETS.get(PART_TARGETS.get(name, ""))
    if part is not None and part.level == level.name:  # a named part: its code and cache key are the prebuilt ones
        level = dataclasses.replace(level, llvm_cpu=part.llvm_cpu)
    device = CpuDevice(name=name, level=level, cores=_usable_cores(), l1_bytes=caches[0], l2_bytes=caches[1],
                       llc_bytes=caches[2], clock_hz=_cpu_mhz() * 1e6)
    forced = os.environ.get(LEVEL_VARIABLE)
    if not forced:
        return device
    device = device.at_level(forced)
    if not device.runs_here():
        missing = sorted(device.level.features - flags)
        runnable = [level.name for level in isa.ARCHITECTURES[arch] if level.runs_on(flags)]
        raise ValueError(f"{LEVEL_VARIABLE}={forced!r}: this CPU ({device.name}) lacks {', '.join(missing)}; "
                         f"it runs the levels {runnable}")
    log.info("bitkern: CPU kernels compiled for %s (%s=%s)", forced, LEVEL_VARIABLE, forced)
    return device


def unrunnable(target: str) -> str | None:
    """Why kernels of the cache target `target` ("cpu-<level>[+<llvm cpu>]-<cores>c") cannot run on this machine's
    CPU (its architecture, or the features it lacks), or None (they can, or it is not a CPU target)."""
    match = re.fullmatch(r"cpu-([^+]+?)(\+[\w.-]+)?-\d+c", target)
    if match is None:
        return None
    try:
        level = isa.level(match[1])
    except ValueError:
        return f"the level {match[1]!r} is not one this bitkern knows"
    return _not_here(level)


def _not_here(level: IsaLevel) -> str | None:
    """Why this machine's CPU cannot run code of `level`, or None."""
    if level.arch != _host_arch():
        return f"they are {level.arch} code and this machine is {platform.machine()}"
    missing = level.features - _cpu_flags()
    return f"this CPU lacks {', '.join(sorted(missing))}" if missing else None


def _host_arch() -> str:
    """This machine's architecture as the levels name it ("x86_64" or "aarch64")."""
    machine = platform.machine()
    arch = {"x86_64": "x86_64", "AMD64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(machine)
    if arch is None:
        raise RuntimeError(f"bitkern's CPU kernels need an x86-64 or aarch64 CPU; this machine is {machine}")
    return arch


# (implementer, part) of /proc/cpuinfo on aarch64 Linux: the core's name
ARM_PARTS = {("0x41", "0xd0b"): "Cortex-A76", ("0x41", "0xd0c"): "Neoverse N1", ("0x41", "0xd40"): "Neoverse V1",
             ("0x41", "0xd4f"): "Neoverse V2", ("0x41", "0xd08"): "Cortex-A72"}
PART_TARGETS = {"Cortex-A76": "cortex-a76", "Neoverse N1": "neoverse-n1", "Neoverse V1": "neoverse-v1",
                "Neoverse V2": "neoverse-v2"}  # detected cores that are named targets (`CPU_TARGETS`)


def cpuinfo_features(text: str) -> frozenset[str]:
    """The CPU features in the text of Linux's /proc/cpuinfo: the first "flags" (x86) or "Features" (aarch64)
    line."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpuinfo_model(text: str) -> str:
    """The CPU's name in the text of /proc/cpuinfo: x86's "model name", else the aarch64 core named by its
    implementer and part (or those numbers)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if fields.get("model name"):
        return fields["model name"]
    implementer, part = fields.get("CPU implementer", "").lower(), fields.get("CPU part", "").lower()
    if part:
        return ARM_PARTS.get((implementer, part), f"aarch64 (implementer {implementer}, part {part})")
    return platform.processor() or "unknown CPU"


# macOS `sysctl hw.optional.*` names of the features the levels read, and their /proc/cpuinfo spelling
SYSCTL_FEATURES = {"hw.optional.floatingpoint": "fp", "hw.optional.AdvSIMD": "asimd", "hw.optional.neon": "asimd",
                   "hw.optional.arm.FEAT_DotProd": "asimddp", "hw.optional.arm.FEAT_I8MM": "i8mm",
                   "hw.optional.arm.FEAT_BF16": "bf16", "hw.optional.arm.FEAT_SVE": "sve",
                   "hw.optional.arm.FEAT_SVE2": "sve2", "hw.optional.arm.FEAT_SME": "sme",
                   "hw.optional.arm.FEAT_FP16": "asimdhp"}


def parse_sysctl(text: str) -> dict[str, str]:
    """{name: value} of `sysctl` output lines "name: value"."""
    values = {}
    for line in text.splitlines():
        name, separator, value = line.partition(":")
        if separator:
            values[name.strip()] = value.strip()
    return values


def sysctl_features(values: dict[str, str]) -> frozenset[str]:
    """The CPU features (/proc/cpuinfo names) macOS reports as present (`hw.optional.*` = 1)."""
    return frozenset(feature for name, feature in SYSCTL_FEATURES.items() if values.get(name) == "1")


def sysctl_caches(values: dict[str, str]) -> tuple[int, int, int]:
    """(L1 data per core, L2 per cluster, last level) bytes of the performance cores macOS reports; Apple's
    system-level cache is not reported, so the last level is taken as the L2."""
    l1 = int(values.get("hw.perflevel0.l1dcachesize", values.get("hw.l1dcachesize", 128 << 10)))
    l2 = int(values.get("hw.perflevel0.l2cachesize", values.get("hw.l2cachesize", 4 << 20)))
    return l1, l2, l2


def _sysctl_text() -> str:
    import subprocess

    return subprocess.run(["sysctl", "hw", "machdep.cpu.brand_string"], capture_output=True, text=True,
                          check=False).stdout


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

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS
    return max(1, min(allowed, torch.get_num_threads()))


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    """This CPU's features, as Linux's /proc/cpuinfo names them (on macOS: translated from sysctl)."""
    if sys.platform == "darwin":
        return sysctl_features(parse_sysctl(_sysctl_text()))
    return cpuinfo_features(_cpuinfo_text())


def _cpu_model() -> str:
    return cpuinfo_model(_cpuinfo_text())


def _cpuinfo_text() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return info.read()
    except OSError:
        return ""


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

    if torch.version.hip is not None:
        raise RuntimeError(f"this torch is built for ROCm (HIP {torch.version.hip}): its 'cuda' device is an AMD GPU, "
                           f"and bitkern's GPU kernels are CUDA code built with NVIDIA's nvcc for NVIDIA GPUs "
                           f"(sm_80 to sm_90); run the model on the CPU, or on an NVIDIA GPU")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is present; name an arch (e.g. 'sm_90') to cross-compile for it")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    detected = f"sm_{props.major}{props.minor}"
    if props.major < 8:
        raise RuntimeError(f"{props.name} is {detected}; bitkern's GPU kernels need sm_80 or newer (bf16 TensorCore "
                           f"instructions): Ampere, Ada or Hopper. Run the model on the CPU")
    base = CUDA_ARCHS.get(detected) or CUDA_ARCHS["sm_90" if props.major >= 9 else "sm_80"]
    return CudaDevice(props.name, detected, props.multi_processor_count, base.global_transaction_bytes,
                      base.shared_banks, base.shared_bank_bytes,
                      getattr(props, "shared_memory_per_block_optin", base.shared_bytes_per_block),
                      getattr(props, "shared_memory_per_multiprocessor", base.shared_bytes_per_sm),
                      base.ldmatrix_bytes, base.registers_per_thread,
                      getattr(props, "regs_per_multiprocessor", base.registers_per_sm),
                      base.max_threads_per_block, getattr(props, "L2_cache_size", base.l2_bytes), base.mma,
                      base.memory_bytes_per_s, base.tensor_flops, base.threads_per_sm, base.blocks_per_sm)


@dataclass(frozen=True)
class NamedCpu:
    """A CPU part to cross-compile or prebuild for: the level it runs, the LLVM CPU that tunes for it, its caches
    (L1 data per core, L2 per core or cluster, last level) and clock, from the vendors' published figures."""

    title: str
    level: str
    llvm_cpu: str
    l1_bytes: int
    l2_bytes: int
    llc_bytes: int
    clock_hz: float


CPU_TARGETS = {
    "neoverse-n1": NamedCpu("Neoverse N1 (Ampere Altra, AWS Graviton 2)", "armv8.2-a", "neoverse-n1", 64 << 10,
                            1 << 20, 32 << 20, 3.0e9),
    "neoverse-v1": NamedCpu("Neoverse V1 (AWS Graviton 3)", "sve", "neoverse-v1", 64 << 10, 1 << 20, 32 << 20,
                            2.6e9),
    "neoverse-v2": NamedCpu("Neoverse V2 (AWS Graviton 4)", "sve2", "neoverse-v2", 64 << 10, 2 << 20, 36 << 20,
                            2.8e9),
    "apple-m1": NamedCpu("Apple M1", "armv8.2-a", "apple-m1", 128 << 10, 12 << 20, 12 << 20, 3.2e9),
    "apple-m4": NamedCpu("Apple M4", "armv8.6-a", "apple-m4", 128 << 10, 16 << 20, 16 << 20, 4.4e9),
    "cortex-a76": NamedCpu("Cortex-A76 (Raspberry Pi 5)", "armv8.2-a", "cortex-a76", 64 << 10, 512 << 10, 2 << 20,
                           2.4e9),
}


def named_cpu(name: str) -> CpuDevice:
    """The part `name` of `CPU_TARGETS`, with this machine's usable cores (as "cpu:<level>" targets have), its
    level's code tuned by the part's LLVM CPU."""
    if name not in CPU_TARGETS:
        raise ValueError(f"cpu target {name!r} is not known; accepted: {sorted(CPU_TARGETS)}")
    part = CPU_TARGETS[name]
    level = dataclasses.replace(isa.level(part.level), llvm_cpu=part.llvm_cpu)
    return CpuDevice(part.title, level, _usable_cores(), part.l1_bytes, part.l2_bytes, part.llc_bytes, part.clock_hz)


def device_for(target: str):
    """A device description from a target name: "cpu" (the host), "cpu:<part>" (a CPU of `CPU_TARGETS`, e.g.
    "cpu:neoverse-v1"), "cpu:<level>" (the host's cores and caches at an instruction-set level of
    `codegen.cpu.isa`, e.g. "cpu:x86-64-v3" to prebuild for a fleet), or a CUDA arch like "sm_90"."""
    if target == "cpu":
        return host_cpu()
    if target.startswith("cpu:"):
        name = target[len("cpu:"):]
        return named_cpu(name) if name in CPU_TARGETS else host_cpu().at_level(name)
    if target == "cuda":
        return cuda_device()
    return cuda_device(target)
