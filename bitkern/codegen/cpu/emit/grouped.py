"""The grouped FMA kernel: the FMA kernel's few-row body (`emit.fma`) over the experts a call's rows are routed to.

For x [M, K], the stacked experts' tile16 weights (expert e's tiles e·T .. (e+1)·T, T = N/16: the [E, ...] buffers of
`bitkern.Experts` seen as [E·T, ...], no copy) and indices [M, top_k], each parallel chunk (one per thread):
  routing   sorts the M·top_k (row, j) pairs by expert (a counting sort, experts in order of first appearance:
            scalar work on at most a few dozen pairs, done by every chunk, so no thread waits for another);
  prologue  widens x's row of every sorted pair to float32 (`emit.fma`'s tables, per pair, so that the pairs of one
            expert are consecutive rows);
  tasks     (selected expert, block of n_tiles tiles) in turn, split evenly between the chunks: the block's words are
            read once and serve the expert's pairs, four rows at a time (the dense body of 1..4 rows, with the
            expert's tiles), each row's sums stored to y[row, j] (+ the expert's bias).
So each selected expert's weights stream from memory once per call, however many rows pick it.

Arguments, in order: x [M, K], qweight [E·T, words, 16], scales (and zeros) [E·T, groups, 16], values (4-bit code
books), indices [M, top_k] int64, bias [E·N] float32 (bias specs), y [M, top_k, N].
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.grouped import GroupedMatmul
from ..fma import FmaConfig
from ..isa import IsaLevel
from ..lut import MAX_ROWS
from .fma import _Builder as FmaBuilder
from .groups import GroupArguments, biased, to_output
from .tir import LANES, load, ramp, to_float32


def build(spec: GroupedMatmul, n: int, k: int, config: FmaConfig, threads: int, level: IsaLevel,
          name: str = "main"):
    """The PrimFunc of the grouped FMA kernel for experts' [N, K] weights, split into `threads` parallel chunks."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if config.rows:
        raise ValueError(f"rows={config.rows}: the grouped kernel runs the few-row body (rows=0)")
    return _Builder(spec, n, k, config, threads, level).build(name)


class _Builder(FmaBuilder):
    def __init__(self, spec: GroupedMatmul, n: int, k: int, config: FmaConfig, threads: int, level: IsaLevel):
        super().__init__(spec, n, k, config, threads, (1, MAX_ROWS), level)
        self.top_k = spec.top_k
        self.pairs = self.m * self.top_k
        self.chunk_rows = self.buffer_rows = self.pairs  # the prologue's rows: one per sorted pair

    def _arguments(self) -> None:
        spec, tiles = self.spec, self.spec.experts * self.n_tiles
        self.x = T.arg("x", T.Buffer((self.m, self.k), spec.activation_dtype))
        self.qweight = T.arg("qweight", T.Buffer((tiles, self.words, LANES), "int32"))
        self.group_args = GroupArguments.declare(spec, (tiles, self.groups, LANES))
        if self.takes_values:
            self.values = T.arg("values", T.Buffer((self.ttype.num_codes,), "float32"))
        self.norm = self.residual = None
        self.indices = T.arg("indices", T.Buffer((self.m, self.top_k), "int64"))
        self.bias = T.arg("bias", T.Buffer((spec.experts * self.n,), "float32")) if spec.bias else None
        self.y = T.arg("y", T.Buffer((self.m, self.top_k, self.n), spec.output_dtype))

    def _body(self) -> None:
        self._main()

    def _main(self) -> None:
        blocks = -(-self.n_tiles // self.cfg.n_tiles)
        with T.parallel(0, self.threads) as chunk:
            self._route()
            self._allocate_tables()
            self.xs = T.alloc_buffer((self.buffer_rows, self.groups), "float32")
            self.nonfinite = T.alloc_buffer((self.buffer_rows, LANES), "uint32")  # rows with ±Inf or NaN in x
            self._prologue([])
            self.base = T.alloc_buffer((1,), "int32", scope="local")  # the task's expert's first tile

            def task(slot, block):
                T.buffer_store(self.base, load(self.selected, slot) * self.n_tiles, [0])
                each_part(load(self.counts, slot), load(self.starts, slot), MAX_ROWS,
                          lambda first, rows: self._task(block, rows, first))

            chunk_tasks(chunk, self.threads, load(self.found, 0), blocks, task)

    def _route(self) -> None:
        self.selected, self.counts, self.starts, self.order, self.found = route(self.indices, self.pairs, self.top_k)

    def _x_at(self, row, index):
        """x[m, index] as float32 for sorted row `row`, the pair (m, j)."""
        token = tirx.floordiv(load(self.order, row), self.top_k)
        return to_float32(load(self.x, token, index), self.spec.activation_dtype)

    def _task_tiles(self, block) -> list:
        """The block's tiles of the task's expert."""
        base = load(self.base, 0)
        return [base + tile for tile in super()._task_tiles(block)]

    def _store(self, yacc, rows: int, tile_index, c, swiglu: bool, first) -> None:
        """y[m, j, tile's 16 columns] = sums (+ the expert's bias) for each sorted row first + row, the pair (m, j)."""
        for row in range(rows):
            write_pair(self, load(self.order, first + row), load(yacc, row, c, ramp(0)), load(self.base, 0),
                       tile_index, self.n_tiles, self.n)


def route(indices, pairs, top_k: int) -> tuple:
    """The `pairs` (row, j) pairs of `indices` [M, top_k] sorted by expert, as buffers (selected, counts, starts,
    order, found): `selected[s]` the s-th distinct expert (found[0] of them), `counts[s]` its pairs, which are sorted
    rows starts[s] .. starts[s] + counts[s] - 1; `order[row]` the pair (m·top_k + j) of sorted row `row`.  A counting
    sort, experts in order of first appearance: scalar work on a few dozen pairs."""
    selected, counts, starts, order = (T.alloc_buffer((pairs,), "int32") for _ in range(4))
    slot_of, filled = T.alloc_buffer((pairs,), "int32"), T.alloc_buffer((pairs,), "int32")
    found = T.alloc_buffer((2,), "int32", scope="local")  # [distinct experts, the pair's slot]
    T.buffer_store(found, 0, [0])
    with T.serial(0, pairs) as pair:
        expert = tirx.Cast("int32", load(indices, tirx.floordiv(pair, top_k), tirx.floormod(pair, top_k)))
        T.buffer_store(found, load(found, 0), [1])
        with T.serial(0, load(found, 0)) as slot:
            with T.If(load(selected, slot) == expert):
                with T.Then():
                    T.buffer_store(found, slot, [1])
        with T.If(load(found, 1) == load(found, 0)):
            with T.Then():
                T.buffer_store(selected, expert, [load(found, 0)])
                T.buffer_store(counts, 0, [load(found, 0)])
                T.buffer_store(found, load(found, 0) + 1, [0])
        T.buffer_store(slot_of, load(found, 1), [pair])
        T.buffer_store(counts, load(counts, load(found, 1)) + 1, [load(found, 1)])
    T.buffer_store(found, 0, [1])
    with T.serial(0, load(found, 0)) as slot:
        T.buffer_store(starts, load(found, 1), [slot])
        T.buffer_store(filled, load(found, 1), [slot])
        T.buffer_store(found, load(found, 1) + load(counts, slot), [1])
    with T.serial(0, pairs) as pair:
        slot = load(slot_of, pair)
        T.buffer_store(order, pair, [load(filled, slot)])
        T.buffer_store(filled, load(filled, slot) + 1, [slot])
    return selected, counts, starts, order, found


def write_pair(builder, pair, sums, base, tile, n_tiles: int, n: int) -> None:
    """y[m, j, the tile's 16 columns] = sums (+ the expert's bias) for the pair m·top_k + j, `tile` one of the N = n
    columns' n_tiles tiles of the expert whose tiles start at `base`; y, bias, spec and top_k are `builder`'s."""
    column = (tile - base) * LANES
    value = biased(sums, builder.bias, ramp(tirx.floordiv(base, n_tiles) * n + column))
    T.buffer_store(builder.y, to_output(value, builder.spec.output_dtype),
                   [tirx.floordiv(pair, builder.top_k), tirx.floormod(pair, builder.top_k), ramp(column)])


def chunk_tasks(chunk, threads: int, distinct, blocks: int, emit) -> None:
    """emit(slot, block) for chunk `chunk`'s share of the (selected expert, block of tiles) tasks: the `distinct`
    experts' `blocks` blocks each, split evenly between the `threads` chunks."""
    tasks = distinct * blocks
    with T.serial(tirx.floordiv(chunk * tasks, threads), tirx.floordiv((chunk + 1) * tasks, threads)) as task:
        emit(tirx.floordiv(task, blocks), tirx.floormod(task, blocks))


def each_part(count, start, most: int, emit) -> None:
    """emit(first sorted row, rows) for an expert's `count` sorted rows from `start`, `most` at a time (a body per
    row count: `rows` is a Python int)."""
    with T.serial(0, tirx.floordiv(count + most - 1, most)) as part:
        left = tirx.min(count - part * most, most)
        for rows in range(1, most + 1):
            with T.If(left == rows):
                with T.Then():
                    emit(start + part * most, rows)
