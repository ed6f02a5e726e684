"""A user-defined type goes through registry, pack, quantize, dequantize, TVM decode and the reference matmul."""

import ml_dtypes
import numpy as np
import pytest
import torch

import bitkern
from bitkern import ttype
from bitkern.ops import Matmul

MY_NF3 = [-1.0, -0.53, -0.25, 0.0, 0.18, 0.4, 0.66, 1.0]


def test_user_codebook_flows_through_the_pipeline(build_elementwise):
    nf3 = ttype.register(ttype.codebook("test_nf3", MY_NF3))
    assert ttype.get("test_nf3") is nf3 and "test_nf3" in ttype.names()
    assert nf3.bits == 3 and nf3.kind == "codebook"
    assert torch.equal(nf3.decode(torch.arange(8)), torch.tensor(MY_NF3))

    codes = torch.randint(0, 8, (5, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ttype.unpack(ttype.pack(codes, nf3.bits), nf3.bits, codes.shape).long(), codes)

    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    q = bitkern.quantize(w, "test_nf3", group_size=32, scale_dtype=torch.float32)
    assert q.qweight.shape == (24, 7)  # 64 codes at ten per word
    scaled = w.reshape(24, 2, 32) / q.scales.unsqueeze(-1)
    nearest = (scaled.unsqueeze(-1) - torch.tensor(MY_NF3)).abs().argmin(-1)
    assert torch.equal(q.codes().long(), nearest.reshape(24, 64))
    assert torch.equal(q.dequantize(), (torch.tensor(MY_NF3)[nearest] * q.scales.unsqueeze(-1)).reshape(24, 64))

    spec = Matmul("test_nf3", "float32", group_size=32, scale_dtype="float32")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(spec.reference(x, q), x @ q.dequantize().T)

    kernel = build_elementwise(lambda c, i: nf3.tvm_decode(c[i], "float32"), [("int32", None)], "float32")
    out = torch.empty(8)
    kernel(torch.arange(8, dtype=torch.int32), out)
    assert torch.equal(out, nf3.values)


def test_user_int5_with_gptq_zeros():
    uint5 = ttype.register(ttype.integer("test_uint5", 5, signed=False))
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    q = bitkern.quantize(w, uint5, group_size=16, scale_dtype=torch.float32)
    assert q.zero_mode == "gptq" and q.qweight.shape == (8, 11)  # six 5-bit codes per word
    error = (q.dequantize() - w).abs().reshape(8, 4, 16).amax(-1)
    assert bool((error <= q.scales * 0.5 * (1 + 1e-5)).all())


def test_user_fp6_matches_ml_dtypes_and_makes_an_mx_type():
    fp6 = ttype.register(ttype.floating("test_fp6_e3m2", 3, 2))
    expected = np.arange(64, dtype=np.uint8).view(ml_dtypes.float6_e3m2fn).astype(np.float32)
    assert torch.equal(fp6.decode(torch.arange(64)), torch.from_numpy(expected))

    mxfp6 = ttype.register(ttype.block_scaled("test_mxfp6", fp6, 32, "float8_e8m0"))
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    q = bitkern.quantize(w, mxfp6)
    assert q.group_size == 32 and q.scales.dtype == torch.uint8
    # emax of e3m2 is 4 (max 28 = 1.75 * 2**4): the OCP rule gives X = 2**(floor(log2 amax) - 4)
    amax = w.reshape(4, 2, 32).abs().amax(-1)
    assert torch.equal(q.scales.long(), torch.floor(torch.log2(amax)).long() - 4 + 127)
    # within half a step of the top binade (2**(e-3) for 2 mantissa bits), or the clip of (28, 32) to 28
    error = (q.dequantize() - w).reshape(4, 2, 32).abs().amax(-1)
    assert bool((error <= torch.exp2(torch.floor(torch.log2(amax)) - 2)).all())


def test_register_refuses_conflicts_and_bad_definitions():
    ttype.register(ttype.integer("test_int6", 6))
    ttype.register(ttype.integer("test_int6", 6))  # identical: fine
    with pytest.raises(ValueError, match="a different type is already registered as 'test_int6'"):
        ttype.register(ttype.integer("test_int6", 6, signed=False))
    with pytest.raises(ValueError, match="a different type is already registered as 'nf4'"):
        ttype.register(ttype.codebook("nf4", MY_NF3 * 2))
    with pytest.raises(TypeError, match="ttype must be a TType"):
        ttype.register("int4")
    with pytest.raises(ValueError, match="block_scale='float8_e9m0' .* is not a registered type"):
        ttype.register(ttype.block_scaled("test_bad_block", ttype.get("int4"), 32, "float8_e9m0"))
    with pytest.raises(ValueError, match="bits=9 is out of range"):
        ttype.integer("test_int9", 9)
    with pytest.raises(ValueError, match="codebook of 'test_cb' has 3 values"):
        ttype.codebook("test_cb", [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="must be a non-empty identifier"):
        ttype.integer("my int", 4)
    with pytest.raises(ValueError, match="exponent_bits=9 is out of range"):
        ttype.floating("test_f", 9, 2)
    with pytest.raises(ValueError, match="exactly representable in float32"):
        ttype.TType("test_f64", 1, "codebook", codebook=(0.0, 0.1))
