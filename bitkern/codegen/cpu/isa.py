"""CPU instruction-set levels (x86-64 and aarch64): what a CPU kernel may use, as one parameter the templates read.

A level names its architecture, the CPU features (as Linux's /proc/cpuinfo spells them) its code needs, its vector
width and the LLVM CPU (and extra attributes) that compile for exactly those features.  Templates declare the features they need
(`Template.requires`); the tuner offers a template only on levels that have them, and a template's emitter asks
the level for its vector width and the few intrinsics that differ (`lookup16`).  The host runs its own level and
every level below it (a lower one can be forced: fleet prebuilds, tests); a level above the host, or of the other
architecture, only compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_AVX512 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


TRIPLES = {"x86_64": "x86_64-unknown-linux-gnu", "aarch64": "aarch64-linux-gnu"}  # the LLVM triple per architecture


@dataclass(frozen=True)
class IsaLevel:
    """One instruction-set level: its name, the features its code needs, its vector width in bytes, the LLVM CPU
    and attributes that compile for it, and its architecture ("x86_64" or "aarch64")."""

    name: str
    features: frozenset
    vector_bytes: int
    llvm_cpu: str
    llvm_attributes: tuple[str, ...] = ()
    arch: str = "x86_64"

    @property
    def vector_registers(self) -> int:
        """The vector registers its code has: 32 (AVX-512's zmm, aarch64's v) or 16 (x86 before AVX-512)."""
        return 32 if self.arch == "aarch64" or self.vector_bytes >= 64 else 16

    def runs_on(self, flags) -> bool:
        """Whether a CPU with these /proc/cpuinfo `flags` runs this level's code."""
        return self.features <= frozenset(flags)

    def target_dict(self, cores: int) -> dict:
        """The TVM LLVM target of this level, as the JSON dict TVM takes (triple and CPU given explicitly)."""
        target = {"kind": "llvm", "mtriple": TRIPLES[self.arch], "mcpu": self.llvm_cpu, "num-cores": cores}
        if self.llvm_attributes:
            target["mattr"] = list(self.llvm_attributes)
        return target


_NEON = frozenset({"fp", "asimd"})
_DOTPROD = _NEON | {"asimddp"}
_V86 = _DOTPROD | {"i8mm", "bf16"}
_V86_ATTRIBUTES = ("+neon", "+dotprod", "+i8mm", "+bf16")

# aarch64, lowest first (feature names as Linux's /proc/cpuinfo "Features" line spells them).  "generic" plus the
# attributes compiles for exactly the level's features.  NEON vectors are 16 bytes.  SVE's length is the CPU's
# choice (256 bits on Neoverse V1, 128 on V2): its levels declare 16 bytes, the length every SVE CPU has, and the
# templates' fixed-width vectors compile to NEON there (LLVM uses SVE for them only given a minimum length).
ARM_LEVELS = (
    IsaLevel("armv8-a", _NEON, 16, "generic", ("+neon",), "aarch64"),  # Cortex-A72 (Raspberry Pi 4)
    IsaLevel("armv8.2-a", _DOTPROD, 16, "generic", ("+neon", "+dotprod"), "aarch64"),  # sdot/udot
    IsaLevel("armv8.6-a", _V86, 16, "generic", _V86_ATTRIBUTES, "aarch64"),  # + smmla, bfdot/bfmmla
    IsaLevel("sve", _V86 | {"sve"}, 16, "generic", (*_V86_ATTRIBUTES, "+sve"), "aarch64"),
    IsaLevel("sve2", _V86 | {"sve", "sve2"}, 16, "generic", (*_V86_ATTRIBUTES, "+sve", "+sve2"), "aarch64"),
)

# x86-64, lowest first.  A host runs the last level whose features it has.  AVX-VNNI (256-bit vpdpbusd, Alder Lake and
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
ARCHITECTURES = {"x86_64": LEVELS, "aarch64": ARM_LEVELS}


def level(name: str) -> IsaLevel:
    """The level called `name` (of either architecture)."""
    known = LEVELS + ARM_LEVELS
    found = next((candidate for candidate in known if candidate.name == name), None)
    if found is None:
        raise ValueError(f"cpu level {name!r} is not known; accepted: {[candidate.name for candidate in known]}")
    return found


def best_level(flags, arch: str = "x86_64") -> IsaLevel:
    """The highest level of `arch` that a CPU with these /proc/cpuinfo `flags` runs."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r} is not accepted; bitkern's CPU kernels know {sorted(ARCHITECTURES)}")
    levels = ARCHITECTURES[arch]
    runnable = [candidate for candidate in levels if candidate.runs_on(flags)]
    return runnable[-1] if runnable else levels[0]


def architecture(features) -> str | None:
    """The architecture whose levels hold every one of these `features` (a template's needs), or None."""
    return next((arch for arch, levels in ARCHITECTURES.items() if frozenset(features) <= levels[-1].features), None)
