"""The grouped VNNI kernel: the VNNI kernel's int8 products (`emit.vnni`) over the experts a call's rows are routed
to, for activation_quant="int8" (llama.cpp's Q4_0 x Q8_0 for mixture-of-experts decode).

For x [M, K], the stacked experts' tile16 weights (as the grouped FMA kernel reads them, `emit.grouped`) and indices
[M, top_k], each parallel chunk (one per thread):
  routing   sorts the M·top_k (row, j) pairs by expert (`emit.grouped.route`);
  prologue  quantizes each of x's M rows to int8 codes, block scales and group sums once (the VNNI prologue): the
            pairs of a row share them;
  tasks     (selected expert, block of n_tiles tiles) in turn, split evenly between the chunks: the expert's sorted
            pairs `rows` at a time, each block over all of K with y in registers (the VNNI kernel's row block, its
            activations the pair's row's), the sums (+ the non-finite terms) to the output stage (`emit.grouped.
            PairOutput`: + the expert's bias, SwiGLU, y[row, j] or the weighted sum of a combine spec).
So each selected expert's weights stream from memory once per call, however many rows pick it.

Arguments, in order: x [M, K] ([M·top_k, K] combined), qweight [E·T, words, 16], scales (and zeros) [E·T, groups,
16], lut (code books' int8 values), indices [M, top_k] int64, weights [M, top_k] float32 (combine specs), bias [E·N]
float32 (bias specs), y (`GroupedMatmul.output_shape`).
"""

from __future__ import annotations

from tvm.script.ir_builder import tirx as T

from ....ops.grouped import GroupedMatmul
from ..isa import IsaLevel
from ..vnni import VnniConfig
from . import nonfinite
from .grouped import PairOutput, block_tiles, each_part, route
from .groups import GroupArguments
from .tile16 import when
from .tir import LANES, load, ramp
from .vnni import VnniBuilder


def build(spec: GroupedMatmul, n: int, k: int, config: VnniConfig, threads: int, level: IsaLevel,
          name: str = "main"):
    """The PrimFunc of the grouped VNNI kernel for experts' [N, K] weights, split into `threads` parallel chunks."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if not config.small_m:
        raise ValueError("small_m=False: the grouped kernel runs each expert's rows in blocks (small_m=True)")
    return GroupedVnniBuilder(spec, n, k, config, threads, level).build(name)


class GroupedVnniBuilder(VnniBuilder):
    """Emits one grouped VNNI kernel: its own arguments, routing and output stage around the VNNI kernel's prologue
    and row blocks."""

    def __init__(self, spec: GroupedMatmul, n: int, k: int, config: VnniConfig, threads: int, level: IsaLevel):
        super().__init__(spec, n, k, config, level, config.rows)
        self.threads, self.top_k = threads, spec.top_k
        if spec.combine:
            self.x_rows = self.m * spec.top_k  # a row per pair

    def _arguments(self) -> None:
        s, spec = self.s, self.spec
        tiles = spec.experts * s.n_tiles
        self.x = T.arg("x", T.Buffer(spec.input_shape(self.m, s.k), spec.activation_dtype))
        self.qweight = T.arg("qweight", T.Buffer((tiles, s.words, LANES), "int32"))
        self.group_args = GroupArguments.declare(spec, (tiles, s.scale_groups, LANES))
        self._declare_constants()
        self.norm = self.residual = None
        self.out = PairOutput.declare(spec, self.m, s.n, self.cfg.n_tiles)

    def _body(self) -> None:
        with T.parallel(0, self.threads) as chunk:
            selected, counts, starts, self.order, found = route(self.out.indices, self.m * self.top_k, self.top_k)
            self._allocate_activations(self.x_rows)
            self.nonfinite = T.alloc_buffer((self.x_rows, LANES), "uint32")  # rows with ±Inf or NaN in x
            self._prologue(self.x_rows)
            base = T.alloc_buffer((1,), "int32", scope="local")  # the task's expert's first tile
            self.out.allocate()

            def task(slot, block):
                T.buffer_store(base, load(selected, slot) * self.s.n_tiles, [0])
                self._expert_task(load(base, 0), block, load(counts, slot), load(starts, slot))

            self.out.run_tasks(chunk, self.threads, load(found, 0), task)

    def _expert_task(self, base, block, count, start) -> None:
        """Column block `block` of the expert whose tiles start at `base`, for its `count` sorted rows from `start`."""
        cfg = self.cfg
        offsets, owned = block_tiles(self.spec, block, cfg.n_tiles, self.s.n_tiles)
        tiles = [base + offset for offset in offsets]
        yacc = T.alloc_buffer((cfg.rows, cfg.n_tiles, LANES), "float32", scope="local", align=64)
        block_registers = self._task_registers()

        def rows_from(first, rows: int) -> None:
            self._all_of_k(yacc, block_registers, tiles, first, 0, rows)
            self._store_pairs(yacc, tiles, offsets, owned, base, first, rows)

        each_part(count, start, cfg.rows, rows_from)

    def _activation_row(self, row):
        """x's row of sorted row `row`: the m of its pair (m, j), or the pair's own where the kernel combines."""
        return self.out.x_row(load(self.order, row))

    def _store_pairs(self, yacc, tiles, offsets, owned, base, first, rows: int) -> None:
        """The output of each sorted row first + r, the pair (m, j): its sums (+ the terms of x's non-finite values)
        to the output stage (`PairOutput.store`), an output tile per tile (SwiGLU: per gate and up tile)."""
        s = self.s
        step = 2 if self.spec.epilogue == "swiglu" else 1
        for r in range(rows):
            pair = load(self.order, first + r)
            nonfinite.add_terms(yacc, r, tiles, self.nonfinite, self.out.x_row(pair), s.k, self._x_value,
                                lambda tile, j: nonfinite.weight_lanes(self.spec, s.k, self.qweight, self.group_args,
                                                                       tile, j))
            for c in range(0, len(tiles), step):
                when(owned[c], lambda r=r, c=c, pair=pair: self.out.store(
                    pair, lambda i: load(yacc, r, c + i, ramp(0)), c, base, offsets[c], s.n_tiles))
