"""LOP3 decode device functions: one 32-bit word of codes in, its C = 32 / bits weights out.

Each `Decoder` emits a C++ function that the CUDA templates call through a tensor intrinsic
(`intrin.decode_intrinsic`); the same source compiles on the host (g++), where the PTX instructions are
replaced by exact C emulations, so tests check every code bit-exactly against `TType.decode`.

What it computes (and what the TIR description of the intrinsic says, see `expr.dequant`): for float
outputs, out = round_out((v - z) · s) with v the code's value, z the integer or float zero point
(zero modes) and s the scale in float32 (element-wise scales, MX's 2^e, NVFP4's e4m3 · tensor scale);
for int8 / float8_e4m3 outputs (integer and fp8 matmuls, scaled after the product) out = v or v - z.
How: integer codes become 16-bit float pairs by OR-ing them into the mantissa of a magic number with one
`lop3.b32` per pair, then one fma removes the magic and the zero point exactly; fp4_e2m1 and fp8 codes
are placed into float16 bit patterns and rescaled by a power of two (exact, subnormals included); other
types (codebooks such as nf4, user-defined floats) read a float32 table of their values in global memory
through the read-only data cache (`BK_LOOKUP`: in constant memory, a warp's different codes serialize; nf4 GEMVs
ran at 0.05 of the H100's bandwidth that way, int4 ones at up to 0.47).  The scale multiplies the exact pair
in 16-bit arithmetic when that rounds exactly like the float32 formula (scale stored in the output type, integer
zero point, values exact in it), else the pair goes through float32.
Pair i of a word holds the codes at positions i and i + C/2, which the "lop3" layout fills with
elements 2i and 2i + 1 (see `layout.py`), so outputs come out in natural order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ...ttype import get
from ...ttype.types import FLOAT, INT, UINT, TType
from .layout import LOP3_BITS, check_type

OUTPUT_DTYPES = ("float16", "bfloat16", "float32", "int8", "float8_e4m3")
FLOAT_OUTPUTS = ("float16", "bfloat16", "float32")
_C_OUT = {"float16": "uint16_t", "bfloat16": "uint16_t", "float32": "float", "int8": "int8_t",
          "float8_e4m3": "uint8_t"}
_C_SCALE = {"float16": "bk_half_arg", "bfloat16": "bk_bf16_arg", "float32": "float", "uint8": "uint8_t"}
_MAGIC = {"float16": (0x6400, 1024.0, 10), "bfloat16": (0x4300, 128.0, 7)}  # bits, value, mantissa bits
_SCALE_TO_F32 = {"float16": "bk_f16_to_f32(BK_HALF_BITS(scale))", "bfloat16": "bk_bf16_to_f32(BK_BF16_BITS(scale))",
                 "float32": "scale"}

PRELUDE = r"""
#ifndef BK_DECODE_PRELUDE
#define BK_DECODE_PRELUDE
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#define BK_FN static __device__ __forceinline__
#define BK_TABLE static __device__ const float
#define BK_LOOKUP(table, i) __ldg(&(table)[i])
typedef __half bk_half_arg;
typedef __nv_bfloat16 bk_bf16_arg;
#define BK_HALF_BITS(x) ((uint32_t)__half_as_ushort(x))
#define BK_BF16_BITS(x) ((uint32_t)__bfloat16_as_ushort(x))
#else
#define BK_FN static inline
#define BK_TABLE static const float
#define BK_LOOKUP(table, i) ((table)[i])
typedef uint16_t bk_half_arg;
typedef uint16_t bk_bf16_arg;
#define BK_HALF_BITS(x) ((uint32_t)(x))
#define BK_BF16_BITS(x) ((uint32_t)(x))
#endif

BK_FN float bk_f32(uint32_t bits) { float f; memcpy(&f, &bits, 4); return f; }
BK_FN uint32_t bk_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* lop3.b32: bit i of LUT is the result for inputs (a, b, c) = (i >> 2 & 1, i >> 1 & 1, i & 1). */
template <int LUT> BK_FN uint32_t bk_lop3(uint32_t a, uint32_t b, uint32_t c) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
#else
  uint32_t d = 0;
  for (int i = 0; i < 8; ++i)
    if ((LUT >> i) & 1) d |= ((i & 4) ? a : ~a) & ((i & 2) ? b : ~b) & ((i & 1) ? c : ~c);
  return d;
#endif
}

/* 0xFFFF in each 16-bit lane where a and b are equal. */
BK_FN uint32_t bk_lanes_equal(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __vcmpeq2(a, b);
#else
  return (((a ^ b) & 0xFFFFu) ? 0u : 0xFFFFu) | (((a ^ b) >> 16) ? 0u : 0xFFFF0000u);
#endif
}

/* Bytes of (b:a) picked by the four selector nibbles (prmt.b32, default mode: nibble < 8). */
BK_FN uint32_t bk_prmt(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, selector);
#else
  uint64_t both = ((uint64_t)b << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) d |= (uint32_t)((both >> (8 * ((selector >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return d;
#endif
}

/* Byte-wise a - b, each byte modulo 256. */
BK_FN uint32_t bk_vsub4(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __vsub4(a, b);
#else
  uint32_t d = 0;
  for (int i = 0; i < 32; i += 8) d |= (((a >> i) - (b >> i)) & 0xFFu) << i;
  return d;
#endif
}

BK_FN float bk_f16_to_f32(uint32_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half((unsigned short)h));
#else
  uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bk_f32(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) return bk_f32(sign | bk_bits((float)mantissa * 5.9604644775390625e-08f));
  return bk_f32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

BK_FN uint32_t bk_f32_to_f16(float f) {
#ifdef __CUDA_ARCH__
  return __half_as_ushort(__float2half_rn(f));
#else
  uint32_t x = bk_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00u;
  if (ax >= 0x477FF000u) return sign | 0x7C00u;
  if (ax < 0x38800000u) return sign | (uint32_t)nearbyintf(bk_f32(ax) * 16777216.0f);
  uint32_t base = (ax >> 13) - (112u << 10), rest = ax & 0x1FFFu;
  return sign | (base + (rest > 0x1000u || (rest == 0x1000u && (base & 1u))));
#endif
}

BK_FN float bk_bf16_to_f32(uint32_t h) { return bk_f32(h << 16); }

BK_FN uint32_t bk_f32_to_bf16(float f) {
#ifdef __CUDA_ARCH__
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  uint32_t x = bk_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return ((x >> 16) & 0x8000u) | 0x7FC0u;
  return (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
#endif
}

BK_FN float bk_e4m3_to_f32(uint32_t c) {
  uint32_t sign = (c & 0x80u) << 24, exponent = (c >> 3) & 0xFu, mantissa = c & 7u;
  if ((c & 0x7Fu) == 0x7Fu) return bk_f32(0x7FC00000u);
  if (exponent == 0) return bk_f32(sign | bk_bits((float)mantissa * 0.001953125f));
  return bk_f32(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

BK_FN uint32_t bk_f32_to_e4m3(float f) {
#ifdef __CUDA_ARCH__
  return (uint32_t)__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
#else
  if (f != f) return 0x7Fu;
  uint32_t sign = f < 0.0f || (f == 0.0f && signbit(f)) ? 0x80u : 0u, best = 0;
  float a = fabsf(f), best_error = INFINITY;
  for (uint32_t c = 0; c < 0x7Fu; ++c) {
    float error = fabsf(bk_e4m3_to_f32(c) - a);
    if (error < best_error || (error == best_error && !(c & 1u))) { best = c; best_error = error; }
  }
  return sign | best;
#endif
}

/* Pairs of 16-bit floats in a uint32 (low lane first).  The host versions compute each lane in float32
   and round once: exact for the exact operations the decoders do, and for the one rounding multiply by
   a scale, whose float32 product is exact. */
#ifdef __CUDA_ARCH__
BK_FN __half2 bk_h2(uint32_t x) { __half2 h; memcpy(&h, &x, 4); return h; }
BK_FN __nv_bfloat162 bk_b2(uint32_t x) { __nv_bfloat162 h; memcpy(&h, &x, 4); return h; }
BK_FN uint32_t bk_u32(__half2 h) { uint32_t x; memcpy(&x, &h, 4); return x; }
BK_FN uint32_t bk_u32(__nv_bfloat162 h) { uint32_t x; memcpy(&x, &h, 4); return x; }
#endif

"""
# The 16-bit pair arithmetic, once for float16 pairs (h2) and once for bfloat16 pairs (b2).
_PAIR_ARITHMETIC = r"""BK_FN uint32_t bk_{pair}_fma(uint32_t a, uint32_t b, uint32_t c) {{
#ifdef __CUDA_ARCH__
  return bk_u32(__hfma2(bk_{pair}(a), bk_{pair}(b), bk_{pair}(c)));
#else
  return bk_f32_to_{half}(fmaf(bk_{half}_to_f32(a & 0xFFFFu), bk_{half}_to_f32(b & 0xFFFFu), bk_{half}_to_f32(c & 0xFFFFu)))
       | (bk_f32_to_{half}(fmaf(bk_{half}_to_f32(a >> 16), bk_{half}_to_f32(b >> 16), bk_{half}_to_f32(c >> 16))) << 16);
#endif
}}

BK_FN uint32_t bk_{pair}_mul(uint32_t a, uint32_t b) {{
#ifdef __CUDA_ARCH__
  return bk_u32(__hmul2_rn(bk_{pair}(a), bk_{pair}(b)));
#else
  return bk_f32_to_{half}(bk_{half}_to_f32(a & 0xFFFFu) * bk_{half}_to_f32(b & 0xFFFFu))
       | (bk_f32_to_{half}(bk_{half}_to_f32(a >> 16) * bk_{half}_to_f32(b >> 16)) << 16);
#endif
}}
"""
PRELUDE += "\n".join(_PAIR_ARITHMETIC.format(pair=pair, half=half) for pair, half in (("h2", "f16"), ("b2", "bf16")))
PRELUDE += "#endif\n"


@dataclass(frozen=True)
class Decoder:
    """The decode function for one (weight type, output type, zero mode, scale storage).

    scale: storage dtype of element-wise scales ("float16", "bfloat16", "float32"), "uint8" for the codes
    of block scales, or None when the output is scaled after the matmul (int8 / float8_e4m3 outputs).
    """

    weight: str
    out: str
    zero_mode: str = "none"
    scale: str | None = "float16"

    def __post_init__(self):
        ttype = get(self.weight)
        object.__setattr__(self, "weight", ttype.name)
        check_type(ttype)
        if self.out not in OUTPUT_DTYPES:
            raise ValueError(f"out={self.out!r} is not a decode output; accepted: {list(OUTPUT_DTYPES)}")
        if self.zero_mode not in ("none", "gptq", "awq", "hqq"):
            raise ValueError(f"zero_mode={self.zero_mode!r} is not known; accepted: none, gptq, awq, hqq")
        if self.zero_mode != "none" and ttype.kind != UINT:
            raise ValueError(f"zero_mode={self.zero_mode!r} needs an unsigned integer type, not {ttype.name!r}")
        scaled_later = self.out not in FLOAT_OUTPUTS
        accepted = [None] if scaled_later else ["uint8"] if ttype.block_size > 1 else sorted(_SCALE_TO_F32)
        if self.scale not in accepted:
            raise ValueError(f"scale={self.scale!r} does not fit {ttype.name!r} decoded to {self.out}; "
                             f"accepted: {accepted}")
        if scaled_later:
            if self.zero_mode == "hqq":
                raise ValueError(f"zero_mode='hqq' (float zeros) cannot be applied exactly in {self.out}")
            if self.out not in ttype.compute_types:
                raise ValueError(f"{ttype.name!r} does not convert exactly to {self.out}; accepted outputs: "
                                 f"{[d for d in OUTPUT_DTYPES if d in ttype.compute_types or d in FLOAT_OUTPUTS]}")
            if self.out == "float8_e4m3" and self.zero_mode != "none":
                raise ValueError("float8_e4m3 outputs take zero_mode='none' only")

    @property
    def ttype(self) -> TType:
        return get(self.weight)

    @property
    def per_word(self) -> int:
        return 32 // self.ttype.bits

    @property
    def name(self) -> str:
        """The C function name (unique per decoder)."""
        return f"bk_decode_{self.weight}_{self.out}_{self.zero_mode}_{self.scale or 'unscaled'}"

    @cached_property
    def method(self) -> str:
        """How codes become values: "magic" (LOP3), "fp4", "fp8", "table" (a float32 table of the type's
        values, read through `BK_LOOKUP`), or "exact" (int8 / float8_e4m3 outputs)."""
        t = self.ttype
        if self.out not in FLOAT_OUTPUTS:
            return "exact"
        if t.kind in (INT, UINT):
            return "magic"
        if t.kind == FLOAT and t.float_format == get("fp4_e2m1").float_format:
            return "fp4"
        if t.kind == FLOAT and t.float_format in (get("float8_e4m3").float_format, get("float8_e5m2").float_format):
            return "fp8"
        return "table"

    @property
    def uses_lop3(self) -> bool:
        """Whether the function's PTX holds lop3.b32 (integer and fp4 decodes, e4m3 to float16 pairs, 4-bit
        integers to int8)."""
        t = self.ttype
        if self.method in ("magic", "fp4"):
            return True
        if self.method == "fp8":
            return t.float_format == get("float8_e4m3").float_format
        return self.method == "exact" and self.out == "int8" and t.bits == 4 and t.kind in (INT, UINT)

    def arguments(self) -> list[str]:
        """The function's arguments after (word, out), in order: "scale", "zero", "tensor_scale"."""
        args = ["scale"] if self.scale is not None else []
        if self.zero_mode != "none":
            args.append("zero")
        if self.ttype.tensor_scale and self.scale is not None:
            args.append("tensor_scale")
        return args

    def signature(self) -> str:
        types = {"scale": _C_SCALE.get(self.scale), "tensor_scale": "float",
                 "zero": _C_SCALE[self.scale] if self.zero_mode == "hqq" else "uint8_t"}
        extra = "".join(f", {types[a]} {a}" for a in self.arguments())
        return f"BK_FN void {self.name}(const void* word, void* out{extra})"

    @property
    def table(self) -> str:
        """Name of the table of the type's float32 values that "table" / "exact" decoders read."""
        return f"bk_values_{self.weight}"

    def source(self) -> str:
        """The C++ source of the function (guarded, so sources can be concatenated); needs `PRELUDE`."""
        guard = self.name.upper()
        body = "\n".join("  " + line for line in _Body(self).lines())
        table = ""
        identity = self.ttype.kind == FLOAT and self.ttype.float_format == get("float8_e4m3").float_format
        if self.method == "table" or (self.method == "exact" and self.ttype.kind not in (INT, UINT) and not identity):
            values = ", ".join(_float(float(v)) for v in self.ttype.values.tolist())
            table = (f"#ifndef {self.table.upper()}\n#define {self.table.upper()}\n"
                     f"BK_TABLE {self.table}[{self.ttype.num_codes}] = {{{values}}};\n#endif\n")
        return f"{table}#ifndef {guard}\n#define {guard}\n{self.signature()} {{\n{body}\n}}\n#endif\n"


class _Body:
    """Generates the statements of one decoder."""

    def __init__(self, decoder: Decoder):
        self.d, self.t = decoder, decoder.ttype
        self.per_word, self.bits = decoder.per_word, decoder.ttype.bits
        self.out: list[str] = ["const uint32_t w = *(const uint32_t*)word;"]

    def lines(self) -> list[str]:
        method = self.d.method
        if method == "exact":
            self._exact()
            return self.out
        if method == "magic":
            pairs, kind = self._magic()
        elif method == "fp4":
            pairs, kind = self._fp4(), "float16"
        elif method == "fp8":
            pairs, kind = self._fp8(), "float16"
        else:
            self._table()
            return self.out
        self._finish_pairs(pairs, kind)
        return self.out

    # -- exact values of the codes -----------------------------------------------------------------------
    def _code(self, element: int) -> str:
        """C expression of the code of `element` (natural k order) in word w."""
        position = element // 2 + (element % 2) * (self.per_word // 2)
        return f"((w >> {position * self.bits}u) & {(1 << self.bits) - 1}u)"

    def _magic(self) -> tuple[list[str], str]:
        """Pairs of exact values (minus an integer zero point) by the magic-number trick."""
        kind = "bfloat16" if self.d.out == "bfloat16" and self.bits <= 4 else "float16"
        magic_bits, magic_value, mantissa_bits = _MAGIC[kind]
        prefix = "b2" if kind == "bfloat16" else "h2"
        to_bits = "bk_f32_to_bf16" if kind == "bfloat16" else "bk_f32_to_f16"
        bits = self.bits
        signed = self.t.kind == INT and bits > 1
        offset = (1 << (bits - 1)) if signed else 0
        source = "w"
        if signed:  # two's complement v = u' - 2^(b-1) with u' the code whose sign bit is flipped
            sign_bits = sum(1 << (bits - 1 + i * bits) for i in range(self.per_word))
            self.out.append(f"const uint32_t flipped = w ^ 0x{sign_bits:08X}u;")
            source = "flipped"
        integer_zero = self.d.zero_mode in ("gptq", "awq")
        mask = (1 << bits) - 1
        pairs, shifted, constants = [], {}, {}
        window = 0
        for i in range(self.per_word // 2):
            position = i * bits
            if position - window + bits > mantissa_bits:
                window = position
            inner = position - window
            if window not in shifted:
                shifted[window] = source if window == 0 else f"t{window}"
                if window:
                    self.out.append(f"const uint32_t t{window} = {source} >> {window}u;")
            if inner not in constants:  # fma(h, 2^-inner, -(magic·2^-inner + offset + zero)) leaves v - zero
                scale_bits = _bits_of(2.0 ** -inner, kind)
                constants[inner] = (f"c{inner}", scale_bits)
                base = magic_value * 2.0 ** -inner + offset
                if integer_zero:
                    self.out.append(f"const uint32_t c{inner} = {to_bits}(-({_float(base)} + (float)zero)) * 0x10001u;")
                else:
                    self.out.append(f"const uint32_t c{inner} = 0x{_bits_of(-base, kind) * 0x10001:08X}u;")
            lane_mask = (mask << inner) * 0x10001
            name = f"p{i}"
            self.out.append(f"uint32_t {name} = bk_lop3<0xEA>({shifted[window]}, 0x{lane_mask:08X}u, "
                            f"0x{magic_bits * 0x10001:08X}u);")
            constant, multiplier = constants[inner]
            self.out.append(f"{name} = bk_{prefix}_fma({name}, 0x{multiplier * 0x10001:08X}u, {constant});")
            if self.t.kind == INT and bits == 1:  # binary weights: v = 2u - 1
                one, minus_one = _bits_of(2.0, kind) * 0x10001, _bits_of(-1.0, kind) * 0x10001
                self.out.append(f"{name} = bk_{prefix}_fma({name}, 0x{one:08X}u, 0x{minus_one:08X}u);")
            pairs.append(name)
        return pairs, kind

    def _fp4(self) -> list[str]:
        """Pairs of e2m1 values as exact float16: the code's bits placed at the float16 exponent's low end
        (value · 2^-14, subnormal for 0.5) and multiplied by 2^14."""
        pairs = []
        for i in range(4):
            source = "w" if i == 0 else f"(w >> {4 * i}u)"
            self.out.append(f"uint32_t p{i} = bk_lop3<0xEA>({source} << 9, 0x0E000E00u, "
                            f"({source} << 12) & 0x80008000u);")
            self.out.append(f"p{i} = bk_h2_mul(p{i}, 0x74007400u);")
            pairs.append(f"p{i}")
        return pairs

    def _fp8(self) -> list[str]:
        """Pairs of fp8 values as exact float16: bytes (0, 2) and (1, 3) moved to the lanes' high bytes;
        e5m2 is float16's top byte, e4m3 is shifted into place, multiplied by 2^8, NaN restored."""
        self.out.append("uint32_t p0 = (w << 8) & 0xFF00FF00u;")
        self.out.append("uint32_t p1 = w & 0xFF00FF00u;")
        if self.t.float_format == get("float8_e4m3").float_format:
            for p in ("p0", "p1"):
                self.out.append(f"const uint32_t nan_{p} = bk_lanes_equal({p} & 0x7F007F00u, 0x7F007F00u);")
                self.out.append(f"{p} = bk_lop3<0xEA>({p} >> 1, 0x3F803F80u, {p} & 0x80008000u);")
                self.out.append(f"{p} = bk_h2_mul({p}, 0x5C005C00u);")
                self.out.append(f"{p} = ({p} & ~nan_{p}) | (nan_{p} & 0x7E007E00u);")
        return ["p0", "p1"]

    def _int4_to_int8(self) -> None:
        """4-bit codes to int8 bytes: two masks (one lop3 each, flipping signed codes' sign bits) give the
        even- and odd-position nibbles as bytes, two byte permutes put them in element order, and a
        byte-wise subtraction removes the zero point (or the flip's offset of 8)."""
        flip = "0x88888888u" if self.t.kind == INT else "0u"
        self.out.append(f"const uint32_t low = bk_lop3<0x48>(w, 0x0F0F0F0Fu, {flip});")
        self.out.append(f"const uint32_t high = bk_lop3<0x48>(w >> 4u, 0x0F0F0F0Fu, {flip});")
        offset = "(uint32_t)zero * 0x01010101u" if self.d.zero_mode != "none" else \
            ("0x08080808u" if self.t.kind == INT else "0u")
        self.out.append(f"const uint32_t offset = {offset};")
        self.out.append("((uint32_t*)out)[0] = bk_vsub4(bk_prmt(low, high, 0x6420u), offset);")
        self.out.append("((uint32_t*)out)[1] = bk_vsub4(bk_prmt(low, high, 0x7531u), offset);")

    # -- scale, zero point and the output store ---------------------------------------------------------
    def _scale_and_zero_f32(self) -> None:
        """Declare `s` (the scale in float32) and, for float zeros, `z`."""
        d = self.d
        if d.scale == "uint8":
            block = self.t.block_scale
            if block == "float8_e8m0":
                self.out.append("const float s = bk_f32(scale == 255u ? 0x7FC00000u : "
                                "scale ? (uint32_t)scale << 23 : 0x00400000u);")
            elif block == "float8_e4m3":
                factor = " * tensor_scale" if self.t.tensor_scale else ""
                self.out.append(f"const float s = bk_e4m3_to_f32(scale){factor};")
            else:
                raise ValueError(f"block_scale={block!r} of {self.t.name!r} has no CUDA decoder; accepted: "
                                 f"float8_e8m0, float8_e4m3")
        else:
            self.out.append(f"const float s = {_SCALE_TO_F32[d.scale]};")
        if d.zero_mode == "hqq":
            self.out.append(f"const float z = {_SCALE_TO_F32[d.scale].replace('scale', 'zero')};")

    def _packed_scale(self, kind: str) -> bool:
        """Whether out = pair · scale in 16-bit arithmetic rounds exactly like the float32 formula."""
        d = self.d
        return d.out == kind and d.scale == kind and d.zero_mode != "hqq"

    def _finish_pairs(self, pairs: list[str], kind: str) -> None:
        if self._packed_scale(kind):
            prefix = "b2" if kind == "bfloat16" else "h2"
            scale_bits = "BK_BF16_BITS(scale)" if kind == "bfloat16" else "BK_HALF_BITS(scale)"
            self.out.append(f"const uint32_t s2 = {scale_bits} * 0x10001u;")
            for i, p in enumerate(pairs):
                self.out.append(f"((uint32_t*)out)[{i}] = bk_{prefix}_mul({p}, s2);")
            return
        self._scale_and_zero_f32()
        to_f32 = "bk_bf16_to_f32" if kind == "bfloat16" else "bk_f16_to_f32"
        for i, p in enumerate(pairs):
            for lane, part in ((0, f"{p} & 0xFFFFu"), (1, f"{p} >> 16")):
                self._store(2 * i + lane, f"{to_f32}({part})")

    def _store(self, element: int, value_f32: str) -> None:
        """out[element] = round_out((value - z) · s) from a float32 value."""
        d = self.d
        value = f"({value_f32} - z)" if d.zero_mode == "hqq" else value_f32
        product = f"{value} * s"
        if d.out == "float32":
            self.out.append(f"((float*)out)[{element}] = {product};")
        else:
            to_out = "bk_f32_to_bf16" if d.out == "bfloat16" else "bk_f32_to_f16"
            self.out.append(f"((uint16_t*)out)[{element}] = (uint16_t){to_out}({product});")

    def _table(self) -> None:
        self._scale_and_zero_f32()
        for e in range(self.per_word):
            self._store(e, f"BK_LOOKUP({self.d.table}, {self._code(e)})")

    def _exact(self) -> None:
        """int8 / float8_e4m3 outputs: the exact value (minus an integer zero point), unscaled."""
        d, t = self.d, self.t
        if t.kind == FLOAT and t.float_format == get("float8_e4m3").float_format:
            for e in range(self.per_word):  # float8_e4m3 to itself: the codes, reordered
                self.out.append(f"((uint8_t*)out)[{e}] = (uint8_t){self._code(e)};")
            return
        if d.out == "int8" and t.bits == 4 and t.kind in (INT, UINT):
            self._int4_to_int8()
            return
        for e in range(self.per_word):
            code = self._code(e)
            if d.zero_mode != "none":
                value = f"(int32_t){code} - (int32_t)zero"
            elif t.kind == INT and t.bits == 1:
                value = f"2 * (int32_t){code} - 1"
            elif t.kind == INT:
                value = f"(int32_t)({code} << {32 - t.bits}u) >> {32 - t.bits}"
            elif t.kind == UINT:
                value = f"(int32_t){code}"
            else:
                value = f"BK_LOOKUP({d.table}, {code})"
            if d.out == "int8":
                self.out.append(f"((int8_t*)out)[{e}] = (int8_t)({value});")
            else:
                self.out.append(f"((uint8_t*)out)[{e}] = (uint8_t)bk_f32_to_e4m3((float)({value}));")


def _float(value: float) -> str:
    """A C float literal (NAN and INFINITY from math.h for the non-finite values)."""
    if value != value:
        return "NAN"
    if value in (float("inf"), float("-inf")):
        return "INFINITY" if value > 0 else "-INFINITY"
    return repr(float(value)) + "f"


def _bits_of(value: float, kind: str) -> int:
    import torch

    dtype = torch.float16 if kind == "float16" else torch.bfloat16
    return int(torch.tensor(value, dtype=dtype).view(torch.int16).item()) & 0xFFFF


def library(decoders) -> str:
    """The prelude and the given decoders' functions, as one C++ source."""
    unique = {d.name: d for d in decoders}
    return PRELUDE + "\n".join(d.source() for d in unique.values())


__all__ = ["Decoder", "FLOAT_OUTPUTS", "LOP3_BITS", "OUTPUT_DTYPES", "PRELUDE", "library"]
