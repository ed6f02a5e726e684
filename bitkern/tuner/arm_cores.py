"""Per-core throughputs of the aarch64 cores bitkern targets: what the cost model prices aarch64 kernels with.

Each core lists, per instruction class its kernels use (`CLASSES`), the micro-ops one instruction issues and the pipes
that can take them, its issue width, and its memory: DRAM bandwidth of the machine it comes in and the cores sharing
it.  `ArmCore.cycles(mix)` is the port-pressure bound of an instruction mix: the busiest pipe group (micro-ops that
only it can take, over its pipes) or the issue width, whichever is larger.  Numbers and where they come from:

- Neoverse V1 and V2: Arm's Software Optimization Guides as LLVM's scheduling models encode them
  (llvm/lib/Target/AArch64/AArch64SchedNeoverseV1.td, ...V2.td, read 2026-11): 4 vector pipes V0-V3, fmla and
  logic on any, shifts on V1/V3, a Q-form int-to-float convert 2 micro-ops on V0/V2, tbl on V0/V1 (V1: 2 micro-ops
  for 1-3 table registers, 3 for 4; V2: 1 for 1-2, 2 for 3, 3 for 4); three load pipes; issue width 8 (LLVM's V1
  figure, taken for V2 too); V2's six integer pipes counted as V1's four (scalar work never binds these loops).
- Neoverse N1 and Cortex-A76 (the same core): 2 vector pipes, shifts on V1 only, converts 2 micro-ops on V0, tbl of
  n registers n micro-ops, issue width 4: from Arm's N1 Software Optimization Guide, not re-checked here (estimate).
- Apple M1 (Firestorm): Dougall Johnson's published measurements (dougallj.github.io/applecpu/): 4 SIMD pipes taking
  fmla, logic, shifts and converts (fcvtzu vector: 1 micro-op) alike, tbl of 1-2 registers 1 micro-op; 3- and
  4-register tbl 2 micro-ops (estimate: his tbx of 2 registers takes 2); three load pipes; issue width 8.
- Apple M4: no published per-instruction tables; M1's per-cycle numbers (estimate), its own clock and memory.
- Memory: DRAM peak of the machine's channels (Graviton 2: 8 x DDR4-3200, 64 cores; Graviton 3: 8 x DDR5-4800, 64
  cores; Graviton 4: 12 x DDR5-5600, 96 cores; M1: LPDDR4X-4266, 128 bits, 4 performance cores; M4: LPDDR5X-7500,
  120 GB/s, 4 performance cores; Raspberry Pi 5: LPDDR4X-4267, 32 bits, 4 cores), vendors' figures; a peak, so the
  per-core share it gives is an upper bound of what a core must sustain.  Apple's efficiency cores are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

# Instruction classes (`benchmarks/arm_model.py` sorts assembly into them; the cost model's operation mixes use them)
CLASSES = ("load", "load_broadcast", "store", "prefetch", "fp", "logic", "shift", "convert", "imul", "dot", "mmla",
           "tbl1", "tbl2", "tbl3", "tbl4", "dup_gpr", "scalar", "branch")


@dataclass(frozen=True)
class ArmCore:
    """One core: {class: (micro-ops, pipe group)} with the group's pipe names, its issue width, and the machine's
    DRAM bandwidth and the cores that share it."""

    title: str
    classes: dict
    pipes: dict  # pipe group -> the pipes in it, e.g. "V02": ("V0", "V2")
    issue_width: int
    dram_bytes_per_s: float
    cores: int
    source: str

    def cycles(self, mix: dict) -> float:
        """Cycles per iteration of an instruction mix {class: count}: the port-pressure bound (every pipe group's
        micro-ops that must run within it, spread over its pipes) against the issue width."""
        return max(self.pressure(mix).values(), default=0.0)

    def limiting(self, mix: dict) -> str:
        """What bounds `mix`: "issue", or the class with the most micro-ops in the busiest pipe group."""
        pressure = self.pressure(mix)
        busiest = max(pressure, key=pressure.get)
        if busiest == "issue":
            return "issue"
        pipes = frozenset(busiest.split("+"))
        return max((name for name in mix if self._pipes(name)[0][1] <= pipes),
                   key=lambda name: mix[name] * self.classes[name][0])

    def pressure(self, mix: dict) -> dict:
        """{pipe group ("V0+V2"), or "issue": cycles} of an instruction mix."""
        uops: dict[frozenset, float] = {}
        for name, count in mix.items():
            for each, pipes in self._pipes(name):
                uops[pipes] = uops.get(pipes, 0.0) + count * each
        pressure = {"+".join(sorted(group)): sum(v for k, v in uops.items() if k <= group) / len(group)
                    for group in uops}
        pressure["issue"] = sum(mix.values()) / self.issue_width
        return pressure

    def _pipes(self, name: str) -> list[tuple[int, frozenset]]:
        """The micro-ops of one instruction of class `name` and the pipes each may run on (a broadcast load also
        moves its element on a vector pipe)."""
        uops, group = self.classes[name]
        found = [(uops, frozenset(self.pipes[group]))]
        return found + [(1, frozenset(self.pipes["V"]))] if name == "load_broadcast" else found


    @property
    def share_bytes_per_s(self) -> float:
        """Each core's share of the DRAM bandwidth with every core streaming."""
        return self.dram_bytes_per_s / self.cores


_NEOVERSE_PIPES = {"V": ("V0", "V1", "V2", "V3"), "V01": ("V0", "V1"), "V02": ("V0", "V2"), "V13": ("V1", "V3"),
                   "L": ("L0", "L1", "L2"), "L01": ("L0", "L1"), "I": ("S0", "S1", "M0", "M1"), "M0": ("M0",),
                   "B": ("B0", "B1")}
_NEOVERSE_V1 = {"load": (1, "L"), "load_broadcast": (1, "L"), "store": (1, "L01"), "prefetch": (1, "L"),
                "fp": (1, "V"), "logic": (1, "V"), "shift": (1, "V13"), "convert": (2, "V02"), "imul": (1, "V02"),
                "dot": (1, "V"), "mmla": (1, "V"), "tbl1": (2, "V01"), "tbl2": (2, "V01"), "tbl3": (2, "V01"),
                "tbl4": (3, "V01"), "dup_gpr": (1, "M0"), "scalar": (1, "I"), "branch": (1, "B")}
_NEOVERSE_V2 = {**_NEOVERSE_V1, "tbl1": (1, "V01"), "tbl2": (1, "V01"), "tbl3": (2, "V01")}
_N1_PIPES = {"V": ("V0", "V1"), "V0": ("V0",), "V1": ("V1",), "L": ("L0", "L1"), "I": ("S0", "S1", "M"),
             "M": ("M",), "B": ("B",)}
_N1 = {"load": (1, "L"), "load_broadcast": (1, "L"), "store": (1, "L"), "prefetch": (1, "L"), "fp": (1, "V"),
       "logic": (1, "V"), "shift": (1, "V1"), "convert": (2, "V0"), "imul": (1, "V0"), "dot": (1, "V"),
       "mmla": (2, "V"), "tbl1": (1, "V"), "tbl2": (2, "V"), "tbl3": (3, "V"), "tbl4": (4, "V"),
       "dup_gpr": (1, "M"), "scalar": (1, "I"), "branch": (1, "B")}
_APPLE_PIPES = {"V": ("V0", "V1", "V2", "V3"), "L": ("L0", "L1", "L2"), "I": tuple(f"I{i}" for i in range(6)),
                "B": ("I0", "I1")}
_FIRESTORM = {"load": (1, "L"), "load_broadcast": (1, "L"), "store": (1, "L"), "prefetch": (1, "L"),
              "fp": (1, "V"), "logic": (1, "V"), "shift": (1, "V"), "convert": (1, "V"), "imul": (1, "V"),
              "dot": (1, "V"), "mmla": (2, "V"), "tbl1": (1, "V"), "tbl2": (1, "V"), "tbl3": (2, "V"),
              "tbl4": (2, "V"), "dup_gpr": (1, "V"), "scalar": (1, "I"), "branch": (1, "B")}

_N1_SOURCE = "Arm Neoverse N1 Software Optimization Guide (not re-checked here: estimate)"
_APPLE_SOURCE = "Dougall Johnson's M1 Firestorm measurements (3- and 4-register tbl: estimate)"

# keyed as `device.CPU_TARGETS` (the part's LLVM CPU)
ARM_CORES = {
    "neoverse-n1": ArmCore("Neoverse N1 (Graviton 2)", _N1, _N1_PIPES, 4, 204.8e9, 64, _N1_SOURCE),
    "neoverse-v1": ArmCore("Neoverse V1 (Graviton 3)", _NEOVERSE_V1, _NEOVERSE_PIPES, 8, 307.2e9, 64,
                           "Arm Neoverse V1 Software Optimization Guide (LLVM AArch64SchedNeoverseV1.td)"),
    "neoverse-v2": ArmCore("Neoverse V2 (Graviton 4)", _NEOVERSE_V2, _NEOVERSE_PIPES, 8, 537.6e9, 96,
                           "Arm Neoverse V2 Software Optimization Guide (LLVM AArch64SchedNeoverseV2.td)"),
    "apple-m1": ArmCore("Apple M1 (Firestorm)", _FIRESTORM, _APPLE_PIPES, 8, 68.25e9, 4, _APPLE_SOURCE),
    "apple-m4": ArmCore("Apple M4", _FIRESTORM, _APPLE_PIPES, 8, 120e9, 4, "M1's per-cycle numbers (estimate)"),
    "cortex-a76": ArmCore("Cortex-A76 (Raspberry Pi 5)", _N1, _N1_PIPES, 4, 17.1e9, 4,
                          f"{_N1_SOURCE}; the A76 is the N1's core"),
}
DEFAULT_CORE = "neoverse-n1"  # an aarch64 CPU not named here: the narrowest core listed


def arm_core(llvm_cpu: str) -> ArmCore:
    """The core aarch64 code tuned for the LLVM CPU `llvm_cpu` (a device's `level.llvm_cpu`) runs on: DEFAULT_CORE for
    CPUs not listed ("generic": a level without a named part)."""
    return ARM_CORES.get(llvm_cpu, ARM_CORES[DEFAULT_CORE])
