"""The AVX512-BF16 kernel: the tile16 builder's prologue, decode and epilogue around vdpbf16ps dot products.

A B-tile row — 16 weight columns, each holding the bf16 pair (k, k+1) — is exactly vdpbf16ps's operand, so the
tile product becomes a register-blocked micro-kernel: per k pair, the task's `n_tiles` decoded rows are read
once and multiplied with the broadcast activation pair of each of `rows` rows, C accumulating in registers.  A
stage of decoded rows (in L1) serves every row block of the task's chunk, so the decode is amortized over all
its rows; for few rows, a direct variant feeds each decoded row from registers into the products.
"""

from __future__ import annotations

import operator
from functools import reduce

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from .tile16 import SMALL_M_ROWS, Tile16Builder, when
from .tir import LANES, load, ramp, registers, splat

# vdpbf16ps through a wrapper of <16 x i32> operands: TVM legalizes bfloat16 vectors to float32 before
# LLVM sees them, so the bf16 pairs travel as int32 lanes and are reinterpreted inside LLVM.
_DOT = "bitkern_dpbf16"
_DOT_IR = f"""
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define linkonce_odr <16 x float> @{_DOT}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %pairs_a = bitcast <16 x i32> %a to <32 x bfloat>
  %pairs_b = bitcast <16 x i32> %b to <32 x bfloat>
  %sum = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %pairs_a,
                                                              <32 x bfloat> %pairs_b)
  ret <16 x float> %sum
}}
"""
# Independent vdpbf16ps accumulation chains a block keeps in flight: its latency (6 cycles on Zen 4) times
# its issue rate (1 per cycle) rounded up; direct blocks with fewer C rows split each row's sum by k pair.
DOT_CHAINS = 8


class DotBuilder(Tile16Builder):
    """Emits one AVX512-BF16 kernel: its tasks run vdpbf16ps on C rows held in zmm registers."""

    def body_scope(self):
        return T.attr(_DOT, "pragma_import_llvm", _DOT_IR)

    def plane_pitch(self) -> int:
        """One cache line more than a row's pairs: the micro-kernel reads `rows` rows at once, and rows a
        multiple of 4 KiB apart (K = 2048, 4096, ...) would all fall into one L1 set."""
        return self.s.pairs + LANES

    def padded_rows(self):
        """Rows of the activation planes: M rounded up to whole register blocks."""
        return tirx.floordiv(self.m + (self.cfg.rows - 1), self.cfg.rows) * self.cfg.rows

    def task(self, rows, block, row0) -> None:
        if self.cfg.direct:
            self._direct_task(block)
            return
        s, cfg = self.s, self.cfg
        tiles, owned = self._block_tiles(block)
        chunk_rows = SMALL_M_ROWS if cfg.small_m else cfg.m_chunk
        row_blocks = tirx.floordiv(tirx.min(chunk_rows, rows - row0), cfg.rows)
        gbuf = T.alloc_buffer((1, s.stage_steps, cfg.n_tiles, self.nibbles, s.depth // 2, LANES), "int32",
                              scope="local", align=64)
        yacc = T.alloc_buffer((chunk_rows, cfg.n_tiles, LANES), "float32", scope="local", align=64)
        acc = registers((1, cfg.rows, cfg.n_tiles, self.nibbles), "float32")
        stash = None
        if s.group_steps > s.stage_steps:  # a group spans stages: C leaves registers between them
            stash = T.alloc_buffer((chunk_rows, cfg.n_tiles, self.nibbles, LANES), "float32", scope="local",
                                   align=64)
        with T.serial(0, chunk_rows) as r:
            for c in range(cfg.n_tiles):
                T.buffer_store(yacc, splat(0.0, "float32"), [r, c, ramp(0)])
        with T.serial(0, s.stages) as stage:
            self._decode_stage(gbuf, tiles, stage, 0)
            with T.serial(0, row_blocks) as rb:
                self._stage_rows(gbuf, acc, yacc, stash, tiles, stage, row0, rb * cfg.rows)
        self._store_output(yacc, tiles, owned, row0, chunk_rows)

    def _stage_rows(self, gbuf, acc, yacc, stash, tiles, stage, row0, local_row) -> None:
        """One stage's products for the `rows` rows from local_row, C held in `acc` (registers)."""
        s, cfg = self.s, self.cfg
        cells = self._cells(cfg.rows, 1)

        def reload_c():
            for _, r, c, p in cells:
                T.buffer_store(acc, load(stash, local_row + r, c, p, ramp(0)), [0, r, c, p, ramp(0)])

        def stash_c():
            for _, r, c, p in cells:
                T.buffer_store(stash, load(acc, 0, r, c, p, ramp(0)), [local_row + r, c, p, ramp(0)])

        for i in range(s.stage_steps):
            starts, ends = self._group_edge(stage, i, start=True), self._group_edge(stage, i, start=False)
            when(starts, lambda: self._zero(acc, cells))
            if stash is not None and i == 0:
                when(tirx.Not(starts), reload_c)
            step = stage * s.stage_steps + i
            with T.serial(0, s.depth // 2) as pair:
                weights = [(c, p, load(gbuf, 0, i, c, p, pair, ramp(0)))
                           for c in range(cfg.n_tiles) for p in range(self.nibbles)]
                self._products(acc, weights, row0 + local_row, cfg.rows, step * s.depth // 2 + pair, 0)
            group = tirx.floordiv(step, s.group_steps)
            when(ends, lambda: self._finish_rows(acc, yacc, tiles, group, row0, local_row, cfg.rows, 1))
            if stash is not None and i == s.stage_steps - 1:
                when(tirx.Not(ends), stash_c)

    def _direct_task(self, block) -> None:
        """Few rows (direct): each decoded weight row goes from registers to the products of every row of a
        block, one body per row count (no padded row is computed); blocks of `rows` rows re-decode."""
        cfg = self.cfg
        tiles, owned = self._block_tiles(block)
        yacc = T.alloc_buffer((SMALL_M_ROWS, cfg.n_tiles, LANES), "float32", scope="local", align=64)
        acc = registers((self._splits(1), cfg.rows, cfg.n_tiles, self.nibbles), "float32")
        with T.serial(0, SMALL_M_ROWS) as r:
            for c in range(cfg.n_tiles):
                T.buffer_store(yacc, splat(0.0, "float32"), [r, c, ramp(0)])
        with T.serial(0, tirx.floordiv(self.m + (cfg.rows - 1), cfg.rows)) as rb:
            left = self.m - rb * cfg.rows
            for count in range(1, cfg.rows + 1):
                with T.If(left == count if count < cfg.rows else left >= count):
                    with T.Then():
                        self._direct_rows(acc, yacc, tiles, rb * cfg.rows, count)
        self._store_output(yacc, tiles, owned, 0, SMALL_M_ROWS)

    def _direct_rows(self, acc, yacc, tiles, local_row, count: int) -> None:
        """All of K for `count` rows from local_row, decoding word by word into the products (the word's k
        pair j accumulating into split j mod splits)."""
        s, cfg = self.s, self.cfg
        splits = self._splits(count)
        cells = self._cells(count, splits)
        with T.serial(0, s.stages) as stage:
            for i in range(s.stage_steps):
                when(self._group_edge(stage, i, start=True), lambda: self._zero(acc, cells))
                step = stage * s.stage_steps + i
                with T.serial(0, s.words_per_step) as w:
                    for c in range(cfg.n_tiles):
                        for j, p, weights in self._decoded_word(tiles[c], step * s.words_per_step + w):
                            pair = step * s.depth // 2 + w * s.rows_per_word + j
                            self._products(acc, [(c, p, weights)], local_row, count, pair, j % splits)
                group = tirx.floordiv(step, s.group_steps)
                when(self._group_edge(stage, i, start=False),
                      lambda: self._finish_rows(acc, yacc, tiles, group, 0, local_row, count, splits))

    def _splits(self, count: int) -> int:
        """Accumulators per C row of a direct block of `count` rows: enough for DOT_CHAINS chains, at most the
        k pairs one word yields."""
        chains = count * self.cfg.n_tiles * self.nibbles
        splits = 1
        while chains * splits < DOT_CHAINS and splits * 2 <= self.s.rows_per_word:
            splits *= 2
        return splits

    def _cells(self, count: int, splits: int) -> list:
        """(split, row, tile, nibble) of every C accumulator of a block of `count` rows."""
        return [(q, r, c, p) for q in range(splits) for r in range(count) for c in range(self.cfg.n_tiles)
                for p in range(self.nibbles)]

    @staticmethod
    def _zero(acc, cells) -> None:
        for cell in cells:
            T.buffer_store(acc, splat(0.0, "float32"), [*cell, ramp(0)])

    def _products(self, acc, weight_rows: list, local_row, count: int, pair, split: int) -> None:
        """acc[split, r, c, p] += weights · x-pair of row r, for each (c, p, weights) and the `count` rows."""
        for plane in range(self.s.planes):
            for r in range(count):
                x_pair = tirx.Broadcast(load(self.a, plane, local_row + r, pair), LANES)
                for c, p, weights in weight_rows:
                    cell = [split, r, c, p, ramp(0)]
                    T.buffer_store(acc, tirx.call_extern("float32x16", _DOT, load(acc, *cell), weights, x_pair), cell)

    def _finish_rows(self, acc, yacc, tiles, group, row0, local_row, count: int, splits: int) -> None:
        """y += scale · (Σ_nibble alpha·C + beta·XS) for the block's `count` rows, C (the sum of its splits)
        read from registers."""
        scale_group = self._scale_group(group)
        for c in range(self.cfg.n_tiles):
            scale, beta = self._group_factors(tiles[c], scale_group)
            for r in range(count):
                local = local_row + r
                sums = [reduce(operator.add, (load(acc, q, r, c, p, ramp(0)) for q in range(splits)))
                        for p in range(self.nibbles)]
                value = self._combine(sums, beta, row0 + local, group)
                T.buffer_store(yacc, load(yacc, local, c, ramp(0)) + value * scale, [local, c, ramp(0)])

