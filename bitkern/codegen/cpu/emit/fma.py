"""The FMA kernel for few rows: y = x · dequant(W)ᵀ with integer codes converted to float32 in registers.

The lookup kernel's structure (`emit.lut`: tasks of tile16 tiles per thread, x widened to float32 per chunk, per
group the scale and zero point folded in, the output stage) with its tables replaced: for every word of 16 rows,
each code position is masked in place and converted to float32 (u·2^(bits·p) for position p, x scaled by
2^(-bits·p) in the prologue: no shift but the top position's; two's complement codes have their sign bits flipped
once per word, u = c + 2^(bits-1), and that many XS come off per group) and multiplied into every row's sums with
x[k] broadcast: 8 codes of 4 bits, 4 of 8 bits per word, two vector operations and one multiply-add per row each.
A word of bfloat16 codes holds two k's: each is its float32 value once moved to the top half (a shift, or a mask).
It serves integer types (and zero-point codes), where the lookup kernel spends three instructions per 8 lanes on a
16-entry table with 256-bit vectors.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.matmul import Matmul
from ....ttype import get
from ....ttype.types import INT
from ...template import ANY_ROWS
from ..fma import FmaConfig, looks_up
from ..isa import IsaLevel
from ..kernel import bfloat16_codes
from . import lut
from .tir import LANES, load, lookup16, prefetch_ahead, ramp, registers, splat, u32


def build(spec: Matmul, n: int, k: int, config: FmaConfig, threads: int, rows: tuple[int, int], level: IsaLevel,
          name: str = "main"):
    """The PrimFunc for a [N, K] weight in the tile16 layout and M in `rows` (within 1..4, or any with config.rows),
    split into `threads` parallel chunks; arguments as the lookup kernel's (`emit.lut.build`) without the value
    table."""
    lut.check_rows(threads, rows, ANY_ROWS if config.rows else lut.MAX_ROWS)
    return _Builder(spec, n, k, config, threads, rows, level).build(name)


class _Builder(lut.Builder):
    def __init__(self, *args):
        super().__init__(*args)
        # 4-bit code books (nf4, fp4, MX, NVFP4): each code's value looked up in the value table; integer codes
        # converted
        self.takes_values = looks_up(self.spec)
        self.bfloat16 = bfloat16_codes(self.ttype)  # codes that are their float32 values' top halves
        self.signed = get(self.spec.weight_dtype).kind == INT and self.spec.zero_mode == "none" \
            and not self.takes_values
        self.top = self.per_word - 1  # the code position at the word's top bits

    def _needs_group_sums(self) -> bool:
        return self.signed or super()._needs_group_sums()

    def _group_offset(self, tile_index, g):
        """Signed codes are read with their sign bit flipped (u = c + 2^(bits-1)): that many XS per group come off."""
        if self.signed:
            return splat(float(1 << (self.bits - 1)), "float32")
        return super()._group_offset(tile_index, g)

    def _allocate_tables(self) -> None:
        """No tables: the main loop reads the widened x."""

    def _tabulate(self, x, first_tiles: list) -> None:
        """x scaled by 2^(-bits·p) for each k at code position p of its word below the top one: a code masked in
        place holds u·2^(bits·p), whose product with it is u·x exactly (scaling by a power of two is exact), so the
        main loop needs no shift but the top position's."""
        slot_of = {self._k_in_word(slot): slot for slot in range(self.per_word)}
        factors = [1.0 if self.takes_values or self.bfloat16 or slot_of[i % self.per_word] == self.top
                   else 2.0 ** -(self.bits * slot_of[i % self.per_word]) for i in range(LANES)]
        pattern = tirx.Shuffle([tirx.const(factor, "float32") for factor in factors], list(range(LANES)))
        vectors = self.k_pad // LANES
        with T.serial(0, self.chunk_rows * vectors) as task:
            row, k0 = tirx.floordiv(task, vectors), tirx.floormod(task, vectors) * LANES
            T.buffer_store(x, load(x, row, ramp(k0)) * pattern, [row, ramp(k0)])
        self.widened = x

    def _sums_buffer(self, rows: int):
        """Registers for a group's sums of every row and tile: each word is decoded once for all rows."""
        return registers((rows, self.cfg.n_tiles), "float32")

    def _group_sums(self, gacc, tiles, rows: int, g, fold, first) -> None:
        """Σ_k u · x[first + row, k] over group g per row and tile, handed to fold(row, c, sums)."""
        for row in range(rows):
            for c in range(len(tiles)):
                T.buffer_store(gacc, splat(0.0, "float32"), [row, c, ramp(0)])
        table = load(self.values, ramp(0)) if self.takes_values else None
        with T.serial(0, self.group_words) as w:
            word_index = g * self.group_words + w
            for c, tile_index in enumerate(tiles):
                prefetch_ahead(self.qweight, tile_index, word_index, self.cfg.prefetch, len(tiles))
                word = load(self.qweight, tile_index, word_index, ramp(0))
                if self.signed:
                    word = tirx.bitwise_xor(word, splat(_sign_bits(self.bits), "int32"))
                for slot in range(self.per_word):
                    codes = self._codes(word, slot, table)
                    k_index = word_index * self.per_word + self._k_in_word(slot)
                    for row in range(rows):
                        x = tirx.Broadcast(load(self.widened, first + row, k_index), LANES)
                        T.buffer_store(gacc, load(gacc, row, c, ramp(0)) + codes * x, [row, c, ramp(0)])
        for row in range(rows):
            for c in range(len(tiles)):
                fold(row, c, load(gacc, row, c, ramp(0)))

    def _codes(self, word, slot: int, table):
        """The codes at position `slot` of 16 words as float32 lanes: looked up in `table` (a 4-bit code book: the
        word shifted down, `lookup16` reads the low 4 bits), else as unsigned integers, masked in place
        (u·2^(bits·slot), exact in float32 and within int32) below the top position, shifted down at the top;
        bfloat16 codes as the float32 whose top half they are."""
        if self.bfloat16:
            top = tirx.bitwise_and(word, splat(-(1 << 16), "int32")) if slot == self.top \
                else tirx.shift_left(word, splat(16, "int32"))
            return tirx.reinterpret("float32x16", top)
        if table is not None:
            index = word if slot == 0 else tirx.shift_right(tirx.reinterpret("uint32x16", word), u32(4 * slot))
            return lookup16(table, tirx.reinterpret("int32x16", index), self.level)
        if slot == self.top:
            moved = tirx.shift_right(tirx.reinterpret("uint32x16", word), splat(32 - self.bits, "uint32"))
            return tirx.Cast("float32x16", tirx.reinterpret("int32x16", moved))
        mask = ((1 << self.bits) - 1) << (self.bits * slot)
        return tirx.Cast("float32x16", tirx.bitwise_and(word, splat(mask, "int32")))


def _sign_bits(bits: int) -> int:
    """The top bit of every `bits`-bit field of a 32-bit word, as a signed int32 (flips two's complement codes
    to offset binary)."""
    pattern = sum(1 << (field + bits - 1) for field in range(0, 32, bits))
    return pattern - (1 << 32) if pattern >= 1 << 31 else pattern
