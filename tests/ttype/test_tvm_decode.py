"""The TVM decode builders are bit-exact against TType.decode over every code, on the LLVM target."""

import pytest
import torch

from bitkern import ttype

TVM_TO_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def _all_codes(t):
    if t.bits <= 16:
        return torch.arange(t.num_codes, dtype=torch.int32)
    words = torch.randint(-(1 << 31), 1 << 31, (65536,), generator=torch.Generator().manual_seed(1),
                          dtype=torch.int64).to(torch.int32)
    return torch.cat([words, torch.tensor([0, -(1 << 31), 0x7F800000, -8388608, 0x7FC00000, 1], dtype=torch.int32)])


def _bits_of(tensor):
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def _expected(t, codes, dtype):
    unsigned = codes.long() & ((1 << t.bits) - 1)
    return t.convert(unsigned, dtype)


def _assert_bit_exact(actual, expected):
    if actual.dtype.is_floating_point:
        nan = torch.isnan(expected.float())
        assert torch.equal(torch.isnan(actual.float()), nan)
        assert torch.equal(_bits_of(actual)[~nan], _bits_of(expected)[~nan])
    else:
        assert torch.equal(actual, expected)


CASES = [(name, dtype) for name in ttype.names() for dtype in TVM_TO_TORCH
         if dtype == "float32" or (dtype in ttype.get(name).compute_types and ttype.get(name).bits <= 16)
         or (dtype == "float16" and name == "nf4")]


@pytest.mark.parametrize("name, dtype", CASES)
def test_tvm_decode_matches_torch_decode(name, dtype, build_elementwise):
    t = ttype.get(name)
    codes = _all_codes(t)
    kernel = build_elementwise(lambda c, i: t.tvm_decode(c[i], dtype), [("int32", None)], dtype)
    out = torch.empty(codes.shape, dtype=TVM_TO_TORCH[dtype])
    kernel(codes, out)
    _assert_bit_exact(out, _expected(t, codes, dtype))


@pytest.mark.parametrize("name", ["nf4", "fp4_e2m1", "float8_e5m2", "int3"])
def test_tvm_decode_through_a_lookup_table(name, build_elementwise):
    t = ttype.get(name)
    codes = torch.arange(t.num_codes, dtype=torch.int32).repeat(3)
    kernel = build_elementwise(lambda c, table, i: t.tvm_decode(c[i], "float16", lut=table),
                               [("int32", None), ("float16", (t.num_codes,))], "float16")
    out = torch.empty(codes.shape, dtype=torch.float16)
    kernel(codes, t.lut(torch.float16), out)
    _assert_bit_exact(out, _expected(t, codes, "float16"))


def test_int8_decode_refused_for_non_integer_types():
    import tvm

    with pytest.raises(ValueError, match="does not convert to int8"):
        ttype.get("nf4").tvm_decode(tvm.tirx.const(3, "uint32"), "int8")


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_tvm_unpack_reads_the_packed_layout(bits, build_elementwise):
    length = 97
    codes = torch.randint(0, 1 << bits, (length,), generator=torch.Generator().manual_seed(bits))
    words = ttype.pack(codes, bits)
    kernel = build_elementwise(lambda w, i: ttype.tvm_unpack(w, (i,), bits).astype("int32"),
                               [("int32", (words.numel(),))], "int32")
    out = torch.empty(length, dtype=torch.int32)
    kernel(words, out)
    assert torch.equal(out.long(), codes)
