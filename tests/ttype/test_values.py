"""Decoded values of every built-in type against independent tables (papers, specs, torch, ml_dtypes)."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from bitkern import ttype

# QLoRA paper (Dettmers et al. 2023), appendix E: the NF4 data type's 16 values.
QLORA_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]
# OCP Microscaling Formats v1.0, table 5: FP4 E2M1 values for codes 0b0000..0b0111; bit 3 is the sign.
OCP_E2M1_POSITIVE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _same_values(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(np.asarray(expected, dtype=np.float32))
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[~nan], expected[~nan])
    assert torch.equal(torch.signbit(actual[~nan]), torch.signbit(expected[~nan]))  # -0.0 stays -0.0


def test_nf4_is_the_qlora_codebook():
    _same_values(ttype.get("nf4").decode(torch.arange(16)), QLORA_NF4)


def test_nf4_matches_its_normal_quantile_construction():
    """QLoRA builds NF4 from quantiles of N(0, 1): 8 positive, 7 negative, and an exact zero."""
    offset = 0.9677083
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    values = values / values.abs().max()
    torch.testing.assert_close(ttype.get("nf4").decode(torch.arange(16)).double(), values, atol=2e-7, rtol=0)


def test_fp4_e2m1_matches_the_ocp_table_and_ml_dtypes():
    expected = OCP_E2M1_POSITIVE + [-v for v in OCP_E2M1_POSITIVE]
    decoded = ttype.get("fp4_e2m1").decode(torch.arange(16))
    _same_values(decoded, expected)
    _same_values(decoded, np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32))


@pytest.mark.parametrize("name, torch_dtype, ml_dtype", [
    ("float8_e4m3", torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    ("float8_e5m2", torch.float8_e5m2, ml_dtypes.float8_e5m2),
])
def test_fp8_every_bit_pattern(name, torch_dtype, ml_dtype):
    codes = torch.arange(256)
    decoded = ttype.get(name).decode(codes)
    _same_values(decoded, codes.to(torch.uint8).view(torch_dtype).float().numpy())
    _same_values(decoded, np.arange(256, dtype=np.uint8).view(ml_dtype).astype(np.float32))


def test_e8m0_scale_follows_the_ocp_rule():
    """OCP MX v1.0 §5.4: E8M0 code e is 2**(e - 127); 0xFF is NaN; no sign, no zero."""
    decoded = ttype.get("float8_e8m0").decode(torch.arange(256))
    expected = [math.ldexp(1.0, e - 127) for e in range(255)] + [math.nan]
    _same_values(decoded, expected)
    _same_values(decoded, np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


@pytest.mark.parametrize("name, torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_16_bit_floats_every_bit_pattern(name, torch_dtype):
    codes = torch.arange(1 << 16, dtype=torch.int32)
    expected = codes.to(torch.int16).view(torch_dtype).float()
    _same_values(ttype.get(name).decode(codes), expected.numpy())


def test_float32_bit_patterns():
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(0, 1 << 32, (100_000,), generator=generator, dtype=torch.int64)
    specials = torch.tensor([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 1, 0x807FFFFF], dtype=torch.int64)
    words = torch.cat([words, specials])
    expected = np.asarray(words.numpy(), dtype=np.uint32).view(np.float32)
    _same_values(ttype.get("float32").decode(words), expected)


@pytest.mark.parametrize("name, ml_dtype, bits", [
    ("int4", ml_dtypes.int4, 4), ("uint4", ml_dtypes.uint4, 4), ("int2", ml_dtypes.int2, 2),
    ("uint2", ml_dtypes.uint2, 2), ("uint1", ml_dtypes.uint1, 1),
])
def test_small_integers_match_ml_dtypes(name, ml_dtype, bits):
    expected = np.arange(1 << bits, dtype=np.uint8).view(ml_dtype).astype(np.float32)
    _same_values(ttype.get(name).decode(torch.arange(1 << bits)), expected)


@pytest.mark.parametrize("name, expected", [
    ("int8", [c - 256 * (c >= 128) for c in range(256)]),
    ("uint8", list(range(256))),
    ("int3", [0, 1, 2, 3, -4, -3, -2, -1]),
    ("uint3", list(range(8))),
    ("int1", [-1, 1]),  # binary weights: ±1, not two's complement's {0, -1}
])
def test_integer_tables(name, expected):
    _same_values(ttype.get(name).decode(torch.arange(len(expected))), expected)


@pytest.mark.parametrize("name, element", [("mxfp8", "float8_e4m3"), ("mxfp4", "fp4_e2m1"),
                                           ("nvfp4", "fp4_e2m1")])
def test_block_types_decode_like_their_elements(name, element):
    block = ttype.get(name)
    codes = torch.arange(block.num_codes)
    assert torch.equal(block.decode(codes).nan_to_num(7.0), ttype.get(element).decode(codes).nan_to_num(7.0))
    assert (block.block_size, block.block_scale, block.tensor_scale) == {
        "mxfp8": (32, "float8_e8m0", False), "mxfp4": (32, "float8_e8m0", False),
        "nvfp4": (16, "float8_e4m3", True)}[name]


def test_registry_holds_the_required_names():
    required = {"float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "int8", "uint8", "int4", "uint4",
                "int3", "uint3", "int2", "uint2", "int1", "uint1", "nf4", "fp4_e2m1", "mxfp8", "mxfp4", "nvfp4"}
    assert required <= set(ttype.names())
    for name in ttype.names():
        assert ttype.get(name).name == name


def test_get_accepts_torch_dtypes_and_ttypes():
    assert ttype.get(torch.float8_e4m3fn).name == "float8_e4m3"
    nf4 = ttype.get("nf4")
    assert ttype.get(nf4) is nf4


@pytest.mark.parametrize("name", [n for n in ttype.names() if ttype.get(n).bits <= 16])
def test_compute_types_are_exactly_the_lossless_ones(name):
    """A compute type is listed iff every value survives the round trip through it."""
    t = ttype.get(name)
    values = t.values
    for dtype, (torch_dtype, _) in ttype.COMPUTE_DTYPES.items():
        if dtype == "int8":
            finite = torch.isfinite(values).all()
            exact = bool(finite) and torch.equal(values.round(), values) and bool(
                (values >= -128).all() and (values <= 127).all())
        else:
            back = values.to(torch_dtype).float()
            exact = torch.equal(back.isnan(), values.isnan()) and torch.equal(back[~back.isnan()],
                                                                              values[~values.isnan()])
        assert (dtype in t.compute_types) == exact, dtype
    assert "float32" in t.compute_types


def test_expected_lossless_conversions():
    assert ttype.get("int4").compute_types == ("float32", "float16", "bfloat16", "float8_e4m3", "int8")
    assert ttype.get("uint8").compute_types == ("float32", "float16", "bfloat16")
    assert ttype.get("nf4").compute_types == ("float32",)
    assert "float16" in ttype.get("float8_e4m3").compute_types
    assert "float8_e4m3" in ttype.get("fp4_e2m1").compute_types


def test_convert_rounds_where_not_lossless_and_refuses_int8_for_non_integers():
    nf4 = ttype.get("nf4")
    half = nf4.convert(torch.arange(16), torch.float16)
    assert half.dtype == torch.float16
    assert torch.equal(half, torch.tensor(QLORA_NF4).half())
    with pytest.raises(ValueError, match="int8"):
        nf4.convert(torch.arange(16), "int8")
    assert torch.equal(ttype.get("int4").convert(torch.arange(16), "int8"),
                       torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1], dtype=torch.int8))


def test_decode_keeps_shape_and_device():
    codes = torch.randint(0, 16, (3, 5, 7), dtype=torch.uint8)
    out = ttype.get("int4").decode(codes)
    assert out.shape == codes.shape and out.dtype == torch.float32


def test_lut_lists_all_codes():
    assert torch.equal(ttype.get("fp4_e2m1").lut(torch.float16), ttype.get("fp4_e2m1").values.half())
    with pytest.raises(ValueError, match="bits <= 8"):
        ttype.get("float16").lut()
