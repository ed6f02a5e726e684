"""x86-64 instruction-set levels: what a CPU kernel may use, as one parameter the templates read.

A level names the CPU features (as /proc/cpuinfo spells them) its code needs, its vector width and the LLVM CPU
(and extra attributes) that compile for exactly those features.  Templates declare the features they need
(`Template.requires`); the tuner offers a template only on levels that have them, and a template's emitter asks
the level for its vector width and the few intrinsics that differ (`lookup16`).  The host runs its own level and
every level below it (a lower one can be forced: fleet prebuilds, tests); a level above the host only compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_AVX512 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


@dataclass(frozen=True)
class IsaLevel:
    """One instruction-set level: its name, the features its code needs, its vector width in bytes, and the LLVM
    CPU and attributes that compile for it."""

    name: str
    features: frozenset
    vector_bytes: int
    llvm_cpu: str
    llvm_attributes: tuple[str, ...] = ()

    def runs_on(self, flags) -> bool:
        """Whether a CPU with these /proc/cpuinfo `flags` runs this level's code."""
        return self.features <= frozenset(flags)

    def target_dict(self, cores: int) -> dict:
        """The TVM LLVM target of this level, as the JSON dict TVM takes (triple and CPU given explicitly)."""
        target = {"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": self.llvm_cpu, "num-cores": cores}
        if self.llvm_attributes:
            target["mattr"] = list(self.llvm_attributes)
        return target


# Lowest first.  A host runs the last level whose features it has.  AVX-VNNI (256-bit vpdpbusd, Alder Lake and
# later, Zen 5) is x86-64-v3 plus one instruction; "cascadelake" is Skylake-SP plus VNNI only (icelake-server would
# add VBMI, which Cascade Lake lacks); "cooperlake" adds AVX512-BF16 (also AMD Zen 4 and later).
LEVELS = (
    IsaLevel("x86-64", frozenset({"sse2"}), 16, "x86-64"),
    IsaLevel("x86-64-v3", _V3, 32, "haswell"),
    IsaLevel("avx-vnni", _V3 | {"avx_vnni"}, 32, "haswell", ("+avxvnni",)),
    IsaLevel("avx512", _AVX512, 64, "skylake-avx512"),
    IsaLevel("avx512-vnni", _AVX512 | {"avx512_vnni"}, 64, "cascadelake"),
    IsaLevel("avx512-bf16", _AVX512 | {"avx512_vnni", "avx512_bf16"}, 64, "cooperlake"),
    IsaLevel("amx", _AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}, 64,
             "sapphirerapids"),
)


def level(name: str) -> IsaLevel:
    """The level called `name`."""
    found = next((candidate for candidate in LEVELS if candidate.name == name), None)
    if found is None:
        raise ValueError(f"cpu level {name!r} is not known; accepted: {[candidate.name for candidate in LEVELS]}")
    return found


def best_level(flags) -> IsaLevel:
    """The highest level a CPU with these /proc/cpuinfo `flags` runs."""
    runnable = [candidate for candidate in LEVELS if candidate.runs_on(flags)]
    return runnable[-1] if runnable else LEVELS[0]
