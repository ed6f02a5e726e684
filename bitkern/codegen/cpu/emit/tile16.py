"""The tile16 builder: what the AMX and AVX512-BF16 kernels share, emitted with TVM's IR builder
(`Tile16Builder`; `emit.amx` and `emit.dot` add the tile products).

Per parallel task (16·n_tiles output columns, a chunk of rows):
  prologue  x -> bf16 planes A[plane, M, K/2] (one plane for bf16, hi+lo for fp16, three for fp32, so
            the planes sum to x) and per-group row sums XS[M, groups] (for zero points and offsets); for a
            convolution spec the rows are gathered from the NHWC image here (implicit GEMM); for a spec with a
            norm prologue each row's statistics come first and the planes are built from x̂ (`ops.expr.apply_norm`);
  stages    the codes of a stage (a few 32-deep k-steps) are decoded with vector ops into bf16 B-tile rows
            in L1, which the subclass's tile products consume; C accumulates one quantization group;
  epilogue  per group, in float32: y += scale · (alpha·C + beta·XS), where C = Σ x·d over the group's
            decoded values d, and alpha/beta fold the decode offset and the zero point exactly.
Decode strategies: "affine" for integer types (d = bf16(128 + u) by OR-ing the code into 0x4300, one
ternary-logic op per 32 codes; 2-bit codes are taken where they lie in the word, at bit 0, 2 or 4, into the
power of two whose mantissa puts them at weight 1 — d = 2^(7-at) + u — so one shift serves three k pairs,
and per-group activation sums XD fold the smaller offsets back), "lut" for any type (a 32-entry bf16 table
through vpermw), "convert" for 8-bit integer codes (each code extended to int32, converted to float32 and
truncated to bf16, exact: one B tile per 16 columns where "affine" multiplies two nibbles), "raw" for bfloat16
codes (a word holds the bf16 pair of its k pair: the B-tile row as it is).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.expr import apply_epilogue, tap_source
from ....ops.matmul import Matmul
from ....ttype import effective_group_size, get
from ....ttype.types import INT, UINT
from ..layout import AMX_TILE_ROWS, padded_k
from ..matrix import PLANES, nibbles, step_depth
from . import nonfinite
from .groups import GroupArguments, biased, write_output
from .norm import NormPrologue
from .tir import (LANES, bf16_bits, bf16_value, horizontal_sum, load, prefetch_ahead, prim_func, ramp, splat,
                  to_float32, u32)

SMALL_M_ROWS = AMX_TILE_ROWS
_MANTISSA_BITS = 7  # of bfloat16: a code u < 2^(7-at) OR-ed in at bit `at` of 2^(7-at) gives 2^(7-at) + u
# k pairs an affine decode takes from one shifted word (each position costs a mask and a base register).
# Measured on Zen 4, 4096x4096 M=1: 2-bit codes 3 per shift (all the mantissa holds), 5-7% faster than 1;
# 1-bit codes 7 or 3 per shift, 2.2x and 1.1x slower (spills: a word feeds 16 activation broadcasts).
_PAIRS_PER_SHIFT = {2: 3}


@dataclass(frozen=True)
class _Decode:
    """How the B tile elements d relate to the weight value v: v = Σ_nibble alpha[nibble]·d + offset, d the
    decode of the code at bit 0 (128 + u for affine).
    xor: bits flipped in each code (per nibble: low, high) to make two's complement offset binary."""

    strategy: str
    bits: int
    signed: bool = False  # convert: the codes are two's complement
    xor: tuple = (0,)
    alpha: tuple = (1.0,)
    offset: float = 0.0

    def positions(self, rows: int) -> tuple:
        """(shift, at) of each of a word's `rows` k pairs: its codes (bit j·bits of each 16-bit half) sit at
        bit `at` of the word shifted right by `shift`.  Affine 2-bit codes are taken anywhere in the mantissa
        (at 0, 2 or 4), so one shift serves 3 k pairs; other codes are shifted to bit 0."""
        per_shift = _PAIRS_PER_SHIFT.get(self.bits, 1) if self.strategy == "affine" else 1
        return tuple((j // per_shift * per_shift * self.bits, j % per_shift * self.bits) for j in range(rows))


def _bf16_power_of_two(exponent: int) -> int:
    """The bfloat16 bit pattern of 2^exponent (0x4300 for 128)."""
    return (127 + exponent) << _MANTISSA_BITS


def _decode_for(spec: Matmul, strategy: str) -> _Decode:
    ttype = get(spec.weight_dtype)
    if strategy == "lut":
        return _Decode("lut", ttype.bits)
    if strategy == "convert":
        return _Decode("convert", 8, signed=ttype.kind == INT)
    if strategy == "raw":
        return _Decode("raw", 16)
    if ttype.bits == 8:  # code = 16·h + l: v = 16·(d_hi - 128 - 8·signed) + (d_lo - 128)
        flip = 8 if ttype.kind == INT else 0
        return _Decode("affine", 8, xor=(0, flip), alpha=(1.0, 16.0), offset=-128.0 - 16.0 * (128 + flip))
    if ttype.kind == UINT:  # d = 128 + code
        return _Decode("affine", ttype.bits, offset=-128.0)
    if ttype.bits == 1:  # ±1: v = 2·code - 1 = 2d - 257
        return _Decode("affine", 1, alpha=(2.0,), offset=-257.0)
    half = 1 << (ttype.bits - 1)  # two's complement: u = code ^ half = v + half, d = 128 + u
    return _Decode("affine", ttype.bits, xor=(half,), offset=-128.0 - half)


class _Shape:
    """Static sizes of one kernel."""

    def __init__(self, spec: Matmul, n: int, k: int, stage_steps: int):
        group = effective_group_size(spec.group_size, k)
        self.bits = get(spec.weight_dtype).bits
        self.n, self.k = n, k
        self.k_pad = padded_k(k, self.bits)
        self.depth = step_depth(group, k)
        self.per_channel = group == k
        self.kgroup = self.k_pad if self.per_channel else group
        self.groups = self.k_pad // self.kgroup
        self.scale_groups = k // group
        self.group_steps = self.kgroup // self.depth
        steps = self.k_pad // self.depth
        self.stage_steps = _stage_steps(self.group_steps, steps, stage_steps)
        self.stages = steps // self.stage_steps
        self.n_tiles = -(-n // AMX_TILE_ROWS)
        self.words = self.k_pad * self.bits // 32
        self.words_per_step = self.depth * self.bits // 32
        self.rows_per_word = 16 // self.bits  # B tile rows (k pairs) one word yields
        self.pairs = self.k_pad // 2
        self.planes = PLANES[spec.activation_dtype]


def _stage_steps(group_steps: int, steps: int, wanted: int) -> int:
    """Steps per pipeline stage, near `wanted`: a divisor of the group's steps, or a multiple of them that
    divides all the steps."""
    if group_steps > wanted:
        return max(d for d in range(1, wanted + 1) if group_steps % d == 0)
    multiples = [m * group_steps for m in range(1, wanted // group_steps + 1) if steps % (m * group_steps) == 0]
    return max(multiples)


class Tile16Builder(abc.ABC):
    """Emits one kernel of a tile16 matrix template with TVM's IRBuilder: the prologue, the decode of B-tile rows,
    the per-group epilogue and the output; a subclass emits each task's products (`task`) and says how its
    activation planes are laid out (`plane_pitch`, `padded_rows`) and what scope the body needs (`body_scope`).
    The spec and configuration are checked by the template (`matrix.MatrixTemplate.program`)."""

    def __init__(self, spec: Matmul, n: int, k: int, config):
        self.spec, self.cfg = spec, config
        self.s = _Shape(spec, n, k, config.stage_steps)
        self.ttype = get(spec.weight_dtype)
        if spec.geometry is None:
            self.batch, self.m = None, tirx.Var("M", "int32")
        else:  # a convolution: M = B · output pixels
            self.batch = tirx.Var("B", "int32")
            self.m = self.batch * spec.geometry.pixels
        self.x_rows = self.m  # the rows of x the prologue reads (a grouped kernel's may differ from M)
        self._set_decode(config)

    def _set_decode(self, config) -> None:
        """The decode of the configuration's strategy (`dec`), the B tiles it makes per 16 columns and step
        (`nibbles`) and, per k pair j of a word, 128 - 2^(7-at): what its decoded values lack of the 128 offset
        the epilogue folds (`offset_shortfall`; None when every code sits at bit 0)."""
        self.dec = _decode_for(self.spec, config.decode)
        self.nibbles = nibbles(self.spec, config.decode)
        shortfall = [128.0 - 2.0 ** (_MANTISSA_BITS - at) for _, at in self.dec.positions(self.s.rows_per_word)]
        self.offset_shortfall = shortfall if any(shortfall) else None

    @abc.abstractmethod
    def task(self, rows, block, row0) -> None:
        """The products of column block `block` for the row chunk from row0, into y (rows: the padded rows)."""

    @abc.abstractmethod
    def plane_pitch(self) -> int:
        """int32 words (bf16 pairs) from one activation-plane row to the next."""

    @abc.abstractmethod
    def padded_rows(self):
        """Rows of the activation planes: M rounded up to the template's row blocks."""

    @abc.abstractmethod
    def body_scope(self):
        """A scope around the function body (the AVX512-BF16 kernels import LLVM code in one)."""

    def build(self, name: str):
        """The kernel's PrimFunc, named `name`."""
        return prim_func(name, self._arguments, self._body)

    def _body(self) -> None:
        with self.body_scope():
            if self.cfg.small_m:
                T.evaluate(tirx.call_intrin("int32", "tirx.assume", self.m <= SMALL_M_ROWS))
            rows = self.padded_rows()
            self._allocate_activations(rows)
            self.nonfinite = T.alloc_buffer((rows, LANES), "uint32")  # rows with ±Inf or NaN in x
            if self.norm is not None:
                self.norm.allocate(rows)
            if not self.cfg.chunk_prologue:
                self._prologue(rows)
            self._main(rows)

    def _allocate_activations(self, rows) -> None:
        """The prologue's outputs: the activation planes A, the group sums XS and, where codes sit above bit 0,
        XD[row, group] = Σ x·shortfall over the group's k's."""
        self.a = T.alloc_buffer((self.s.planes, rows, self.plane_pitch()), "int32")
        self.xs = T.alloc_buffer((rows, self.s.groups), "float32")
        self.xd = None
        if self.offset_shortfall is not None:
            self.xd = T.alloc_buffer((rows, self.s.groups), "float32")

    # -- arguments -------------------------------------------------------------------------------------
    def _arguments(self) -> None:
        s, spec = self.s, self.spec
        per_tile = (s.n_tiles, s.scale_groups, LANES)
        g = spec.geometry
        x_shape = (self.m, s.k) if g is None else (self.batch, g.height, g.width, g.in_channels)
        self.x = T.arg("x", T.Buffer(x_shape, spec.activation_dtype))
        self.qweight = T.arg("qweight", T.Buffer((s.n_tiles, s.words, LANES), "int32"))
        self.group_args = GroupArguments.declare(spec, per_tile)
        self._declare_constants()
        self.norm = NormPrologue.declare(spec, s.k)
        self.bias = T.arg("bias", T.Buffer((s.n,), "float32")) if spec.bias else None
        out_n = spec.out_features(s.n)
        self.residual = T.arg("residual", T.Buffer((self.m, out_n), spec.output_dtype)) if spec.residual else None
        self.y = T.arg("y", T.Buffer((self.m, out_n), spec.output_dtype))

    def _declare_constants(self) -> None:
        """The template's constant arguments (`CpuTemplate.constants`), after the weight's: a code book's table."""
        self.lut = T.arg("lut", T.Buffer((LANES,), "int32")) if self.dec.strategy == "lut" else None

    # -- prologue: activation planes and group sums -------------------------------------------------
    def _prologue(self, rows) -> None:
        """Every row's planes before the main loop (one parallel region; few rows: serial, as waking the
        thread pool costs more than converting them)."""
        rows_loop = T.serial if self.cfg.small_m else T.parallel
        with rows_loop(0, rows) as row:
            self._prologue_row(row)

    def _prologue_row(self, row) -> None:
        """A-plane row `row` and its group sums: x's row (or the gathered pixel), zeros past M."""
        s = self.s
        full_chunks = s.k // 32  # chunks of 16 pairs that lie inside K
        with T.If(row < self.x_rows):
            with T.Then():
                if self.spec.geometry is not None:
                    self._gather_row(row)
                else:
                    if self.norm is not None:
                        self.norm.statistics(row, lambda index: self._as_float(load(self.x, row, index)))
                    with T.serial(0, full_chunks) as chunk:
                        self._store_planes(row, chunk, *self._x_pairs(row, chunk))
                    if s.k_pad > full_chunks * 32:
                        self._prologue_tail(row, full_chunks)
            with T.Else():
                with T.serial(0, s.pairs // LANES) as chunk:
                    self._store_planes(row, chunk, splat(0.0, "float32"), splat(0.0, "float32"))

    def _prologue_tail(self, row, chunk) -> None:
        """The last 32-k chunk when K is not a multiple of 32: scalar loads, zero past K."""
        s = self.s
        values = [self._x_at(row, chunk * 32 + i) if chunk * 32 + i < s.k else
                  tirx.const(0.0, "float32") for i in range(32)]
        self._store_planes(row, chunk, *_by_parity(values))

    def _x_pairs(self, row, chunk) -> tuple:
        """The (even k, odd k) float32x16 vectors of x̂'s 32-k chunk `chunk`: x (and the norm's vectors) loaded as two
        contiguous halves and split by a shuffle (a strided load gathers element by element); bfloat16 x is
        shuffled as its bits (TVM legalizes bfloat16 vector shuffles to float32 ones)."""
        def halves(buffer, *row_index):
            return [load(buffer, *row_index, ramp(chunk * 32 + half * LANES)) for half in (0, 1)]

        def split(values, parity):
            return tirx.Shuffle(values, list(range(parity, 2 * LANES, 2)))

        x = halves(self.x, row)
        if self.spec.activation_dtype == "bfloat16":
            x = [tirx.reinterpret("uint16x16", value) for value in x]
        pairs = []
        for parity in (0, 1):
            value = self._as_float(split(x, parity))
            pairs.append(value if self.norm is None else
                         self.norm.apply(row, lambda vector: split(halves(vector), parity), value))
        return tuple(pairs)

    def _x_at(self, row, index):
        """x[row, index] as float32 (index a scalar or a ramp), normalized for a norm prologue (x̂)."""
        value = self._as_float(load(self.x, row, index))
        return value if self.norm is None else self.norm.apply(row, lambda vector: load(vector, index), value)

    def _gather_row(self, row) -> None:
        """A-plane row `row` of a convolution: output pixel (b, oh, ow) reads x[b, ih, iw, c] for each tap
        (kh, kw) and channel c, in the weight's (kh, kw, c) order; 0 outside the image and past K."""
        if self.spec.geometry.in_channels % 32 == 0:
            self._gather_channel_runs(row)
        else:
            self._gather_staged(row)

    def _gather_channel_runs(self, row) -> None:
        """Each 32-k chunk is 32 channels of one tap: two vector loads, or zeros outside the image."""
        g = self.spec.geometry
        runs = g.in_channels // 32
        zero = splat(0.0, "float32")
        with T.serial(0, g.kernel[0] * g.kernel[1]) as tap:
            where, inside = tap_source(g, row, tap)
            with T.serial(0, runs) as run:
                with T.If(inside):
                    with T.Then():
                        even, odd = (self._as_float(load(self.x, *where, tirx.Ramp(run * 32 + p, 2, LANES)))
                                     for p in (0, 1))
                        self._store_planes(row, tap * runs + run, even, odd)
                    with T.Else():
                        self._store_planes(row, tap * runs + run, zero, zero)

    def _gather_staged(self, row) -> None:
        """Channel runs straddle 32-k chunks: stage the row in float32 tap by tap, then split it in chunks."""
        g, s = self.spec.geometry, self.s
        staged = T.alloc_buffer((s.k_pad,), "float32", scope="local", align=64)
        with T.serial(0, g.kernel[0] * g.kernel[1]) as tap:
            where, inside = tap_source(g, row, tap)
            with T.serial(0, g.in_channels) as c:
                value = tirx.if_then_else(inside, self._as_float(load(self.x, *where, c)), tirx.const(0.0, "float32"))
                T.buffer_store(staged, value, [tap * g.in_channels + c])
        with T.serial(s.k, s.k_pad) as k_index:
            T.buffer_store(staged, tirx.const(0.0, "float32"), [k_index])
        with T.serial(0, s.k_pad // 32) as chunk:
            even, odd = (load(staged, tirx.Ramp(chunk * 32 + p, 2, LANES)) for p in (0, 1))
            self._store_planes(row, chunk, even, odd)

    def _x_value(self, row, j):
        """X̂[row, j] of the GEMM as float32: x[row, j] (normalized for a norm prologue), or for a convolution the
        pixel its tap reads (0 outside the image)."""
        g = self.spec.geometry
        if g is None:
            return self._x_at(row, j)
        where, inside = tap_source(g, row, tirx.floordiv(j, g.in_channels))
        return tirx.if_then_else(inside, self._as_float(load(self.x, *where, tirx.floormod(j, g.in_channels))),
                                 tirx.const(0.0, "float32"))

    def _as_float(self, value):
        """Loaded x values as float32."""
        return to_float32(value, self.spec.activation_dtype)

    def _store_planes(self, row, chunk, even, odd) -> None:
        """A[plane, row, 16·chunk + i] = bf16 pair of plane `plane` of x[2i], x[2i+1]; XS sums their total (and
        XD, weighted by the offset shortfall of their k pair).  Non-finite x count as 0 here and flag the row
        (see `nonfinite`)."""
        (even, even_flags), (odd, odd_flags) = nonfinite.finite_part(even), nonfinite.finite_part(odd)
        nonfinite.note(self.nonfinite, row, chunk == 0, tirx.bitwise_or(even_flags, odd_flags))
        total_even = total_odd = None
        for plane in range(self.s.planes):
            bits_even, bits_odd = bf16_bits(even), bf16_bits(odd)
            word = tirx.bitwise_or(bits_even, tirx.shift_left(bits_odd, u32(16)))
            T.buffer_store(self.a, tirx.reinterpret("int32x16", word), [plane, row, ramp(chunk * LANES)])
            kept_even, kept_odd = bf16_value(bits_even), bf16_value(bits_odd)
            total_even = kept_even if total_even is None else total_even + kept_even
            total_odd = kept_odd if total_odd is None else total_odd + kept_odd
            even, odd = even - kept_even, odd - kept_odd
        pair_sums = total_even + total_odd
        self._add_to_group_sums(self.xs, row, chunk, pair_sums)
        if self.xd is not None:
            per_lane = [self.offset_shortfall[i % self.s.rows_per_word] for i in range(LANES)]
            weights = tirx.Shuffle([tirx.const(w, "float32") for w in per_lane], list(range(LANES)))
            self._add_to_group_sums(self.xd, row, chunk, pair_sums * weights)

    def _add_to_group_sums(self, sums, row, chunk, pair_values) -> None:
        """sums[row, group] += Σ of a 32-k chunk's 16 pair values, per group (the group's first chunk sets it)."""
        parts = max(1, 32 // self.s.kgroup)  # 16-k groups (nvfp4) split a 32-k chunk in two
        for part in range(parts):
            width = LANES // parts
            part_sum = horizontal_sum(tirx.Shuffle([pair_values], list(range(part * width, (part + 1) * width))))
            k_start = chunk * 32 + part * (32 // parts)
            group = tirx.floordiv(k_start, self.s.kgroup)
            first = tirx.floormod(k_start, self.s.kgroup) == 0
            T.buffer_store(sums, tirx.Select(first, part_sum, load(sums, row, group) + part_sum), [row, group])

    # -- main loop ---------------------------------------------------------------------------------------
    def _main(self, rows) -> None:
        cfg = self.cfg
        blocks = -(-self.s.n_tiles // cfg.n_tiles)
        chunks = 1 if cfg.small_m else tirx.floordiv(rows + (cfg.m_chunk - 1), cfg.m_chunk)
        if cfg.chunk_prologue:  # a task per row chunk: its planes, then every column block over them
            with T.parallel(0, chunks) as chunk:
                row0 = chunk * cfg.m_chunk
                with T.serial(0, tirx.min(cfg.m_chunk, rows - row0)) as r:
                    self._prologue_row(row0 + r)
                with T.serial(0, blocks) as block:
                    self.task(rows, block, row0)
            return
        with T.parallel(0, blocks * chunks) as task:
            if cfg.small_m:
                self.task(rows, task, 0)
            else:
                self.task(rows, tirx.floordiv(task, chunks), tirx.floormod(task, chunks) * cfg.m_chunk)

    def _block_tiles(self, block) -> tuple[list, list]:
        """The column block's tile indices and whether each is its own (the last block repeats a tile)."""
        first_tile = block * self.cfg.n_tiles
        tiles = [tirx.min(first_tile + c, self.s.n_tiles - 1) for c in range(self.cfg.n_tiles)]
        return tiles, [first_tile + c < self.s.n_tiles for c in range(self.cfg.n_tiles)]

    def _decode_stage(self, gbuf, tiles, stage, slot) -> None:
        """Decode the codes of `stage` for the task's tiles into gbuf[slot] (bf16 B tiles)."""
        for i in range(self.s.stage_steps):
            for c in range(self.cfg.n_tiles):
                self._decode_tile(gbuf, tiles, stage, slot, i, c)

    def _decode_tile(self, gbuf, tiles, stage, slot, i, c) -> None:
        """Decode step i of `stage` for tile c into gbuf[slot, i, c] (a loop over the step's words)."""
        s = self.s
        with T.serial(0, s.words_per_step) as w:
            word_index = (stage * s.stage_steps + i) * s.words_per_step + w
            for j, nibble, row in self._decoded_word(tiles[c], word_index):
                T.buffer_store(gbuf, row, [slot, i, c, nibble, w * s.rows_per_word + j, ramp(0)])

    def _decoded_word(self, tile_index, word_index) -> list:
        """(k pair j within the word, nibble, bf16 B-tile row) for every row one weight word yields; the word
        `prefetch` words ahead is prefetched."""
        s, cfg = self.s, self.cfg
        prefetch_ahead(self.qweight, tile_index, word_index, cfg.prefetch, cfg.n_tiles)
        if self.dec.strategy == "raw":  # a word of bfloat16 codes is the B-tile row of its k pair
            return [(0, 0, load(self.qweight, tile_index, word_index, ramp(0)))]
        word = tirx.reinterpret("uint32x16", load(self.qweight, tile_index, word_index, ramp(0)))
        if self.dec.strategy == "convert":
            return [(j, 0, self._converted(word, j)) for j in range(s.rows_per_word)]
        rows, shifted = [], {}
        for j, (shift, at) in enumerate(self.dec.positions(s.rows_per_word)):
            if shift not in shifted:
                shifted[shift] = word if shift == 0 else tirx.shift_right(word, u32(shift))
            rows += [(j, nibble, self._decode_word(shifted[shift], nibble, at)) for nibble in range(self.nibbles)]
        return rows

    def _decode_word(self, shifted, nibble: int = 0, at: int = 0):
        """bf16 pairs for (k = 2j, 2j + 1) of 16 rows from a word whose codes for them sit at bit `at` (of
        8-bit codes: the low or high nibble): 2^(7-at) + u, as the code's bits fill that power of two's
        mantissa from the bit of weight 1."""
        dec = self.dec
        if dec.strategy == "lut":
            table = tirx.reinterpret("int16x32", load(self.lut, ramp(0)))
            picked = tirx.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512.permvar.hi.512", table,
                                                tirx.reinterpret("int16x32", shifted))
            return tirx.reinterpret("int32x16", picked)
        mask = ((1 << min(dec.bits, 4)) - 1) << at
        if nibble:
            shifted = tirx.shift_right(shifted, u32(4))
        code = tirx.bitwise_and(shifted, u32(mask | (mask << 16)))
        if dec.xor[nibble]:
            flip = dec.xor[nibble] << at
            code = tirx.bitwise_xor(code, u32(flip | (flip << 16)))
        base = _bf16_power_of_two(_MANTISSA_BITS - at)
        return tirx.reinterpret("int32x16", tirx.bitwise_or(code, u32(base | (base << 16))))

    def _converted(self, word, j: int):
        """bf16 pairs for (k = 2j, 2j + 1) of 16 rows from a word of 8-bit codes (k = 2j in byte j, 2j + 1 in
        byte 2 + j): each code shifted to the top byte and back (arithmetically for signed codes), converted
        to float32, whose upper half is the code's exact bf16."""
        lane = "int32" if self.dec.signed else "uint32"
        word = tirx.reinterpret(f"{lane}x{LANES}", word)
        halves = []
        for byte in (j, 2 + j):
            code = word if byte == 3 else tirx.shift_left(word, splat(24 - 8 * byte, lane))
            code = tirx.shift_right(code, splat(24, lane))
            halves.append(tirx.reinterpret("uint32x16", tirx.Cast("float32x16", code)))
        low = tirx.shift_right(halves[0], u32(16))
        return tirx.reinterpret("int32x16", tirx.bitwise_or(low, tirx.bitwise_and(halves[1], u32(0xFFFF0000))))

    def _group_edge(self, stage, i, start: bool):
        """Whether step i of `stage` starts (or ends) a quantization group: a bool, or a runtime test."""
        s = self.s
        if s.group_steps <= s.stage_steps:  # stages hold whole groups
            return i % s.group_steps == (0 if start else s.group_steps - 1)
        if i != (0 if start else s.stage_steps - 1):
            return False
        per_group = s.group_steps // s.stage_steps
        return tirx.floormod(stage, per_group) == (0 if start else per_group - 1)

    def _scale_group(self, group):
        """The scale group of quantization group `group` (padded groups read the last: their C = XS = 0)."""
        return 0 if self.s.per_channel else tirx.min(group, self.s.scale_groups - 1)

    def _group_factors(self, tile_index, scale_group, streams: int | None = None):
        """(scale, beta) lanes of one tile and group, prefetching the scales of groups ahead (past the tile's end,
        those of the tile `streams` on: the task's tiles read at once, default all); beta folds the decode offset and
        the zero point (None when there is neither)."""
        if not self.s.per_channel:
            self.group_args.prefetch(tile_index, scale_group, streams or self.cfg.n_tiles)
        scale = self.group_args.scale(tile_index, scale_group)
        if self.dec.offset == 0.0 and self.group_args.zeros is None:
            return scale, None
        beta = splat(self.dec.offset, "float32")
        if self.group_args.zeros is not None:
            beta = beta - self.group_args.zero(tile_index, scale_group)
        return scale, beta

    def _combine(self, nibble_sums: list, beta, row, group):
        """Σ_nibble alpha·C (+ beta·XS[row, group]): a row's group result before scaling (C + XD[row, group]
        where codes sit above bit 0)."""
        value = None
        if self.xd is not None:  # one nibble plane: C + XD is Σ x·(128 + u)
            nibble_sums = [nibble_sums[0] + tirx.Broadcast(load(self.xd, row, group), LANES)]
        for term, alpha in zip(nibble_sums, self.dec.alpha):
            term = term if alpha == 1.0 else term * splat(alpha, "float32")
            value = term if value is None else value + term
        if beta is not None:
            value = value + beta * tirx.Broadcast(load(self.xs, row, group), LANES)
        return value

    def _store_output(self, yacc, tiles, owned, row0, chunk_rows) -> None:
        """y = f(C + bias) (+ residual) for the task's rows and tiles (SwiGLU: each even tile is a gate tile, the
        next its up tile, `swiglu_rows`; they make one 16-column tile of y)."""
        s = self.s
        rows_here = self.m if self.cfg.small_m else tirx.max(tirx.min(chunk_rows, self.m - row0), 0)
        step = 2 if self.spec.epilogue == "swiglu" else 1
        with T.serial(0, rows_here) as r:  # the terms of non-finite x the prologue left out
            nonfinite.add_terms(yacc, r, tiles, self.nonfinite, row0 + r, s.k, self._x_value,
                                lambda tile, j: nonfinite.weight_lanes(self.spec, s.k, self.qweight, self.group_args,
                                                                       tile, j))
        with T.serial(0, rows_here) as r:
            for c in range(0, len(tiles), step):
                column = tiles[c] * LANES
                with T.If(owned[c]):
                    with T.Then():
                        if step == 2:
                            self._store_swiglu(yacc, r, c, row0, column)
                        elif s.n % LANES == 0:
                            self._store_vector(yacc, r, c, row0, column)
                        else:
                            with T.If(column + LANES <= s.n):
                                with T.Then():
                                    self._store_vector(yacc, r, c, row0, column)
                                with T.Else():
                                    with T.serial(0, s.n % LANES) as lane:
                                        self._store(load(yacc, r, c, lane), row0 + r, column + lane)

    def _store_vector(self, yacc, r, c, row0, column) -> None:
        self._store(load(yacc, r, c, ramp(0)), row0 + r, ramp(column))

    def _store_swiglu(self, yacc, r, c, row0, column) -> None:
        """One 16-column tile of silu(gate) · up from the gate tile c and the up tile c + 1 (column: the gate's)."""
        gate, up = (biased(load(yacc, r, c + i, ramp(0)), self.bias, ramp(column + i * LANES)) for i in (0, 1))
        write_output(self.spec, self.y, self.residual, apply_epilogue("silu", gate) * up, row0 + r,
                     ramp(tirx.floordiv(column, 2)))

    def _store(self, value, row, columns) -> None:
        """y[row, columns] = f(value + bias) (+ residual): the output stage of an elementwise epilogue."""
        value = apply_epilogue(self.spec.epilogue, biased(value, self.bias, columns))
        write_output(self.spec, self.y, self.residual, value, row, columns)


def _by_parity(values: list):
    """32 scalars of consecutive k as the (even k, odd k) float32x16 vectors the planes are built from."""
    return tuple(tirx.Shuffle(values[parity::2], list(range(LANES))) for parity in (0, 1))


def when(condition, emit) -> None:
    """Emit `emit()` if condition is True, under a runtime test if it is an expression, never if False."""
    if condition is True:
        emit()
    elif condition is not False:
        with T.If(condition):
            with T.Then():
                emit()
