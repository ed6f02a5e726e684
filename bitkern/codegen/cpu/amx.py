"""AMX template: y = x · dequant(W)ᵀ with 1-, 2-, 4- and 8-bit weights decoded to bf16 tiles on the fly, the tile
products done by AMX (tdpbf16ps); its code comes from `emit.amx` (see there for the kernel's structure)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ...ops.matmul import Matmul
from ...ttype import effective_group_size, get
from ..template import Work
from . import isa
from .kernel import LARGE_M, PREFETCH_WORDS, SMALL_M, Footprint, doublings, norm_prologue, operand_bytes
from .layout import AMX_TILE_ROWS, padded_k
from .matrix import PLANES, TILE_BYTES, MatrixConfig, MatrixTemplate, decode_strategies, nibbles

TILE_REGISTERS = 8  # AMX tile registers
PIPELINE_TILES = 4  # decoded tiles between a tile's stores and its AMX load that keep the load from stalling


@dataclass(frozen=True)
class AmxConfig(MatrixConfig):
    """Tile configuration of the AMX template (chosen by the tuner): MatrixConfig's fields, n_tiles counting
    16-column C tiles, and m_tiles, the 16-row A tiles per m-block (large M; small_m kernels have one block of
    M rows)."""

    m_tiles: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.small_m and (self.m_tiles != 1 or self.chunk_prologue):
            raise ValueError("small_m kernels use m_tiles=1 and build their planes in one pass")
        if self.m_tiles * self.n_tiles + self.m_tiles + 1 > TILE_REGISTERS:
            raise ValueError(f"m_tiles={self.m_tiles} x n_tiles={self.n_tiles} needs more than "
                             f"{TILE_REGISTERS} AMX tile registers")
        if self.m_chunk % (AMX_TILE_ROWS * self.m_tiles):
            raise ValueError(f"m_chunk={self.m_chunk} must be a multiple of {AMX_TILE_ROWS * self.m_tiles}")


class AmxTemplate(MatrixTemplate):
    name = "amx"
    title = "AMX"
    config_type = AmxConfig
    amx_tiles = True
    shape_fields = ("n_tiles", "m_tiles", "prefetch", "decode", "chunk_prologue")
    requires = (isa.level("amx").features,)

    def unsupported(self, spec: Matmul, n: int, k: int, device) -> str | None:
        return self.unsupported_spec(spec, k)

    def builder(self):
        from .emit.amx import AmxBuilder

        return AmxBuilder

    def resources(self, spec: Matmul, k: int, config: AmxConfig) -> Footprint:
        """L1: two decoded stages of B tiles, the C tiles stored at each group's end for the epilogue (they are
        read back at once), and the task's float32 accumulators (a row of 16 columns per tile)."""
        planes = nibbles(spec, config.decode)  # the affine decode of 8-bit codes: a B and a C tile per nibble
        stages = 2 * config.stage_steps * config.n_tiles * planes * TILE_BYTES
        c_tiles = config.m_tiles * config.n_tiles * planes * TILE_BYTES
        rows = SMALL_M if config.small_m else config.m_chunk
        return Footprint(l1_bytes=stages + c_tiles + rows * config.n_tiles * 64)

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[AmxConfig]:
        """Tile counts that fit the 8 tile registers, stages and row chunks whose footprint fits L1 (row chunks
        from the hint's rows), every prefetch depth and decode; per-chunk planes for the open-ended bucket, where
        all rows' planes outgrow L2."""
        found = []
        small = bucket[1] <= SMALL_M
        prologues = (False, True) if bucket[1] > LARGE_M else (False,)
        for decode, m_tiles in itertools.product(decode_strategies(spec), (1,) if small else (1, 2)):
            planes = nibbles(spec, decode)
            for n_tiles in range(1, TILE_REGISTERS):
                if m_tiles * n_tiles * planes + m_tiles + 1 > TILE_REGISTERS:
                    break
                for stage in doublings(1, 8):
                    for chunk in [SMALL_M] if small else doublings(hint.m * m_tiles, 256):
                        config = AmxConfig(n_tiles, small, max(chunk, 16 * m_tiles), stage, 0, decode, m_tiles=m_tiles)
                        if self.resources(spec, k, config).l1_bytes > device.l1_bytes:
                            continue
                        found += [AmxConfig(n_tiles, small, config.m_chunk, stage, prefetch, decode, chunk_prologue,
                                            m_tiles=m_tiles)
                                  for prefetch, chunk_prologue in itertools.product(PREFETCH_WORDS, prologues)]
        return self.for_epilogue(spec, found)

    def work(self, spec: Matmul, n: int, k: int, m: int, config: AmxConfig, device) -> Work:
        """Per call: B tiles decoded (once per row chunk; those the AMX load would wait for count as stalled),
        tile loads and products per m-block, the per-group epilogue's C tiles and rows, C tiles stashed where a
        stage ends inside a group, and the activation planes that outgrow L2 (re-read per column block)."""
        k_pad = padded_k(k, get(spec.weight_dtype).bits)
        tiles_n = -(-n // AMX_TILE_ROWS)
        steps = k_pad // 32
        planes = PLANES[spec.activation_dtype]
        b_tiles = tiles_n * steps * nibbles(spec, config.decode)
        if config.small_m:
            rows, blocks, chunks = m, 1, 1
            product = "tdpbf16ps_few_rows" if m <= 4 else "tdpbf16ps"
        else:
            block = AMX_TILE_ROWS * config.m_tiles
            rows = -(-m // block) * block
            chunks, blocks, product = -(-rows // config.m_chunk), rows // block, "tdpbf16ps"
        decoded = b_tiles * chunks
        ahead = config.stage_steps * config.n_tiles
        block_steps = b_tiles / config.n_tiles * blocks * planes
        group = effective_group_size(spec.group_size, k)
        group_tiles = tiles_n * (k_pad // max(group, 16))
        stashed = 0.0
        group_steps = max(1, min(group, k_pad) // 32)
        if not config.small_m and group_steps > config.stage_steps:  # C tiles leave the registers between stages
            inside = 1 - config.stage_steps / group_steps  # the share of stage ends that fall inside a group
            stashed = tiles_n * blocks * steps / config.stage_steps * inside * config.m_tiles * \
                nibbles(spec, config.decode) * 2
        tasks = -(-tiles_n // config.n_tiles) * chunks
        plane_bytes = 0.0
        if config.chunk_prologue:  # a task per chunk; its planes stay in L2 for all its column blocks
            tasks = chunks
        elif not config.small_m and rows * k_pad * 2 * planes > device.l2_bytes:
            # the planes of all rows leave the caches near the cores: written, then read once per column block
            plane_bytes = rows * k_pad * 2 * planes * (1 + -(-tiles_n // config.n_tiles))
        operations = {f"amx_decode_tile.{config.decode}": decoded,
                      "amx_decode_stall": decoded * max(0, PIPELINE_TILES - ahead) / PIPELINE_TILES,
                      "amx_tile_load": block_steps * (config.m_tiles + config.n_tiles),
                      product: block_steps * config.m_tiles * config.n_tiles,
                      "amx_group_tile": group_tiles, "amx_group_row": group_tiles * rows, "amx_c_tile_move": stashed,
                      **norm_prologue(spec, m, k, device.cores if config.small_m else 1)}
        return Work(tasks, operand_bytes(spec, n, k, m) + plane_bytes, operations,
                    l1_bytes=self.resources(spec, k, config).l1_bytes, l1_budget=device.l1_bytes / 4,
                    streams=config.n_tiles, prefetch=config.prefetch)


TEMPLATE = AmxTemplate()
