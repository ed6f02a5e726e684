"""Table-lookup template for few rows (T-MAC style): y = x · dequant(W)ᵀ without decoding the weights: per nibble
of 16 weight rows, one lookup (a vpermps with AVX-512, three instructions per 8 lanes with AVX2) finds the partial
sums of x in a 16-entry table; its code comes from
`emit.lut` (see there for the kernel's structure).  Cost grows with the number of rows: it serves M <= 4."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.matmul import EPILOGUES, NORMS, Matmul
from ...ttype import codes_per_word, effective_group_size, get
from ..template import Work
from . import isa
from .kernel import (FEW_ROWS, PREFETCH_WORDS, CpuTemplate, Footprint, check_prefetch, doublings, norm_prologue,
                     operand_bytes)
from .layout import AMX_TILE_ROWS, TILE16_BITS, padded_k
from .matrix import PLANES

MAX_ROWS = FEW_ROWS
NIBBLES_PER_WORD = 8
# The body is unrolled per row count and tile (measured on Zen 4, int1 4096x4096: rows 1..4 x 4 tiles (40)
# compiled in 0.93 s, x 8 tiles in 2.2 s; one row x 8 tiles in 0.23 s):
BODY = 36  # tiles x the bucket's row counts summed
LOOKUP_256 = 3  # a word's lookups and sums per row cost this many times more with 256-bit vectors (three
#                 instructions per 8 lanes for each vpermps of 16, `emit.tir.lookup16`; estimated)


@dataclass(frozen=True)
class LutConfig:
    """Tile configuration of the lookup template: `n_tiles` 16-row weight tiles per task (they share each
    group's tables while those sit in L1), `prefetch` words ahead (0: none)."""

    n_tiles: int = 8
    prefetch: int = 32

    def __post_init__(self):
        check_prefetch(self.prefetch)


def value_table(spec: Matmul) -> torch.Tensor:
    """The `values` argument: float32 v(c) for every code c of the weight type (raw codes for zero modes)."""
    ttype = get(spec.weight_dtype)
    if spec.zero_mode != "none":
        return torch.arange(ttype.num_codes, dtype=torch.float32)
    return ttype.values.clone()


def min_tiles(spec: Matmul) -> int:
    """Tiles a task must hold: a (gate, up) pair for SwiGLU (`ops.matmul.swiglu_rows`), else one."""
    return 2 if spec.epilogue == "swiglu" else 1


class LutTemplate(CpuTemplate):
    name = "lut"
    title = "lookup"
    config_type = LutConfig
    max_rows = MAX_ROWS
    shape_fields = ("n_tiles", "prefetch")
    epilogues = EPILOGUES  # its output stage (`emit.lut.Builder._store`)
    norms = NORMS  # the tables are built from x̂ (`emit.norm`)
    residual_add = True
    # 256-bit vpermps at least on x86, NEON's four-register tbl on aarch64 (`emit.tir.lookup16`)
    requires = (isa.level("x86-64-v3").features, isa.level("armv8-a").features)

    def unsupported(self, spec: Matmul, n: int, k: int, device) -> str | None:
        ttype = get(spec.weight_dtype)
        group = effective_group_size(spec.group_size, k)
        if spec.geometry is not None:
            return f"a convolution (the {self.title} template reads x as a matrix; it has no gathering prologue)"
        reason = self.unsupported_codes(spec)
        if reason:
            return reason
        if spec.activation_dtype not in PLANES:
            return f"activation_dtype={spec.activation_dtype}"
        if group != k and group % codes_per_word(ttype.bits):
            return f"group_size={group} (it needs whole 32-bit words of codes per group)"
        return None

    def unsupported_codes(self, spec: Matmul) -> str | None:
        """Why the template cannot read the spec's weight codes, or None."""
        bits = get(spec.weight_dtype).bits
        return None if bits in TILE16_BITS else f"{bits}-bit codes (it reads {TILE16_BITS}-bit codes)"

    def resources(self, spec: Matmul, k: int, config: LutConfig) -> Footprint:
        """L1: a group's tables (16 float32 sums per nibble position) and the task's accumulators."""
        group = effective_group_size(spec.group_size, k)
        tables = group // codes_per_word(get(spec.weight_dtype).bits) * NIBBLES_PER_WORD * 64
        return Footprint(l1_bytes=tables + config.n_tiles * MAX_ROWS * 64)

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[LutConfig]:
        """Tiles per task while a group's tables and the accumulators fit L1 and the body stays small (the
        fewest tiles always: one, or for SwiGLU a (gate, up) pair), every prefetch depth."""
        row_counts = sum(range(bucket[0], bucket[1] + 1))
        fewest = min_tiles(spec)
        found = []
        for n_tiles in doublings(fewest, 16):
            too_large = self.resources(spec, k, LutConfig(n_tiles)).l1_bytes > device.l1_bytes or \
                n_tiles * row_counts > BODY
            if too_large and n_tiles > fewest:
                break
            found += [LutConfig(n_tiles, prefetch) for prefetch in PREFETCH_WORDS]
        return found

    def work(self, spec: Matmul, n: int, k: int, m: int, config: LutConfig, device) -> Work:
        """Per call: the words of codes looked up (a fixed part, and a part per row of x), the table entries every
        thread builds for itself, and the tables each task re-reads from L2."""
        bits = get(spec.weight_dtype).bits
        words = -(-n // AMX_TILE_ROWS) * padded_k(k, bits) // codes_per_word(bits)
        positions = padded_k(k, bits) * bits // 4
        tasks = -(-(-(-n // AMX_TILE_ROWS)) // config.n_tiles)
        lookups = 1 if device.vector_bytes >= 64 else LOOKUP_256
        operations = {"lookup_word": words, "lookup_word_row": words * m * lookups,
                      "lookup_table_entry": m * positions * min(device.cores, tasks),
                      "l2_byte": tasks * m * positions * 64, **norm_prologue(spec, m, k, min(device.cores, tasks))}
        return Work(tasks, operand_bytes(spec, n, k, m), operations, streams=config.n_tiles, prefetch=config.prefetch)

    def program(self, spec: Matmul, n: int, k: int, config: LutConfig, layout, bucket, device):
        """The PrimFunc for M in `bucket` (within 1..4), split into `device.cores` parallel chunks, and the constants
        it takes after the weight's tensors (`emit`)."""
        self.check_config(config)
        reason = self.unsupported_grouping(spec) or self.unsupported(spec, n, k, device) or \
            self.unsupported_epilogue(spec)
        if reason:
            raise ValueError(f"the {self.title} template does not support {reason}")
        if config.n_tiles % min_tiles(spec):
            raise ValueError(f"n_tiles={config.n_tiles}: epilogue='swiglu' needs an even n_tiles (gate and up tiles "
                             f"in pairs)")
        return self.emit(spec, n, k, config, bucket, device)

    def emit(self, spec: Matmul, n: int, k: int, config, bucket, device):
        """(the kernel's PrimFunc, its constants): here the lookup kernel (`emit.lut.build`) and its value table."""
        from .emit.lut import build

        return build(spec, n, k, config, device.cores, bucket, device.level), [value_table(spec)]


TEMPLATE = LutTemplate()
