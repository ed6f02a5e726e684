"""Memory-traffic and footprint cost model (Welder §3.2 MemTraffic/MemFootprint, §4.1 penalties).

For a candidate, count the bytes each level moves (DRAM: weights, scales, activations, outputs; L2:
lookup tables and activation planes re-read per task) and the work each unit does per core (vector
decode with its 64-byte stores, AMX tile loads and products, table lookups), turn them into time with the
device's throughputs, and add the §4.1 penalties: too little parallelism (tasks that leave cores idle or
unbalanced), footprints over capacity, and — for the prefetch knob the traffic counts cannot see — the
distance from the prefetch depth that keeps the device's memory latency covered.

The cycle costs below are per 64-byte operation on the CPUs the templates target (Sapphire Rapids:
two 512-bit ALU ports, one 512-bit store per cycle, AMX tile load 8 cycles, tdpbf16ps 16 cycles for 16
rows and ~9 for a few; CPUs without AMX, such as AMD Zen 4: one vdpbf16ps per cycle); decode and AMX work
do not overlap (measured), memory and compute partly do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..codegen.cpu.amx import PLANES, nibbles
from ..codegen.cpu.layout import padded_k
from ..ops.matmul import Matmul
from ..ttype import codes_per_word, effective_group_size, get, itemsize

TILE_LOAD_CYCLES = 8
TDP_CYCLES_FULL = 16
TDP_CYCLES_FEW_ROWS = 9
DECODE_CYCLES = {"affine": 19, "lut": 21, "convert": 56}  # per decoded B tile: 16 stores, shifts, ternlog or
#   vpermw; convert (estimated from its ~7 vector ops per row on two ports, not measured on AMX) four shifts, two
#   int-to-float conversions, a shift and an OR
PIPELINE_TILES = 4  # decoded tiles needed between a tile's stores and its AMX load to avoid a stall
STALL_CYCLES = 12  # per tile, when the decode runs closer than that
STASH_CYCLES = 12  # per C tile stored to or reloaded from L1 when a stage ends inside a quantization group
L1_PRESSURE = 0.25  # slowdown per L1 capacity of footprint beyond a quarter of L1 (activations and codes
#                     stream through the rest; measured on the AMX template's stage depth)
LOOKUP_CYCLES = (1, 12)  # per 64-byte word of codes: fixed (load, prefetch), and per row of x (7 shifts,
#                         8 vpermps, 8 adds on two ports; measured 12-14 at M=1)
DOT_BROADCAST_CYCLES = (2, 0.25)  # per activation pair broadcast in the AVX512-BF16 micro-kernel: a bound
#                                  beside 1 per vdpbf16ps, and an issue cost on top (fitted on Zen 4 at M=16:
#                                  per product, 16 rows x 1 tile 2.27x the time of 4 rows x 4 tiles, 8 x 2 1.09x,
#                                  8 x 3 1.06x)
DOT_GROUP_CYCLES = 4  # per C row and group: zeroing, scaling into the row's float32 accumulator
DOT_STEP_CYCLES = 32  # per register block and 16-pair step: loop entry and exit, row pointers (fitted on Zen 4:
#                       2 tiles x 4 rows took 1.13x the time per product of 5 x 4 at M=128)
# per 16 decoded B rows stored to L1 for the AVX512-BF16 micro-kernel (Zen 4 stores a zmm in two cycles; fitted:
# 4096x4096 int1 GEMV 0.49 ms staged against 0.27 ms direct); convert adds its ~7 vector ops per row (estimated)
DOT_DECODE_CYCLES = {"affine": 40, "lut": 40, "convert": 100}
# per decoded B row fed straight into the products (load share, shift, mask, OR; fitted on Zen 4: the direct int1
# GEMV, decode-bound, took ~3 cycles per row); convert fitted on Zen 4 from int8 4096x4096 M=1 with the weights
# in cache: 0.47 ms against 0.28-0.33 ms for the affine decode's two nibble rows
DOT_DIRECT_ROW_CYCLES = {"affine": 1.5, "lut": 1.5, "convert": 6}
OVERLAP = 0.5  # the fraction of the smaller of memory and compute time that does not hide under the larger
PREFETCH_PENALTY = 0.04  # per doubling away from the ideal prefetch depth
# No software prefetch (prefetch=0): the model cannot tell whether the hardware prefetchers keep up (measured on
# Zen 4, in probes: 5-9% faster at M=1 int4/nf4, 7-11% slower at M=16 int4 and M=1 int2).  It ranks it below every depth
# within a doubling of the ideal, and profiling decides (the shortlist always times the best one's twin without it)
HARDWARE_PREFETCH_DOUBLINGS = 1.5


@dataclass(frozen=True)
class Estimate:
    """Modeled seconds of one call and the parts it is made of."""

    seconds: float
    parts: dict

    def __str__(self) -> str:
        return ", ".join(f"{name}={value:.3g}" for name, value in self.parts.items())


def estimate(template: str, config, spec: Matmul, n: int, k: int, m: int, device) -> Estimate:
    """Modeled time of `template` with `config` for M rows of a [N, K] weight on a CPU `device`."""
    ttype = get(spec.weight_dtype)
    bits = ttype.bits
    groups = k // effective_group_size(spec.group_size, k)
    scale_bytes = 1 if ttype.block_size > 1 else itemsize(spec.scale_dtype)
    activation_bytes = itemsize(spec.activation_dtype)
    dram = n * k * bits / 8 + n * groups * scale_bytes + m * k * activation_bytes + m * n * 4
    work = {"amx": _amx_cycles, "dot": _dot_cycles, "lut": _lut_cycles, "generic": _generic_cycles}[template]
    cycles, tasks, extra = work(config, spec, n, k, m, device)
    dram += extra.get("plane_bytes", 0)
    imbalance = math.ceil(tasks / device.cores) / (tasks / device.cores) if tasks else 1.0
    compute = cycles / device.cores * imbalance / device.clock_hz
    memory = dram / device.memory_bandwidth()
    seconds = max(compute, memory) + OVERLAP * min(compute, memory)
    if hasattr(config, "prefetch"):
        doublings = abs(math.log2(config.prefetch / _ideal_prefetch(config, device))) if config.prefetch else \
            HARDWARE_PREFETCH_DOUBLINGS
        seconds *= 1 + PREFETCH_PENALTY * doublings
    parts = {"compute_s": compute, "dram_s": memory, "dram_bytes": dram, "tasks": tasks, "imbalance": imbalance,
             **extra}
    return Estimate(seconds, parts)


def _ideal_prefetch(config, device) -> float:
    """Words ahead that cover the memory latency: each task streams `n_tiles` tile rows at once."""
    streams = getattr(config, "n_tiles", 1)
    return max(8.0, device.prefetch_bytes / 64 / streams * 2)


def _amx_cycles(config, spec, n, k, m, device):
    k_pad = padded_k(k, get(spec.weight_dtype).bits)
    tiles_n = -(-n // 16)
    steps = k_pad // 32
    planes = PLANES[spec.activation_dtype]
    b_tiles = tiles_n * steps
    if config.small_m:
        rows, blocks, chunks, tdp = m, 1, 1, TDP_CYCLES_FEW_ROWS if m <= 4 else TDP_CYCLES_FULL
    else:
        block = 16 * config.m_tiles
        rows = -(-m // block) * block
        chunks = -(-rows // config.m_chunk)
        blocks = rows // block
        tdp = TDP_CYCLES_FULL
    nibble_planes = nibbles(spec, config.decode)  # affine 8-bit codes: a B and a C tile per nibble
    b_tiles *= nibble_planes
    decode = b_tiles * chunks * DECODE_CYCLES[config.decode]
    distance = config.stage_steps * config.n_tiles
    decode += b_tiles * chunks * STALL_CYCLES * max(0, PIPELINE_TILES - distance) / PIPELINE_TILES
    per_step_block = planes * (config.m_tiles * TILE_LOAD_CYCLES + config.n_tiles * TILE_LOAD_CYCLES
                               + config.m_tiles * config.n_tiles * tdp)
    products = b_tiles / config.n_tiles * blocks * per_step_block
    group = effective_group_size(spec.group_size, k)
    epilogue = tiles_n * (k_pad // max(group, 16)) * (TDP_CYCLES_FULL + rows * 3)
    stash = 0.0
    group_steps = max(1, min(group, k_pad) // 32)
    if not config.small_m and group_steps > config.stage_steps:  # C tiles leave registers between stages
        inside = 1 - config.stage_steps / group_steps  # the share of stage ends that fall inside a group
        stash = tiles_n * blocks * steps / config.stage_steps * inside * config.m_tiles * nibble_planes * 2 * STASH_CYCLES
    tasks = -(-tiles_n // config.n_tiles) * chunks
    plane_bytes = 0.0
    if config.chunk_prologue:  # a task per chunk; its planes stay in L2 for all its column blocks
        tasks = chunks
    elif not config.small_m and rows * k_pad * 2 * planes > device.l2_bytes:
        # the planes of all rows leave the caches near the cores: written, then read once per column block
        plane_bytes = rows * k_pad * 2 * planes * (1 + -(-tiles_n // config.n_tiles))
    footprint = 2 * config.stage_steps * config.n_tiles * 1024 * nibble_planes + \
        (config.m_chunk if not config.small_m else 16) * config.n_tiles * 64
    pressure = 1 + L1_PRESSURE * max(0.0, footprint - device.l1_bytes / 4) / device.l1_bytes
    return (decode + products + epilogue + stash) * pressure, tasks, \
        {"decode_cycles": decode, "amx_cycles": products, "stash_cycles": stash, "l1_pressure": pressure,
         "plane_bytes": plane_bytes}


def _dot_cycles(config, spec, n, k, m, device):
    k_pad = padded_k(k, get(spec.weight_dtype).bits)
    tiles_n = -(-n // 16)
    pairs = k_pad // 2
    planes, nibble_planes = PLANES[spec.activation_dtype], nibbles(spec, config.decode)
    rows = -(-m // config.rows) * config.rows
    chunks = 1 if config.small_m else -(-rows // config.m_chunk)
    blocks = -(-tiles_n // config.n_tiles)
    row_blocks = rows // config.rows
    group = effective_group_size(spec.group_size, k)
    groups = k_pad // min(group, k_pad)
    if config.direct:  # each row block decodes all of K and multiplies only its real rows
        b_rows = tiles_n * pairs * nibble_planes * row_blocks
        products = planes * min(m, config.rows)  # per B row; the broadcasts serve the block's tiles
        broadcasts = blocks * row_blocks * pairs * products * DOT_BROADCAST_CYCLES[1]
        work = b_rows * (DOT_DIRECT_ROW_CYCLES[config.decode] + products) + broadcasts
        epilogue = blocks * groups * m * config.n_tiles * (nibble_planes + DOT_GROUP_CYCLES)
        return work + epilogue, blocks, {"direct_cycles": work}
    dots = config.rows * config.n_tiles * nibble_planes * planes
    broadcasts = config.rows * planes
    per_pair = max(dots, DOT_BROADCAST_CYCLES[0] * broadcasts) + DOT_BROADCAST_CYCLES[1] * broadcasts
    products = blocks * row_blocks * (pairs * per_pair + k_pad // 32 * DOT_STEP_CYCLES)
    decode = tiles_n * k_pad // 32 * nibble_planes * chunks * DOT_DECODE_CYCLES[config.decode]
    epilogue = blocks * row_blocks * groups * config.rows * config.n_tiles * (nibble_planes + DOT_GROUP_CYCLES)
    group_steps = max(1, min(group, k_pad) // 32)
    stash = 0.0
    if group_steps > config.stage_steps:  # C rows are stored and reloaded at stage ends inside a group
        stash = blocks * row_blocks * k_pad // 32 / config.stage_steps * config.rows * config.n_tiles * nibble_planes * 2
    tasks = chunks if config.chunk_prologue else blocks * chunks
    plane_bytes = 0.0
    if not config.chunk_prologue and not config.small_m and rows * k_pad * 2 * planes > device.l2_bytes:
        plane_bytes = rows * k_pad * 2 * planes * (1 + blocks)
    # The micro-kernel streams the decoded stage from L1 (accumulator rows are touched once per group): measured
    # on Zen 4, 4 steps x 5 tiles (20 KiB) ran fastest; 8 x 5 (40 KiB, past L1) 7% slower.
    decoded = config.stage_steps * config.n_tiles * nibble_planes * 1024
    pressure = 1 + L1_PRESSURE * max(0.0, decoded - device.l1_bytes / 2) / device.l1_bytes
    return (products + decode + epilogue + stash) * pressure, tasks, \
        {"dot_cycles": products, "decode_cycles": decode, "stash_cycles": stash, "l1_pressure": pressure,
         "plane_bytes": plane_bytes}


def _lut_cycles(config, spec, n, k, m, device):
    bits = get(spec.weight_dtype).bits
    words = -(-n // 16) * padded_k(k, bits) // codes_per_word(bits)
    lookups = words * (LOOKUP_CYCLES[0] + LOOKUP_CYCLES[1] * m)
    positions = padded_k(k, bits) * bits // 4
    tasks = -(-(-(-n // 16)) // config.n_tiles)
    tables = m * positions * 4 * min(device.cores, tasks)  # every thread builds the tables for itself
    table_reads = tasks * m * positions * 64 / 32  # each task re-reads every table from L2 at 32 B/cycle
    return lookups + tables + table_reads, tasks, {"lookup_cycles": lookups, "table_l2_cycles": table_reads}


GENERIC_PRODUCT_CYCLES = 2.5  # per 16-lane vector of multiply-adds in the generic template (measured on Zen 4:
#                              6.4 multiply-adds per cycle and core, int4 4096x4096 at M=16)


def _generic_cycles(config, spec, n, k, m, device):
    lanes = device.vector_bytes // 4
    decode = n * k * 6 / lanes
    products = n * k * m * GENERIC_PRODUCT_CYCLES / lanes
    return decode + products, max(1, n // lanes), {"decode_cycles": decode}


# -- CUDA -------------------------------------------------------------------------------------------------
MMA_EFFICIENCY = 0.6  # fraction of peak tensor throughput a hand-scheduled mma pipeline sustains
DECODE_FLOPS_PER_WEIGHT = 4  # LOP3 + fma per decoded element, on the CUDA cores
WAVE_LATENCY_S = 3e-6  # a block's fixed cost (pipeline fill, epilogue) per wave


def estimate_cuda(template: str, config, spec: Matmul, n: int, k: int, m: int, device) -> Estimate:
    """Modeled time on an NVIDIA GPU: HBM traffic at the device bandwidth, mma work at its tensor
    throughput, both per wave of resident blocks (occupancy from shared memory, threads and registers;
    a last partial wave costs a whole one)."""
    from ..codegen.cuda import resources
    from ..codegen.cuda.layout import padded_shape

    ttype = get(spec.weight_dtype)
    n_pad, k_pad = padded_shape(n, k)
    activation_bytes = itemsize(spec.activation_dtype)
    weight_bytes = n_pad * k_pad * ttype.bits / 8 + n_pad * (k_pad // max(16, abs(spec.group_size))) * 2
    used = resources(spec, k, config)
    per_sm = min(device.blocks_per_sm, device.threads_per_sm // max(1, used.threads),
                 device.registers_per_sm // max(1, used.threads * used.registers),
                 device.shared_bytes_per_sm // max(1, used.shared_bytes) if used.shared_bytes else device.blocks_per_sm)
    per_sm = max(1, per_sm)
    if template == "gemm":
        m_blocks = -(-m // config.block_m)
        blocks = m_blocks * (n_pad // config.block_n)
        dram = weight_bytes * min(m_blocks, 1 + (weight_bytes > device.l2_bytes) * (m_blocks - 1)) + \
            m * k_pad * activation_bytes * (n_pad // config.block_n) / max(1, (device.l2_bytes > m * k_pad * 2) * 8) + \
            m * n_pad * 4
        flops = 2 * m_blocks * config.block_m * n_pad * k_pad  # padded rows are computed too
        compute = flops / (device.tensor_flops * MMA_EFFICIENCY) + n_pad * k_pad * m_blocks * \
            DECODE_FLOPS_PER_WEIGHT / (device.tensor_flops / 16)
    else:
        row_blocks = -(-m // config.rows)
        blocks = row_blocks * (n_pad // config.columns) * config.split_k
        dram = weight_bytes * row_blocks + m * k_pad * activation_bytes + m * n_pad * 4 * config.split_k
        compute = 2 * m * n_pad * k_pad / (device.tensor_flops / 16) + n_pad * k_pad * row_blocks * \
            DECODE_FLOPS_PER_WEIGHT / (device.tensor_flops / 16)
    waves = -(-blocks // (device.sm_count * per_sm))
    # Few blocks cannot keep HBM busy: bandwidth scales with the SMs that have work.
    busy = min(1.0, blocks / device.sm_count)
    memory = dram / (device.memory_bandwidth() * busy)
    seconds = max(compute, memory) + waves * WAVE_LATENCY_S
    return Estimate(seconds, {"compute_s": compute, "dram_s": memory, "dram_bytes": dram, "blocks": blocks,
                              "waves": waves, "blocks_per_sm": per_sm})
