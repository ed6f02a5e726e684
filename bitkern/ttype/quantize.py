"""Round-to-nearest quantization of a [N, K] weight into a ttype, and the dequantize reference.

Zero-point conventions (the ones users' checkpoints use), per group of `group_size` consecutive
elements along K (q: the element code, v(q): its value, s: the group's scale):

| zero_mode | types          | zero stored as               | dequantized weight | range the scale covers        |
|-----------|----------------|------------------------------|--------------------|-------------------------------|
| "none"    | any            | —                            | v(q) · s           | [-absmax, absmax] (bnb absmax) |
| "gptq"    | unsigned ints  | integer code, `bits` wide    | (q − z) · s        | [min(w, 0), max(w, 0)]        |
| "awq"     | unsigned ints  | integer code, `bits` wide    | (q − z) · s        | [min(w), max(w)], z clamped   |
| "hqq"     | unsigned ints  | float (scale dtype)          | (q − z) · s        | [min(w), max(w)], z exact     |

For "none", s = absmax / (largest value of the type), which is bitsandbytes' blockwise absmax rule for
nf4 and fp4; the binary type int1 (±1) takes s = mean |w| instead, the L2-optimal binary scale.
bfloat16 (`CAST_TYPES`) is not quantized but cast: s = 1 and the codes are torch's round-to-nearest-even
bfloat16 of the weight, so a bf16 model's weight is stored exactly (the output layer of a quantized model,
streamed by the same kernels).
Block-scaled types carry their own rule: MX (OCP MX v1.0 §6.3) stores the shared exponent
floor(log2(absmax)) − emax(element) as an e8m0 code per 32; NVFP4 stores absmax / 6 / t as an e4m3
code per 16, with one float32 t = absmax(tensor) / (6 · 448) per tensor.
Every code is the nearest representable value, ties to the even code (round-half-even for integers,
IEEE round-to-nearest-even for floats).
"""

from __future__ import annotations

import math

import torch

from .dtypes import torch_dtype
from .packing import pack, packed_length, unpack
from .registry import get
from .types import INT, UINT, TType
from .weight import ZERO_MODES, Layout, StoredWeight, weight_format

INTEGER_ZERO_MODES = ("gptq", "awq")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_GROUP_SIZE = 128
_ROWS_PER_CHUNK = 256  # bounds the float64 temporaries of nearest-value rounding
CAST_TYPES = ("bfloat16",)  # 16-bit types a weight is cast to (scale 1), not quantized


class QuantizedWeight(StoredWeight):
    """A [N, K] weight stored in a ttype: packed codes, per-group scales and zeros (the portable layout).

    qweight: int32 [N, packed_length(K)] codes packed along K (see `bitkern.ttype.packing`).
    scales: [N, K // group_size] floats, or uint8 codes of `ttype.block_scale` for block-scaled types.
    zeros: [N, K // group_size] uint8 codes ("gptq", "awq"), floats ("hqq"), or None.
    tensor_scale: float32 scalar tensor for types with a per-tensor scale (nvfp4), else None.
    """

    def __init__(self, ttype, shape, group_size, zero_mode: str, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None, tensor_scale: torch.Tensor | None = None):
        ttype = get(ttype)
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise ValueError(f"shape={shape} must be (out_features, in_features)")
        n, k = shape
        group_size = check_group_size(ttype, group_size, k)
        check_zero_mode(ttype, zero_mode)
        _check_tensor("qweight", qweight, (n, packed_length(k, ttype.bits)), (torch.int32,))
        groups = (n, k // group_size)
        scale_dtypes = (torch.uint8,) if ttype.block_size > 1 else SCALE_DTYPES
        _check_tensor("scales", scales, groups, scale_dtypes)
        if zero_mode in INTEGER_ZERO_MODES:
            _check_tensor("zeros", zeros, groups, (torch.uint8,))
        elif zero_mode == "hqq":
            _check_tensor("zeros", zeros, groups, SCALE_DTYPES)
        elif zeros is not None:
            raise ValueError(f"zeros must be None for zero_mode={zero_mode!r}")
        if ttype.tensor_scale:
            _check_tensor("tensor_scale", tensor_scale, (), (torch.float32,))
        elif tensor_scale is not None:
            raise ValueError(f"tensor_scale must be None for type {ttype.name!r}")
        for argument, tensor in (("scales", scales), ("zeros", zeros), ("tensor_scale", tensor_scale)):
            if tensor is not None and tensor.device != qweight.device:
                raise ValueError(f"{argument} is on {tensor.device} but qweight is on {qweight.device}")
        super().__init__(weight_format(ttype, shape, group_size, zero_mode, scales, Layout.ROWMAJOR), qweight, scales,
                         zeros, tensor_scale)

    def codes(self) -> torch.Tensor:
        """The unpacked [N, K] codes (uint8)."""
        return unpack(self.qweight, self.ttype.bits, self.shape)

    def scale_values(self) -> torch.Tensor:
        """The float32 [N, K // group_size] scale of every group (block scale × tensor scale where present)."""
        if self.ttype.block_size == 1:
            return self.scales.float()
        scale = get(self.ttype.block_scale).decode(self.scales)
        return scale * self.tensor_scale if self.tensor_scale is not None else scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight this object represents, computed in float32 and returned in `dtype`."""
        n, k = self.shape
        groups = k // self.group_size
        codes = self.codes().reshape(n, groups, self.group_size)
        scale = self.scale_values().unsqueeze(-1)
        if self.zero_mode == "none":
            weight = self.ttype.decode(codes) * scale
        else:
            weight = (codes.float() - self.zeros.float().unsqueeze(-1)) * scale
        return weight.reshape(n, k).to(dtype)

    def to_portable(self) -> "QuantizedWeight":
        """Itself: the portable layout."""
        return self


def effective_group_size(group_size: int, k: int) -> int:
    """Elements along K per scale: `group_size`, or all of K for per-channel (-1)."""
    return k if group_size == -1 else group_size


def quantize(weight: torch.Tensor, dtype="int4", group_size: int | None = None, zero_mode: str | None = None,
             scale_dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """Quantize a float [N, K] weight (N outputs, K inputs) to `dtype` by round-to-nearest per group.

    group_size: elements along K sharing a scale; any divisor of K, -1 for per-channel; default 128
    (the block size for block-scaled types, which accept no other).  zero_mode: see the module table;
    default "gptq" for unsigned integer types and "none" otherwise.  scale_dtype: storage of the scales
    (and of hqq's float zeros).
    """
    ttype = get(dtype)
    if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"weight must be a floating-point torch.Tensor, got {got}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if ttype.bits > 8 and ttype.name not in CAST_TYPES:
        raise ValueError(f"dtype={ttype.name!r} is not a low-precision type; quantize accepts types of at most "
                         f"8 bits and {', '.join(CAST_TYPES)} (for {ttype.name} cast the weight with .to())")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype} is not supported; accepted: {list(SCALE_DTYPES)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight contains NaN or infinity; quantization needs finite values")
    n, k = weight.shape
    group_size = check_group_size(ttype, DEFAULT_GROUP_SIZE if group_size is None and ttype.block_size == 1
                                  else group_size, k)
    zero_mode = default_zero_mode(ttype) if zero_mode is None else zero_mode
    check_zero_mode(ttype, zero_mode)

    if ttype.name in CAST_TYPES:
        return _cast(ttype, weight, group_size, zero_mode, scale_dtype)
    groups = weight.float().reshape(n, k // group_size, group_size)
    zeros = tensor_scale = None
    if ttype.block_size > 1:
        scales, tensor_scale, divisor = _block_scales(ttype, groups)
        codes = nearest_codes(ttype, _safe_divide(groups, divisor.unsqueeze(-1)))
    elif zero_mode == "none":
        scales = _store_scale(_symmetric_scale(ttype, groups), scale_dtype)
        codes = nearest_codes(ttype, _safe_divide(groups, scales.float().unsqueeze(-1)))
    else:
        scales, zeros, codes = _asymmetric(ttype, groups, zero_mode, scale_dtype)
    return QuantizedWeight(ttype, (n, k), group_size, zero_mode, pack(codes.reshape(n, k), ttype.bits),
                           scales, zeros, tensor_scale)


def _cast(ttype: TType, weight: torch.Tensor, group_size: int, zero_mode: str, scale_dtype) -> QuantizedWeight:
    """The weight cast to a 16-bit float type of `CAST_TYPES` (scale 1): its codes are the cast's bits, two per
    word as `pack` lays them (the even k in the low half)."""
    n, k = weight.shape
    bits = weight.to(torch_dtype(ttype.name)).contiguous().view(torch.int16)
    words = torch.nn.functional.pad(bits, (0, k % 2)).view(torch.int32)
    scales = torch.ones(n, k // group_size, dtype=scale_dtype, device=weight.device)
    return QuantizedWeight(ttype, (n, k), group_size, zero_mode, words, scales)


def default_zero_mode(ttype: TType) -> str:
    """The zero mode `quantize` uses when none is given: asymmetric for unsigned integers."""
    return "gptq" if ttype.kind == UINT and ttype.block_size == 1 else "none"


def check_group_size(ttype: TType, group_size, k: int) -> int:
    """Validate `group_size` for a reduction length `k`; -1 means per-channel (k)."""
    if ttype.block_size > 1:
        if group_size not in (None, ttype.block_size):
            raise ValueError(f"group_size={group_size!r}: type {ttype.name!r} has a fixed block of "
                             f"{ttype.block_size}; accepted: None or {ttype.block_size}")
        group_size = ttype.block_size
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int (a divisor of in_features={k}, or -1), got {group_size!r}")
    group_size = effective_group_size(group_size, k)
    if group_size < 1 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}; accepted: a divisor of "
                         f"{k}, or -1 for per-channel")
    return group_size


def check_zero_mode(ttype: TType, zero_mode) -> None:
    """Validate that `zero_mode` is known and applies to `ttype`."""
    if zero_mode not in ZERO_MODES:
        raise ValueError(f"zero_mode={zero_mode!r} is not known; accepted: {list(ZERO_MODES)}")
    if zero_mode != "none" and (ttype.kind != UINT or ttype.block_size > 1):
        raise ValueError(f"zero_mode={zero_mode!r} needs an unsigned integer type (uint1..uint8); type "
                         f"{ttype.name!r} accepts zero_mode='none'")


def nearest_codes(ttype: TType, x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of the values of `ttype` nearest to float tensor `x`, ties to the even code,
    saturating at the largest finite values."""
    if ttype.kind in (INT, UINT) and ttype.bits > 1:
        values = ttype.values
        q = torch.round(x).clamp(float(values.min()), float(values.max())).long()
        return (q & (ttype.num_codes - 1)).to(torch.uint8)
    candidates, codes = _sorted_finite_values(ttype)
    candidates, codes = candidates.to(x.device), codes.to(x.device)
    zero, negative_zero = _zero_codes(ttype)
    midpoints = (candidates[1:] + candidates[:-1]) / 2
    flat = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    for start in range(0, flat.shape[0], _ROWS_PER_CHUNK):
        chunk = flat[start:start + _ROWS_PER_CHUNK].double()
        index = torch.searchsorted(midpoints, chunk)
        upper = (index + 1).clamp(max=len(codes) - 1)
        tie = chunk == midpoints[index.clamp(max=len(midpoints) - 1)]
        take_upper = tie & (codes[index] % 2 == 1) & (codes[upper] % 2 == 0)
        chosen = torch.where(take_upper, codes[upper], codes[index])
        if negative_zero is not None:  # IEEE rounding keeps the sign of a value that rounds to zero
            chosen = torch.where((chosen == zero) & torch.signbit(chunk), negative_zero, chosen)
        out[start:start + _ROWS_PER_CHUNK] = chosen.to(torch.uint8)
    return out.reshape(x.shape)


def _sorted_finite_values(ttype: TType) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct finite values of `ttype` in increasing order (float64) and the smallest code of each."""
    values = ttype.values.double()
    codes = torch.arange(ttype.num_codes)
    finite = torch.isfinite(values)
    values, codes = values[finite], codes[finite]
    order = torch.argsort(values, stable=True)  # equal values (±0) keep the smaller code first
    values, codes = values[order], codes[order]
    first = torch.ones_like(values, dtype=torch.bool)
    first[1:] = values[1:] != values[:-1]
    return values[first], codes[first]


def _zero_codes(ttype: TType) -> tuple[int | None, int | None]:
    """The codes of +0 and, for types that have one (IEEE-style floats), of -0."""
    values = ttype.values
    zeros = (values == 0).nonzero().flatten().tolist()
    positive = [c for c in zeros if not torch.signbit(values[c])]
    negative = [c for c in zeros if torch.signbit(values[c])]
    return (positive[0] if positive else None), (negative[0] if negative and positive else None)


def _safe_divide(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, with zero scales (all-zero groups) treated as 1 so their codes come out as 0."""
    return x / torch.where(scale == 0, torch.ones_like(scale), scale)


def _symmetric_scale(ttype: TType, groups: torch.Tensor) -> torch.Tensor:
    if ttype.kind == INT and ttype.bits == 1:
        return groups.abs().mean(-1)
    largest = float(ttype.values[torch.isfinite(ttype.values)].max())
    return groups.abs().amax(-1) / largest


def _store_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    stored = scale.to(scale_dtype)
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(f"scales overflow scale_dtype={scale_dtype}; pass scale_dtype=torch.float32")
    return stored


def _asymmetric(ttype: TType, groups: torch.Tensor, zero_mode: str, scale_dtype: torch.dtype):
    """Scales, zeros and codes of the zero-point conventions ("gptq", "awq", "hqq")."""
    top = ttype.num_codes - 1
    low, high = groups.amin(-1), groups.amax(-1)
    # GPTQ's range always holds 0; the others widen only constant groups to 0, so they stay exact.
    widen = torch.ones_like(low, dtype=torch.bool) if zero_mode == "gptq" else low == high
    low, high = torch.where(widen, low.clamp(max=0), low), torch.where(widen, high.clamp(min=0), high)
    scale = _store_scale((high - low) / top, scale_dtype)
    stored = scale.float()
    stored = torch.where(stored == 0, torch.ones_like(stored), stored)
    if zero_mode == "hqq":
        zero = (-low / stored).to(scale_dtype)
        codes = torch.round(groups / stored.unsqueeze(-1) + zero.float().unsqueeze(-1)).clamp(0, top)
    else:
        zero = torch.round(-low / stored).clamp(0, top)
        codes = (torch.round(groups / stored.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, top)
        zero = zero.to(torch.uint8)
    return scale, zero, codes.to(torch.uint8)


def _block_scales(ttype: TType, groups: torch.Tensor):
    """Block scale codes (uint8), tensor scale, and the float32 divisor per block, by the type's rule."""
    absmax = groups.abs().amax(-1)
    element_max = float(ttype.values[torch.isfinite(ttype.values)].max())
    scale_type = get(ttype.block_scale)
    if ttype.tensor_scale:
        tensor_amax = float(absmax.max())
        tensor_scale = torch.tensor(tensor_amax / (element_max * scale_type.max_abs) if tensor_amax else 1.0,
                                    dtype=torch.float32, device=groups.device)
        codes = nearest_codes(scale_type, absmax / element_max / tensor_scale)
        return codes, tensor_scale, scale_type.decode(codes) * tensor_scale
    if scale_type.name != "float8_e8m0":
        raise ValueError(f"block_scale={scale_type.name!r} of {ttype.name!r} has no scale rule; "
                         f"accepted: float8_e8m0 (MX), float8_e4m3 with tensor_scale (NVFP4)")
    element_emax = math.floor(math.log2(element_max))
    _, exponent = torch.frexp(absmax)
    shared = torch.where(absmax > 0, exponent - 1 - element_emax, torch.full_like(exponent, -127)).clamp(-127, 127)
    codes = (shared + 127).to(torch.uint8)
    return codes, None, torch.ldexp(torch.ones_like(absmax), shared)


def _check_tensor(argument: str, tensor, shape: tuple, dtypes: tuple) -> None:
    """Raise naming `argument` unless `tensor` is a tensor of `shape` with one of `dtypes`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor of shape {shape}, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{argument} has dtype {tensor.dtype}; accepted: {list(dtypes)}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{argument} has shape {tuple(tensor.shape)}, expected {shape}")
