"""The lookup kernel (T-MAC style): y = x · dequant(W)ᵀ without decoding the weights.

Each 4-bit nibble of a tile16 word holds 4/bits codes of one row.  For every nibble position p and every
row of x, the prologue tabulates all 16 partial sums T[m, p, c] = Σ_i x[m, k_i] · v(code_i(c)) over the
k's the nibble covers.  The main loop then needs, per nibble of 16 weight rows, one 16-entry float32 table
lookup in registers, indexed by the low 4 bits of each lane (the word shifted by 4·j: a vpermps with AVX-512,
two per half and a blend with AVX2, `tir.lookup16`) and one add: 64 weights per lookup for 1-bit codes, 32 for
2-bit, 16 for 4-bit, all in exact float32 sums.
Per group, y += scale · (Σ + beta·XS) folds the zero point (codes tabulate as raw integers then).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.expr import apply_epilogue
from ....ops.matmul import Matmul
from ....ttype import codes_per_word, effective_group_size, get
from ..isa import IsaLevel
from ..layout import AMX_TILE_ROWS, padded_k
from ..lut import MAX_ROWS, NIBBLES_PER_WORD, LutConfig
from . import nonfinite
from .groups import GroupArguments, biased, write_output
from .norm import NormPrologue
from .tir import (LANES, horizontal_sum, load, lookup16, prefetch, prefetch_ahead, prim_func, ramp, registers, splat,
                  to_float32, u32)


def build(spec: Matmul, n: int, k: int, config: LutConfig, threads: int, rows: tuple[int, int], level: IsaLevel,
          name: str = "main"):
    """The PrimFunc for a [N, K] weight in the tile16 layout and M in `rows` (inclusive, within 1..4) at the
    instruction-set `level` (its vector width picks the table lookup, `tir.lookup16`), split into `threads` parallel
    chunks (the runtime's thread count: each chunk tabulates x itself, see
    `Builder._main`).  Other row counts compute nothing: the body is emitted per row count of the range.

    Arguments, in order: x [M, K], qweight, scales, zeros (zero modes), tensor_scale (nvfp4), values
    (see `lut.value_table`), the norm's weight and bias [K] float32 (norm prologues), bias [N] float32 (bias
    specs), residual (residual specs), y [M, out_features]; the tables are built from x̂ for a norm prologue
    (`emit.norm`), and the output stage applies the spec's epilogue (SwiGLU: tasks hold (gate, up) tile pairs,
    `lut.min_tiles`).
    """
    check_rows(threads, rows)
    return Builder(spec, n, k, config, threads, rows, level).build(name)


def check_rows(threads: int, rows: tuple[int, int], max_rows: int = MAX_ROWS) -> None:
    """Raise unless `threads` and the row range `rows` are ones the kernel takes (few rows: at most MAX_ROWS)."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if not 1 <= rows[0] <= rows[1]:
        raise ValueError(f"rows={rows} is not a range of row counts")
    if rows[1] > max_rows:
        raise ValueError(f"rows={rows}: a few-row kernel serves at most {max_rows} rows")


class Builder:
    """The lookup kernel's builder; the FMA kernel (`emit.fma`) replaces its tables and inner loop."""

    takes_values = True  # it takes the value table (`lut.value_table`)

    def __init__(self, spec: Matmul, n: int, k: int, config: LutConfig, threads: int, rows: tuple[int, int],
                 level: IsaLevel):
        self.spec, self.cfg, self.threads, self.rows, self.level = spec, config, threads, rows, level
        self.ttype = get(spec.weight_dtype)
        self.bits = self.ttype.bits
        self.n, self.k = n, k
        self.k_pad = padded_k(k, self.bits)
        group = effective_group_size(spec.group_size, k)
        self.per_channel = group == k
        self.kgroup = self.k_pad if self.per_channel else group
        self.groups = k // group  # a group below 32 leaves padding words past the last: they add 0
        self.per_word = codes_per_word(self.bits)
        self.words = self.k_pad // self.per_word
        self.group_words = self.kgroup // self.per_word
        self.codes_per_nibble = 4 // self.bits
        self.positions = self.words * NIBBLES_PER_WORD
        self.n_tiles = -(-n // AMX_TILE_ROWS)
        self.m = tirx.Var("M", "int32")
        # The rows the prologue prepares at a time: all of M (few rows), else chunks of config.m_chunk
        # (`_row_chunks`); their first row in x and y, how many, and the rows the prologue's buffers hold.
        self.row_base, self.chunk_rows = 0, self.m
        self.buffer_rows = self.m if rows[1] <= MAX_ROWS else config.m_chunk

    def build(self, name: str):
        """The kernel's PrimFunc, named `name`."""
        return prim_func(name, self._arguments, self._body)

    def _body(self) -> None:
        T.evaluate(tirx.call_intrin("int32", "tirx.assume", self.m <= self.rows[1]))
        self._main()

    def _arguments(self) -> None:
        spec = self.spec
        per_tile = (self.n_tiles, self.groups, AMX_TILE_ROWS)
        self.x = T.arg("x", T.Buffer((self.m, self.k), spec.activation_dtype))
        self.qweight = T.arg("qweight", T.Buffer((self.n_tiles, self.words, AMX_TILE_ROWS), "int32"))
        self.group_args = GroupArguments.declare(spec, per_tile)
        if self.takes_values:
            self.values = T.arg("values", T.Buffer((self.ttype.num_codes,), "float32"))
        self.norm = NormPrologue.declare(spec, self.k)
        self.bias = T.arg("bias", T.Buffer((self.n,), "float32")) if spec.bias else None
        out_n = spec.out_features(self.n)
        self.residual = T.arg("residual", T.Buffer((self.m, out_n), spec.output_dtype)) if spec.residual else None
        self.y = T.arg("y", T.Buffer((self.m, out_n), spec.output_dtype))

    # -- prologue: tables and group sums ---------------------------------------------------------------
    def _k_in_word(self, slot: int) -> int:
        """The k offset (within its word's k's) of code position `slot` of a tile16 word."""
        half = self.per_word // 2
        return slot * 2 if slot < half else (slot - half) * 2 + 1

    def _x_at(self, row, index):
        """x[row, index] as float32 (index a scalar or a ramp within K), normalized for a norm prologue (x̂)."""
        value = to_float32(load(self.x, self.row_base + row, index), self.spec.activation_dtype)
        return value if self.norm is None else self.norm.apply(row, lambda vector: load(vector, index), value)

    def _x(self, row, k_index, end=None):
        """x̂[row, k] as float32, 0 from `end` (default K) on."""
        value = self._x_at(row, tirx.min(k_index, self.k - 1))
        return tirx.Select(k_index < (self.k if end is None else end), value, tirx.const(0.0, "float32"))

    def _prologue(self, first_tiles: list) -> None:
        """T[m, 8w + j, c] = Σ_i x[m, k_i] · v((c >> i·bits) & mask) over the k's of nibble j of word w; with
        zero points also XS[m, g] = Σ_{k in g} x[m, k].  For a norm prologue each row's statistics come first and
        x means x̂ throughout.  x is first widened to float32 (zero past K), so each
        term is a broadcast load and a multiply-add.  Meanwhile word w of each of the chunk's first tiles
        (and its group's scales) is prefetched into L2: the first task then starts on cached lines instead of
        cold misses (measured at 4096x4096 int1: its first task 9.8 -> 5.1 µs, the prologue 2.8 -> 6.3 µs)."""
        if self.norm is not None:
            with T.serial(0, self.chunk_rows) as row:
                self.norm.statistics(row, lambda index: to_float32(load(self.x, self.row_base + row, index),
                                                                   self.spec.activation_dtype))
        self._tabulate(self._widened_x(), first_tiles)
        if not self._needs_group_sums():
            return
        span = min(self.kgroup, self.k)  # a per-channel group runs over the padding too, where x is 0
        with T.serial(0, self.chunk_rows) as row:
            with T.serial(0, self.groups) as g:
                acc = T.alloc_buffer((LANES,), "float32", scope="local")
                T.buffer_store(acc, splat(0.0, "float32"), [ramp(0)])
                with T.serial(0, -(-span // LANES)) as chunk:
                    vector = self._x_vector(row, g * self.kgroup + chunk * LANES, g * self.kgroup + span)
                    T.buffer_store(acc, load(acc, ramp(0)) + nonfinite.finite_part(vector)[0], [ramp(0)])
                T.buffer_store(self.xs, horizontal_sum(load(acc, ramp(0))), [row, g])

    def _tabulate(self, x, first_tiles: list) -> None:
        """The tables T from the widened x (see `_prologue`), prefetching the chunk's first tiles meanwhile."""
        mask = (1 << self.bits) - 1
        lane = tirx.Ramp(0, 1, LANES)
        selected = [load(self.values, tirx.bitwise_and(tirx.shift_right(lane, splat(i * self.bits, "int32")),
                                                        splat(mask, "int32"))) for i in range(self.codes_per_nibble)]
        with T.serial(0, self.chunk_rows * self.words) as task:
            row, word = tirx.floordiv(task, self.words), tirx.floormod(task, self.words)
            for tile in first_tiles:
                prefetch(load(self.qweight, tile, word, 0), into_l1=False)
                self.group_args.prefetch_into_l2(tile, tirx.min(tirx.floordiv(word, self.group_words), self.groups - 1))
            for nibble in range(NIBBLES_PER_WORD):
                total = None
                for i in range(self.codes_per_nibble):
                    k_index = word * self.per_word + self._k_in_word(nibble * self.codes_per_nibble + i)
                    term = tirx.Broadcast(load(x, row, k_index), LANES) * selected[i]
                    total = term if total is None else total + term
                T.buffer_store(self.tables, total, [row, word * NIBBLES_PER_WORD + nibble, ramp(0)])

    def _widened_x(self):
        """x as float32 [M, K_pad], zero past K; non-finite x count as 0 and flag their row (see `nonfinite`)."""
        x = T.alloc_buffer((self.buffer_rows, self.k_pad), "float32", align=64)
        vectors = self.k_pad // LANES
        with T.serial(0, self.chunk_rows * vectors) as task:
            row, k0 = tirx.floordiv(task, vectors), tirx.floormod(task, vectors) * LANES
            if self.k % LANES == 0:
                value = tirx.Select(k0 < self.k, self._x_vector(row, tirx.min(k0, self.k - LANES), self.k),
                                    splat(0.0, "float32"))
            else:
                value = tirx.Shuffle([self._x(row, k0 + i) for i in range(LANES)], list(range(LANES)))
            value, flags = nonfinite.finite_part(value)
            nonfinite.note(self.nonfinite, row, k0 == 0, flags)
            T.buffer_store(x, value, [row, ramp(k0)])
        return x

    def _x_vector(self, row, k0, end):
        """x̂[row, k0 : k0 + 16] as float32 lanes, 0 from `end` on (the group's end or K)."""
        if self.k % LANES == 0 and min(self.kgroup, self.k) % LANES == 0:
            return self._x_at(row, ramp(k0))
        return tirx.Shuffle([self._x(row, k0 + i, end) for i in range(LANES)], list(range(LANES)))

    # -- main loop --------------------------------------------------------------------------------------
    def _main(self) -> None:
        """Per parallel chunk (one per thread): tabulate x, then run the chunk's share of consecutive tasks of
        n_tiles weight tiles.  Each chunk builds its own tables: tables built once by one thread and read by
        the others cross between the cores' caches line by line (measured on a 4096x4096 int1 GEMV: 105 ->
        98 µs from DRAM, 19 -> 8 µs for 256 rows in cache).  Per group, the group's tables (L1) serve every
        tile of a task.  The task body is emitted once per row count of the range: rows and tiles unroll, so
        a word position's 8 tables are loaded once into registers for all the task's tiles and the partial
        sums stay in registers."""
        blocks = -(-self.n_tiles // self.cfg.n_tiles)
        chunks = min(self.threads, blocks)
        with T.parallel(0, chunks) as chunk:
            first, end = tirx.floordiv(chunk * blocks, chunks), tirx.floordiv((chunk + 1) * blocks, chunks)
            self._allocate_tables()
            self.xs = T.alloc_buffer((self.buffer_rows, self.groups), "float32")
            self.nonfinite = T.alloc_buffer((self.buffer_rows, LANES), "uint32")  # rows with ±Inf or NaN in x
            if self.norm is not None:
                self.norm.allocate(self.buffer_rows)
            first_tiles = [tirx.min(first * self.cfg.n_tiles + c, self.n_tiles - 1) for c in range(self.cfg.n_tiles)]
            if self.rows[1] > MAX_ROWS:
                self._row_chunks(first, end, first_tiles)
                return
            self._prologue(first_tiles)
            with T.serial(first, end) as block:
                for rows in range(self.rows[0], self.rows[1] + 1):
                    with T.If(self.m == rows):
                        with T.Then():
                            self._task(block, rows)

    def _row_chunks(self, first, end, first_tiles) -> None:
        """Many rows: per chunk of config.m_chunk rows, the prologue for them, then every task of the thread over
        them (`_rows_task`)."""
        with T.serial(0, tirx.floordiv(self.m + self.cfg.m_chunk - 1, self.cfg.m_chunk)) as chunk:
            self.row_base = chunk * self.cfg.m_chunk
            self.chunk_rows = tirx.min(self.cfg.m_chunk, self.m - self.row_base)
            self._prologue(first_tiles)
            with T.serial(first, end) as block:
                self._rows_task(block)

    def _rows_task(self, block) -> None:
        """y for the task's tiles and every row of the chunk: per group, its sums for each block of config.rows rows
        (and one block of the rows left over) folded into the rows' y in memory, so that the group's words, read from
        DRAM once, serve every block from L1 (measured at x86-64-v3, int4 4096x14336 M=16: with all of K per block
        the words of a task no longer stayed in L2 beside the widened rows, 16.7 ms from DRAM, 8.2 in cache)."""
        n_tiles, block_rows = self.cfg.n_tiles, self.cfg.rows
        tiles = [tirx.min(block * n_tiles + c, self.n_tiles - 1) for c in range(n_tiles)]
        yacc = T.alloc_buffer((self.buffer_rows, n_tiles, LANES), "float32", align=64)
        with T.serial(0, self.chunk_rows) as row:
            for c in range(n_tiles):
                T.buffer_store(yacc, splat(0.0, "float32"), [row, c, ramp(0)])
        whole = tirx.floordiv(self.chunk_rows, block_rows)
        with T.serial(0, self.groups) as g:
            term = self._group_term(tiles, g)

            def block_sums(rows: int, start) -> None:
                def fold(row, c, total):
                    T.buffer_store(yacc, load(yacc, start + row, c, ramp(0)) + term(c, start + row, total),
                                   [start + row, c, ramp(0)])

                self._group_sums(self._sums_buffer(rows), tiles, rows, g, fold, start)

            with T.serial(0, whole) as row_block:
                block_sums(block_rows, row_block * block_rows)
            for rows in range(1, block_rows):
                with T.If(self.chunk_rows - whole * block_rows == rows):
                    with T.Then():
                        block_sums(rows, whole * block_rows)
        swiglu = self.spec.epilogue == "swiglu"
        with T.serial(0, self.chunk_rows) as row:
            one = registers((1, n_tiles), "float32")
            for c in range(n_tiles):
                T.buffer_store(one, load(yacc, row, c, ramp(0)), [0, c, ramp(0)])
            nonfinite.add_terms(one, 0, tiles, self.nonfinite, row, self.k, self._x,
                                lambda tile, j: nonfinite.weight_lanes(self.spec, self.k, self.qweight,
                                                                       self.group_args, tile, j))
            for c in range(0, n_tiles, 2 if swiglu else 1):
                with T.If(block * n_tiles + c < self.n_tiles):
                    with T.Then():
                        self._store(one, 1, tiles[c], c, swiglu, row)

    def _needs_group_sums(self) -> bool:
        """Whether the group sums XS of x are needed (`_group_offset`)."""
        return self.group_args.zeros is not None

    def _group_offset(self, tile_index, g):
        """What the sums over a group hold per unit of XS beyond Σ x·value (the zero point, codes tabulated raw), or
        None."""
        return self.group_args.zero(tile_index, g) if self.group_args.zeros is not None else None

    def _allocate_tables(self) -> None:
        self.tables = T.alloc_buffer((self.buffer_rows, self.positions, LANES), "float32")

    def _group_term(self, tiles, g):
        """For group g of the task's tiles (prefetching the scales of groups ahead): term(c, row, Σ), the group's
        part of y for tile c and row `row` of the chunk, scale · (Σ - offset · XS[row, g])."""
        for tile in tiles:
            self.group_args.prefetch(tile, g, len(tiles))
        scales = [self.group_args.scale(tile, g) for tile in tiles]
        offsets = [self._group_offset(tile, g) for tile in tiles]

        def term(c, row, total):
            if offsets[c] is not None:
                total = total - offsets[c] * tirx.Broadcast(load(self.xs, row, g), LANES)
            return total * scales[c]

        return term

    def _task_tiles(self, block) -> list:
        """The weight tiles of column block `block` (the last block repeats the last tile)."""
        return [tirx.min(block * self.cfg.n_tiles + c, self.n_tiles - 1) for c in range(self.cfg.n_tiles)]

    def _task(self, block, rows: int, first=0) -> None:
        """y for the task's tiles and `rows` rows of the chunk from row `first`, the sums in registers over all of
        K."""
        n_tiles = self.cfg.n_tiles
        tiles = self._task_tiles(block)
        yacc, gacc = registers((rows, n_tiles), "float32"), self._sums_buffer(rows)
        for row in range(rows):
            for c in range(n_tiles):
                T.buffer_store(yacc, splat(0.0, "float32"), [row, c, ramp(0)])
        with T.serial(0, self.groups) as g:
            term = self._group_term(tiles, g)

            def fold(row, c, total):
                """y += scale · (Σ - offset · XS) for row `row` and tile c of the task."""
                T.buffer_store(yacc, load(yacc, row, c, ramp(0)) + term(c, first + row, total), [row, c, ramp(0)])

            self._group_sums(gacc, tiles, rows, g, fold, first)
        for row in range(rows):  # the terms of non-finite x the prologue left out
            nonfinite.add_terms(yacc, row, tiles, self.nonfinite, first + row, self.k, self._x,
                                lambda tile, j: nonfinite.weight_lanes(self.spec, self.k, self.qweight,
                                                                       self.group_args, tile, j))
        swiglu = self.spec.epilogue == "swiglu"
        for c in range(0, n_tiles, 2 if swiglu else 1):
            with T.If(block * n_tiles + c < self.n_tiles):
                with T.Then():
                    self._store(yacc, rows, tiles[c], c, swiglu, first)

    def _sums_buffer(self, rows: int):
        """Registers for a group's sums: one row's per tile (the rows take turns)."""
        return registers((self.cfg.n_tiles,), "float32")

    def _group_sums(self, gacc, tiles, rows: int, g, fold, first) -> None:
        """Each row's sums over group g's words per tile, looked up, handed to fold(row, c, sums) (rows counted
        from the chunk's row `first`)."""
        for row in range(rows):
            for c in range(len(tiles)):
                T.buffer_store(gacc, splat(0.0, "float32"), [c, ramp(0)])
            with T.serial(0, self.group_words) as w:
                self._lookup_words(gacc, tiles, row, g * self.group_words + w, first)
            for c in range(len(tiles)):
                fold(row, c, load(gacc, c, ramp(0)))

    def _lookup_words(self, gacc, tiles, row, word_index, first) -> None:
        """gacc[c] += Σ_j T[first + row, 8·word + j][nibble j of each lane's word] for every tile c of the task."""
        tables = [load(self.tables, first + row, word_index * NIBBLES_PER_WORD + j, ramp(0))
                  for j in range(NIBBLES_PER_WORD)]
        for c, tile_index in enumerate(tiles):
            if row == 0:
                prefetch_ahead(self.qweight, tile_index, word_index, self.cfg.prefetch, len(tiles))
            word = tirx.reinterpret("uint32x16", load(self.qweight, tile_index, word_index, ramp(0)))
            nibbles = [word if j == 0 else tirx.shift_right(word, u32(4 * j)) for j in range(NIBBLES_PER_WORD)]
            picked = [lookup16(table, tirx.reinterpret("int32x16", nibble), self.level)
                      for table, nibble in zip(tables, nibbles)]
            T.buffer_store(gacc, load(gacc, c, ramp(0)) + _tree_sum(picked), [c, ramp(0)])

    def _store(self, yacc, rows: int, tile_index, c, swiglu: bool, first) -> None:
        """y = f(C + bias) (+ residual) for tile c of the task (16 lanes at a time where N fills the tile);
        SwiGLU: silu(gate) · up from the gate tile c and the up tile c + 1, one 16-column tile of y."""
        column = tile_index * LANES
        for row in range(rows):
            y_row = self.row_base + first + row
            if swiglu:
                gate, up = (biased(load(yacc, row, c + i, ramp(0)), self.bias, ramp(column + i * LANES))
                            for i in (0, 1))
                write_output(self.spec, self.y, self.residual, apply_epilogue("silu", gate) * up, y_row,
                             ramp(tirx.floordiv(column, 2)))
            elif self.n % LANES == 0:
                self._store_columns(load(yacc, row, c, ramp(0)), y_row, ramp(column))
            else:
                with T.serial(0, tirx.min(LANES, self.n - column)) as lane:
                    self._store_columns(load(yacc, row, c, lane), y_row, column + lane)

    def _store_columns(self, value, row, columns) -> None:
        value = apply_epilogue(self.spec.epilogue, biased(value, self.bias, columns))
        write_output(self.spec, self.y, self.residual, value, row, columns)


def _tree_sum(terms: list):
    """Σ of a power-of-two number of terms as a balanced tree (short dependency chains)."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] for i in range(0, len(terms), 2)]
    return terms[0]
