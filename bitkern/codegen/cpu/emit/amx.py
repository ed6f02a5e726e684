"""The AMX kernel: the tile16 builder's prologue, decode and epilogue around AMX tile products.

Per task, the codes of the next stage are decoded into bf16 B tiles in L1 while AMX multiplies the current stage
(a software pipeline: tile loads never wait on the stores just issued); C tiles accumulate one quantization
group in tile registers and are stored for the epilogue at its end.
"""

from __future__ import annotations

import contextlib

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.matmul import Matmul
from ..amx import TILE_REGISTERS
from ..layout import AMX_TILE_ROWS
from .tile16 import SMALL_M_ROWS, Tile16Builder, when
from .tir import LANES, intrinsic, load, ramp, splat, stride, tile, tile_pointer


class AmxBuilder(Tile16Builder):
    """Emits one AMX kernel: its tasks load A and B tiles and run tdpbf16ps; C tiles live in tile registers."""

    def __init__(self, spec: Matmul, n: int, k: int, config):
        super().__init__(spec, n, k, config)
        self._assign_tile_registers()

    def _assign_tile_registers(self) -> None:
        """C tiles: [m tile][n tile][nibble]; then the A tiles; the rest is a ring for B tiles."""
        mt, nc, nb = self.cfg.m_tiles, self.cfg.n_tiles, self.nibbles
        self.c_tiles = [[[(i * nc + c) * nb + p for p in range(nb)] for c in range(nc)] for i in range(mt)]
        self.a_tiles = [mt * nc * nb + i for i in range(mt)]
        self.b_tiles = list(range(mt * nc * nb + mt, TILE_REGISTERS))
        if not self.b_tiles:
            raise ValueError(f"m_tiles={mt} x n_tiles={nc} x {nb} nibble planes leave no AMX tile register for B")

    def body_scope(self):
        return contextlib.nullcontext()

    def plane_pitch(self) -> int:
        """int32 words (bf16 pairs) from one activation-plane row to the next."""
        return self.s.pairs

    def padded_rows(self):
        if self.cfg.small_m:
            return self.m
        block = AMX_TILE_ROWS * self.cfg.m_tiles
        return tirx.floordiv(self.m + (block - 1), block) * block

    def task(self, rows, block, row0) -> None:
        s, cfg = self.s, self.cfg
        tiles, owned = self._block_tiles(block)
        tile_rows = self.m if cfg.small_m else AMX_TILE_ROWS
        block_rows = AMX_TILE_ROWS * cfg.m_tiles
        chunk_rows = SMALL_M_ROWS if cfg.small_m else cfg.m_chunk
        m_blocks = 1 if cfg.small_m else tirx.min(cfg.m_chunk // block_rows, tirx.floordiv(rows - row0, block_rows))
        gbuf = T.alloc_buffer((2, s.stage_steps, cfg.n_tiles, self.nibbles, s.depth // 2, LANES), "int32", scope="local",
                              align=64)
        cbuf = T.alloc_buffer((cfg.m_tiles, cfg.n_tiles, self.nibbles, AMX_TILE_ROWS, LANES), "float32",
                              scope="local", align=64)
        yacc = T.alloc_buffer((chunk_rows, cfg.n_tiles, LANES), "float32", scope="local", align=64)
        stash = None
        if s.group_steps > s.stage_steps and not cfg.small_m:  # C tiles leave registers between stages
            stash = T.alloc_buffer((cfg.m_chunk // block_rows, cfg.m_tiles, cfg.n_tiles, self.nibbles, AMX_TILE_ROWS,
                                    LANES),
                                   "float32", scope="local", align=64)
        self._configure_tiles(tile_rows)
        with T.serial(0, chunk_rows) as r:
            for c in range(cfg.n_tiles):
                T.buffer_store(yacc, splat(0.0, "float32"), [r, c, ramp(0)])
        self._decode_stage(gbuf, tiles, 0, 0)
        with T.serial(0, s.stages) as stage:
            upcoming = (tirx.min(stage + 1, s.stages - 1), tirx.floormod(stage + 1, 2))
            if cfg.small_m:  # one m-block: decode the next stage tile by tile between the AMX ops
                self._stage(gbuf, cbuf, yacc, stash, tiles, stage, row0, 0, tile_rows, upcoming)
            else:  # the decoded stage serves every m-block of the chunk
                self._decode_stage(gbuf, tiles, *upcoming)
                with T.serial(0, m_blocks) as mb:
                    self._stage(gbuf, cbuf, yacc, stash, tiles, stage, row0, mb, tile_rows)
        self._store_output(yacc, tiles, owned, row0, chunk_rows)
        intrinsic("llvm.x86.tilerelease")

    def _configure_tiles(self, tile_rows) -> None:
        """ldtilecfg: C and A tiles of `tile_rows` rows (A 2·depth bytes wide), B tiles of depth/2 rows."""
        config = T.alloc_buffer((64,), "uint8", scope="local", align=64)
        for i in range(64):
            T.buffer_store(config, tirx.const(1 if i == 0 else 0, "uint8"), [i])
        shapes = [(t, tile_rows, 64) for row in self.c_tiles for planes in row for t in planes]
        shapes += [(t, tile_rows, 2 * self.s.depth) for t in self.a_tiles]
        shapes += [(t, self.s.depth // 2, 64) for t in self.b_tiles]
        for t, rows, width in shapes:
            T.buffer_store(config, tirx.const(width & 0xFF, "uint8"), [16 + 2 * t])
            T.buffer_store(config, tirx.const(width >> 8, "uint8"), [17 + 2 * t])
            T.buffer_store(config, tirx.Cast("uint8", rows), [48 + t])
        intrinsic("llvm.x86.ldtilecfg", config.access_ptr("r", extent=64))

    def _stage(self, gbuf, cbuf, yacc, stash, tiles, stage, row0, mb, tile_rows, upcoming=None) -> None:
        """AMX products of one stage for one m-block, with group starts and ends and C stashing; with
        `upcoming` (stage, slot), each B tile's products are followed by decoding that tile of `upcoming`."""
        s, cfg = self.s, self.cfg
        slot = tirx.floormod(stage, 2)
        local_row = mb * AMX_TILE_ROWS * cfg.m_tiles
        for i in range(s.stage_steps):
            starts, ends = self._group_edge(stage, i, start=True), self._group_edge(stage, i, start=False)
            when(starts, self._zero_c)
            if stash is not None and i == 0:
                when(tirx.Not(starts), lambda: self._move_c(stash, mb, "llvm.x86.tileloadd64"))
            step = stage * s.stage_steps + i
            for plane in range(s.planes):
                for m_i, a_tile in enumerate(self.a_tiles):
                    source = tile_pointer(self.a, (plane, row0 + local_row + m_i * AMX_TILE_ROWS, step * s.depth // 2),
                                          AMX_TILE_ROWS, self.plane_pitch(), "r")
                    intrinsic("llvm.x86.tileloadd64", tile(a_tile), source, stride(self.plane_pitch() * 4))
                for c in range(cfg.n_tiles):
                    for nibble in range(self.nibbles):
                        b_tile = self.b_tiles[(c * self.nibbles + nibble) % len(self.b_tiles)]
                        source = tile_pointer(gbuf, (slot, i, c, nibble, 0, 0), s.depth // 2, LANES, "r")
                        intrinsic("llvm.x86.tileloadd64", tile(b_tile), source, stride(64))
                        for m_i, a_tile in enumerate(self.a_tiles):
                            intrinsic("llvm.x86.tdpbf16ps", tile(self.c_tiles[m_i][c][nibble]), tile(a_tile),
                                      tile(b_tile))
                    if upcoming is not None and plane == s.planes - 1:
                        self._decode_tile(gbuf, tiles, *upcoming, i, c)
            group = tirx.floordiv(step, s.group_steps)
            when(ends, lambda: self._finish_group(cbuf, yacc, tiles, group, row0, local_row, tile_rows))
            if stash is not None and i == s.stage_steps - 1:
                when(tirx.Not(ends), lambda: self._move_c(stash, mb, "llvm.x86.tilestored64"))

    def _all_c(self):
        """(m tile, n tile, nibble, register) of every C tile."""
        return [(m_i, c, p, t) for m_i, row in enumerate(self.c_tiles) for c, planes in enumerate(row)
                for p, t in enumerate(planes)]

    def _zero_c(self) -> None:
        for _, _, _, t in self._all_c():
            intrinsic("llvm.x86.tilezero", tile(t))

    def _move_c(self, stash, mb, op: str) -> None:
        access = "r" if op == "llvm.x86.tileloadd64" else "w"
        for m_i, c, p, t in self._all_c():
            intrinsic(op, tile(t), tile_pointer(stash, (mb, m_i, c, p, 0, 0), AMX_TILE_ROWS, LANES, access),
                      stride(64))

    def _finish_group(self, cbuf, yacc, tiles, group, row0, local_row, tile_rows) -> None:
        """Store C and apply y += scale · (Σ_nibble alpha·C + beta·XS) to the block's rows."""
        cfg = self.cfg
        for m_i, c, p, t in self._all_c():
            target = tile_pointer(cbuf, (m_i, c, p, 0, 0), AMX_TILE_ROWS, LANES, "w")
            intrinsic("llvm.x86.tilestored64", tile(t), target, stride(64))
        scale_group = self._scale_group(group)
        for c in range(cfg.n_tiles):
            scale, beta = self._group_factors(tiles[c], scale_group)
            for m_i in range(cfg.m_tiles):
                with T.serial(0, tile_rows) as r:
                    local = local_row + m_i * AMX_TILE_ROWS + r
                    value = self._combine([load(cbuf, m_i, c, p, r, ramp(0)) for p in range(self.nibbles)], beta,
                                          row0 + local, group)
                    T.buffer_store(yacc, load(yacc, local, c, ramp(0)) + value * scale, [local, c, ramp(0)])

