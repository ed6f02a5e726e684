"""FMA template: y = x · dequant(W)ᵀ with codes decoded to float32 in registers and multiplied in by FMA (any level
from AVX2 up); its code comes from `emit.fma`, the lookup kernel's structure with the tables replaced.  It serves
integer and zero-point codes of 2, 4 and 8 bits (converted), 4-bit code books (nf4, fp4, MX, NVFP4: looked up,
`emit.tir.lookup16`) and bfloat16 weights (moved into float32's top half).  For M <= 4 (few rows) it is the decode kernel: where a
16-entry table lookup is one vpermps (AVX-512) the lookup template competes, where it takes three per 8 lanes (AVX2)
this one is the cheaper decode of 4- and 8-bit codes.  Beyond that (prompts) it runs blocks of rows, each word
decoded once per block, on levels without AVX512-BF16 (with it, the dot template's bf16 products are the faster
float path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.matmul import Matmul
from ...ttype import effective_group_size, get
from ...ttype.types import INT, UINT
from ..template import ANY_ROWS, Work
from . import isa
from .kernel import (FEW_ROWS, PREFETCH_WORDS, Footprint, bfloat16_codes, doublings, norm_prologue,
                     operand_bytes)
from .layout import AMX_TILE_ROWS, padded_k
from .lut import LOOKUP_256, LutConfig, LutTemplate, min_tiles, value_table

# integer widths (and bfloat16's 16 bits); 1-bit codes: the lookup template (64 per lookup); 32 positions would
# outgrow a 16-lane x pattern
BITS = (2, 4, 8)
# rows x tiles of 16-lane sums a body keeps in registers: with AVX2 each is two of its 16 ymm
BODY = 8
# Beyond few rows, row blocks whose sums, decoded codes and broadcast x stay in the level's vector registers
# (`fits_registers`); the prologue prepares M_CHUNK rows of x at a time (a chunk of widened rows is read once per
# block and task, from L2 or L3; the weights are read again per chunk)
BLOCK_ROWS = (2, 3, 4, 6, 8, 12)
M_CHUNK = 64


def fits_registers(rows: int, n_tiles: int, level, lookup: bool) -> bool:
    """Whether a block of rows stays in the `level`'s vector registers: a 16-lane sum per row and tile, each tile's
    decoded codes and, for code books, the value table (each 16 lanes taking 64 / vector bytes registers), and a
    broadcast x.  More spills the sums (measured at x86-64-v3, int4 4096x14336 M=16: 2 tiles x 3 rows 14.7 ms,
    1 x 6 8.7 ms)."""
    per_16_lanes = 64 // min(level.vector_bytes, 64)
    return (rows * n_tiles + n_tiles + int(lookup)) * per_16_lanes + 1 <= level.vector_registers


def looks_up(spec: Matmul) -> bool:
    """Whether the kernel looks the codes' values up (4-bit code books: nf4, fp4, MX, NVFP4) instead of converting
    them."""
    ttype = get(spec.weight_dtype)
    return spec.zero_mode == "none" and ttype.bits == 4 and not converts_exactly(ttype)


def converts_exactly(ttype) -> bool:
    """Whether a type's codes are their values as integers (two's complement for int types, plain for uint), which
    the kernel converts; other types (int1's ±1, codebooks, floats) go through a lookup."""
    if ttype.kind not in (INT, UINT) or ttype.block_size > 1:
        return False
    codes = torch.arange(ttype.num_codes)
    if ttype.kind == INT:
        codes = torch.where(codes >= ttype.num_codes // 2, codes - ttype.num_codes, codes)
    return torch.equal(ttype.values, codes.to(ttype.values.dtype))


@dataclass(frozen=True)
class FmaConfig(LutConfig):
    """Tile configuration of the FMA template: `n_tiles` 16-row weight tiles per task (each broadcast of x serves
    them all), `prefetch` words ahead (0: none); beyond few rows `rows` per block (each word decoded once per block)
    and `m_chunk` rows the prologue prepares at a time (0, 0 for few rows: a body per row count)."""

    n_tiles: int = 2
    rows: int = 0
    m_chunk: int = 0

    def __post_init__(self):
        super().__post_init__()
        if (self.rows == 0) != (self.m_chunk == 0) or self.rows < 0 or self.m_chunk % max(self.rows, 1):
            raise ValueError(f"rows={self.rows}, m_chunk={self.m_chunk}: both 0 (few rows), or rows >= 1 and "
                             f"m_chunk a multiple of rows")


class FmaTemplate(LutTemplate):
    """The lookup template's checks, output stage and prologue (`emit.fma` builds on its kernel), with its own codes,
    configurations and counts."""

    name = "fma"
    title = "FMA"
    config_type = FmaConfig
    # vfmadd231ps on x86; fmla (and tbl for code books, `emit.tir.lookup16`) on aarch64
    requires = (isa.level("x86-64-v3").features, isa.level("armv8-a").features)
    max_rows = ANY_ROWS

    def unsupported_codes(self, spec: Matmul) -> str | None:
        ttype = get(spec.weight_dtype)
        if bfloat16_codes(ttype):
            return None
        if ttype.bits not in BITS:
            return f"{ttype.bits}-bit codes (it reads {list(BITS)}-bit codes and bfloat16)"
        if spec.zero_mode == "none" and not converts_exactly(ttype) and not looks_up(spec):
            return f"{ttype.name} codes (it converts integer codes and looks up 4-bit code books)"
        return None

    def resources(self, spec: Matmul, k: int, config: FmaConfig) -> Footprint:
        """L1: the task's sums (rows x tiles of 16 float32) and a group's widened x per row."""
        group = min(effective_group_size(spec.group_size, k), k)
        return Footprint(l1_bytes=config.n_tiles * FEW_ROWS * 64 + FEW_ROWS * group * 4)

    def unsupported_rows(self, bucket: tuple[int, int], device) -> str | None:
        """Beyond few rows, none where AVX512-BF16 exists (the dot template's bf16 products are the faster float
        path there)."""
        if bucket[1] > FEW_ROWS and "avx512_bf16" in device.flags:
            return f"{bucket[1]} rows with AVX512-BF16 (the dot template serves them)"
        return None

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[FmaConfig]:
        """Few rows: tiles per task while the sums of the bucket's largest row count stay within BODY (the fewest
        tiles always: one, or a (gate, up) pair for SwiGLU), every prefetch depth.  More rows (none with AVX512-BF16):
        row blocks of tiles x rows that fit the level's registers (`fits_registers`), no prefetch or 32 words (the
        blocks after the first find the task's words in L2)."""
        fewest = min_tiles(spec)
        if bucket[1] <= FEW_ROWS:
            return [FmaConfig(n_tiles, prefetch) for n_tiles in doublings(fewest, 8)
                    if n_tiles == fewest or n_tiles * bucket[1] <= BODY for prefetch in PREFETCH_WORDS]
        return [FmaConfig(n_tiles, prefetch, rows, M_CHUNK - M_CHUNK % rows)
                for n_tiles in doublings(fewest, 4) for rows in BLOCK_ROWS
                if fits_registers(rows, n_tiles, device.level, looks_up(spec)) for prefetch in (0, 32)]

    def work(self, spec: Matmul, n: int, k: int, m: int, config: FmaConfig, device) -> Work:
        """Per call: every 16-lane vector of codes decoded once, or once per row block (a mask and a convert; a
        shift and a lookup, LOOKUP_256 times that with 256-bit vectors), and multiplied in per row, x broadcast per row
        and task; with 256-bit vectors each counts twice."""
        bits = get(spec.weight_dtype).bits
        vectors = -(-n // AMX_TILE_ROWS) * padded_k(k, bits)
        widths = 64 // device.vector_bytes
        tasks = -(-(-(-n // AMX_TILE_ROWS)) // config.n_tiles)
        blocks = -(-m // config.rows) if config.rows else 1
        decode = LOOKUP_256 if looks_up(spec) and device.vector_bytes < 64 else 1
        operations = {"convert_code_vector": vectors * blocks * widths * decode, "fma_code_row": vectors * m * widths,
                      "fma_broadcast_row": vectors * m * widths // config.n_tiles, **norm_prologue(spec, m, k, min(device.cores, tasks))}
        return Work(tasks, operand_bytes(spec, n, k, m), operations, streams=config.n_tiles, prefetch=config.prefetch)

    def emit(self, spec: Matmul, n: int, k: int, config: FmaConfig, bucket, device):
        """The FMA kernel (`emit.fma.build`) and, for code books, the value table."""
        from .emit.fma import build

        constants = [value_table(spec)] if looks_up(spec) else []
        return build(spec, n, k, config, device.cores, bucket, device.level), constants


TEMPLATE = FmaTemplate()
