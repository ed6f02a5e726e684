"""AVX512-BF16 template: y = x · dequant(W)ᵀ on CPUs without AMX (AMD Zen 4 and later, Cooper Lake, Sapphire
Rapids VMs with AMX hidden), the tile products done by a register-blocked vdpbf16ps micro-kernel; its code
comes from `emit.dot` (see there for the kernel's structure)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ...ops.matmul import Matmul
from ...ttype import effective_group_size, get
from ..template import Work
from . import isa
from .kernel import (FEW_ROWS, LARGE_M, PREFETCH_WORDS, SMALL_M, Footprint, doublings, norm_prologue,
                     operand_bytes)
from .layout import AMX_TILE_ROWS, padded_k
from .matrix import PLANES, TILE_BYTES, MatrixConfig, MatrixTemplate, decode_strategies, nibbles

# zmm registers a register block may hold (C rows and the task's decoded weight rows, of 32): measured on
# AMD Zen 4, 3 rows x 7 tiles (28) ran at half the speed of 4 x 5 (25)
REGISTERS = 27
# LLVM's compile time grows steeply with the unrolled register block (measured: float32 activations, 8 rows x 2
# tiles x 4 steps, 11 s; bfloat16, 16 rows x 1 tile x 4 steps for large M, 3.2 s):
BROADCASTS = {True: 8, False: 4}  # rows x activation planes per block (small-M kernels, large-M kernels)
BODY = 80  # vdpbf16ps per k pair over a stage's steps


@dataclass(frozen=True)
class DotConfig(MatrixConfig):
    """Tile configuration of the AVX512-BF16 template (chosen by the tuner): MatrixConfig's fields, n_tiles
    counting 16-column weight tiles; rows: activation rows per register block (C rows held in registers:
    rows x n_tiles, x2 for 8-bit codes); direct (few rows): decoded weight rows go from registers straight into
    the products of a block of up to `rows` rows, one body per row count, instead of through a decoded stage in
    L1 that serves every row block."""

    n_tiles: int = 2
    m_chunk: int = 64
    stage_steps: int = 2
    rows: int = 8
    direct: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.direct and not self.small_m:
            raise ValueError("direct kernels serve few rows: they need small_m")
        if self.small_m and (self.chunk_prologue or AMX_TILE_ROWS % self.rows):
            raise ValueError(f"small_m kernels take a divisor of {AMX_TILE_ROWS} rows per block and build their "
                             f"planes in one pass")
        if (self.rows + 1) * self.n_tiles > REGISTERS:
            raise ValueError(f"rows={self.rows} x n_tiles={self.n_tiles} needs more than {REGISTERS} "
                             f"vector registers")
        if self.m_chunk % self.rows:
            raise ValueError(f"m_chunk={self.m_chunk} must be a multiple of rows={self.rows}")


class DotTemplate(MatrixTemplate):
    name = "dot"
    title = "AVX512-BF16"
    config_type = DotConfig
    shape_fields = ("n_tiles", "rows", "prefetch", "decode", "chunk_prologue")
    requires = (isa.level("avx512-bf16").features,)

    def unsupported(self, spec: Matmul, n: int, k: int, device) -> str | None:
        if device.has_amx_bf16:
            return "this CPU has AMX (the AVX512-BF16 template serves CPUs without it)"
        return self.unsupported_spec(spec, k)

    def builder(self):
        from .emit.dot import DotBuilder

        return DotBuilder

    def resources(self, spec: Matmul, k: int, config: DotConfig) -> Footprint:
        """L1: the decoded stage the micro-kernel streams (accumulator rows are touched once per group); L2: the
        stage and the task's float32 accumulators."""
        decoded = config.stage_steps * config.n_tiles * nibbles(spec, config.decode) * TILE_BYTES
        return Footprint(l1_bytes=decoded, l2_bytes=decoded + config.m_chunk * config.n_tiles * 64)

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[DotConfig]:
        """Register blocks (rows x n_tiles C rows, plus the n_tiles weight rows) that fit the vector registers,
        decoded stages that fit half of L1 (with the accumulators, half of L2), and bodies LLVM compiles in well
        under a second (BROADCASTS, BODY; a direct kernel's bodies for every row count up to its rows)."""
        planes = PLANES[spec.activation_dtype]
        small = bucket[1] <= SMALL_M
        broadcasts = BROADCASTS[small]
        prologues = (False, True) if bucket[1] > LARGE_M else (False,)
        found = []
        all_rows = [r for r in doublings(1, SMALL_M) if r * planes <= broadcasts and (r <= bucket[1] or not small)]
        for decode, rows in itertools.product(decode_strategies(spec), all_rows):
            nib = nibbles(spec, decode)
            for n_tiles in range(1, REGISTERS):
                if (rows + 1) * n_tiles * nib > REGISTERS:
                    break
                for stage in doublings(1, 8):
                    if stage * rows * planes * n_tiles * nib > BODY:
                        break
                    for chunk in [SMALL_M] if small else [c for c in doublings(32, 256) if c % rows == 0]:
                        used = self.resources(spec, k, DotConfig(n_tiles, small, chunk, stage, 0, decode, rows=rows))
                        if used.l1_bytes > device.l1_bytes // 2 or used.l2_bytes > device.l2_bytes // 2:
                            continue
                        for prefetch in PREFETCH_WORDS:
                            found += [DotConfig(n_tiles, small, max(chunk, rows), stage, prefetch, decode,
                                                chunk_prologue, rows=rows) for chunk_prologue in prologues]
                            # a direct kernel has a body for each row count up to `rows`
                            direct_body = stage * rows * (rows + 1) // 2 * planes * n_tiles * nib
                            if bucket[1] <= FEW_ROWS and direct_body <= BODY:
                                found.append(DotConfig(n_tiles, True, SMALL_M, stage, prefetch, decode,
                                                       rows=rows, direct=True))
        return self.for_epilogue(spec, found)

    def work(self, spec: Matmul, n: int, k: int, m: int, config: DotConfig, device) -> Work:
        """Per call: the micro-kernel's vdpbf16ps and activation broadcasts per k pair (a block issues its
        products and broadcasts side by side), its loop steps, the decoded B rows (stored to L1 once per row
        chunk, or fed from registers to each row block for direct kernels), the per-group epilogue of each C
        row, C rows stashed where a stage ends inside a group, and planes that outgrow L2."""
        k_pad = padded_k(k, get(spec.weight_dtype).bits)
        tiles_n = -(-n // AMX_TILE_ROWS)
        pairs = k_pad // 2
        planes, nib = PLANES[spec.activation_dtype], nibbles(spec, config.decode)
        rows = -(-m // config.rows) * config.rows
        chunks = 1 if config.small_m else -(-rows // config.m_chunk)
        blocks = -(-tiles_n // config.n_tiles)
        row_blocks = rows // config.rows
        group = effective_group_size(spec.group_size, k)
        groups = k_pad // min(group, k_pad)
        if config.direct:  # each row block decodes all of K and multiplies only its real rows
            b_rows = tiles_n * pairs * nib * row_blocks
            products = planes * min(m, config.rows)  # per B row; the broadcasts serve the block's tiles
            group_rows = blocks * groups * m * config.n_tiles
            operations = {f"dot_decode_direct.{config.decode}": b_rows, "vdpbf16ps": b_rows * products,
                          "dot_broadcast": blocks * row_blocks * pairs * products,
                          "dot_group_row": group_rows, "dot_group_row_plane": group_rows * nib,
                          **norm_prologue(spec, m, k, device.cores)}
            return Work(blocks, operand_bytes(spec, n, k, m), operations, streams=config.n_tiles,
                        prefetch=config.prefetch)
        block_pairs = blocks * row_blocks * pairs
        broadcasts = config.rows * planes
        group_rows = blocks * row_blocks * groups * config.rows * config.n_tiles
        group_steps = max(1, min(group, k_pad) // 32)
        stashed = 0.0
        if group_steps > config.stage_steps:  # C rows are stored and reloaded at stage ends inside a group
            stashed = blocks * row_blocks * k_pad // 32 / config.stage_steps * config.rows * config.n_tiles * nib * 2
        tasks = chunks if config.chunk_prologue else blocks * chunks
        plane_bytes = 0.0
        if not config.chunk_prologue and not config.small_m and rows * k_pad * 2 * planes > device.l2_bytes:
            plane_bytes = rows * k_pad * 2 * planes * (1 + blocks)
        operations = {"dot_broadcast": block_pairs * broadcasts, "dot_block_step": blocks * row_blocks * (k_pad // 32),
                      f"dot_decode_stage.{config.decode}": tiles_n * k_pad // 32 * nib * chunks,
                      "dot_group_row": group_rows, "dot_group_row_plane": group_rows * nib, "dot_c_row_move": stashed,
                      **norm_prologue(spec, m, k, device.cores if config.small_m else 1)}
        bound = {"vdpbf16ps": block_pairs * config.rows * config.n_tiles * nib * planes,
                 "dot_broadcast_issue": block_pairs * broadcasts}
        # The micro-kernel streams the decoded stage from L1: measured on Zen 4, 4 steps x 5 tiles (20 KiB) ran
        # fastest; 8 x 5 (40 KiB, past L1) 7% slower.
        return Work(tasks, operand_bytes(spec, n, k, m) + plane_bytes, operations, (bound,),
                    l1_bytes=self.resources(spec, k, config).l1_bytes, l1_budget=device.l1_bytes / 2,
                    streams=config.n_tiles, prefetch=config.prefetch)


TEMPLATE = DotTemplate()
