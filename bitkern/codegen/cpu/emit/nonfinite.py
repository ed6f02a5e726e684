"""Non-finite activations (±Inf, NaN) in the tile16 templates (AMX, AVX512-BF16, lookup).

These templates fold constants out of their sums — a decode offset or zero point z: Σ x·(d - z) is
computed as Σ x·d - z·Σ x — and split fp16/fp32 x into bf16 planes (x - bf16(x)).  For an infinite x
both give Inf - Inf = NaN across the whole row, where torch's x·Wᵀ gives ±Inf, and NaN only where an
infinity meets a zero weight or infinities of both signs meet.  So the prologues take non-finite x as 0
(the folded sums stay finite and exact) and flag the row; once a task's sums are complete, each flagged
row gets x·w added for each of its non-finite x, w dequantized as the reference dequantizes it, and IEEE
arithmetic then gives torch's ±Inf and NaN.  Rows of finite values cost an OR per 16 x values in the
prologue and one flag test per task.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.matmul import Matmul
from ....ttype import codes_per_word, effective_group_size, get
from ..layout import tile16_shift
from .tir import LANES, horizontal_sum, lanes, load, ramp, splat, u32

_EXPONENT = 0x7F800000  # float32's exponent bits: all set for ±Inf and NaN


def is_nonfinite(value):
    """bool (lanes): the float32 value is ±Inf or NaN."""
    n = lanes(value)
    ones = u32(_EXPONENT, n) if n > 1 else tirx.const(_EXPONENT, "uint32")
    bits = tirx.reinterpret("uint32" if n == 1 else f"uint32x{n}", value)
    return tirx.bitwise_and(bits, ones) == ones


def finite_part(values):
    """(float32 lanes with ±Inf and NaN taken as 0, uint32 lanes: 1 where the value was not finite)."""
    n = lanes(values)
    nonfinite = is_nonfinite(values)
    return tirx.Select(nonfinite, splat(0.0, "float32", n), values), tirx.Select(nonfinite, u32(1, n), u32(0, n))


def note(flags, row, first, lane_flags) -> None:
    """Record lane flags (`finite_part`'s) of a row in flags[row] (uint32 lanes): set them on the row's first
    chunk (`first`: a bool, or an expression), OR them in after."""
    if first is True:
        value = lane_flags
    else:
        value = tirx.bitwise_or(load(flags, row, ramp(0)), lane_flags)
        if first is not False:
            value = tirx.Select(first, lane_flags, value)
    T.buffer_store(flags, value, [row, ramp(0)])


def add_terms(yacc, local_row, tiles: list, flags, row, k: int, x_at, weight_at) -> None:
    """yacc[local_row, c] += x[row, j]·w[tiles[c], j] for every non-finite x[row, j] of a flagged row.

    x_at(row, j): x[row, j] as float32 (scalar); weight_at(tile, j): the 16 weights of the tile's rows at
    j as float32 lanes (see `weight_lanes`)."""
    with T.If(horizontal_sum(load(flags, row, ramp(0))) != tirx.const(0, "uint32")):
        with T.Then():
            with T.serial(0, k) as j:
                value = x_at(row, j)
                with T.If(is_nonfinite(value)):
                    with T.Then():
                        for c, tile in enumerate(tiles):
                            term = tirx.Broadcast(value, LANES) * weight_at(tile, j)
                            T.buffer_store(yacc, load(yacc, local_row, c, ramp(0)) + term, [local_row, c, ramp(0)])


def weight_lanes(spec: Matmul, k: int, qweight, group_args, tile, j):
    """The dequantized weights of a tile's 16 rows at reduction index j, float32 lanes: the code read from
    the tile16 word, decoded (or less its zero point) and scaled as `bitkern.ops.expr` does."""
    ttype = get(spec.weight_dtype)
    group = effective_group_size(spec.group_size, k)
    word = tirx.reinterpret("uint32x16", load(qweight, tile, tirx.floordiv(j, codes_per_word(ttype.bits)), ramp(0)))
    shift = tirx.Broadcast(tirx.Cast("uint32", tile16_shift(j, ttype.bits)), LANES)
    code = tirx.bitwise_and(tirx.shift_right(word, shift), u32((1 << ttype.bits) - 1))
    scale_group = tirx.floordiv(j, group)
    if spec.zero_mode != "none":
        value = tirx.Cast("float32x16", code) - group_args.zero(tile, scale_group)
    else:
        value = ttype.tvm_decode(code, "float32")
    return value * group_args.scale(tile, scale_group)
