"""TVM expressions that convert a raw code into a compute type: the `convert` kernels inline.

Integer types decode arithmetically (sign extension, cast), float types by assembling the float32 bit
pattern, codebooks by a select tree on the code bits or, when the kernel supplies one, a lookup table.
Every builder is checked bit-exactly against `TType.decode` on the LLVM target.
"""

from __future__ import annotations

import torch
from tvm import tirx

from .registry import get
from .types import COMPUTE_DTYPES, FLOAT, INT, UINT, TType


def decode(ttype: TType, code, dtype: str, lut=None):
    """Expression of `dtype` (a bitkern compute-type name) holding the value of integer expression `code`.

    lut: optional tensor/buffer indexed by code that holds the values in `dtype` (see `TType.lut`);
    kernels pass one to decode codebooks with a single load instead of a select tree.
    """
    tvm_dtype = COMPUTE_DTYPES[dtype][1]
    if lut is not None:
        return lut[tirx.Cast("int32", code)]
    if dtype == "int8":
        if "int8" not in ttype.compute_types:
            raise ValueError(f"type {ttype.name!r} does not convert to int8; "
                             f"accepted: {list(ttype.compute_types)}")
        return tirx.Cast("int8", _integer(ttype, code))
    if dtype == "float8_e4m3":
        return _float8_e4m3(ttype, tirx.Cast("uint32", code))
    if ttype.kind in (INT, UINT):
        value = tirx.Cast("float32", _integer(ttype, code))
    elif ttype.kind == FLOAT:
        value = _float(ttype, tirx.Cast("uint32", code))
    else:
        value = _select_tree([tirx.const(v, "float32") for v in ttype.codebook], tirx.Cast("uint32", code))
    return value if tvm_dtype == "float32" else tirx.Cast(tvm_dtype, value)


def _float8_e4m3(ttype: TType, code):
    """float8_e4m3 from its bit pattern: TVM's LLVM cast from float32 flushes subnormals and NaN."""
    e4m3 = get("float8_e4m3").float_format
    if ttype.float_format == e4m3:
        return tirx.reinterpret("float8_e4m3fn", tirx.Cast("uint8", code))
    if ttype.bits > 8:
        raise ValueError(f"type {ttype.name!r} has {ttype.bits}-bit codes; float8_e4m3 decode needs bits <= 8")
    patterns = ttype.convert(torch.arange(ttype.num_codes), "float8_e4m3").view(torch.uint8).tolist()
    return tirx.reinterpret("float8_e4m3fn", _select_tree([tirx.const(p, "uint8") for p in patterns], code))


def _u32(value: int):
    return tirx.const(value, "uint32")


def _integer(ttype: TType, code):
    """int32 (or int64 for 32-bit unsigned) expression of an integer type's value."""
    if ttype.kind == UINT:
        return tirx.Cast("int64" if ttype.bits == 32 else "int32", code)
    as_int = tirx.Cast("int32", tirx.Cast("uint32", code))
    if ttype.bits == 1:
        return as_int * 2 - 1
    shift = tirx.const(32 - ttype.bits, "int32")
    return tirx.shift_right(tirx.shift_left(as_int, shift), shift)


def _float(ttype: TType, code):
    """float32 expression of a minifloat code, built from its bit fields."""
    fmt = ttype.float_format
    e, m = fmt.exponent_bits, fmt.mantissa_bits
    if e == 8 and fmt.bias == 127 and fmt.signed and fmt.subnormals and fmt.specials == "ieee":
        # float32 and bfloat16 are float32 bit patterns with the low mantissa bits cut off.
        return tirx.reinterpret("float32", tirx.shift_left(code, _u32(32 - ttype.bits)))
    exponent = tirx.bitwise_and(tirx.shift_right(code, _u32(m)), _u32((1 << e) - 1))
    mantissa = tirx.bitwise_and(code, _u32((1 << m) - 1))
    sign = tirx.shift_left(tirx.bitwise_and(tirx.shift_right(code, _u32(e + m)), _u32(1)), _u32(31)) \
        if fmt.signed else _u32(0)
    # Normal numbers: rebias the exponent into float32's and left-align the mantissa.
    rebias = 127 - fmt.bias
    normal_bits = tirx.bitwise_or(sign, tirx.bitwise_or(
        tirx.shift_left(exponent + _u32(rebias) if rebias >= 0 else exponent - _u32(-rebias), _u32(23)),
        tirx.shift_left(mantissa, _u32(23 - m))))
    value = tirx.reinterpret("float32", normal_bits)
    negative = sign != _u32(0)
    if fmt.subnormals:
        # Subnormals (exponent 0): mantissa * 2**(1 - bias - m), exact in float32 arithmetic.
        magnitude = tirx.Cast("float32", mantissa) * tirx.const(2.0 ** (1 - fmt.bias - m), "float32")
        subnormal = tirx.Select(negative, -magnitude, magnitude)
        value = tirx.Select(exponent == _u32(0), subnormal, value)
    elif rebias <= 0:
        # No subnormals and exponent 0 falls below float32's normal range (e8m0's 2**-127).
        smallest = tirx.Cast("float32", tirx.bitwise_or(_u32(1 << m), mantissa)) * \
            tirx.const(2.0 ** (-fmt.bias - m), "float32")
        value = tirx.Select(exponent == _u32(0), tirx.Select(negative, -smallest, smallest), value)
    all_ones = _u32((1 << e) - 1)
    nan = tirx.const(float("nan"), "float32")
    if fmt.specials == "ieee":
        inf = tirx.Select(negative, tirx.const(float("-inf"), "float32"), tirx.const(float("inf"), "float32"))
        value = tirx.Select(exponent == all_ones, tirx.Select(mantissa == _u32(0), inf, nan), value)
    elif fmt.specials == "fn":
        value = tirx.Select(tirx.all(exponent == all_ones, mantissa == _u32((1 << m) - 1)), nan, value)
    elif fmt.specials == "nan_max":
        value = tirx.Select(code == _u32((1 << ttype.bits) - 1), nan, value)
    return value


def _select_tree(leaves, code):
    """leaves[code] as a binary select tree: log2(len(leaves)) levels, one bit of the code per level."""
    if len(leaves) == 1:
        return leaves[0]
    half = len(leaves) // 2
    bit = tirx.bitwise_and(tirx.shift_right(code, _u32(half.bit_length() - 1)), _u32(1))
    return tirx.Select(bit == _u32(1), _select_tree(leaves[half:], code), _select_tree(leaves[:half], code))
