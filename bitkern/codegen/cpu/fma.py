"""FMA template for few rows: y = x · dequant(W)ᵀ with integer codes converted to float32 in registers and
multiplied in by FMA (any level from AVX2 up); its code comes from `emit.fma`, the lookup kernel's structure with
the tables replaced.  It serves integer and zero-point codes of 2, 4 and 8 bits for M <= 4: where a 16-entry
table lookup is one vpermps (AVX-512) the lookup template competes, where it takes three per 8 lanes (AVX2) this
one is the cheaper decode of 4- and 8-bit codes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.matmul import Matmul
from ...ttype import effective_group_size, get
from ...ttype.types import INT, UINT
from ..template import Work
from . import isa
from .kernel import FEW_ROWS, PREFETCH_WORDS, Footprint, doublings, norm_prologue, operand_bytes
from .layout import AMX_TILE_ROWS, padded_k
from .lut import LutConfig, LutTemplate, min_tiles

BITS = (2, 4, 8)  # 1-bit codes: the lookup template (64 per lookup); 32 positions would outgrow a 16-lane x pattern
# rows x tiles of 16-lane sums a body keeps in registers: with AVX2 each is two of its 16 ymm
BODY = 8


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
    them all), `prefetch` words ahead (0: none)."""

    n_tiles: int = 2


class FmaTemplate(LutTemplate):
    """The lookup template's checks, output stage and prologue (`emit.fma` builds on its kernel), with its own codes,
    configurations and counts."""

    name = "fma"
    title = "FMA"
    config_type = FmaConfig
    requires = isa.level("x86-64-v3").features  # vfmadd231ps

    def unsupported_codes(self, spec: Matmul) -> str | None:
        ttype = get(spec.weight_dtype)
        if ttype.bits not in BITS:
            return f"{ttype.bits}-bit codes (it reads {list(BITS)}-bit codes)"
        if spec.zero_mode == "none" and not converts_exactly(ttype):
            return f"{ttype.name} codes (it converts codes that are their values as integers)"
        return None

    def resources(self, spec: Matmul, k: int, config: FmaConfig) -> Footprint:
        """L1: the task's sums (rows x tiles of 16 float32) and a group's widened x per row."""
        group = min(effective_group_size(spec.group_size, k), k)
        return Footprint(l1_bytes=config.n_tiles * FEW_ROWS * 64 + FEW_ROWS * group * 4)

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[FmaConfig]:
        """Tiles per task while the sums of the bucket's largest row count stay within BODY (the fewest tiles always:
        one, or a (gate, up) pair for SwiGLU), every prefetch depth."""
        fewest = min_tiles(spec)
        return [FmaConfig(n_tiles, prefetch) for n_tiles in doublings(fewest, 8)
                if n_tiles == fewest or n_tiles * bucket[1] <= BODY for prefetch in PREFETCH_WORDS]

    def work(self, spec: Matmul, n: int, k: int, m: int, config: FmaConfig, device) -> Work:
        """Per call: every 16-lane vector of codes converted once (mask, convert) and multiplied in per row; with
        256-bit vectors each counts twice."""
        bits = get(spec.weight_dtype).bits
        vectors = -(-n // AMX_TILE_ROWS) * padded_k(k, bits)
        widths = 64 // device.vector_bytes
        tasks = -(-(-(-n // AMX_TILE_ROWS)) // config.n_tiles)
        operations = {"convert_code_vector": vectors * widths, "fma_code_row": vectors * m * widths,
                      **norm_prologue(spec, m, k, min(device.cores, tasks))}
        return Work(tasks, operand_bytes(spec, n, k, m), operations, streams=config.n_tiles, prefetch=config.prefetch)

    def emit(self, spec: Matmul, n: int, k: int, config: FmaConfig, bucket, device):
        """The FMA kernel (`emit.fma.build`); no constants."""
        from .emit.fma import build

        return build(spec, n, k, config, device.cores, bucket, device.level), []


TEMPLATE = FmaTemplate()
