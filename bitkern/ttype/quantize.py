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

`method` says how the scales and zeros are chosen ("rtn": by the rules above; "hqq": optimized per group
without data, see `_optimized`); the codes are then always the nearest ones for the group's scale and zero.
"gptq" (`bitkern.ttype.gptq`) needs calibration data; it takes a `Grid` (the scales and zeros of some groups and
their rounding) per group and rounds one column at a time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .dtypes import torch_dtype
from .packing import pack_codes, packed_length, unpack
from .registry import get
from .types import INT, UINT, TType
from .weight import ZERO_MODES, Layout, StoredWeight, weight_format

INTEGER_ZERO_MODES = ("gptq", "awq")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_GROUP_SIZE = 128
_ROWS_PER_CHUNK = 256  # bounds the float64 temporaries of nearest-value rounding by search
_CHUNK_ELEMENTS = 1 << 20  # quantize rows in chunks of about this many weights, so temporaries stay in cache
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # weight dtypes that divide by float32 scales exactly
CAST_TYPES = ("bfloat16",)  # 16-bit types a weight is cast to (scale 1), not quantized
METHODS = ("rtn", "hqq", "gptq")  # how a weight was quantized: the module table's rules, optimized per group, GPTQ
CALIBRATED_METHODS = ("gptq",)  # methods that need calibration data (bitkern.quantize_model's calibration=)
# "hqq" on scale search: the group's range (or absmax) times each factor, the best one by squared error after an
# exact least-squares refit of the scale; 1.0 first, so that ties keep round-to-nearest's choice
_SEARCH_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7)
_BLOCK_SCALE_STEPS = (0, 1, -1)  # "hqq" on block-scaled types: the rule's scale code and its neighbours
# "hqq" on float zeros: half-quadratic splitting with an l_p error (p < 1: outliers pull the zero less), the
# shrinkage weight beta (in code units) growing by kappa per iteration
_HQ_P, _HQ_BETA, _HQ_KAPPA, _HQ_ITERATIONS = 0.7, 1.0, 1.5, 12
_AFFINE_REFITS = 4  # then scale and zero refitted by least squares to the codes, alternating with rounding


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

    def dequantize(self, dtype: torch.dtype = torch.float32, values: torch.Tensor | None = None) -> torch.Tensor:
        """The [N, K] weight this object represents, computed in float32 and returned in `dtype`; `values`: the
        value of every code in place of the type's own (the int8 code book activation_quant="int8" multiplies)."""
        n, k = self.shape
        groups = k // self.group_size
        codes = self.codes().reshape(n, groups, self.group_size)
        scale = self.scale_values().unsqueeze(-1)
        if values is not None:
            weight = values.float()[codes.long()] * scale
        elif self.zero_mode == "none":
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
             scale_dtype: torch.dtype = torch.float16, method: str = "rtn") -> QuantizedWeight:
    """Quantize a float [N, K] weight (N outputs, K inputs) to `dtype`, per group of `group_size` inputs.

    group_size: elements along K sharing a scale; any divisor of K, -1 for per-channel; default 128
    (the block size for block-scaled types, which accept no other).  zero_mode: see the module table;
    default "gptq" for unsigned integer types and "none" otherwise.  scale_dtype: storage of the scales
    (and of hqq's float zeros).  method: "rtn" (default) takes each group's scale and zero from its range by
    the module table's rules; "hqq" optimizes them per group, without data, for the least squared
    reconstruction error (never more than "rtn"'s: its choice is one of the candidates).  Rows are quantized a
    chunk at a time, so the temporaries stay small.
    """
    ttype, group_size, zero_mode = resolve_arguments(weight, dtype, group_size, zero_mode, scale_dtype)
    n, k = weight.shape
    check_method(ttype, method)

    if ttype.name in CAST_TYPES:
        return _cast(ttype, weight, group_size, zero_mode, scale_dtype)
    grid = group_grid(weight, ttype, group_size, zero_mode, scale_dtype, method)
    qweight = torch.empty(n, packed_length(k, ttype.bits), dtype=torch.int32, device=weight.device)
    rows = max(1, _CHUNK_ELEMENTS // k)
    for start in range(0, n, rows):
        chunk = weight[start:start + rows]
        codes = grid.rule.codes(_as_float(chunk).reshape(chunk.shape[0], -1, group_size), slice(start, start + rows))
        qweight[start:start + rows] = pack_codes(codes.reshape(chunk.shape), ttype.bits)
    return QuantizedWeight(ttype, (n, k), group_size, zero_mode, qweight, grid.scales, grid.zeros, grid.tensor_scale)


@dataclass
class Grid:
    """The scales and zeros chosen for the groups of a weight ([N, groups] as `QuantizedWeight` stores them) and
    the rounding they give: what `quantize` codes a whole weight with, and what GPTQ rounds one column of a group
    with (`codes`) and takes back to values (`values`) to feed the rounding error forward."""

    ttype: TType
    scales: torch.Tensor
    zeros: torch.Tensor | None
    tensor_scale: torch.Tensor | None
    rule: _Rounding

    def codes(self, column: torch.Tensor, group: int) -> torch.Tensor:
        """The uint8 codes [N] of a float32 column [N] of group `group`."""
        return self.rule.codes(column.reshape(-1, 1, 1), slice(None), group).reshape(-1)

    def values(self, codes: torch.Tensor, group: int) -> torch.Tensor:
        """The float32 values [N] that codes [N] of group `group` stand for (`QuantizedWeight.dequantize`'s)."""
        if self.ttype.block_size == 1:
            scale = self.scales[:, group].float()
        else:
            scale = get(self.ttype.block_scale).decode(self.scales[:, group])
            scale = scale * self.tensor_scale if self.tensor_scale is not None else scale
        if self.zeros is None:
            return self.ttype.decode(codes) * scale
        return (codes.float() - self.zeros[:, group].float()) * scale


def group_grid(weight: torch.Tensor, ttype: TType, group_size: int, zero_mode: str, scale_dtype: torch.dtype,
               method: str, tensor_scale: torch.Tensor | None = None) -> Grid:
    """The `Grid` of a float [N, K] weight's groups chosen by `method` ("rtn" or "hqq"; the arguments checked by
    the caller).  tensor_scale: for types with one (nvfp4), the tensor scale to use instead of the weight's own
    (GPTQ takes the whole weight's while it chooses one group at a time)."""
    low, high = _group_range(weight, group_size)
    zeros = None
    if ttype.block_size > 1:
        scales, tensor_scale, divisor = _block_scales(ttype, torch.maximum(low.abs(), high.abs()), tensor_scale)
        if method == "hqq":
            scales, divisor = _optimized(_search_block_scale, weight, group_size, ttype, scales, tensor_scale)
        rule = _Rounding(ttype, _nonzero(divisor))
    elif zero_mode == "none":
        scales = _store_scale(_symmetric_scale(ttype, weight, group_size, low, high), scale_dtype)
        if method == "hqq":
            scales = _optimized(_search_symmetric, weight, group_size, ttype, scales)
        rule = _Rounding(ttype, _nonzero(scales.float()))
    else:
        scales, zeros, divisor, offset = _asymmetric(ttype, low, high, zero_mode, scale_dtype)
        if method == "hqq":
            search = _half_quadratic_zero if zero_mode == "hqq" else _search_integer_zero
            scales, zeros = _optimized(search, weight, group_size, ttype, scales, zeros, low, high, zero_mode)
            divisor, offset = _nonzero(scales.float()), zeros.float()
        rule = _Rounding(ttype, divisor, offset, zero_mode)
    return Grid(ttype, scales, zeros, tensor_scale, rule)


def resolve_arguments(weight: torch.Tensor, dtype, group_size, zero_mode, scale_dtype) -> tuple[TType, int, str]:
    """`quantize`'s arguments checked (ValueError/TypeError naming the one at fault), with the type, the group
    size and the zero mode they resolve to (defaults filled in, -1 as K)."""
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
    k = weight.shape[1]
    group_size = check_group_size(ttype, DEFAULT_GROUP_SIZE if group_size is None and ttype.block_size == 1
                                  else group_size, k)
    zero_mode = default_zero_mode(ttype) if zero_mode is None else zero_mode
    check_zero_mode(ttype, zero_mode)
    return ttype, group_size, zero_mode


def _cast(ttype: TType, weight: torch.Tensor, group_size: int, zero_mode: str, scale_dtype) -> QuantizedWeight:
    """The weight cast to a 16-bit float type of `CAST_TYPES` (scale 1): its codes are the cast's bits, two per
    word as `pack` lays them (the even k in the low half)."""
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight contains NaN or infinity; quantization needs finite values")
    n, k = weight.shape
    bits = weight.to(torch_dtype(ttype.name)).contiguous().view(torch.int16)
    words = torch.nn.functional.pad(bits, (0, k % 2)).view(torch.int32)
    scales = torch.ones(n, k // group_size, dtype=scale_dtype, device=weight.device)
    return QuantizedWeight(ttype, (n, k), group_size, zero_mode, words, scales)


def check_method(ttype: TType, method, calibrated: bool = False) -> None:
    """Validate that `method` is known and applies to `ttype` (a cast type has no scale or zero to optimize), and
    that a method needing calibration data has it (`calibrated`: data comes with it, or the weight was quantized
    with it and is only recorded)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not known; accepted: {list(METHODS)}")
    if method != "rtn" and ttype.name in CAST_TYPES:
        raise ValueError(f"method={method!r} does not apply to dtype={ttype.name!r}, which is cast, not quantized "
                         f"(no scale or zero to optimize); accepted: method='rtn'")
    if method in CALIBRATED_METHODS and not calibrated:
        data_free = [m for m in METHODS if m not in CALIBRATED_METHODS]
        raise ValueError(f"method={method!r} needs calibration data (inputs whose activations weigh each layer's "
                         f"error), which is not given here; pass it as bitkern.quantize_model(model, "
                         f"method={method!r}, calibration=...), or use a data-free method: {data_free}")


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
        top = float(values.max())
        codes = _as_bytes(torch.round(x).clamp_(float(values.min()), top), top)
        return codes if ttype.kind == UINT or ttype.bits == 8 else codes.bitwise_and_(ttype.num_codes - 1)
    table = _rounding_table(ttype, x.device) if x.dtype in _FLOATS else None
    if table is None:
        return _nearest_codes_by_search(ttype, x)
    return table.codes(x)


class _RoundingTable:
    """Nearest-code rounding of float32 values by table lookup, bit for bit what `_nearest_codes_by_search`
    gives.  A value's bfloat16 rounding (its top 16 bits, rounded) names an interval of float32 values that
    holds at most one rounding threshold; per interval the table keeps that threshold and the codes below
    and above it (the same code twice where the interval holds none), the code of interval i and side u
    at 2·i + u."""

    def __init__(self, threshold: torch.Tensor, codes: torch.Tensor):
        self.threshold, self.codes_by_side = threshold, codes

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1).float()
        cell = flat.to(torch.bfloat16).view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
        above = flat > self.threshold.index_select(0, cell)
        return self.codes_by_side.index_select(0, cell.mul_(2).add_(above)).reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _rounding_table(ttype: TType, device: torch.device) -> _RoundingTable | None:
    """The rounding table of `ttype` on `device`, or None where some bfloat16 interval holds two thresholds
    (values closer than bfloat16 resolves) or a threshold lies among the float32 subnormals (which some
    float32 -> bfloat16 conversions flush to zero)."""
    if device.type != "cpu":
        cpu = _rounding_table(ttype, torch.device("cpu"))
        return None if cpu is None else _RoundingTable(cpu.threshold.to(device), cpu.codes_by_side.to(device))
    candidates, codes = _sorted_finite_values(ttype)
    zero, negative_zero = _zero_codes(ttype)
    midpoints = (candidates[1:] + candidates[:-1]) / 2
    # x > thresholds[j] exactly when the search rounds x above midpoint j: x > m, or x >= m where a tie at
    # m goes to the upper code (the even one)
    tie_up = (codes[:-1] % 2 == 1) & (codes[1:] % 2 == 0)
    thresholds = midpoints.float()
    below = (thresholds.double() > midpoints) | (tie_up & (thresholds.double() == midpoints))
    thresholds = torch.where(below, torch.nextafter(thresholds, torch.tensor(-math.inf)), thresholds)
    if bool((thresholds.abs() < torch.finfo(torch.float32).tiny).any()):
        return None
    # float32 bit patterns rounding to each bfloat16 pattern (round to nearest, ties to even), by magnitude
    pattern = torch.arange(1 << 16, dtype=torch.int64)
    magnitude, negative = pattern & 0x7FFF, pattern >= 0x8000
    infinity = 0x7F800000
    low = ((magnitude << 16) - 0x8000 + (magnitude & 1)).clamp(0, infinity)
    high = ((magnitude << 16) + 0x8000 - (magnitude & 1)).clamp(0, infinity)
    ends = torch.stack([low, high], -1).to(torch.int32).view(torch.float32).double()
    ends = torch.where(negative.unsqueeze(-1), -ends.flip(-1), ends)
    index = torch.searchsorted(thresholds.double(), ends)
    if bool((index[:, 1] - index[:, 0] > 1).any()):
        return None
    chosen = codes[index]
    if negative_zero is not None:  # IEEE rounding keeps the sign of a value that rounds to zero
        chosen = torch.where((chosen == zero) & negative.unsqueeze(-1), negative_zero, chosen)
    threshold = thresholds[index[:, 0].clamp(max=len(thresholds) - 1)]
    return _RoundingTable(threshold, chosen.reshape(-1).to(torch.uint8))


def _nearest_codes_by_search(ttype: TType, x: torch.Tensor) -> torch.Tensor:
    """`nearest_codes` by binary search over the midpoints of the type's values, in float64."""
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


def _as_float(weight: torch.Tensor) -> torch.Tensor:
    """The weight in a dtype whose division by float32 scales is the float32 division (float32 itself, or a
    16-bit float, which converts to float32 exactly)."""
    return weight if weight.dtype in _FLOATS else weight.float()


def _group_range(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of every group as float32 [N, K // group_size], read a chunk of rows at a time; ValueError
    if the weight holds NaN or infinity.  Taken from float32 groups (faster than 16-bit ones, and which of -0.0
    and +0.0 a group's amin/amax reports depends on the dtype's vector width: the sign of a zero range reaches
    the zero-point conventions' scales and zeros)."""
    n, k = weight.shape
    low = torch.empty(n, k // group_size, dtype=torch.float32, device=weight.device)
    high = torch.empty_like(low)
    rows = max(1, _CHUNK_ELEMENTS // k)
    for start in range(0, n, rows):
        chunk = weight[start:start + rows]
        groups = chunk.float().reshape(chunk.shape[0], -1, group_size)
        low[start:start + rows], high[start:start + rows] = groups.amin(-1), groups.amax(-1)
    if not bool(torch.isfinite(low).all() & torch.isfinite(high).all()):
        raise ValueError("weight contains NaN or infinity; quantization needs finite values")
    return low, high


@dataclass
class _Rounding:
    """How a chunk of groups becomes codes: divided by its group's `divisor`, then rounded to the nearest
    code ("none"), or rounded with the group's zero point `offset` added before ("hqq") or after ("gptq",
    "awq") and clamped to the code range."""

    ttype: TType
    divisor: torch.Tensor
    offset: torch.Tensor | None = None
    zero_mode: str = "none"

    def codes(self, groups: torch.Tensor, rows: slice, group: int | None = None) -> torch.Tensor:
        """Codes of `groups` [rows, G, group_size] (the rows `rows` of the weight), or with `group`, of one
        group's elements [rows, 1, m] (that group's divisor and offset)."""
        columns = slice(None) if group is None else slice(group, group + 1)
        x = groups / self.divisor[rows, columns].unsqueeze(-1)
        if self.zero_mode == "none":
            return nearest_codes(self.ttype, x)
        offset = self.offset[rows, columns].unsqueeze(-1)
        x = x.add_(offset).round_() if self.zero_mode == "hqq" else x.round_().add_(offset)
        return _as_bytes(x.clamp_(0, self.ttype.num_codes - 1), self.ttype.num_codes - 1)


def _as_bytes(q: torch.Tensor, top: float) -> torch.Tensor:
    """Integral floats in [-128, top], top <= 255, as uint8 (negatives as their two's complement byte): through
    int8 where top allows (torch converts float32 to int8 ~8x faster than to uint8), else through int16."""
    return q.to(torch.int8).view(torch.uint8) if top < 128 else q.to(torch.int16).to(torch.uint8)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """Zero scales (all-zero groups) replaced by 1, so that their codes come out as 0."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _symmetric_scale(ttype: TType, weight: torch.Tensor, group_size: int, low: torch.Tensor,
                     high: torch.Tensor) -> torch.Tensor:
    if ttype.kind == INT and ttype.bits == 1:
        return weight.float().reshape(weight.shape[0], -1, group_size).abs().mean(-1)
    largest = float(ttype.values[torch.isfinite(ttype.values)].max())
    return torch.maximum(low.abs(), high.abs()) / largest


def _store_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    stored = scale.to(scale_dtype)
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(f"scales overflow scale_dtype={scale_dtype}; pass scale_dtype=torch.float32")
    return stored


def _asymmetric(ttype: TType, low: torch.Tensor, high: torch.Tensor, zero_mode: str, scale_dtype: torch.dtype):
    """Scales and zeros of the zero-point conventions ("gptq", "awq", "hqq"), the float32 divisor of each
    group and the zero point its rounding adds (see `_Rounding`)."""
    top = ttype.num_codes - 1
    # GPTQ's range always holds 0; the others widen only constant groups to 0, so they stay exact.
    widen = torch.ones_like(low, dtype=torch.bool) if zero_mode == "gptq" else low == high
    low, high = torch.where(widen, low.clamp(max=0), low), torch.where(widen, high.clamp(min=0), high)
    scale = _store_scale((high - low) / top, scale_dtype)
    stored = _nonzero(scale.float())
    if zero_mode == "hqq":
        zero = (-low / stored).to(scale_dtype)
        return scale, zero, stored, zero.float()
    zero = torch.round(-low / stored).clamp(0, top)
    return scale, zero.to(torch.uint8), stored, zero


def _optimized(search, weight: torch.Tensor, group_size: int, ttype: TType, *arguments):
    """Run a "hqq" `search(ttype, groups, *arguments)` on a chunk of rows at a time (groups: float32
    [rows, K // group_size, group_size]; the [N, K // group_size] tensors among `arguments` sliced to the
    chunk's rows) and join its per-group results."""
    n, k = weight.shape
    rows = max(1, _CHUNK_ELEMENTS // k)
    parts = []
    for start in range(0, n, rows):
        groups = weight[start:start + rows].float().reshape(-1, k // group_size, group_size)
        chunk = [a[start:start + rows] if isinstance(a, torch.Tensor) and a.dim() == 2 else a for a in arguments]
        result = search(ttype, groups, *chunk)
        parts.append(result if isinstance(result, tuple) else (result,))
    joined = tuple(torch.cat(part) for part in zip(*parts))
    return joined if len(joined) > 1 else joined[0]


def _nearest_values(ttype: TType, x: torch.Tensor) -> torch.Tensor:
    """The values (float32) of `ttype` nearest to `x`: rounding and clamping for integers, else by code."""
    if ttype.kind == INT and ttype.bits > 1:
        finite = ttype.values
        return torch.round(x).clamp_(float(finite.min()), float(finite.max()))
    return ttype.values.to(x.device).index_select(0, nearest_codes(ttype, x).reshape(-1).long()).reshape(x.shape)


def _squared_error(sum_ww, sum_wv, sum_vv, scale):
    """Σ (w − scale·v)² of each group, from its sums Σw², Σw·v and Σv²."""
    return sum_ww - 2 * scale * sum_wv + scale * scale * sum_vv


def _refit(groups: torch.Tensor, values: torch.Tensor, dtype: torch.dtype):
    """The least-squares scale of each group for fixed code values (Σw·v / Σv², stored in `dtype`) and the
    squared error it gives (infinite where no positive finite scale exists)."""
    return _least_squares((groups * groups).sum(-1), (groups * values).sum(-1), (values * values).sum(-1), dtype)


def _least_squares(sum_ww: torch.Tensor, sum_wv: torch.Tensor, sum_vv: torch.Tensor, dtype: torch.dtype):
    """`_refit`'s scale (Σw·v / Σv² in `dtype`) and squared error from the groups' three sums."""
    stored = (sum_wv / sum_vv).to(dtype)
    scale = stored.float()
    error = _squared_error(sum_ww, sum_wv, sum_vv, scale)
    return stored, error.masked_fill_(~(torch.isfinite(error) & (scale > 0)), math.inf)


def _keep_better(best: list, error: torch.Tensor, *candidates) -> None:
    """Take, per group, the candidate tensors where `error` is lower than best[0] (ties keep the earlier one)."""
    better = error < best[0]
    best[0] = torch.where(better, error, best[0])
    for i, candidate in enumerate(candidates, 1):
        best[i] = torch.where(better, candidate, best[i])


def _search_symmetric(ttype: TType, groups: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """"hqq" for zero_mode "none": scales tried at factors of the absmax rule's (`_SEARCH_FACTORS`), each refitted
    by least squares to the codes it rounds to; the lowest squared error per group wins (the rule's own scale
    included).  Where the type's values are not symmetric about 0 (int4 reaches -8 but only +7; nf4 has eight
    positive levels and seven negative ones), each factor is tried with a negative scale too: the group mirrored
    onto the type's other side, as llama.cpp's q4_0 maps a group's signed extreme to -8.  A negative scale is
    stored as it is (dequantized = value x scale holds for either sign)."""
    rule = scales.float()
    x = groups / _nonzero(rule).unsqueeze(-1)
    sum_ww = torch.linalg.vecdot(groups, groups)
    values = _nearest_values(ttype, x)
    best = [_squared_error(sum_ww, torch.linalg.vecdot(groups, values), torch.linalg.vecdot(values, values), rule),
            scales]
    signs = _scale_signs(ttype)
    integer = ttype.kind == INT and ttype.bits > 1
    if integer:
        low, high = float(ttype.values.min()), float(ttype.values.max())
    for factor in _SEARCH_FACTORS:
        if integer:  # one rounding serves both signs: the value v at scale -t is -v at t, clamped to [-high, -low]
            rounded = torch.mul(x, 1 / factor).round_()
            candidates = [rounded.clamp(low, high)] + ([rounded.clamp_(-high, -low)] if len(signs) > 1 else [])
        else:
            candidates = [_nearest_values(ttype, x * (sign / factor)).mul_(sign) for sign in signs]
        for sign, values in zip(signs, candidates):
            candidate, error = _refit_given(groups, values, sum_ww, scales.dtype)
            _keep_better(best, error, candidate if sign > 0 else candidate.neg())
    return best[1]


def _refit_given(groups: torch.Tensor, values: torch.Tensor, sum_ww: torch.Tensor, dtype: torch.dtype):
    """`_refit` with the groups' Σw² given, its sums by `torch.linalg.vecdot` (no product temporaries)."""
    return _least_squares(sum_ww, torch.linalg.vecdot(groups, values), torch.linalg.vecdot(values, values), dtype)


@functools.lru_cache(maxsize=None)
def _scale_signs(ttype: TType) -> tuple[float, ...]:
    """(1.0, -1.0) where the type's finite values are not symmetric about 0 (a negative scale reaches other
    values), else (1.0,)."""
    values = ttype.values[torch.isfinite(ttype.values)].float()
    mirrored = torch.equal(torch.sort(values).values, torch.sort(-values).values)
    return (1.0,) if mirrored else (1.0, -1.0)


def _search_integer_zero(ttype: TType, groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         low: torch.Tensor, high: torch.Tensor, zero_mode: str):
    """"hqq" for integer zeros ("gptq", "awq"): the group's range shrunk by each factor gives a scale and an
    integer zero; the scale is refitted by least squares to the codes it rounds to, the zero kept; the lowest
    squared error per group wins (the rule's scale and zero included)."""
    top = ttype.num_codes - 1
    rule, zero = scales.float(), zeros.float()
    shifted = torch.round(groups / _nonzero(rule).unsqueeze(-1)).add_(zero.unsqueeze(-1)).clamp_(0, top)
    shifted.sub_(zero.unsqueeze(-1))
    sum_ww = (groups * groups).sum(-1)
    best = [_squared_error(sum_ww, (groups * shifted).sum(-1), (shifted * shifted).sum(-1), rule), scales, zeros]
    for factor in _SEARCH_FACTORS:
        lo, hi = low * factor, high * factor
        if zero_mode == "gptq":
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = _nonzero((hi - lo) / top)
        zero = torch.round(-lo / scale).clamp_(0, top)
        shifted = torch.round(groups / scale.unsqueeze(-1)).add_(zero.unsqueeze(-1)).clamp_(0, top)
        candidate, error = _refit(groups, shifted.sub_(zero.unsqueeze(-1)), scales.dtype)
        _keep_better(best, error, candidate, zero.to(torch.uint8))
    return best[1], best[2]


def _half_quadratic_zero(ttype: TType, groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         low: torch.Tensor, high: torch.Tensor, zero_mode: str):
    """"hqq" for float zeros (zero_mode "hqq"): first the zero minimizing an l_p norm (p < 1) of the error at the
    rule's scale, by half-quadratic splitting: the error e is split off as a variable of its own, shrunk to the
    l_p proximal step (small errors go to 0, outliers keep most of theirs), and the zero set to the mean that
    makes the codes reproduce w minus the shrunk error; alternating with rounding, with the splitting weight beta
    growing.  In code units (w / scale), so beta does not depend on the weights' magnitude.  Then scale and zero
    together refitted by least squares to the codes they round to (`_refit_affine`).  Every candidate is measured
    as stored (scale dtype); the lowest squared error per group wins (the rule's scale and zero included)."""
    top = ttype.num_codes - 1
    x = groups / _nonzero(scales.float()).unsqueeze(-1)
    zero, beta = zeros.float(), _HQ_BETA
    best = [torch.full_like(zero, math.inf), zeros]
    for _ in range(_HQ_ITERATIONS + 1):
        codes = torch.round(x + zero.unsqueeze(-1)).clamp_(0, top)
        error = x - codes + zero.unsqueeze(-1)
        _keep_better(best, (error * error).sum(-1), zero.to(zeros.dtype))
        magnitude = error.abs()
        error.sign_().mul_((magnitude - magnitude.pow(_HQ_P - 1) / beta).clamp_(min=0))
        zero = (codes - x + error).mean(-1).to(zeros.dtype).float()
        beta *= _HQ_KAPPA
    best = [_affine_error(groups, scales, best[1], top), scales, best[1]]
    for _ in range(_AFFINE_REFITS):
        candidate_scale, candidate_zero = _refit_affine(groups, best[1], best[2], top)
        _keep_better(best, _affine_error(groups, candidate_scale, candidate_zero, top), candidate_scale,
                     candidate_zero)
    return best[1], best[2]


def _affine_error(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, top: int) -> torch.Tensor:
    """Σ (w − (q − z)·s)² of each group for stored float zeros z and scales s, q the codes they round w to
    (infinite where the scale is not positive and finite)."""
    scale, zero = scales.float(), zeros.float().unsqueeze(-1)
    residual = _float_zero_codes(groups, scales, zeros, top).sub_(zero).mul_(scale.unsqueeze(-1)).sub_(groups)
    error = torch.linalg.vecdot(residual, residual)
    return error.masked_fill_(~(torch.isfinite(error) & (scale > 0)), math.inf)


def _refit_affine(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, top: int):
    """The scale and float zero of the least-squares line w ≈ s·q − s·z through each group's codes q (those
    `scales` and `zeros` round it to), stored in their dtypes; a group whose codes are all equal gets an
    infinite scale, which `_affine_error` rejects."""
    codes = _float_zero_codes(groups, scales, zeros, top)
    mean_codes, mean_weights = codes.mean(-1), groups.mean(-1)
    centred = codes.sub_(mean_codes.unsqueeze(-1))
    scale = torch.linalg.vecdot(centred, groups) / torch.linalg.vecdot(centred, centred)
    stored = scale.to(scales.dtype)
    zero = mean_codes - mean_weights / stored.float()
    return stored, zero.to(zeros.dtype)


def _float_zero_codes(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, top: int) -> torch.Tensor:
    """The codes (float32) that stored float zeros and scales round each group's weights to: w / s + z, rounded and
    clamped to 0..top, as `_Rounding` does for zero_mode "hqq"."""
    return torch.round(groups / _nonzero(scales.float()).unsqueeze(-1) + zeros.float().unsqueeze(-1)).clamp_(0, top)


def _search_block_scale(ttype: TType, groups: torch.Tensor, codes: torch.Tensor, tensor_scale):
    """"hqq" for block-scaled types: the block scale code of the rule and its neighbours (the next larger scale
    clips less, the next smaller rounds finer); the lowest squared error per block wins.  Returns the codes and
    the float32 divisor of each block."""
    scale_type = get(ttype.block_scale)
    lowest, highest = _positive_code_range(scale_type)
    factor = 1.0 if tensor_scale is None else tensor_scale
    sum_ww = (groups * groups).sum(-1)
    best = [torch.full(codes.shape, math.inf, device=codes.device), codes,
            torch.zeros(codes.shape, device=codes.device)]
    for step in _BLOCK_SCALE_STEPS:
        candidate = codes if step == 0 else (codes.int() + step).clamp_(lowest, highest).to(torch.uint8)
        divisor = scale_type.decode(candidate) * factor
        values = _nearest_values(ttype, groups / _nonzero(divisor).unsqueeze(-1))
        error = _squared_error(sum_ww, (groups * values).sum(-1), (values * values).sum(-1), divisor)
        _keep_better(best, error, candidate, divisor)
    return best[1], best[2]


@functools.lru_cache(maxsize=None)
def _positive_code_range(scale_type: TType) -> tuple[int, int]:
    """The run of codes of a block scale type from its smallest positive value up to its largest finite one
    (in code order, which is value order there)."""
    values = scale_type.values
    lowest = int((values > 0).nonzero()[0])
    highest = lowest
    while highest + 1 < scale_type.num_codes and bool(values[highest + 1] > values[highest]) and bool(
            torch.isfinite(values[highest + 1])):
        highest += 1
    return lowest, highest


def _block_scales(ttype: TType, absmax: torch.Tensor, tensor_scale: torch.Tensor | None = None):
    """Block scale codes (uint8), tensor scale, and the float32 divisor per block (from each block's largest
    magnitude), by the type's rule (the tensor scale given, or from absmax's largest)."""
    element_max = float(ttype.values[torch.isfinite(ttype.values)].max())
    scale_type = get(ttype.block_scale)
    if ttype.tensor_scale:
        if tensor_scale is None:
            tensor_amax = float(absmax.max())
            tensor_scale = torch.tensor(tensor_amax / (element_max * scale_type.max_abs) if tensor_amax else 1.0,
                                        dtype=torch.float32, device=absmax.device)
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
