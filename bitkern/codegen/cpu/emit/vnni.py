"""The VNNI kernel of activation_quant="int8" (W4A8, W8A8 as llama.cpp's Q4_0 x Q8_0): integer weight codes times
int8 activations by vpdpbusd (or the level's byte dot product, `vnni.dot_instruction`: sdot on aarch64), exact in
int32 per activation block.

Per parallel task (16·n_tiles output columns, a chunk of rows):
  prologue  each row's 32-k blocks of x̂ -> int8 codes q and a float32 scale d, as `ops.matmul.activation_blocks`
            defines them (non-finite x̂ count as 0 and flag the row, see `nonfinite`); the codes are stored as the
            4-byte groups vpdpbusd multiplies with the bytes of a masked tile16 word, so one broadcast serves a
            whole weight vector; per quantization group the sums XS = Σ d·q (for offsets and zero points);
  main      per block of `rows` rows (all of K with y in registers where one block holds the call's rows, else
            per group, every block in turn, so a group's words come from DRAM once): each tile16 word (16 columns)
            is masked per byte position (its codes as unsigned bytes u, two's complement codes with their sign bit
            flipped: u = v + 2^(bits-1); code books and floats looked up by vpshufb or tbl in their int8 code book,
            `vnni.byte_table`), and vpdpbusd adds u·q of 4 k's per lane into int32 sums C (in pairs,
            `_paired_block`: smmla adds 8 k's of two rows and two columns); per activation block
            y += (scale·alpha·d)·C, per group y += scale·beta·XS, where v = alpha·u + offset and beta = offset - zero
            point;
  output    the tile16 builder's (non-finite terms, bias, epilogue, residual).
The decode is a mask (and a shift) per byte position, so rows re-decode it per block instead of staging it.  Where a
level has 16 vector registers (AVX2), blocks of several rows run a group's products as one loop over its words, y in
memory (`vnni.steps_words`), so that LLVM keeps one word's decoded codes and the sums in registers.
"""

from __future__ import annotations

import contextlib

import torch
from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.matmul import ACTIVATION_BLOCK
from ....ttype import get
from ....ttype.types import INT
from ..isa import IsaLevel
from ..layout import padded_k, tile16_shift
from ..vnni import byte_bias, byte_bits, dot_instruction, looks_up_bytes, reads_signed_bytes, steps_words
from . import nonfinite
from .tile16 import SMALL_M_ROWS, Tile16Builder, _Decode
from .tir import LANES, by_parts, horizontal_max, load, lookup_bytes, prefetch_ahead, ramp, registers, splat, u32

QUADS = ACTIVATION_BLOCK // 4  # int32 words of int8 codes per activation block
# Independent 16-lane chains a row block keeps in flight, per byte dot product (`vnni.dot_instruction`): vpdpbusd's
# latency, 5 cycles on Sapphire Rapids, at one per cycle, rounded up to a power of two; sdot's 4 cycles at two per
# cycle (Cortex-A76, Neoverse N1; from Arm's guides, not measured), four sdot per 16 lanes; vpmaddubsw and vpmaddwd
# end in a one-cycle add.  Cells with fewer split their sums by product.
CHAINS = {"vpdpbusd": 8, "sdot": 2, "vpmaddubsw": 1}


class _Codes:
    """Where a tile16 word keeps its codes, as vpdpbusd reads them: `positions` byte positions (a shift by
    bits·s and a mask give every byte's code at position s), and for each position and byte the k (within the
    word) whose code it is."""

    def __init__(self, bits: int):
        self.bits = bits
        self.per_word = 32 // bits
        self.positions = 8 // bits
        self.mask = ((1 << bits) - 1) * 0x01010101
        at = {tile16_shift(k, bits): k for k in range(self.per_word)}
        self.k_of = [[at[8 * byte + bits * s] for byte in range(4)] for s in range(self.positions)]
        self.words = ACTIVATION_BLOCK // self.per_word  # words of one activation block

    def quad_order(self) -> list[int]:
        """For each of a block's 32 code bytes, in the order the kernel reads them (word, position, byte), the k
        within the block whose activation it multiplies."""
        return [w * self.per_word + self.k_of[s][byte] for w in range(self.words) for s in range(self.positions)
                for byte in range(4)]


def table_decode(spec, level: IsaLevel) -> _Decode:
    """v = alpha·b + offset for the bytes b a code book's codes look up (`vnni.byte_table`): b = t, read as signed
    bytes, or t + bias (offset -bias units), with alpha the code book's unit (`TType.int8_values`)."""
    ttype = get(spec.weight_dtype)
    unit = ttype.int8_values[1]
    signed = reads_signed_bytes(level, 8)
    return _Decode("lut", ttype.bits, signed=signed, alpha=(unit,), offset=-byte_bias(spec, level) * unit)


def signed_decode(spec) -> _Decode:
    """v = s + offset for 8-bit codes read as signed bytes s: two's complement codes as they are, unsigned ones with
    their top bit flipped (s = u - 128)."""
    if get(spec.weight_dtype).kind == INT:
        return _Decode("signed", 8, signed=True)
    return _Decode("signed", 8, signed=True, xor=(0x80808080,), offset=128.0)


def unsigned_decode(spec) -> _Decode:
    """v = alpha·u + offset for the codes read as unsigned integers u (two's complement codes with their sign bit
    flipped; int1's binary codes 0, 1 mean -1, +1), and the bits to flip (per word)."""
    ttype = get(spec.weight_dtype)
    if ttype.kind != INT:
        return _Decode("unsigned", ttype.bits)
    if ttype.bits == 1:
        return _Decode("unsigned", 1, alpha=(2.0,), offset=-1.0)
    half = 1 << (ttype.bits - 1)
    flip = sum(half << (i * ttype.bits) for i in range(32 // ttype.bits))
    return _Decode("unsigned", ttype.bits, xor=(flip,), offset=-float(half))


def decode_of(spec, level: IsaLevel) -> _Decode:
    """How the kernel reads `spec`'s codes at `level`: looked up in the int8 code book, as signed bytes, or as
    unsigned integers (`table_decode`, `signed_decode`, `unsigned_decode`)."""
    if looks_up_bytes(spec):
        return table_decode(spec, level)
    return (signed_decode if reads_signed_bytes(level, get(spec.weight_dtype).bits) else unsigned_decode)(spec)


def flip_words(spec, level: IsaLevel) -> list:
    """The `flip` argument of a decode that flips bits of every word (`decode_of`) on x86: 16 int32 of the pattern,
    else nothing (aarch64 keeps the constant: its kernels were not measured with the argument)."""
    flip = decode_of(spec, level).xor[0] if level.arch == "x86_64" else 0
    return [torch.full((LANES,), flip - (1 << 32) if flip >= 1 << 31 else flip, dtype=torch.int32)] if flip else []


class VnniBuilder(Tile16Builder):
    """Emits one VNNI kernel: the tile16 builder's arguments, row loop and output stage around an int8 prologue and
    vpdpbusd products."""

    def __init__(self, spec, n: int, k: int, config, level: IsaLevel, max_rows: int):
        self.level = level  # before the tile16 builder's set-up, which picks the decode (`_set_decode`)
        self.max_rows = max_rows  # the most rows a call brings (the bucket's): one row block or several
        super().__init__(spec, n, k, config)
        self.chains = CHAINS[dot_instruction(level)]
        self.codes = _Codes(self.ttype.bits)
        self.blocks = padded_k(k, self.ttype.bits) // ACTIVATION_BLOCK
        self.group_blocks = self.s.kgroup // ACTIVATION_BLOCK

    def _set_decode(self, config) -> None:
        self.dec = decode_of(self.spec, self.level)
        self.nibbles, self.offset_shortfall = 1, None

    def _declare_constants(self) -> None:
        """A code book's table (`lut`), or the bits that flip codes to unsigned (`flip`, `flip_words`): from memory,
        LLVM xors each word once; as a constant it moved the xor past the mask and shift, once per byte position."""
        super()._declare_constants()
        self.flip = T.arg("flip", T.Buffer((LANES,), "int32")) if flip_words(self.spec, self.level) else None

    def body_scope(self):
        return contextlib.nullcontext()

    def plane_pitch(self) -> int:
        """int32 words of int8 codes per row, and a cache line (rows read together stay off one L1 set)."""
        return self.blocks * QUADS + LANES

    def padded_rows(self):
        """The rows themselves: row blocks run bodies for exact row counts."""
        return self.m

    def _allocate_activations(self, rows) -> None:
        self.a = T.alloc_buffer((rows, self.plane_pitch()), "int32")
        self.xscale = T.alloc_buffer((rows, self.blocks), "float32")
        self.xs = T.alloc_buffer((rows, self.s.groups), "float32")
        self.xd = None

    # -- prologue --------------------------------------------------------------------------------------------------
    def _store_planes(self, row, chunk, even, odd) -> None:
        """Activation block `chunk` of a row (x̂ at its even and odd k's): its int8 codes in the kernel's byte order,
        its scale d, and d·Σq into the group's XS."""
        (even, even_flags), (odd, odd_flags) = nonfinite.finite_part(even), nonfinite.finite_part(odd)
        nonfinite.note(self.nonfinite, row, chunk == 0, tirx.bitwise_or(even_flags, odd_flags))
        # values and the scale pass through local buffers (registers): an expression used twice is a tree copied
        # twice, and TVM's passes slow down with the size of the trees (CSE is off, see kernel.compile_function)
        values = registers((2,), "float32")
        for parity, value in enumerate((even, odd)):
            T.buffer_store(values, value, [parity, ramp(0)])
        scale = T.alloc_buffer((1,), "float32")
        magnitudes = tirx.max(tirx.abs(load(values, 0, ramp(0))), tirx.abs(load(values, 1, ramp(0))))
        T.buffer_store(scale, horizontal_max(magnitudes) / tirx.const(127.0, "float32"), [0])
        d = load(scale, 0)
        divisor = tirx.Broadcast(tirx.Select(d > tirx.const(0.0, "float32"), d, tirx.const(1.0, "float32")), LANES)
        for parity in (0, 1):
            code = tirx.call_llvm_pure_intrin("float32x16", "llvm.roundeven", load(values, parity, ramp(0)) / divisor)
            T.buffer_store(values, tirx.min(tirx.max(code, splat(-127.0, "float32")), splat(127.0, "float32")),
                           [parity, ramp(0)])
        codes = [load(values, parity, ramp(0)) for parity in (0, 1)]
        by_k = [2 * i + parity for parity in (0, 1) for i in range(LANES)]  # lane of each k in (even, odd)
        order = [by_k.index(k) for k in self.codes.quad_order()]
        packed = tirx.Shuffle([tirx.Cast("int8x16", code) for code in codes], order)
        T.buffer_store(self.a, tirx.reinterpret(f"int32x{QUADS}", packed), [row, ramp(chunk * QUADS, QUADS)])
        T.buffer_store(self.xscale, d, [row, chunk])
        self._add_to_group_sums(self.xs, row, chunk, (codes[0] + codes[1]) * tirx.Broadcast(d, LANES))

    # -- main loop -------------------------------------------------------------------------------------------------
    def task(self, rows, block, row0) -> None:
        """The task's rows in blocks of cfg.rows.  Where the bucket holds one block, y stays in registers over all of K;
        with more, the groups run outside the blocks (`_group_rows`), so each group's words come from DRAM once and
        serve every block from L1."""
        cfg = self.cfg
        tiles, owned = self._block_tiles(block)
        chunk_rows = SMALL_M_ROWS if cfg.small_m else cfg.m_chunk
        here = self.m if cfg.small_m else tirx.min(chunk_rows, self.m - row0)
        yacc = T.alloc_buffer((chunk_rows, cfg.n_tiles, LANES), "float32", scope="local", align=64)
        block_registers = self._task_registers()

        def each_block(emit) -> None:
            with T.serial(0, tirx.floordiv(here + (cfg.rows - 1), cfg.rows)) as rb:
                left = here - rb * cfg.rows
                for count in range(1, cfg.rows + 1):
                    with T.If(left == count if count < cfg.rows else left >= count):
                        with T.Then():
                            emit(rb * cfg.rows, count)

        if cfg.in_turn or self.max_rows <= cfg.rows:
            each_block(lambda local_row, count: self._all_of_k(yacc, block_registers, tiles, row0, local_row, count))
        else:
            with T.serial(0, here) as r:
                for c in range(cfg.n_tiles):
                    T.buffer_store(yacc, splat(0.0, "float32"), [r, c, ramp(0)])
            with T.serial(0, self.s.groups) as group:
                each_block(lambda local_row, count: self._group_rows(yacc, block_registers, tiles, row0, local_row,
                                                                     count, group))
        self._store_output(yacc, tiles, owned, row0, chunk_rows)

    def _task_registers(self) -> tuple:
        """The registers of a task's row blocks (y, the int32 sums and a group's factors, of its tiles, or of one at a
        time in turn), and the code book of a looked-up type in `table`, read once per task."""
        cfg = self.cfg
        width = 1 if cfg.in_turn else cfg.n_tiles  # tiles in registers at once
        self.table = None
        if self.lut is not None:
            self.table = registers((1,), "int32")
            T.buffer_store(self.table, load(self.lut, ramp(0)), [0, ramp(0)])
        return (registers((cfg.rows, width), "float32"), registers((self._splits(1, width), cfg.rows, width), "int32"),
                registers((2, width), "float32"))

    def _all_of_k(self, yacc, block_registers, tiles, row0, local_row, count: int) -> None:
        """yacc[local_row + r] for the `count` rows of a block over all of K (`_rows`): the task's tiles at once, or
        one after another (in_turn)."""
        if self.cfg.in_turn:
            for c, tile in enumerate(tiles):
                self._rows(yacc, block_registers, [tile], row0, local_row, count, c)
        else:
            self._rows(yacc, block_registers, tiles, row0, local_row, count)

    def _splits(self, count: int, width: int) -> int:
        """int32 sums per C cell of a block of `count` rows and `width` tiles: CHAINS in flight, at most the products
        of a block (one in pairs: a row pair's tile is eight independent smmla sums)."""
        if self.cfg.pairs:
            return 1
        splits = 1
        while count * width * splits < self.chains and splits < QUADS:
            splits *= 2
        return splits

    def _rows(self, yacc, block_registers, tiles, row0, local_row, count: int, column: int = 0) -> None:
        """yacc[local_row + r, column..] for the `count` rows of a block and `tiles` (the task's from `column` on): all
        of K, y in registers (`block_registers`: y, the int32 sums and the group's factors scale·alpha, scale·beta per
        tile), or in yacc itself where the block steps through words (`vnni.steps_words`: its loop then holds only
        the sums in registers)."""
        cells = [(r, c) for r in range(count) for c in range(len(tiles))]
        in_yacc = steps_words(self.level, count)
        y = self._rows_of(yacc, local_row, column, len(tiles)) if in_yacc else block_registers[0]
        for r, c in cells:
            T.buffer_store(y, splat(0.0, "float32"), [r, c, ramp(0)])
        with T.serial(0, self.s.groups) as group:
            self._group((y, *block_registers[1:]), tiles, row0 + local_row, count, group)
        if not in_yacc:
            for r, c in cells:
                T.buffer_store(yacc, load(y, r, c, ramp(0)), [local_row + r, column + c, ramp(0)])

    def _rows_of(self, yacc, local_row, column: int, width: int):
        """yacc's cells of a block's rows from local_row and its tiles from `column`, as a buffer [rows, width, 16]
        in place (a view at a variable offset, which LLVM keeps in memory rather than in registers)."""
        tiles = self.cfg.n_tiles
        return T.decl_buffer((self.cfg.rows, width, LANES), "float32", data=yacc.data, scope="local",
                             strides=(tiles * LANES, LANES, 1), elem_offset=(local_row * tiles + column) * LANES)

    def _group_rows(self, yacc, block_registers, tiles, row0, local_row, count: int, group) -> None:
        """yacc[local_row + r] += one group's terms for the `count` rows of a block (y through registers, or in yacc
        itself where the block steps through words)."""
        if steps_words(self.level, count):
            self._group((self._rows_of(yacc, local_row, 0, len(tiles)), *block_registers[1:]), tiles, row0 + local_row,
                        count, group)
            return
        y = block_registers[0]
        cells = [(r, c) for r in range(count) for c in range(len(tiles))]
        for r, c in cells:
            T.buffer_store(y, load(yacc, local_row + r, c, ramp(0)), [r, c, ramp(0)])
        self._group(block_registers, tiles, row0 + local_row, count, group)
        for r, c in cells:
            T.buffer_store(yacc, load(y, r, c, ramp(0)), [local_row + r, c, ramp(0)])

    def _group(self, block_registers, tiles, first_row, count: int, group) -> None:
        """y += quantization group `group`'s terms for rows first_row.. of a block: its activation blocks' products
        scaled by scale·alpha·d, then the offset and zero point term scale·beta·XS."""
        splits = self._splits(count, len(tiles))
        cells = [(r, c) for r in range(count) for c in range(len(tiles))]
        y, acc, factors = block_registers
        rows = [self._activation_row(first_row + r) for r in range(count)]
        scale_group = self._scale_group(group)
        for c in range(len(tiles)):
            scale, beta = self._group_factors(tiles[c], scale_group, len(tiles))
            alpha = self.dec.alpha[0]
            T.buffer_store(factors, scale if alpha == 1.0 else scale * splat(alpha, "float32"), [0, c, ramp(0)])
            if beta is not None:
                T.buffer_store(factors, scale * beta, [1, c, ramp(0)])
        if steps_words(self.level, count):
            self._stepped_blocks(y, acc, factors, tiles, rows, group)
        else:
            with T.serial(0, self.group_blocks) as inner:
                self._block(y, acc, factors, tiles, rows, group * self.group_blocks + inner, splits)
        if self.dec.offset != 0.0 or self.group_args.zeros is not None:
            for r, c in cells:
                xs = tirx.Broadcast(load(self.xs, rows[r], group), LANES)
                T.buffer_store(y, load(y, r, c, ramp(0)) + load(factors, 1, c, ramp(0)) * xs, [r, c, ramp(0)])

    def _activation_row(self, row):
        """The row of the prologue's int8 codes, scales and sums that row `row` of a block multiplies: itself."""
        return row

    def _codes_at(self, word, position: int):
        """The bytes a dot product multiplies at a byte position of a (flipped) word: its codes shifted and masked,
        or looked up in the code book."""
        codes = self.codes
        shifted = word if position == 0 else tirx.shift_right(word, u32(codes.bits * position))
        unsigned = shifted if codes.bits == 8 else tirx.bitwise_and(shifted, u32(codes.mask))
        if self.table is not None:
            unsigned = lookup_bytes(load(self.table, 0, ramp(0)), unsigned, self.level)
        return unsigned

    def _words(self, tiles, word_index):
        """Each tile's word `word_index` (prefetching ahead), its bits flipped as the decode says."""
        flip = u32(self.dec.xor[0]) if self.flip is None else tirx.reinterpret("uint32x16", load(self.flip, ramp(0)))
        words = []
        for tile in tiles:
            prefetch_ahead(self.qweight, tile, word_index, self.cfg.prefetch, len(tiles))
            word = tirx.reinterpret("uint32x16", load(self.qweight, tile, word_index, ramp(0)))
            words.append(tirx.bitwise_xor(word, flip) if self.dec.xor[0] else word)
        return words

    def _block(self, y, acc, factors, tiles, rows, block, splits: int) -> None:
        """One activation block: C = Σ u·q per cell in int32 (product t of the block into split t mod splits; or
        as int16 pairs widened once, `sums_pairs`; or by row pairs, `_paired_block`), then y += (scale·alpha·d)·C."""
        if self.cfg.pairs:
            self._paired_block(y, acc, factors, tiles, rows, block)
            return
        codes, width = self.codes, len(tiles)
        self._clear_sums(acc, splits, len(rows), width)
        for w in range(codes.words):
            self._word_products(acc, tiles, rows, block, w, block * codes.words + w, lambda product: product % splits)
        self._scale_into_y(y, factors, rows, block, width, lambda r, c: self._cell_total(acc, splits, r, c))

    def _stepped_blocks(self, y, acc, factors, tiles, rows, group) -> None:
        """A group's activation blocks as one loop over its words (`vnni.steps_words`), one sum per cell: each
        word's products (`_word_products`), and after a block's last word y += (scale·alpha·d)·C and the sums
        cleared.  The same sums in the same order as `_block`'s, so the same y bit for bit."""
        codes, width, count = self.codes, len(tiles), len(rows)
        first = group * self.group_blocks
        self._clear_sums(acc, 1, count, width)
        with T.serial(0, self.group_blocks * codes.words) as step:
            block, w = first + tirx.floordiv(step, codes.words), tirx.floormod(step, codes.words)
            self._word_products(acc, tiles, rows, block, w, first * codes.words + step, lambda product: 0)
            with T.If(w == codes.words - 1):
                with T.Then():
                    self._scale_into_y(y, factors, rows, block, width, lambda r, c: self._cell_total(acc, 1, r, c))
                    self._clear_sums(acc, 1, count, width)

    def _cell_total(self, acc, splits: int, r: int, c: int):
        """A cell's int32 sum C over its `splits` partial sums (int16 pairs widened first, `sums_pairs`)."""
        pairs = sums_pairs(self.level, byte_bits(self.spec), self.dec.signed)
        sums = [load(acc, split, r, c, ramp(0)) for split in range(splits)]
        found = None
        for value in (widen_pairs(v, self.level) for v in sums) if pairs else sums:
            found = value if found is None else found + value
        return found

    def _clear_sums(self, acc, splits: int, count: int, width: int) -> None:
        """Zero the int32 sums of a block's cells (`splits` per cell)."""
        for split in range(splits):
            for r in range(count):
                for c in range(width):
                    T.buffer_store(acc, splat(0, "int32"), [split, r, c, ramp(0)])

    def _word_products(self, acc, tiles, rows, block, w, word_index, split_of) -> None:
        """acc += the byte products of word `w` of activation block `block` (the tiles' word `word_index`), per
        byte position, row and tile: into split `split_of(product)` of each cell, as int16 pairs (`sums_pairs`) or
        int32 dot products (`dot_bytes`)."""
        codes = self.codes
        pairs = sums_pairs(self.level, byte_bits(self.spec), self.dec.signed)
        words = self._words(tiles, word_index)
        for s in range(codes.positions):
            product = w * codes.positions + s
            quads = [tirx.Broadcast(load(self.a, row, block * QUADS + product), LANES) for row in rows]
            for c, word in enumerate(words):
                unsigned = self._codes_at(word, s)
                for r, quad in enumerate(quads):
                    cell = [split_of(product), r, c, ramp(0)]
                    if pairs:
                        total = add_byte_pairs(load(acc, *cell), unsigned, quad, self.level)
                    else:
                        total = dot_bytes(load(acc, *cell), unsigned, quad, self.level, byte_bits(self.spec),
                                          self.dec.signed)
                    T.buffer_store(acc, total, cell)

    def _scale_into_y(self, y, factors, rows, block, width: int, sums) -> None:
        """y += (scale·alpha·d)·C for each row and tile of a block, C = sums(r, c) (its int32 sums, 16 lanes)."""
        for r, row in enumerate(rows):
            d = tirx.Broadcast(load(self.xscale, row, block), LANES)
            for c in range(width):
                term = tirx.Cast("float32x16", sums(r, c)) * (load(factors, 0, c, ramp(0)) * d)
                T.buffer_store(y, load(y, r, c, ramp(0)) + term, [r, c, ramp(0)])

    def _paired_block(self, y, acc, factors, tiles, rows, block) -> None:
        """One activation block by row pairs (`vnni.pair_instruction`): per two products (8 k's) and tile, the codes of
        each column pair side by side (`pair_operands`), and per row pair (an odd last row paired with itself) the two
        rows' 8 activation bytes, which smmla multiplies into the pair's 2x2 int32 sums; cells 2p and 2p+1 of `acc`
        hold row pair p's sums for the tile's columns 0-7 and 8-15, in smmla's order (`paired_row_lanes`); then
        y += (scale·alpha·d)·C per row (`_scale_into_y`)."""
        width = len(tiles)
        pairs = [(rows[i], rows[min(i + 1, len(rows) - 1)]) for i in range(0, len(rows), 2)]
        for cell in range(2 * len(pairs)):
            for c in range(width):
                T.buffer_store(acc, splat(0, "int32"), [0, cell, c, ramp(0)])
        products = [(w, s) for w in range(self.codes.words) for s in range(self.codes.positions)]
        words = {}
        for first in range(0, len(products), 2):
            operands = []
            for c in range(width):
                codes = []
                for w, s in products[first:first + 2]:
                    if w not in words:
                        words[w] = self._words(tiles, block * self.codes.words + w)
                    codes.append(self._codes_at(words[w][c], s))
                operands.append(pair_operands(*codes))
            for p, pair in enumerate(pairs):
                activations = tirx.Shuffle([load(self.a, row, ramp(block * QUADS + first, 2)) for row in pair],
                                           list(range(4)))
                for c in range(width):
                    for half in (0, 1):
                        cell = [0, 2 * p + half, c, ramp(0)]
                        T.buffer_store(acc, multiply_pairs(load(acc, *cell), activations, operands[c][half]), cell)
        self._scale_into_y(y, factors, rows, block, width, lambda r, c: tirx.Shuffle(
            [load(acc, 0, r // 2 * 2, c, ramp(0)), load(acc, 0, r // 2 * 2 + 1, c, ramp(0))], paired_row_lanes(r % 2)))


def pair_operands(first, second):
    """smmla's column operands of a tile: per column pair (j, j+1) its 8 code bytes per column, the 4 of product
    `first` then the 4 of `second` (int32 lanes first[j], second[j], first[j+1], second[j+1]), as two 16-lane
    vectors (columns 0-7 and 8-15; a zip per 4 lanes)."""
    order = [lane for j in range(0, LANES, 2) for lane in (j, LANES + j, j + 1, LANES + j + 1)]
    return [tirx.Shuffle([first, second], order[half * LANES:(half + 1) * LANES]) for half in (0, 1)]


def multiply_pairs(acc, activations, operands):
    """acc + smmla per 4 lanes (a column pair): the 2x8 activation bytes of a row pair (`activations`, int32x4: two
    quads per row) times each column pair's 8x2 code bytes (`pair_operands`), into its 2x2 int32 sums (row-major:
    the first row's two columns, then the second's), signed bytes times signed bytes."""
    rows = tirx.reinterpret("int8x16", activations)
    return by_parts(4, lambda part, columns: tirx.call_llvm_pure_intrin(
        "int32x4", "llvm.aarch64.neon.smmla", part, rows, tirx.reinterpret("int8x16", columns)), acc, operands)


def paired_row_lanes(row: int) -> list[int]:
    """Lanes of a row pair's sums (two 16-lane cells: columns 0-7, then 8-15, 2x2 blocks per column pair) that
    hold row `row` (0 or 1) of the pair, by column."""
    return [(j // 8) * LANES + 4 * (j % 8 // 2) + 2 * row + j % 2 for j in range(LANES)]


def sums_pairs(level: IsaLevel, bits: int, signed_codes: bool) -> bool:
    """Whether a block's byte products add up as vpmaddubsw's int16 pairs, widened to int32 once per block by a
    vpmaddwd (`add_byte_pairs`, `widen_pairs`): without VNNI, for unsigned codes of at most 4 bits, whose pairs
    (at most 2·15·127) summed over a block's 8 products stay below 2^15."""
    return dot_instruction(level) == "vpmaddubsw" and bits <= 4 and not signed_codes


def add_byte_pairs(pairs, unsigned, signed, level: IsaLevel):
    """pairs + vpmaddubsw(unsigned, signed): int16 sums of adjacent byte products (held as 16 int32 lanes), on 16
    lanes with AVX-512, per 8 with AVX2."""
    pairs_name, _, lanes = _AVX512_MADD if level.vector_bytes >= 64 else _AVX2_MADD
    product = by_parts(lanes, lambda *parts: tirx.reinterpret(f"int32x{lanes}", tirx.call_llvm_pure_intrin(
        f"int16x{2 * lanes}", pairs_name, *(tirx.reinterpret(f"int8x{4 * lanes}", part) for part in parts))),
        unsigned, signed)
    total = tirx.reinterpret("int16x32", pairs) + tirx.reinterpret("int16x32", product)
    return tirx.reinterpret("int32x16", total)


def widen_pairs(pairs, level: IsaLevel):
    """The int32 lanes of `add_byte_pairs`'s int16 pair sums: vpmaddwd by ones."""
    _, words_name, lanes = _AVX512_MADD if level.vector_bytes >= 64 else _AVX2_MADD
    return by_parts(lanes, lambda part: tirx.call_llvm_pure_intrin(
        f"int32x{lanes}", words_name, tirx.reinterpret(f"int16x{2 * lanes}", part), splat(1, "int16", 2 * lanes)),
        pairs)


def dot_bytes(acc, unsigned, signed, level: IsaLevel, bits: int, signed_codes: bool = False):
    """acc + Σ of the 4 byte products per int32 lane (16 lanes): bytes of `unsigned` (codes of `bits` bits; signed
    bytes where `signed_codes`, see `reads_signed_bytes`) times signed bytes of `signed` (activation codes within
    ±127), exact.  AVX512-VNNI: one vpdpbusd; AVX-VNNI: one per 8 lanes; aarch64: one sdot per 4 lanes (signed
    times signed: codes of fewer than 8 bits are below 16 either way); without VNNI, vpmaddubsw (pairs into int16)
    and vpmaddwd (the pairs into int32), on 16 lanes with AVX-512, per 8 with AVX2.  vpmaddubsw's pairs would saturate
    for unsigned 8-bit codes: AVX2 multiplies signed codes s as |s| times q with the sign of s (vpsignb; 2·128·127 fits
    int16), AVX-512 (no vpsignb) 8-bit codes as two nibbles, the high ones times 16."""
    if dot_instruction(level) == "sdot":
        return _signed_dot_bytes(acc, unsigned, signed)
    if level.vector_bytes >= 64:
        if "avx512_vnni" in level.features:
            return tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc,
                                              tirx.reinterpret("int8x64", unsigned),
                                              tirx.reinterpret("int8x64", signed))
        return _multiply_add_bytes(acc, unsigned, signed, bits, _AVX512_MADD)
    if "avx_vnni" in level.features:
        def half(part, codes, activations):
            return tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", part,
                                              tirx.reinterpret("int8x32", codes),
                                              tirx.reinterpret("int8x32", activations))
    elif signed_codes:
        half = _multiply_add_signed_bytes
    else:
        def half(part, codes, activations):
            return _multiply_add_bytes(part, codes, activations, bits, _AVX2_MADD)
    return by_parts(8, half, acc, unsigned, signed)


# (vpmaddubsw, vpmaddwd) intrinsics and the int32 lanes they work on
_AVX512_MADD = ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512", 16)
_AVX2_MADD = ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd", 8)


def _signed_dot_bytes(acc, codes, activations):
    """acc + Σ of the 4 byte products per lane of signed codes and activations: one NEON sdot per 4 lanes."""
    return by_parts(4, lambda part, quarter_codes, quarter_activations: tirx.call_llvm_pure_intrin(
        "int32x4", "llvm.aarch64.neon.sdot", part, tirx.reinterpret("int8x16", quarter_codes),
        tirx.reinterpret("int8x16", quarter_activations)), acc, codes, activations)


def _multiply_add_signed_bytes(acc, codes, activations):
    """acc + Σ of 4 byte products per lane (8 lanes) of signed codes and activations: vpmaddubsw of |codes| (as
    unsigned bytes: |-128| is 128) and the activations with the codes' signs (vpsignb: negated where a code is
    negative, 0 where it is 0), then vpmaddwd by ones."""
    pairs_name, words_name, lanes = _AVX2_MADD
    signed = tirx.reinterpret("int8x32", codes)
    magnitudes = tirx.call_llvm_pure_intrin("int8x32", "llvm.abs", signed, tirx.const(False, "bool"))
    signs = tirx.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", tirx.reinterpret("int8x32", activations),
                                       signed)
    pairs = tirx.call_llvm_pure_intrin("int16x16", pairs_name, magnitudes, signs)
    return acc + tirx.call_llvm_pure_intrin(f"int32x{lanes}", words_name, pairs, splat(1, "int16", 2 * lanes))


def _multiply_add_bytes(acc, codes, activations, bits: int, madd: tuple):
    """acc + Σ of 4 byte products per lane by vpmaddubsw and vpmaddwd (`madd`), 8-bit codes as two nibbles."""
    pairs_name, words_name, lanes = madd
    nibbles = [(codes, 1)] if bits <= 4 else [
        (tirx.bitwise_and(codes, u32(0x0F0F0F0F, lanes)), 1),
        (tirx.bitwise_and(tirx.shift_right(codes, u32(4, lanes)), u32(0x0F0F0F0F, lanes)), 16)]
    for nibble, weight in nibbles:
        pairs = tirx.call_llvm_pure_intrin(f"int16x{2 * lanes}", pairs_name,
                                           tirx.reinterpret(f"int8x{4 * lanes}", nibble),
                                           tirx.reinterpret(f"int8x{4 * lanes}", activations))
        acc = acc + tirx.call_llvm_pure_intrin(f"int32x{lanes}", words_name, pairs, splat(weight, "int16", 2 * lanes))
    return acc
