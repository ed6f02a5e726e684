"""The tType (LADDER §3.1): bit width, value set, block metadata and the compute types a code decodes into.

A TType describes how an element is *stored*: a raw code of `bits` bits.  `decode` maps codes to their
float32 values; `compute_types` lists the hardware types the values convert to without loss (LADDER's
c_tTypes); `tvm_decode` builds the same conversion as a TVM expression for kernels to inline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from .dtypes import DTYPES

INT, UINT, FLOAT, CODEBOOK = "int", "uint", "float", "codebook"
KINDS = (INT, UINT, FLOAT, CODEBOOK)
STORAGE_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
FLOAT_SPECIALS = ("ieee", "fn", "finite", "nan_max")

# Compute types a code may be converted to: bitkern name -> (torch dtype, TVM dtype).
COMPUTE_DTYPES = {name: (DTYPES[name].torch, DTYPES[name].tvm)
                  for name in ("float32", "float16", "bfloat16", "float8_e4m3", "int8")}
_INT8_RANGE = (-128, 127)


def check_compute_dtype(dtype, argument: str = "dtype") -> str:
    """Normalise a compute type given as a bitkern name or torch dtype; raise naming `argument` otherwise."""
    for name, (torch_dtype, _) in COMPUTE_DTYPES.items():
        if dtype == name or dtype is torch_dtype:
            return name
    raise ValueError(f"{argument}={dtype!r} is not a compute type; accepted: {sorted(COMPUTE_DTYPES)}")


@dataclass(frozen=True)
class FloatFormat:
    """A sign/exponent/mantissa layout. `specials` says which codes are not finite numbers:
    "ieee" (max exponent = inf/NaN), "fn" (only all-ones = NaN, as float8_e4m3fn), "finite" (none, as
    fp4_e2m1), "nan_max" (the all-ones code is NaN, as the MX e8m0 scale)."""

    exponent_bits: int
    mantissa_bits: int
    bias: int
    signed: bool = True
    specials: str = "finite"
    subnormals: bool = True

    def __post_init__(self):
        if not 1 <= self.exponent_bits <= 8:
            raise ValueError(f"exponent_bits={self.exponent_bits} is out of range; accepted: 1..8")
        if not 0 <= self.mantissa_bits <= 23:
            raise ValueError(f"mantissa_bits={self.mantissa_bits} is out of range; accepted: 0..23")
        if self.specials not in FLOAT_SPECIALS:
            raise ValueError(f"specials={self.specials!r} is not known; accepted: {list(FLOAT_SPECIALS)}")

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    def value_table(self) -> torch.Tensor:
        """float64 value of every code, from the format's definition (NaN and ±inf where it has them)."""
        e, m = self.exponent_bits, self.mantissa_bits
        codes = torch.arange(1 << self.bits, dtype=torch.int64)
        exponent, mantissa = (codes >> m) & ((1 << e) - 1), codes & ((1 << m) - 1)
        normal = torch.ldexp(((1 << m) + mantissa).double(), exponent - self.bias - m)
        subnormal = torch.ldexp(mantissa.double(), torch.full_like(codes, 1 - self.bias - m))
        value = torch.where((exponent == 0) & self.subnormals, subnormal, normal)
        all_ones = (1 << e) - 1
        if self.specials == "ieee":
            value = torch.where(exponent == all_ones, torch.where(mantissa == 0, math.inf, math.nan), value)
        elif self.specials == "fn":
            value = torch.where((exponent == all_ones) & (mantissa == (1 << m) - 1), math.nan, value)
        elif self.specials == "nan_max":
            value = torch.where(codes == (1 << self.bits) - 1, math.nan, value)
        if self.signed:
            value = torch.where((codes >> (e + m)) & 1 == 1, -value, value)
        return value


@dataclass(frozen=True)
class TType:
    """A storage type for tensor elements.

    kind: "int" (two's complement; int1 is the binary type with codes 0, 1 meaning -1, +1), "uint",
    "float" (with `float_format`) or "codebook" (code i means `codebook[i]`).
    block_size / block_scale / tensor_scale: metadata shared by every `block_size` consecutive elements
    along the reduction axis (a scale stored in the ttype named `block_scale`, e.g. MX's e8m0 per 32) and,
    for NVFP4, one float32 scale per tensor.  Element-wise types (block_size 1) get their per-group scale
    and zero point from quantization instead (see `bitkern.quantize`).
    """

    name: str
    bits: int
    kind: str
    float_format: FloatFormat | None = None
    codebook: tuple[float, ...] | None = None
    block_size: int = 1
    block_scale: str | None = None
    tensor_scale: bool = False
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name={self.name!r} must be a non-empty identifier such as 'my_int5'")
        if self.bits not in STORAGE_BITS:
            raise ValueError(f"bits={self.bits!r} is out of range; accepted: {list(STORAGE_BITS)}")
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is not known; accepted: {list(KINDS)}")
        if (self.kind == FLOAT) != (self.float_format is not None):
            raise ValueError(f"float_format must be given exactly when kind='float' (type {self.name!r})")
        if self.kind == FLOAT and self.float_format.bits != self.bits:
            raise ValueError(f"float_format of {self.name!r} has {self.float_format.bits} bits, "
                             f"but bits={self.bits}")
        if (self.kind == CODEBOOK) != (self.codebook is not None):
            raise ValueError(f"codebook must be given exactly when kind='codebook' (type {self.name!r})")
        if self.kind == CODEBOOK:
            if self.bits > 8 or len(self.codebook) != 1 << self.bits:
                raise ValueError(f"codebook of {self.name!r} has {len(self.codebook)} values; a codebook "
                                 f"type needs exactly 2**bits values with bits <= 8")
            if not all(math.isfinite(v) for v in self.codebook):
                raise ValueError(f"codebook of {self.name!r} must hold finite values only")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if (self.block_size > 1) != (self.block_scale is not None):
            raise ValueError(f"block_scale must be given exactly when block_size > 1 (type {self.name!r})")
        if self.tensor_scale and self.block_size == 1:
            raise ValueError(f"tensor_scale needs a block-scaled type (type {self.name!r})")
        if self.bits <= 16:
            table = self._value_table()
            finite = table[torch.isfinite(table)]
            if not torch.equal(finite.float().double(), finite):
                raise ValueError(f"values of {self.name!r} must be exactly representable in float32")

    # -- value set -------------------------------------------------------------------------------
    @property
    def signed(self) -> bool:
        if self.kind == FLOAT:
            return self.float_format.signed
        return self.kind == INT or (self.kind == CODEBOOK and min(self.codebook) < 0)

    @property
    def num_codes(self) -> int:
        return 1 << self.bits

    def _value_table(self) -> torch.Tensor:
        """float64 value of every code (bits <= 16), from the defining formula."""
        codes = range(self.num_codes)
        if self.kind == INT:
            if self.bits == 1:
                return torch.tensor([-1.0, 1.0], dtype=torch.float64)
            half = 1 << (self.bits - 1)
            return torch.tensor([c - (c >= half) * (1 << self.bits) for c in codes], dtype=torch.float64)
        if self.kind == UINT:
            return torch.arange(self.num_codes, dtype=torch.float64)
        if self.kind == CODEBOOK:
            return torch.tensor(self.codebook, dtype=torch.float64)
        return self.float_format.value_table()

    @cached_property
    def values(self) -> torch.Tensor:
        """float32 value of every code, indexed by code (types of at most 16 bits)."""
        if self.bits > 16:
            raise ValueError(f"type {self.name!r} has {self.bits}-bit codes; `values` needs bits <= 16")
        return self._value_table().float()

    @cached_property
    def max_abs(self) -> float:
        """Largest finite magnitude the type represents (the quantization range)."""
        if self.bits > 16:
            return float(torch.finfo(torch.float32).max) if self.kind == FLOAT else float(2 ** (self.bits - 1))
        v = self.values
        return float(v[torch.isfinite(v)].abs().max())

    @cached_property
    def int8_values(self) -> tuple[torch.Tensor, float] | None:
        """(t, unit): every code's value as unit·t with t int8 in [-127, 127], for types of at most 4 bits that are
        neither int nor uint (code books and small floats), as activation_quant="int8" multiplies them: exact where
        every value is a multiple of a power of two within ±127 units (e2m1: 0.5·{0, ±1, …, ±12}), else rounded on a
        grid of max|v|/127 (nf4, bitsandbytes' fp4), as llama.cpp's IQ4_NL holds its code book.  None for the
        others (integer codes multiply as they are; wider codes or non-finite values have no int8 table)."""
        if self.kind in (INT, UINT) or self.bits > 4:
            return None
        values = self._value_table()
        if not bool(torch.isfinite(values).all()) or not bool(values.any()):
            return None
        largest = float(values.abs().max())
        for exponent in range(7, -9, -1):  # the coarsest unit first
            unit = 2.0 ** exponent
            steps = values / unit
            if largest / unit <= _INT8_RANGE[1] and torch.equal(steps.round(), steps):
                return steps.to(torch.int8), unit
        unit = largest / _INT8_RANGE[1]
        return (values / unit).round().to(torch.int8), unit

    # -- conversions -----------------------------------------------------------------------------
    @cached_property
    def compute_types(self) -> tuple[str, ...]:
        """Compute types that hold every value of this type exactly (LADDER's c_tTypes)."""
        return tuple(name for name in COMPUTE_DTYPES if self._converts_exactly(name))

    def _converts_exactly(self, name: str) -> bool:
        torch_dtype = COMPUTE_DTYPES[name][0]
        if self.bits == 32:
            return name == "float32" and self.kind == FLOAT
        values = self.values
        if name == "int8":
            finite = values[torch.isfinite(values)]
            integral = torch.equal(finite.round(), finite) and finite.numel() == values.numel()
            return integral and _INT8_RANGE[0] <= float(finite.min()) and float(finite.max()) <= _INT8_RANGE[1]
        converted = values.to(torch_dtype).float()
        same_nan = torch.equal(torch.isnan(converted), torch.isnan(values))
        finite = ~torch.isnan(values)
        return same_nan and torch.equal(converted[finite], values[finite])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 values of a tensor of raw codes (integers in [0, 2**bits)), on the codes' device."""
        codes = check_codes(codes, self.bits, "codes")
        if self.bits <= 16:
            return self.values.to(codes.device)[codes.long()]
        signed_bits = as_signed(codes.long(), 32).to(torch.int32)
        if self.kind == FLOAT:
            return signed_bits.view(torch.float32).clone()
        return (signed_bits.to(torch.int64) if self.kind == INT else codes.long()).float()

    def convert(self, codes: torch.Tensor, dtype) -> torch.Tensor:
        """Codes decoded into a compute type (rounded where the type is not in `compute_types`)."""
        name = check_compute_dtype(dtype)
        values = self.decode(codes)
        if name == "int8" and "int8" not in self.compute_types:
            raise ValueError(f"type {self.name!r} does not convert to int8; accepted: {list(self.compute_types)}")
        return values.to(COMPUTE_DTYPES[name][0])

    def lut(self, dtype="float32") -> torch.Tensor:
        """Lookup table of all codes' values in `dtype` (types of at most 8 bits), for table-decoding kernels."""
        if self.bits > 8:
            raise ValueError(f"type {self.name!r} has {self.bits}-bit codes; a lookup table needs bits <= 8")
        return self.convert(torch.arange(self.num_codes), dtype)

    def tvm_decode(self, code, dtype="float32", lut=None):
        """TVM expression converting the integer expression `code` to `dtype` (see `tvm_decode.decode`)."""
        from .tvm_decode import decode

        return decode(self, code, check_compute_dtype(dtype), lut)

    def __repr__(self) -> str:
        extra = f", block_size={self.block_size}, block_scale={self.block_scale!r}" if self.block_size > 1 else ""
        return f"TType({self.name!r}, bits={self.bits}, kind={self.kind!r}{extra})"


def as_signed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Reinterpret unsigned `bits`-bit integers (int64 tensor) as two's complement."""
    return values - (values >= (1 << (bits - 1))).long() * (1 << bits)


def check_codes(codes, bits: int, argument: str) -> torch.Tensor:
    """Validate a tensor of raw codes: integer dtype, values in [0, 2**bits)."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor of integer codes, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"{argument} must hold integer codes, got dtype {codes.dtype}")
    if codes.numel():
        low, high = (0, int(codes.max())) if codes.dtype == torch.uint8 else map(int, torch.aminmax(codes))
        if low < 0 or high >= 1 << bits:
            raise ValueError(f"{argument} must lie in [0, 2**{bits}); got values in [{low}, {high}]")
    return codes


# -- factories: how users define their own types in one line ----------------------------------------
def integer(name: str, bits: int, signed: bool = True, description: str = "") -> TType:
    """A two's-complement (signed) or plain unsigned integer type of 1..8, 16 or 32 bits."""
    return TType(name, bits, INT if signed else UINT, description=description)


def floating(name: str, exponent_bits: int, mantissa_bits: int, bias: int | None = None, signed: bool = True,
             specials: str = "finite", subnormals: bool = True, description: str = "") -> TType:
    """A minifloat; `bias` defaults to 2**(exponent_bits-1) - 1."""
    bias = (1 << (exponent_bits - 1)) - 1 if bias is None else bias
    fmt = FloatFormat(exponent_bits, mantissa_bits, bias, signed, specials, subnormals)
    return TType(name, fmt.bits, FLOAT, float_format=fmt, description=description)


def codebook(name: str, values, description: str = "") -> TType:
    """A lookup-table type: code i decodes to values[i] (rounded to float32); len(values) must be a power
    of two (2..256)."""
    values = tuple(torch.tensor([float(v) for v in values], dtype=torch.float32).tolist())
    bits = max(1, (len(values) - 1).bit_length())
    return TType(name, bits, CODEBOOK, codebook=values, description=description)


def block_scaled(name: str, element: TType, block_size: int, block_scale: str, tensor_scale: bool = False,
                 description: str = "") -> TType:
    """A block type (MX, NVFP4): elements of `element`'s kind sharing one `block_scale` per block."""
    return TType(name, element.bits, element.kind, float_format=element.float_format, codebook=element.codebook,
                 block_size=block_size, block_scale=block_scale, tensor_scale=tensor_scale,
                 description=description)
