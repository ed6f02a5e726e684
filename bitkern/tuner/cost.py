"""Memory-traffic and footprint cost model (Welder §3.2 MemTraffic/MemFootprint, §4.1 penalties).

A template counts what one call of a configuration does (`Template.work`: DRAM bytes, operations, tasks, the
footprint it keeps in L1); this model prices it on a device.  CPUs: each operation costs the cycles below
(per 64-byte operation on the CPUs the templates target: Sapphire Rapids, two 512-bit ALU ports, one 512-bit
store per cycle, AMX tile load 8 cycles, tdpbf16ps 16 cycles for 16 rows and ~9 for a few; CPUs without AMX,
such as AMD Zen 4: one vdpbf16ps per cycle; decode and AMX work do not overlap, measured; on aarch64 the operations
of the templates serving it are priced as their NEON instructions on the device's core, `ARM_MIXES`), spread over the
cores, with the §4.1 penalties: too little parallelism (tasks that leave cores idle or unbalanced), a footprint
over its share of L1, and — for the prefetch knob the traffic counts cannot see — the distance from the
prefetch depth that keeps the device's memory latency covered, and where a template measured it, the weight streams a
task reads at once; memory and compute partly overlap.  CUDA GPUs:
HBM traffic at the device bandwidth, mma work at its tensor throughput, per wave of resident blocks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..codegen import Work, template
from ..codegen.cpu.lut import LOOKUP_256
from ..ops.matmul import Matmul
from .arm_cores import arm_core

# Cycles per operation a CPU template counts.
CPU_CYCLES = {
    # AMX (Sapphire Rapids)
    "amx_tile_load": 8,
    "tdpbf16ps": 16,  # 16 rows
    "tdpbf16ps_few_rows": 9,  # up to 4 rows
    # per decoded B tile: 16 stores, shifts, ternlog or vpermw; convert (estimated from its ~7 vector ops per row
    # on two ports, not measured on AMX) four shifts, two int-to-float conversions, a shift and an OR
    "amx_decode_tile.affine": 19, "amx_decode_tile.lut": 21, "amx_decode_tile.convert": 56,
    "amx_decode_tile.raw": 16,  # bfloat16 codes: the 16 stores alone (estimated)
    "amx_decode_stall": 12,  # per decoded tile the AMX load waits for (the decode runs too few tiles ahead)
    "amx_c_tile_move": 12,  # per C tile stored to or reloaded from L1 when a stage ends inside a group
    "amx_group_tile": 16,  # per C tile and group in the epilogue: stored to L1 and read back
    "amx_group_row": 3,  # per row and group in the epilogue: scaling into the row's float32 accumulator
    # AVX512-BF16 (Zen 4)
    "vdpbf16ps": 1,
    # per activation pair broadcast in the micro-kernel: a bound beside 1 per vdpbf16ps (issued side by side), and
    # an issue cost on top (fitted on Zen 4 at M=16: per product, 16 rows x 1 tile 2.27x the time of 4 rows x 4
    # tiles, 8 x 2 1.09x, 8 x 3 1.06x)
    "dot_broadcast_issue": 2, "dot_broadcast": 0.25,
    # per register block and 16-pair step: loop entry and exit, row pointers (fitted on Zen 4: 2 tiles x 4 rows
    # took 1.13x the time per product of 5 x 4 at M=128)
    "dot_block_step": 32,
    # per 16 decoded B rows stored to L1 for the micro-kernel (Zen 4 stores a zmm in two cycles; fitted: 4096x4096
    # int1 GEMV 0.49 ms staged against 0.27 ms direct); convert adds its ~7 vector ops per row (estimated)
    "dot_decode_stage.affine": 40, "dot_decode_stage.lut": 40, "dot_decode_stage.convert": 100,
    "dot_decode_stage.raw": 32,  # bfloat16 codes: the stores alone (estimated)
    # per decoded B row fed straight into the products (load share, shift, mask, OR; fitted on Zen 4: the direct
    # int1 GEMV, decode-bound, took ~3 cycles per row); convert fitted on Zen 4 from int8 4096x4096 M=1 with the
    # weights in cache: 0.47 ms against 0.28-0.33 ms for the affine decode's two nibble rows
    "dot_decode_direct.affine": 1.5, "dot_decode_direct.lut": 1.5, "dot_decode_direct.convert": 6,
    "dot_decode_direct.raw": 0.5,  # bfloat16 codes: the load alone (estimated)
    "dot_group_row": 4,  # per C row and group: zeroing, scaling into the row's float32 accumulator
    "dot_group_row_plane": 1,  # per nibble plane of a C row and group: summing it in
    "dot_c_row_move": 1,  # per C row stored to or reloaded from L1 when a stage ends inside a group
    # table lookup
    "lookup_word": 1,  # per 64-byte word of codes: load, prefetch
    "lookup_word_row": 12,  # per word and row of x: 7 shifts, 8 vpermps, 8 adds on two ports (measured 12-14 at M=1)
    "lookup_table_entry": 4,  # per 16-entry table a thread builds
    "l2_byte": 1 / 32,  # per byte re-read from L2 (32 bytes per cycle)
    # FMA decode (few rows), per 64 bytes: a vector of codes masked in place and converted on two ports; per row, one
    # multiply-add, and a broadcast of x per row and task (shared by its n_tiles tiles: on Zen 5 the grouped int4
    # projections took 0.8x the time with 2 tiles a task as with 1, measured)
    "convert_code_vector": 1.0, "fma_code_row": 0.5, "fma_broadcast_row": 0.25,
    # VNNI (activation_quant="int8"): byte dot products in units of one 512-bit vpdpbusd, one per cycle (`byte_dot`;
    # `codegen.cpu.vnni.dot_cost` converts each level's instructions to it); beside them, per byte position of a word
    # and row block, its shift, mask and the word's load; per row, tile and 32-k block, the int32 sums converted,
    # scaled and added; per group the offset term; per activation broadcast a load; per x element quantized in the
    # prologue (estimated)
    "byte_dot": 1, "vnni_unpack": 1.5, "vnni_block_row": 4, "vnni_group_row": 2, "vnni_broadcast": 0.5,
    "vnni_quantize_element": 0.5,
    # norm prologue, per element of x normalized: its statistics pass and x̂ (fitted on Zen 4, 3072x2048 int4 with a
    # bf16 RMSNorm against none: +15 µs at M=16, serial; +46 µs at M=128 over two cores)
    "norm_prologue_element": 1.5,
    # generic template (measured on Zen 4: 6.4 multiply-adds per cycle and core, int4 4096x4096 at M=16)
    "generic_decode_vector": 6,
    "generic_fma_vector": 2.5,
}
# aarch64: the NEON instructions (classes of `arm_cores.CLASSES`) one counted operation takes, read from the templates'
# inner loops as LLVM compiles them for Neoverse V1 (benchmarks/arm_model.py prints them per weight byte), priced by the
# device's core (`ArmCore.cycles`).  FMA: per 4 lanes of codes a mask (and, sign flip) and an int-to-float convert,
# a shift per 8; per row an fmla; x's element loaded per row and 4 lanes of a task.  The work counts' lookup factor
# (LOOKUP_256, AVX2's three instructions per lookup) applies on aarch64 as well: a code-book decode (one four-register
# tbl, an index multiply and shift) is priced as three conversions, and the lookup template's per-row work (per word:
# 32 tbl of four registers, 32 index multiplies, 32 fadd, ~64 moves and masks, ~32 shifts, stack traffic) is spread
# over that factor.  Generic: per 4 lanes decoded (shifts, convert, scale multiply, the tile's store) and per 4 lanes
# and row of products (an fmla, its loads, x's broadcast).  VNNI (int8 activations, sdot; the work counts' byte
# dot product `byte_dot`, `codegen.cpu.vnni.dot_cost`, which counts on aarch64 one unit per two sdot,
# a looked-up code book's 1-register tbl counted as one more sdot): per unit two dot-class instructions; per 16-byte
# vector of codes unpacked (`vnni_unpack`) a mask (and), a sign flip (eor), half a shift (ushr) and a quarter of its
# load; per activation broadcast an ld1r; per row, tile and 32-k block four int-to-float converts and four fmla; per
# group and row two (estimated).  Read from the int4 M=1 loop (tests/codegen/cpu/test_arm_levels.py: per activation
# block and tile 32 sdot, 32 and, 32 eor, 16 ushr, 8 ld1r).  Rows in pairs (i8mm): one smmla each (`pair_dot`), and
# per 16-byte vector of codes and row block a zip of two products' codes into column pairs, and a code book's tbl.
ARM_MIXES = {
    "convert_code_vector": {"logic": 2, "convert": 1, "shift": 0.125, "load": 0.25},
    "fma_code_row": {"fp": 1},
    "fma_broadcast_row": {"load": 0.25},
    "lookup_word": {"load": 4, "prefetch": 0.5, "scalar": 1},
    "lookup_word_row": {name: count / LOOKUP_256 for name, count in
                        {"tbl4": 32, "imul": 32, "fp": 32, "logic": 64, "shift": 32, "load": 40, "store": 40}.items()},
    "lookup_table_entry": {"fp": 1, "logic": 0.5, "store": 0.25},
    "generic_decode_vector": {"shift": 3, "convert": 1, "fp": 1, "store": 1, "load": 1, "scalar": 2.5},
    "generic_fma_vector": {"fp": 1, "load": 1.25, "scalar": 0.5, "dup_gpr": 0.25},
    "byte_dot": {"dot": 2},
    "pair_dot": {"mmla": 1},
    "vnni_zip": {"logic": 1},
    "vnni_table": {"tbl1": 1},
    "vnni_unpack": {"logic": 2, "shift": 0.5, "load": 0.25},
    "vnni_broadcast": {"load_broadcast": 1},
    "vnni_block_row": {"convert": 4, "fp": 4},
    "vnni_group_row": {"fp": 2},
}
L1_PRESSURE = 0.25  # slowdown per L1 capacity of footprint beyond its share of L1 (activations and codes stream
#                     through the rest; measured on the AMX template's stage depth)
OVERLAP = 0.5  # the fraction of the smaller of memory and compute time that does not hide under the larger
PREFETCH_PENALTY = 0.04  # per doubling away from the ideal prefetch depth
# No software prefetch (prefetch=0): the model cannot tell whether the hardware prefetchers keep up (measured on
# Zen 4, in probes: 5-9% faster at M=1 int4/nf4, 7-11% slower at M=16 int4 and M=1 int2).  It ranks it below every depth
# within a doubling of the ideal, and profiling decides (the shortlist always times the best one's twin without it)
HARDWARE_PREFETCH_DOUBLINGS = 1.5

MMA_EFFICIENCY = 0.6  # fraction of peak tensor throughput a hand-scheduled mma pipeline sustains
DECODE_FLOPS_PER_WEIGHT = 4  # LOP3 + fma per decoded element, on the CUDA cores
CUDA_CORE_SHARE = 16  # the CUDA cores' flops: the tensor throughput over this
WAVE_LATENCY_S = 3e-6  # a block's fixed cost (pipeline fill, epilogue) per wave, and a further kernel's per call
# resident warps per SM that keep its share of the HBM bandwidth busy: fewer leave it latency-bound (H100, ncu: the
# int4 GEMM at M=16 with 128 blocks of two warps, ~2 warps per SM, read at 12% of the DRAM peak)
MEMORY_WARPS = 16
# an SM's L1 delivers one 128-byte wavefront to registers per clock; loads the GEMVs make through it (x, which every
# warp reads again, and the streamed weights) took ~3 clocks a wavefront (H100 ncu, int2 28672x8192 M=1: L1 92.8% busy
# for 4.1M wavefronts in 99K cycles on 132 SMs)
L1_WAVEFRONT_BYTES = 128
L1_CYCLES_PER_WAVEFRONT = 3
CORE_FLOPS_PER_SM_CYCLE = 256  # 128 float32 lanes, an FMA each: SM cycles per second are the cores' flops over this


@dataclass(frozen=True)
class Estimate:
    """Modeled seconds of one call and the parts it is made of."""

    seconds: float
    parts: dict

    def __str__(self) -> str:
        return ", ".join(f"{name}={value:.3g}" for name, value in self.parts.items())


def estimate(template_name: str, config, spec: Matmul, n: int, k: int, m: int, device) -> Estimate:
    """Modeled time of the template named `template_name` with `config` for M rows of a [N, K] weight on
    `device` (a CPU or a CUDA architecture)."""
    work = template(template_name).work(spec, n, k, m, config, device)
    return _cpu_estimate(work, device) if device.kind == "cpu" else _cuda_estimate(work, device)


def _cpu_estimate(work: Work, device) -> Estimate:
    """The work's cycles over the cores (an unbalanced last round of tasks costs a whole one) against its DRAM
    bytes at the device's bandwidth; the footprint and prefetch penalties."""
    cycles_of = operation_cycles(device)
    priced = {op: count * cycles_of[op] for op, count in work.operations.items()}
    bound = [max(count * cycles_of[op] for op, count in group.items()) for group in work.bounds]
    pressure = 1 + L1_PRESSURE * max(0.0, work.l1_bytes - work.l1_budget) / device.l1_bytes
    cycles = (sum(priced.values()) + sum(bound)) * pressure
    tasks = work.tasks
    imbalance = math.ceil(tasks / device.cores) / (tasks / device.cores) if tasks else 1.0
    compute = cycles / device.cores * imbalance / device.clock_hz
    memory = work.dram_bytes / device.memory_bandwidth() * (1 + work.stream_penalty * math.log2(max(1, work.streams)))
    seconds = max(compute, memory) + OVERLAP * min(compute, memory)
    if work.prefetch is not None:
        ideal = max(8.0, device.prefetch_bytes / 64 / work.streams * 2)  # each task streams `streams` tiles at once
        doublings = abs(math.log2(work.prefetch / ideal)) if work.prefetch else HARDWARE_PREFETCH_DOUBLINGS
        seconds *= 1 + PREFETCH_PENALTY * doublings
    return Estimate(seconds, {"compute_s": compute, "dram_s": memory, "dram_bytes": work.dram_bytes, "tasks": tasks,
                              "imbalance": imbalance, "l1_pressure": pressure, **priced})


def operation_cycles(device) -> dict:
    """Cycles per counted operation on a CPU `device`: CPU_CYCLES, with `ARM_MIXES` priced by the core an aarch64
    device's code is tuned for (`arm_cores.arm_core`)."""
    return _arm_cycles(device.level.llvm_cpu) if device.level.arch == "aarch64" else CPU_CYCLES


@functools.lru_cache(maxsize=None)
def _arm_cycles(llvm_cpu: str) -> dict:
    core = arm_core(llvm_cpu)
    return {**CPU_CYCLES, **{op: core.cycles(mix) for op, mix in ARM_MIXES.items()}}


def _cuda_estimate(work: Work, device) -> Estimate:
    """HBM traffic at the device bandwidth (few resident warps keep a fraction of it busy), mma flops at the sustained
    tensor throughput, the products of the CUDA cores and the decode, the loads through L1 into registers (the
    GEMVs'), per wave of resident blocks (occupancy
    from each block's shared memory, threads and registers; a last partial wave costs a whole one) and per further
    kernel a call launches (split-K's reduce)."""
    used = work.per_block
    per_sm = min(device.blocks_per_sm, device.threads_per_sm // max(1, used.threads),
                 device.registers_per_sm // max(1, used.threads * used.registers),
                 device.shared_bytes_per_sm // max(1, used.shared_bytes) if used.shared_bytes else device.blocks_per_sm)
    per_sm = max(1, per_sm)
    cores = device.tensor_flops / CUDA_CORE_SHARE
    operations = work.operations
    compute = operations.get("mma_flop", 0) / (device.tensor_flops * MMA_EFFICIENCY) + \
        operations.get("core_flop", 0) / cores + operations["decoded_weight"] * DECODE_FLOPS_PER_WEIGHT / cores
    blocks = work.tasks
    waves = -(-blocks // (device.sm_count * per_sm))
    warps_per_sm = min(blocks / device.sm_count, per_sm) * -(-used.threads // 32)
    busy = min(1.0, warps_per_sm / MEMORY_WARPS)
    memory = work.dram_bytes / (device.memory_bandwidth() * busy)
    sm_cycles_per_s = cores / CORE_FLOPS_PER_SM_CYCLE
    l1 = operations.get("l1_bytes", 0) / L1_WAVEFRONT_BYTES * L1_CYCLES_PER_WAVEFRONT / sm_cycles_per_s
    seconds = max(compute, memory, l1) + (waves + operations.get("extra_launch", 0)) * WAVE_LATENCY_S
    return Estimate(seconds, {"compute_s": compute, "dram_s": memory, "l1_s": l1, "dram_bytes": work.dram_bytes,
                              "blocks": blocks, "waves": waves, "blocks_per_sm": per_sm})
