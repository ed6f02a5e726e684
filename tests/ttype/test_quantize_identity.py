"""The chunked, table-driven quantization and byte-wise packing give, bit for bit, what bitkern's first
implementation gave: that implementation is kept here as the oracle (float64 binary search over the midpoints
of a type's values, int64 shift-and-sum packing, the tile16 layout made from unpacked codes), and both are
run over random weights of every element type, group size, zero mode, scale dtype and weight dtype, with
the edge values that rounding and ranges meet (ties, signed zeros, all-zero and constant groups, huge and
subnormal magnitudes)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitkern import pack, quantize, ttype
from bitkern.codegen.cpu.layout import AMX_TILE_ROWS, padded_k
from bitkern.ttype.quantize import default_zero_mode, nearest_codes


# -- the oracle: bitkern's first round-to-nearest and packing ------------------------------------------
def _oracle_pack(values, bits):
    per_word = 32 // bits
    length = values.shape[-1]
    words = math.ceil(length / per_word)
    codes = torch.nn.functional.pad(values.long(), (0, words * per_word - length))
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    word_values = (codes.reshape(*values.shape[:-1], words, per_word) << shifts).sum(-1)
    return (word_values - (word_values >= 2**31).long() * 2**32).to(torch.int32)


def _oracle_nearest_codes(t, x):
    if t.kind in ("int", "uint") and t.bits > 1:
        q = torch.round(x).clamp(float(t.values.min()), float(t.values.max())).long()
        return (q & (t.num_codes - 1)).to(torch.uint8)
    values, codes = t.values.double(), torch.arange(t.num_codes)
    finite = torch.isfinite(values)
    values, codes = values[finite], codes[finite]
    order = torch.argsort(values, stable=True)
    values, codes = values[order], codes[order]
    first = torch.ones_like(values, dtype=torch.bool)
    first[1:] = values[1:] != values[:-1]
    values, codes = values[first], codes[first]
    signed_zeros = [c for c in (t.values == 0).nonzero().flatten().tolist()]
    positive = [c for c in signed_zeros if not torch.signbit(t.values[c])]
    negative = [c for c in signed_zeros if torch.signbit(t.values[c])]
    midpoints = (values[1:] + values[:-1]) / 2
    chunk = x.double()
    index = torch.searchsorted(midpoints, chunk)
    upper = (index + 1).clamp(max=len(codes) - 1)
    tie = chunk == midpoints[index.clamp(max=len(midpoints) - 1)]
    chosen = torch.where(tie & (codes[index] % 2 == 1) & (codes[upper] % 2 == 0), codes[upper], codes[index])
    if negative and positive:
        chosen = torch.where((chosen == positive[0]) & torch.signbit(chunk), negative[0], chosen)
    return chosen.to(torch.uint8)


def _oracle_quantize(weight, name, group_size, zero_mode, scale_dtype):
    """(codes, scales, zeros, tensor_scale) as bitkern computed them before the fast path."""
    t = ttype.get(name)
    n, k = weight.shape
    group_size = t.block_size if t.block_size > 1 else (k if group_size == -1 else group_size)
    zero_mode = default_zero_mode(t) if zero_mode is None else zero_mode
    groups = weight.float().reshape(n, k // group_size, group_size)
    safe = (lambda s: torch.where(s == 0, torch.ones_like(s), s))
    zeros = tensor_scale = None
    if t.block_size > 1:
        absmax = groups.abs().amax(-1)
        element_max = float(t.values[torch.isfinite(t.values)].max())
        scale_type = ttype.get(t.block_scale)
        if t.tensor_scale:
            amax = float(absmax.max())
            tensor_scale = torch.tensor(amax / (element_max * scale_type.max_abs) if amax else 1.0)
            scales = _oracle_nearest_codes(scale_type, absmax / element_max / tensor_scale)
            divisor = scale_type.decode(scales) * tensor_scale
        else:
            _, exponent = torch.frexp(absmax)
            shared = torch.where(absmax > 0, exponent - 1 - math.floor(math.log2(element_max)),
                                 torch.full_like(exponent, -127)).clamp(-127, 127)
            scales, divisor = (shared + 127).to(torch.uint8), torch.ldexp(torch.ones_like(absmax), shared)
        codes = _oracle_nearest_codes(t, groups / safe(divisor).unsqueeze(-1))
    elif zero_mode == "none":
        if t.kind == "int" and t.bits == 1:
            scale = groups.abs().mean(-1)
        else:
            scale = groups.abs().amax(-1) / float(t.values[torch.isfinite(t.values)].max())
        scales = scale.to(scale_dtype)
        codes = _oracle_nearest_codes(t, groups / safe(scales.float()).unsqueeze(-1))
    else:
        top = t.num_codes - 1
        low, high = groups.amin(-1), groups.amax(-1)
        widen = torch.ones_like(low, dtype=torch.bool) if zero_mode == "gptq" else low == high
        low, high = torch.where(widen, low.clamp(max=0), low), torch.where(widen, high.clamp(min=0), high)
        scales = ((high - low) / top).to(scale_dtype)
        stored = safe(scales.float())
        if zero_mode == "hqq":
            zeros = (-low / stored).to(scale_dtype)
            codes = torch.round(groups / stored.unsqueeze(-1) + zeros.float().unsqueeze(-1)).clamp(0, top)
        else:
            zero = torch.round(-low / stored).clamp(0, top)
            codes = (torch.round(groups / stored.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, top)
            zeros = zero.to(torch.uint8)
        codes = codes.to(torch.uint8)
    return codes.reshape(n, k), scales, zeros, tensor_scale


def _oracle_tile16(codes, bits, scales, zeros):
    n, k = codes.shape
    rows = math.ceil(n / AMX_TILE_ROWS) * AMX_TILE_ROWS
    padded = torch.nn.functional.pad(codes, (0, padded_k(k, bits) - k, 0, rows - n))
    per_word = 32 // bits
    order = torch.cat([torch.arange(0, per_word, 2), torch.arange(1, per_word, 2)])
    mapped = padded.reshape(rows, -1, per_word)[..., order].reshape(padded.shape)
    tile = (lambda t: None if t is None else torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))
            .reshape(rows // AMX_TILE_ROWS, AMX_TILE_ROWS, -1).permute(0, 2, 1).contiguous())
    return tile(_oracle_pack(mapped, bits)), tile(scales), tile(zeros)


# -- weights that meet the edge cases ---------------------------------------------------------------
def _weight(n, k, seed, dtype, edges):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator) * torch.exp(torch.randn(n, 1, generator=generator) * 3)
    if edges:
        spots = torch.rand(n, k, generator=generator)
        w = torch.where(spots < 0.05, torch.round(w * 4) / 4, w)  # quarter steps land on rounding ties
        w = torch.where((spots > 0.05) & (spots < 0.1), torch.zeros_like(w), w)
        w = torch.where((spots > 0.1) & (spots < 0.12), -torch.zeros_like(w), w)
        w[0] = 0.0  # an all-zero row: zero scales
        if n > 1:
            w[1] = -0.0 if k % 2 else torch.tensor([0.0, -0.0]).repeat(k // 2)  # signed zeros only
        if n > 2:
            w[2] = 1.5  # constant groups
        if n > 3:
            w[3] = w[3] * 1e-30  # subnormal scales and quotients
    return w.to(dtype)


SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
TYPES = {name: [None] for name in ("int8", "int4", "int3", "int2", "int1", "nf4", "fp4_e2m1", "float8_e4m3",
                                   "float8_e5m2", "mxfp4", "mxfp8", "nvfp4", "uint1")}
TYPES.update({name: ["gptq", "awq", "hqq", "none"] for name in ("uint8", "uint4", "uint3", "uint2")})


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(sorted(TYPES)), data=st.data(), n=st.integers(1, 40), groups=st.integers(1, 6),
       group_size=st.sampled_from([2, 16, 32, 64, 128]), per_channel=st.booleans(),
       scale_dtype=st.sampled_from(SCALE_DTYPES), weight_dtype=st.sampled_from(WEIGHT_DTYPES),
       edges=st.booleans(), seed=st.integers(0, 2**31))
def test_quantize_is_bit_identical_to_the_oracle(name, data, n, groups, group_size, per_channel, scale_dtype,
                                                 weight_dtype, edges, seed):
    t = ttype.get(name)
    zero_mode = data.draw(st.sampled_from(TYPES[name]))
    block = t.block_size > 1
    k = groups * (t.block_size if block else group_size)
    argument = None if block else -1 if per_channel else group_size
    w = _weight(n, k, seed, weight_dtype, edges)
    run = (lambda: quantize(w, name, group_size=argument, zero_mode=zero_mode, scale_dtype=scale_dtype))
    if not bool(torch.isfinite(w).all()):
        with pytest.raises(ValueError, match="NaN or infinity"):
            run()
        return
    codes, scales, zeros, tensor_scale = _oracle_quantize(w, name, argument or -1, zero_mode, scale_dtype)
    if not block and not bool(torch.isfinite(scales.float()).all()):
        with pytest.raises(ValueError, match="overflow"):
            run()
        return
    q = run()
    assert torch.equal(q.qweight, _oracle_pack(codes, t.bits))
    assert q.scales.dtype == scales.dtype and torch.equal(q.scales.view(torch.uint8), scales.view(torch.uint8))
    if zeros is None:
        assert q.zeros is None
    else:
        assert torch.equal(q.zeros.view(torch.uint8), zeros.view(torch.uint8))
    assert (q.tensor_scale is None) == (tensor_scale is None)
    if tensor_scale is not None:
        assert q.tensor_scale.item() == tensor_scale.item()
    if t.bits in (1, 2, 4, 8):  # the widths the CPU kernels read in tile16
        packed = pack(q)
        words, tiled_scales, tiled_zeros = _oracle_tile16(codes, t.bits, q.scales, q.zeros)
        assert torch.equal(packed.qweight, words) and torch.equal(packed.scales, tiled_scales)
        assert (tiled_zeros is None and packed.zeros is None) or torch.equal(packed.zeros, tiled_zeros)
        portable = packed.to_portable()
        assert torch.equal(portable.qweight, q.qweight) and torch.equal(portable.scales, q.scales)


@pytest.mark.parametrize("name", ["nf4", "fp4_e2m1", "float8_e4m3", "float8_e5m2", "int1", "uint1"])
def test_nearest_codes_on_every_bfloat16_and_its_neighbours(name):
    """Every float32 that is a bfloat16, and the float32 values one step either side of it (the ends of the
    intervals the rounding table keys on), round as the oracle's search rounds them."""
    t = ttype.get(name)
    centres = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    centres = centres[torch.isfinite(centres)]
    x = torch.cat([centres, torch.nextafter(centres, torch.tensor(math.inf)),
                   torch.nextafter(centres, torch.tensor(-math.inf)),
                   centres + torch.ldexp(torch.ones_like(centres), torch.frexp(centres)[1] - 9)])  # half a bfloat16 step
    x = x[torch.isfinite(x)]
    assert torch.equal(nearest_codes(t, x), _oracle_nearest_codes(t, x))


def test_nearest_codes_of_a_codebook_finer_than_bfloat16_falls_back_to_the_search():
    fine = ttype.codebook("fine_codebook_test", [-1.0, 0.0, 1.0, 1.001])
    x = torch.linspace(-2, 2, 100_001)
    assert torch.equal(nearest_codes(fine, x), _oracle_nearest_codes(fine, x))
