"""Roller-style candidate enumeration: hint-aligned tiles, grown while they fit each level's capacity.

Tiles are multiples of the device hint on every axis (16-column weight tiles, 32-deep k steps, 16-row
AMX blocks); each axis grows by doubling from the hint until the footprint exceeds the level that must
hold it (AMX tile registers for C/A/B tiles, vector registers for AVX512-BF16 register blocks, L1 for
decoded stages and lookup tables, L2 for activation planes).  Knobs the traffic model cannot see (prefetch
distance, decode strategy) vary alongside.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..codegen.cpu import amx, dot, lut
from ..codegen.cpu.configs import DOT_REGISTERS, TILE_REGISTERS, AmxConfig, DotConfig, GenericConfig, LutConfig
from ..ops.matmul import Matmul
from ..ttype import codes_per_word, effective_group_size, get
from .hints import Hint, cpu_hint

PREFETCH_WORDS = (0, 16, 32, 64, 128)  # software prefetch depths; 0: the hardware prefetchers alone
# LLVM's compile time grows steeply with the AVX512-BF16 template's unrolled register block (measured: float32
# activations, 8 rows x 2 tiles x 4 steps, 11 s; bfloat16, 16 rows x 1 tile x 4 steps for large M, 3.2 s):
DOT_BROADCASTS = {True: 8, False: 4}  # rows x activation planes per block (small-M kernels, large-M kernels)
DOT_BODY = 80  # vdpbf16ps per k pair over a stage's steps
LUT_MAX_ROWS = lut.MAX_ROWS
# The lookup template unrolls its body per row count and tile (measured on Zen 4, int1 4096x4096: rows 1..4 x 4
# tiles (40) compiled in 0.93 s, x 8 tiles in 2.2 s; one row x 8 tiles in 0.23 s):
LUT_BODY = 36  # tiles x the bucket's row counts summed
SMALL_M = amx.SMALL_M_ROWS
LARGE_M = 128


@dataclass(frozen=True)
class Candidate:
    """One template configuration the tuner may build."""

    template: str
    config: object


def templates_for(spec: Matmul, k: int, bucket: tuple[int, int], layout: str, device) -> dict[str, str | None]:
    """Each CPU template and why it cannot serve this kernel (None: it can)."""
    high = bucket[1]
    reasons = {"generic": None}
    amx_reason = amx.unsupported_reason(spec, k) if layout == "tile16" else f"the {layout} weight layout"
    if not device.has_amx_bf16:
        amx_reason = "this CPU (no AMX-BF16)"
    reasons["amx"] = amx_reason
    dot_reason = amx.unsupported_reason(spec, k) if layout == "tile16" else f"the {layout} weight layout"
    if device.has_amx_bf16:
        dot_reason = "this CPU has AMX (the AVX512-BF16 template serves CPUs without it)"
    reasons["dot"] = dot.device_reason(device) or dot_reason
    lut_reason = lut.unsupported_reason(spec, k) if layout == "tile16" else f"the {layout} weight layout"
    if high > LUT_MAX_ROWS:
        lut_reason = f"{high} rows (the lookup template serves at most {LUT_MAX_ROWS})"
    if spec.geometry is not None:
        lut_reason = "a convolution (the lookup template reads x as a matrix; it has no gathering prologue)"
    reasons["lut"] = lut_reason
    return reasons


def enumerate_candidates(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str,
                         device) -> tuple[Hint, list[Candidate]]:
    """The device hint and every configuration, of every template that can serve the kernel."""
    hint = cpu_hint(spec, k, device)
    reasons = templates_for(spec, k, bucket, layout, device)
    found: list[Candidate] = []
    if reasons["amx"] is None:
        found += _amx(spec, k, bucket, device, hint)
    if reasons["dot"] is None:
        found += _dot(spec, bucket, device)
    if reasons["lut"] is None:
        found += _lut(spec, k, bucket, device)
    if reasons["generic"] is None:
        found += [Candidate("generic", GenericConfig(block)) for block in _doublings(hint.k, 256) if k % block == 0]
        if not any(c.template == "generic" for c in found):
            found.append(Candidate("generic", GenericConfig(k)))
    return hint, found


def _doublings(start: int, limit: int) -> list[int]:
    values, value = [], max(1, start)
    while value <= limit:
        values.append(value)
        value *= 2
    return values


def _amx(spec: Matmul, k: int, bucket: tuple[int, int], device, hint: Hint) -> list[Candidate]:
    tile_bytes = 16 * 64  # a decoded bf16 B tile, a float32 C tile
    found = []
    small = bucket[1] <= SMALL_M
    # Per-chunk planes pay off where all rows' planes outgrow L2: only the open-ended bucket gets them.
    prologues = (False, True) if bucket[1] > LARGE_M else (False,)
    for decode, m_tiles in itertools.product(amx.decode_strategies(spec), (1,) if small else (1, 2)):
        planes = amx.nibbles(spec, decode)  # the affine decode of 8-bit codes: a B and a C tile per nibble
        for n_tiles in range(1, TILE_REGISTERS):
            if m_tiles * n_tiles * planes + m_tiles + 1 > TILE_REGISTERS:
                break
            for stage in _doublings(1, 8):
                # L1 holds two decoded stages, the stored C tiles and the task's accumulators.
                footprint = (2 * stage * n_tiles + m_tiles * n_tiles) * planes * tile_bytes
                chunks = [SMALL_M] if small else [c for c in _doublings(hint.m * m_tiles, 256)]
                for chunk in chunks:
                    if footprint + chunk * n_tiles * 64 > device.l1_bytes:
                        continue
                    for prefetch, chunk_prologue in itertools.product(PREFETCH_WORDS, prologues):
                        found.append(Candidate("amx", AmxConfig(n_tiles, m_tiles, small, max(chunk, 16 * m_tiles),
                                                                stage, prefetch, decode, chunk_prologue)))
    return found


def _dot(spec: Matmul, bucket: tuple[int, int], device) -> list[Candidate]:
    """AVX512-BF16 configurations: register blocks (rows x n_tiles C rows, plus the n_tiles weight rows) that
    fit the vector registers, decoded stages that fit half of L1, and bodies LLVM compiles in well under a
    second (DOT_BROADCASTS, DOT_BODY; a direct kernel's bodies for every row count up to its rows count)."""
    planes = amx.PLANES[spec.activation_dtype]
    small = bucket[1] <= SMALL_M
    broadcasts = DOT_BROADCASTS[small]
    prologues = (False, True) if bucket[1] > LARGE_M else (False,)
    found = []
    all_rows = [r for r in _doublings(1, SMALL_M) if r * planes <= broadcasts and (r <= bucket[1] or not small)]
    for decode, rows in itertools.product(amx.decode_strategies(spec), all_rows):
        nibbles = amx.nibbles(spec, decode)
        for n_tiles in range(1, DOT_REGISTERS):
            if (rows + 1) * n_tiles * nibbles > DOT_REGISTERS:
                break
            for stage in _doublings(1, 8):
                decoded = stage * n_tiles * nibbles * 1024
                if stage * rows * planes * n_tiles * nibbles > DOT_BODY:
                    break
                for chunk in [SMALL_M] if small else [c for c in _doublings(32, 256) if c % rows == 0]:
                    if decoded > device.l1_bytes // 2 or decoded + chunk * n_tiles * 64 > device.l2_bytes // 2:
                        continue
                    for prefetch in PREFETCH_WORDS:
                        for chunk_prologue in prologues:
                            found.append(Candidate("dot", DotConfig(n_tiles, rows, small, max(chunk, rows), stage,
                                                                    prefetch, decode, chunk_prologue)))
                        # a direct kernel has a body for each row count up to `rows`
                        direct_body = stage * rows * (rows + 1) // 2 * planes * n_tiles * nibbles
                        if bucket[1] <= LUT_MAX_ROWS and direct_body <= DOT_BODY:
                            found.append(Candidate("dot", DotConfig(n_tiles, rows, True, SMALL_M, stage, prefetch,
                                                                    decode, direct=True)))
    return found


def _lut(spec: Matmul, k: int, bucket: tuple[int, int], device) -> list[Candidate]:
    bits = get(spec.weight_dtype).bits
    row_counts = sum(range(bucket[0], bucket[1] + 1))
    group = effective_group_size(spec.group_size, k)
    tables_per_group = group // codes_per_word(bits) * lut.NIBBLES_PER_WORD * 64
    found = []
    for n_tiles in _doublings(1, 16):
        if (tables_per_group + n_tiles * LUT_MAX_ROWS * 64 > device.l1_bytes or n_tiles * row_counts > LUT_BODY) \
                and n_tiles > 1:
            break
        found += [Candidate("lut", LutConfig(n_tiles, prefetch)) for prefetch in PREFETCH_WORDS]
    return found


# -- CUDA -------------------------------------------------------------------------------------------------
CUDA_SMALL_M = 4  # rows a GEMV candidate competes for


def fits(resources, device) -> str | None:
    """Why a kernel using `resources` per block cannot run on `device`, or None."""
    if resources.shared_bytes > device.shared_bytes_per_block:
        return f"{resources.shared_bytes} bytes of shared memory > {device.shared_bytes_per_block}"
    if resources.threads > device.max_threads_per_block:
        return f"{resources.threads} threads > {device.max_threads_per_block}"
    if resources.registers > device.registers_per_thread:
        return f"{resources.registers} registers per thread > {device.registers_per_thread}"
    if resources.registers * resources.threads > device.registers_per_sm:
        return f"{resources.registers * resources.threads} registers per block > {device.registers_per_sm}"
    return None


def enumerate_cuda_candidates(spec: Matmul, n: int, k: int, bucket: tuple[int, int], device):
    """The hint and every GEMM (and, for few rows, GEMV) configuration that builds for `spec` and fits the
    architecture's shared memory, thread and register limits."""
    from ..codegen.cuda import GemmConfig, GemvConfig, gemm, gemv, resources
    from .hints import cuda_hint

    hint = cuda_hint(spec, device)
    found = []
    for warp_m in (16, 32, 64):
        for warp_n in (16, 32, 64):
            for rows_of_warps, cols_of_warps in ((1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2)):
                for block_k in (32, 64, 128):
                    for stages in (2, 3, 4):
                        for decode in ("lop3", "tir"):
                            try:
                                config = GemmConfig(warp_m * rows_of_warps, warp_n * cols_of_warps, block_k, warp_m,
                                                    warp_n, stages, decode)
                            except ValueError:
                                continue
                            if config.block_m % hint.m or config.block_n % hint.n:
                                continue
                            if gemm.unsupported_reason(spec, n, k, config, device.arch) is None and \
                                    fits(resources(spec, k, config), device) is None:
                                found.append(Candidate("gemm", config))
    if bucket[1] <= CUDA_SMALL_M:
        for rows in (1, 2, 4):
            for warps in (2, 4, 8):
                for k_threads in (8, 16, 32):
                    for words in (2, 4):
                        for split_k in (1, 2, 4):
                            for decode in ("lop3", "tir"):
                                config = GemvConfig(rows, warps, k_threads, words, split_k, decode)
                                if gemv.unsupported_reason(spec, n, k, config) is None and \
                                        fits(resources(spec, k, config), device) is None:
                                    found.append(Candidate("gemv", config))
    return hint, _prefer_lop3(found)


def _prefer_lop3(candidates: list) -> list:
    """The plain-TIR decode only where the LOP3 decode cannot serve (it is the slower, general path)."""
    lop3 = {(c.template, _without_decode(c.config)) for c in candidates if c.config.decode == "lop3"}
    return [c for c in candidates if c.config.decode == "lop3" or (c.template, _without_decode(c.config)) not in lop3]


def _without_decode(config):
    import dataclasses

    return dataclasses.replace(config, decode="lop3")
