"""TVM expressions that convert a raw code into a compute type: the `convert` kernels inline.

Integer types decode arithmetically (sign extension, cast), float types by assembling the float32 bit
pattern, codebooks by a select tree on the code bits or, when the kernel supplies one, a lookup table.
`code` may be a scalar or a vector expression; the result has the same lanes.  Every builder is checked
bit-exactly against `TType.decode` on the LLVM target.
"""

from __future__ import annotations

import torch
from tvm import tirx

from .registry import get
from .types import COMPUTE_DTYPES, FLOAT, INT, UINT, TType


class _Lanes:
    """Types and constants with the lane count of the code expression."""

    def __init__(self, code):
        self.count = code.ty.dtype.lanes

    def type(self, dtype: str) -> str:
        return f"{dtype}x{self.count}" if self.count > 1 else dtype

    def const(self, value, dtype: str):
        scalar = tirx.const(value, dtype)
        return tirx.Broadcast(scalar, self.count) if self.count > 1 else scalar

    def u32(self, value: int):
        return self.const(value, "uint32")

    def cast(self, dtype: str, value):
        return tirx.Cast(self.type(dtype), value)


def decode(ttype: TType, code, dtype: str, lut=None):
    """Expression of `dtype` (a bitkern compute-type name) holding the value of integer expression `code`.

    lut: optional tensor/buffer indexed by code that holds the values in `dtype` (see `TType.lut`);
    kernels pass one to decode codebooks with a single load instead of a select tree.
    """
    if hasattr(code, "asobject"):  # a TE tensor element
        code = code.asobject()
    v = _Lanes(code)
    tvm_dtype = COMPUTE_DTYPES[dtype][1]
    if lut is not None:
        return lut[v.cast("int32", code)]
    if dtype == "int8":
        if "int8" not in ttype.compute_types:
            raise ValueError(f"type {ttype.name!r} does not convert to int8; "
                             f"accepted: {list(ttype.compute_types)}")
        return v.cast("int8", _integer(ttype, code, v))
    code = v.cast("uint32", code)
    if dtype == "float8_e4m3":
        return _float8_e4m3(ttype, code, v)
    if ttype.kind in (INT, UINT):
        value = v.cast("float32", _integer(ttype, code, v))
    elif ttype.kind == FLOAT:
        value = _float(ttype, code, v)
    else:
        value = _select_tree([v.const(x, "float32") for x in ttype.codebook], code, v)
    return value if tvm_dtype == "float32" else v.cast(tvm_dtype, value)


def _float8_e4m3(ttype: TType, code, v: _Lanes):
    """float8_e4m3 from its bit pattern: TVM's LLVM cast from float32 flushes subnormals and NaN."""
    if ttype.float_format == get("float8_e4m3").float_format:
        return tirx.reinterpret(v.type("float8_e4m3fn"), v.cast("uint8", code))
    if ttype.bits > 8:
        raise ValueError(f"type {ttype.name!r} has {ttype.bits}-bit codes; float8_e4m3 decode needs bits <= 8")
    patterns = ttype.convert(torch.arange(ttype.num_codes), "float8_e4m3").view(torch.uint8).tolist()
    return tirx.reinterpret(v.type("float8_e4m3fn"), _select_tree([v.const(p, "uint8") for p in patterns], code, v))


def _integer(ttype: TType, code, v: _Lanes):
    """int32 (or int64 for 32-bit unsigned) expression of an integer type's value."""
    if ttype.kind == UINT:
        return v.cast("int64" if ttype.bits == 32 else "int32", code)
    as_int = v.cast("int32", v.cast("uint32", code))
    if ttype.bits == 1:
        return as_int * v.const(2, "int32") - v.const(1, "int32")
    shift = v.const(32 - ttype.bits, "int32")
    return tirx.shift_right(tirx.shift_left(as_int, shift), shift)


def _float(ttype: TType, code, v: _Lanes):
    """float32 expression of a minifloat code, built from its bit fields."""
    fmt = ttype.float_format
    e, m = fmt.exponent_bits, fmt.mantissa_bits
    f32 = v.type("float32")
    if e == 8 and fmt.bias == 127 and fmt.signed and fmt.subnormals and fmt.specials == "ieee":
        # float32 and bfloat16 are float32 bit patterns with the low mantissa bits cut off.
        return tirx.reinterpret(f32, tirx.shift_left(code, v.u32(32 - ttype.bits)))
    exponent = tirx.bitwise_and(tirx.shift_right(code, v.u32(m)), v.u32((1 << e) - 1))
    mantissa = tirx.bitwise_and(code, v.u32((1 << m) - 1))
    sign = tirx.shift_left(tirx.bitwise_and(tirx.shift_right(code, v.u32(e + m)), v.u32(1)), v.u32(31)) \
        if fmt.signed else v.u32(0)
    # Normal numbers: rebias the exponent into float32's and left-align the mantissa.
    rebias = 127 - fmt.bias
    rebiased = exponent + v.u32(rebias) if rebias >= 0 else exponent - v.u32(-rebias)
    normal_bits = tirx.bitwise_or(sign, tirx.bitwise_or(tirx.shift_left(rebiased, v.u32(23)),
                                                        tirx.shift_left(mantissa, v.u32(23 - m))))
    value = tirx.reinterpret(f32, normal_bits)
    negative = sign != v.u32(0)
    exponent_zero = exponent == v.u32(0)
    if fmt.subnormals:
        # Subnormals (exponent 0): mantissa * 2**(1 - bias - m), exact in float32 arithmetic.
        magnitude = v.cast("float32", mantissa) * v.const(2.0 ** (1 - fmt.bias - m), "float32")
        value = tirx.Select(exponent_zero, tirx.Select(negative, -magnitude, magnitude), value)
    elif rebias <= 0:
        # No subnormals and exponent 0 falls below float32's normal range (e8m0's 2**-127).
        smallest = v.cast("float32", tirx.bitwise_or(v.u32(1 << m), mantissa)) * \
            v.const(2.0 ** (-fmt.bias - m), "float32")
        value = tirx.Select(exponent_zero, tirx.Select(negative, -smallest, smallest), value)
    all_ones = v.u32((1 << e) - 1)
    nan = v.const(float("nan"), "float32")
    if fmt.specials == "ieee":
        inf = tirx.Select(negative, v.const(float("-inf"), "float32"), v.const(float("inf"), "float32"))
        value = tirx.Select(exponent == all_ones, tirx.Select(mantissa == v.u32(0), inf, nan), value)
    elif fmt.specials == "fn":
        value = tirx.Select(tirx.And(exponent == all_ones, mantissa == v.u32((1 << m) - 1)), nan, value)
    elif fmt.specials == "nan_max":
        value = tirx.Select(code == v.u32((1 << ttype.bits) - 1), nan, value)
    return value


def _select_tree(leaves, code, v: _Lanes):
    """leaves[code] as a binary select tree: log2(len(leaves)) levels, one bit of the code per level."""
    if len(leaves) == 1:
        return leaves[0]
    half = len(leaves) // 2
    bit = tirx.bitwise_and(tirx.shift_right(code, v.u32(half.bit_length() - 1)), v.u32(1))
    return tirx.Select(bit == v.u32(1), _select_tree(leaves[half:], code, v), _select_tree(leaves[:half], code, v))
