"""The grouped FMA kernel: the FMA kernel's few-row body (`emit.fma`) over the experts a call's rows are routed to.

For x [M, K], the stacked experts' tile16 weights (expert e's tiles e·T .. (e+1)·T, T = N/16: the [E, ...] buffers of
`bitkern.Experts` seen as [E·T, ...], no copy) and indices [M, top_k], each parallel chunk (one per thread):
  routing   sorts the M·top_k (row, j) pairs by expert (a counting sort, experts in order of first appearance:
            scalar work on at most a few dozen pairs, done by every chunk, so no thread waits for another);
  prologue  widens x's row of every sorted pair to float32 (`emit.fma`'s tables, per pair, so that the pairs of one
            expert are consecutive rows);
  tasks     (selected expert, block of n_tiles tiles) in turn, split evenly between the chunks: the block's words are
            read once and serve the expert's pairs, four rows at a time (the dense body of 1..4 rows, with the
            expert's tiles), each row's sums stored to y[row, j] (+ the expert's bias; `PairOutput`).
So each selected expert's weights stream from memory once per call, however many rows pick it.  SwiGLU specs take
each block's gate tiles with their up tiles (the expert's second half of rows, `block_tiles`); combine specs split
the column blocks between the chunks, each summing its blocks' weighted outputs per token over every selected expert
(`PairOutput`).

Arguments, in order: x [M, K] ([M·top_k, K] combined), qweight [E·T, words, 16], scales (and zeros) [E·T, groups,
16], values (4-bit code books), indices [M, top_k] int64, weights [M, top_k] float32 (combine specs), bias [E·N]
float32 (bias specs), y (`GroupedMatmul.output_shape`).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.expr import apply_epilogue
from ....ops.grouped import GroupedMatmul
from ..fma import FmaConfig
from ..isa import IsaLevel
from ..lut import MAX_ROWS
from .fma import _Builder as FmaBuilder
from .groups import GroupArguments, biased, to_output
from .tir import LANES, load, ramp, splat, to_float32


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
        self.x = T.arg("x", T.Buffer(spec.input_shape(self.m, self.k), spec.activation_dtype))
        self.qweight = T.arg("qweight", T.Buffer((tiles, self.words, LANES), "int32"))
        self.group_args = GroupArguments.declare(spec, (tiles, self.groups, LANES))
        if self.takes_values:
            self.values = T.arg("values", T.Buffer((self.ttype.num_codes,), "float32"))
        self.norm = self.residual = None
        self.out = PairOutput.declare(spec, self.m, self.n, self.cfg.n_tiles)
        self.indices = self.out.indices

    def _body(self) -> None:
        self._main()

    def _main(self) -> None:
        with T.parallel(0, self.threads) as chunk:
            self._route()
            self._allocate_tables()
            self.xs = T.alloc_buffer((self.buffer_rows, self.groups), "float32")
            self.nonfinite = T.alloc_buffer((self.buffer_rows, LANES), "uint32")  # rows with ±Inf or NaN in x
            self._prologue([])
            self.base = T.alloc_buffer((1,), "int32", scope="local")  # the task's expert's first tile
            self.out.allocate()

            def task(slot, block):
                T.buffer_store(self.base, load(self.selected, slot) * self.n_tiles, [0])
                each_part(load(self.counts, slot), load(self.starts, slot), MAX_ROWS,
                          lambda first, rows: self._task(block, rows, first))

            self.out.run_tasks(chunk, self.threads, load(self.found, 0), task)

    def _route(self) -> None:
        self.selected, self.counts, self.starts, self.order, self.found = route(self.indices, self.pairs, self.top_k)

    def _x_at(self, row, index):
        """x[m, index] as float32 for sorted row `row`: the row of its pair (m, j), x's row m or, combined, its own."""
        return to_float32(load(self.x, self.out.x_row(load(self.order, row)), index), self.spec.activation_dtype)

    def _task_tiles(self, block) -> list:
        """The block's tiles of the task's expert."""
        base = load(self.base, 0)
        return [base + offset for offset in block_tiles(self.spec, block, self.cfg.n_tiles, self.n_tiles)[0]]

    def _store(self, yacc, rows: int, tile_index, c, swiglu: bool, first) -> None:
        """The pair's output of tile c of the task, `tile_index` (SwiGLU: with its up tile c + 1), for each sorted row
        first + row, the pair (m, j) (`PairOutput.store`)."""
        base = load(self.base, 0)
        for row in range(rows):
            self.out.store(load(self.order, first + row), lambda i, row=row: load(yacc, row, c + i, ramp(0)), c,
                           base, tile_index - base, self.n_tiles)


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


def block_tiles(spec: GroupedMatmul, block, per_task: int, expert_tiles: int) -> tuple[list, list]:
    """(tile offsets within the expert, owned) of column block `block`: per_task consecutive tiles or, for SwiGLU,
    per_task / 2 gate tiles each followed by its up tile (the same tile of the expert's second half of rows); the last
    block repeats its last tile there (not owned: computed, not stored)."""
    if spec.epilogue != "swiglu":
        raw = [block * per_task + c for c in range(per_task)]
        return [tirx.min(r, expert_tiles - 1) for r in raw], [r < expert_tiles for r in raw]
    half = expert_tiles // 2
    gates = [block * (per_task // 2) + i for i in range(per_task // 2)]
    offsets = [tile for gate in gates for tile in (tirx.min(gate, half - 1), tirx.min(gate, half - 1) + half)]
    return offsets, [gate < half for gate in gates for _ in (0, 1)]


class PairOutput:
    """A grouped kernel's routing arguments and output stage.  A (token m, slot j) pair's sums of an output tile
    (tile c of the task; SwiGLU: the gate tile c and its up tile c + 1) become z + the expert's bias, then SwiGLU's
    silu(gate) · up where the spec has it, stored to y[m, j]; combined, weights[m, j] times that is added to the
    chunk's float32 sums of token m, which `run_tasks` zeroes before the chunk's tasks and stores to y[m] after."""

    def __init__(self, spec: GroupedMatmul, m, n: int, per_task: int):
        self.spec, self.m, self.n = spec, m, n
        self.swiglu, self.combine, self.top_k = spec.epilogue == "swiglu", spec.combine, spec.top_k
        self.outputs = per_task // 2 if self.swiglu else per_task  # output tiles a task makes
        self.out_tiles = spec.out_features(n) // LANES
        self.sums = None

    @classmethod
    def declare(cls, spec: GroupedMatmul, m, n: int, per_task: int) -> "PairOutput":
        """Declare the routing arguments, the bias and y (in the kernel's argument order) and give their stage."""
        stage = cls(spec, m, n, per_task)
        stage.indices = T.arg("indices", T.Buffer((m, spec.top_k), "int64"))
        stage.weights = T.arg("weights", T.Buffer((m, spec.top_k), "float32")) if spec.combine else None
        stage.bias = T.arg("bias", T.Buffer((spec.experts * n,), "float32")) if spec.bias else None
        stage.y = T.arg("y", T.Buffer(spec.output_shape(m, n), spec.output_dtype))
        return stage

    def allocate(self) -> None:
        """The chunk's per-token sums of a combine spec (in the chunk's parallel body)."""
        if self.combine:
            self.sums = T.alloc_buffer((self.m, self.out_tiles, LANES), "float32")

    def x_row(self, pair):
        """x's row for the pair m·top_k + j: m, or the pair's own row where the kernel combines."""
        return pair if self.combine else tirx.floordiv(pair, self.top_k)

    def run_tasks(self, chunk, threads: int, distinct, emit) -> None:
        """emit(slot, block) for chunk `chunk`'s share of the (selected expert, column block) tasks, split evenly
        between the `threads` chunks.  Combined, the chunks split the column blocks, and each runs its blocks expert
        by expert (each expert's words a stream, as apart), between zeroing and storing its tokens' sums."""
        blocks = -(-self.out_tiles // self.outputs)
        if not self.combine:
            chunk_tasks(chunk, threads, distinct, blocks, emit)
            return
        first, end = tirx.floordiv(chunk * blocks, threads), tirx.floordiv((chunk + 1) * blocks, threads)
        self._each_tile(first, end, lambda token, tile: T.buffer_store(self.sums, splat(0.0, "float32"),
                                                                       [token, tile, ramp(0)]))
        with T.serial(0, distinct) as slot:
            with T.serial(first, end) as block:
                emit(slot, block)
        self._each_tile(first, end, lambda token, tile: T.buffer_store(
            self.y, to_output(load(self.sums, token, tile, ramp(0)), self.spec.output_dtype),
            [token, ramp(tile * LANES)]))

    def store(self, pair, sums, c: int, base, offset, expert_tiles: int) -> None:
        """The output of the task's tile c for the pair m·top_k + j: sums(i) the pair's sums of tile c + i (i = 1: the
        up tile of SwiGLU), `offset` tile c's tile within the expert (its output tile: a gate tile's is its own),
        whose tiles start at `base`."""
        expert = tirx.floordiv(base, expert_tiles)
        column = offset * LANES
        value = biased(sums(0), self.bias, ramp(expert * self.n + column))
        if self.swiglu:
            up = biased(sums(1), self.bias, ramp(expert * self.n + self.n // 2 + column))
            value = apply_epilogue("silu", value) * up
        m, j = tirx.floordiv(pair, self.top_k), tirx.floormod(pair, self.top_k)
        if not self.combine:
            T.buffer_store(self.y, to_output(value, self.spec.output_dtype), [m, j, ramp(column)])
            return
        weighted = value * tirx.Broadcast(load(self.weights, m, j), LANES)
        T.buffer_store(self.sums, load(self.sums, m, offset, ramp(0)) + weighted, [m, offset, ramp(0)])

    def _each_tile(self, first, end, emit) -> None:
        """emit(token, output tile) for every token and the output tiles of column blocks first .. end - 1."""
        with T.serial(0, self.m) as token:
            with T.serial(first * self.outputs, tirx.min(end * self.outputs, self.out_tiles)) as tile:
                emit(token, tile)


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
