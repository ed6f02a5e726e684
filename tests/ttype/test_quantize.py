"""Quantize -> dequantize: error bounds per type and group size, hand-computed examples for each zero-point
convention, MX and NVFP4 against independent implementations of their rules, and input errors."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import bitkern
from bitkern import ttype


def _weight(n=16, k=256, seed=0, dtype=torch.float32):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _groups(t, q):
    return t.reshape(q.shape[0], -1, q.group_size)


def _max_half_gap(t):
    """Half the largest gap between adjacent finite values of a type: the rounding error bound per unit scale."""
    values = t.values[torch.isfinite(t.values)].double().unique()
    return float((values[1:] - values[:-1]).max()) / 2


ELEMENT_TYPES = ["int8", "int4", "int3", "int2", "nf4", "fp4_e2m1", "float8_e4m3", "float8_e5m2"]


@pytest.mark.parametrize("name", ELEMENT_TYPES)
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_symmetric_error_is_within_half_a_step(name, group_size):
    w = _weight()
    q = bitkern.quantize(w, name, group_size=group_size, scale_dtype=torch.float32)
    t = ttype.get(name)
    assert q.zero_mode == "none" and q.group_size == (256 if group_size == -1 else group_size)
    error = _groups((q.dequantize() - w).abs(), q).amax(-1)
    scale = q.scales.float()
    # Every weight lies in [-absmax, absmax] = [-s·max, s·max], inside the type's range: no clipping.
    bound = scale * _max_half_gap(t) * (1 + 1e-5) + 1e-7
    if t.kind == "float":  # relative spacing: the largest gap sits at the top of the range
        bound = scale * _max_half_gap(t) * (1 + 1e-5)
    assert bool((error <= bound).all()), float((error - bound).max())


@pytest.mark.parametrize("name", ["uint8", "uint4", "uint3", "uint2"])
@pytest.mark.parametrize("zero_mode", ["gptq", "awq", "hqq"])
@pytest.mark.parametrize("group_size", [16, 128])
def test_zero_point_error_is_within_half_a_step(name, zero_mode, group_size):
    w = _weight(seed=1)
    q = bitkern.quantize(w, name, group_size=group_size, zero_mode=zero_mode, scale_dtype=torch.float32)
    groups = _groups(w, q)
    straddles_zero = (groups.amin(-1) < 0) & (groups.amax(-1) > 0)  # AWQ clamps its zero for one-signed groups
    assert bool(straddles_zero.all())
    error = _groups((q.dequantize() - w).abs(), q).amax(-1)
    assert bool((error <= q.scales * 0.5 * (1 + 1e-3)).all())


def test_error_shrinks_with_bits_and_group_size():
    w = _weight(64, 512, seed=2)
    rms = {(name, g): float((bitkern.quantize(w, name, group_size=g).dequantize() - w).pow(2).mean().sqrt())
           for name in ["uint2", "uint3", "uint4", "uint8"] for g in [32, 128]}
    for g in [32, 128]:
        assert rms["uint2", g] > rms["uint3", g] > rms["uint4", g] > rms["uint8", g]
    for name in ["uint2", "uint3", "uint4"]:
        assert rms[name, 32] < rms[name, 128]
    assert rms["uint4", 128] < 0.12 and rms["uint8", 128] < 0.01


def test_int1_uses_the_mean_absolute_scale():
    w = _weight(4, 64, seed=3)
    q = bitkern.quantize(w, "int1", group_size=64, scale_dtype=torch.float32)
    torch.testing.assert_close(q.scales.squeeze(1), w.abs().mean(1))
    torch.testing.assert_close(q.dequantize(), torch.where(w >= 0, 1.0, -1.0) * w.abs().mean(1, keepdim=True))


# -- hand-computed examples, one per convention ---------------------------------------------------------
def test_symmetric_int4_by_hand():
    w = torch.tensor([[-3.5, 1.0, 0.0, 0.75, 2.0, -0.25, 0.5, 3.0]])
    q = bitkern.quantize(w, "int4", group_size=8, scale_dtype=torch.float32)
    assert q.scales.tolist() == [[0.5]]  # absmax 3.5 / 7
    # w / s = [-7, 2, 0, 1.5, 4, -0.5, 1, 6]; halves round to even: 1.5 -> 2, -0.5 -> 0
    assert q.codes().tolist() == [[9, 2, 0, 2, 4, 0, 1, 6]]  # -7 is 9 in two's complement
    assert q.dequantize().tolist() == [[-3.5, 1.0, 0.0, 1.0, 2.0, 0.0, 0.5, 3.0]]


def test_gptq_by_hand_including_the_packed_zeros():
    w = torch.tensor([[-1.0, 0.0, 0.6, 2.75], [0.5, 1.0, 3.75, 2.0]])
    q = bitkern.quantize(w, "uint4", group_size=4, zero_mode="gptq", scale_dtype=torch.float32)
    # row 0: range [-1, 2.75], s = 3.75/15 = 0.25, z = round(1/0.25) = 4
    # row 1: range widened to 0: [0, 3.75], s = 0.25, z = 0
    assert q.scales.tolist() == [[0.25], [0.25]]
    assert q.zeros.tolist() == [[4], [0]]
    assert q.codes().tolist() == [[0, 4, 6, 15], [2, 4, 15, 8]]
    assert q.dequantize().tolist() == [[-1.0, 0.0, 0.5, 2.75], [0.5, 1.0, 3.75, 2.0]]
    assert q.qweight.tolist() == [[0xF640], [0x8F42]]
    assert ttype.pack(q.zeros.T.contiguous(), 4).tolist() == [[0x04]]  # zeros packed along N, GPTQ-style


def test_awq_by_hand_clamps_the_zero_of_a_one_signed_group():
    w = torch.tensor([[-0.5, 0.0, 1.0, 3.25], [0.5, 1.0, 3.75, 2.0]])
    q = bitkern.quantize(w, "uint4", group_size=4, zero_mode="awq", scale_dtype=torch.float32)
    # row 0: range [-0.5, 3.25], s = 0.25, z = 2, codes exact
    assert q.zeros[0].tolist() == [2] and q.codes()[0].tolist() == [0, 2, 6, 15]
    assert q.dequantize()[0].tolist() == [-0.5, 0.0, 1.0, 3.25]
    # row 1: range [0.5, 3.75], s = 3.25/15, z = round(-0.5/s) = -2 clamped to 0 (as AWQ does), 3.75/s clips to 15
    s = 3.25 / 15
    assert q.scales[1].item() == pytest.approx(s, rel=1e-7) and q.zeros[1].tolist() == [0]
    assert q.codes()[1].tolist() == [2, 5, 15, 9]
    torch.testing.assert_close(q.dequantize()[1], torch.tensor([2 * s, 5 * s, 15 * s, 9 * s]))


def test_hqq_by_hand_has_a_float_zero():
    w = torch.tensor([[-0.3, 0.0, 1.2, 3.45]])
    q = bitkern.quantize(w, "uint4", group_size=4, zero_mode="hqq", scale_dtype=torch.float32)
    # range [-0.3, 3.45]: s = 0.25, z = 0.3/0.25 = 1.2 (not rounded), q = round(w/s + z)
    assert q.scales.item() == pytest.approx(0.25) and q.zeros.item() == pytest.approx(1.2)
    assert q.codes().tolist() == [[0, 1, 6, 15]]
    torch.testing.assert_close(q.dequantize(), torch.tensor([[-0.3, -0.05, 1.2, 3.45]]))


def test_bitsandbytes_style_nf4_absmax_by_hand():
    w = torch.tensor([[-2.0, 1.0, 0.5, 0.0]])
    q = bitkern.quantize(w, "nf4", group_size=4, scale_dtype=torch.float32)
    # absmax 2 is the scale; w/2 = [-1, 0.5, 0.25, 0] -> nearest NF4 codes 0, 12 (0.4407), 10 (0.2461), 7 (0)
    assert q.scales.tolist() == [[2.0]]
    assert q.codes().tolist() == [[0, 12, 10, 7]]
    torch.testing.assert_close(q.dequantize(), 2 * ttype.get("nf4").values[[0, 12, 10, 7]].unsqueeze(0))


def test_mxfp4_by_hand():
    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([3.0, 0.75, -0.1])
    q = bitkern.quantize(w, "mxfp4")
    # absmax 3: floor(log2 3) = 1, minus emax(e2m1) = 2 -> shared exponent -1, e8m0 code 126, X = 0.5
    assert q.group_size == 32 and q.scales.tolist() == [[126]]
    # w / X = [6, 1.5, -0.2]: codes 7 (6.0), 3 (1.5), 8 (-0.0)
    assert q.codes()[0, :3].tolist() == [7, 3, 8]
    assert q.dequantize()[0, :3].tolist() == [3.0, 0.75, 0.0]


# -- MX and NVFP4 against independent implementations of their rules ------------------------------------
@pytest.mark.parametrize("name, element", [("mxfp4", ml_dtypes.float4_e2m1fn), ("mxfp8", ml_dtypes.float8_e4m3fn)])
def test_mx_follows_the_ocp_rule(name, element):
    """OCP MX v1.0 §6.3: X = 2**(floor(log2(max|V|)) - emax_elem); P_i = V_i / X rounded (saturating)."""
    w = _weight(8, 128, seed=4) * torch.logspace(-3, 3, 8).unsqueeze(1)
    w[0, :32] = 0.0  # an all-zero block
    q = bitkern.quantize(w, name)
    emax_elem = {"mxfp4": 2, "mxfp8": 8}[name]
    largest = float(ml_dtypes.finfo(element).max)
    expected_codes, expected = [], np.zeros(tuple(w.shape), dtype=np.float32)
    for row in range(w.shape[0]):
        for block in range(w.shape[1] // 32):
            values = w[row, block * 32:(block + 1) * 32].numpy()
            amax = float(np.abs(values).max())
            shared = max(-127, math.frexp(amax)[1] - 1 - emax_elem) if amax > 0 else -127
            expected_codes.append(shared + 127)
            scale = math.ldexp(1.0, shared)
            elements = np.clip(values / np.float32(scale), -largest, largest).astype(element).astype(np.float32)
            expected[row, block * 32:(block + 1) * 32] = elements * scale
    assert q.scales.flatten().tolist() == expected_codes
    assert torch.equal(q.dequantize(), torch.from_numpy(expected))


def test_nvfp4_follows_its_two_level_scale_rule():
    w = _weight(8, 64, seed=5) * torch.logspace(-2, 2, 8).unsqueeze(1)
    q = bitkern.quantize(w, "nvfp4")
    tensor_scale = float(w.abs().max()) / (6 * 448)
    assert q.tensor_scale.item() == pytest.approx(tensor_scale, rel=1e-6)
    blocks = w.reshape(8, 4, 16).numpy()
    block_scale = (np.abs(blocks).max(-1) / 6 / np.float32(q.tensor_scale.item())).astype(ml_dtypes.float8_e4m3fn)
    assert q.scales.numpy().tolist() == block_scale.view(np.uint8).tolist()
    divisor = block_scale.astype(np.float32) * np.float32(q.tensor_scale.item())
    elements = np.clip(blocks / divisor[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    expected = torch.from_numpy(elements * divisor[..., None]).reshape(8, 64)
    assert torch.equal(q.dequantize(), expected)
    assert float((q.dequantize() - w).abs().max()) <= float(w.abs().max()) / 6  # within one e2m1 step of the max


@pytest.mark.parametrize("name", ["fp4_e2m1", "float8_e4m3"])
def test_float_elements_round_to_nearest_even_like_ml_dtypes(name):
    w = _weight(4, 128, seed=6)
    q = bitkern.quantize(w, name, group_size=32, scale_dtype=torch.float32)
    element = {"fp4_e2m1": ml_dtypes.float4_e2m1fn, "float8_e4m3": ml_dtypes.float8_e4m3fn}[name]
    scaled = (_groups(w, q) / q.scales.unsqueeze(-1)).numpy()
    expected = scaled.astype(element).view(np.uint8).reshape(4, 128)
    assert q.codes().numpy().tolist() == expected.tolist()


# -- storage, dtypes, devices ---------------------------------------------------------------------------
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scale_dtype_and_bytes(scale_dtype):
    w = _weight(32, 256, dtype=torch.bfloat16)
    q = bitkern.quantize(w, "uint4", group_size=64, scale_dtype=scale_dtype)
    assert q.scales.dtype == scale_dtype and q.zeros.dtype == torch.uint8
    assert q.nbytes == 32 * 256 // 2 + 32 * 4 * (scale_dtype.itemsize + 1)
    assert q.dequantize(torch.float16).dtype == torch.float16


def test_all_zero_groups_dequantize_to_zero():
    w = torch.zeros(2, 64)
    for name, mode in [("int4", None), ("uint4", "gptq"), ("uint4", "awq"), ("uint4", "hqq"), ("nf4", None),
                       ("mxfp4", None), ("nvfp4", None), ("int1", None)]:
        assert torch.equal(bitkern.quantize(w, name, group_size=None if name[:2] in ("mx", "nv") else 32,
                                            zero_mode=mode).dequantize(), w), name


def test_constant_groups_are_exact_for_zero_point_modes():
    w = torch.full((2, 32), 0.5)
    w[1] = -1.25
    for mode in ["gptq", "awq", "hqq"]:
        q = bitkern.quantize(w, "uint4", group_size=32, zero_mode=mode, scale_dtype=torch.float32)
        torch.testing.assert_close(q.dequantize(), w)


@pytest.mark.requires_cuda
def test_quantize_on_gpu_matches_cpu():
    w = _weight(64, 256)
    for name, mode in [("nf4", None), ("uint4", "gptq"), ("mxfp4", None), ("nvfp4", None)]:
        cpu = bitkern.quantize(w, name, zero_mode=mode)
        gpu = bitkern.quantize(w.cuda(), name, zero_mode=mode)
        assert gpu.device.type == "cuda"
        assert torch.equal(gpu.qweight.cpu(), cpu.qweight)
        torch.testing.assert_close(gpu.dequantize().cpu(), cpu.dequantize())


def test_to_moves_every_tensor():
    q = bitkern.quantize(_weight(), "nvfp4").to("cpu")
    assert q.tensor_scale.device.type == q.qweight.device.type == "cpu"


# -- bad input -----------------------------------------------------------------------------------------
def test_unknown_type_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown type 'int17'; known types: float32, .*nf4"):
        bitkern.quantize(_weight(), "int17")


def test_group_size_must_divide_k():
    with pytest.raises(ValueError, match="group_size=100 does not divide in_features=256"):
        bitkern.quantize(_weight(), "int4", group_size=100)
    with pytest.raises(TypeError, match="group_size must be an int"):
        bitkern.quantize(_weight(), "int4", group_size=32.0)
    with pytest.raises(ValueError, match="fixed block of 32"):
        bitkern.quantize(_weight(), "mxfp4", group_size=64)


def test_zero_mode_errors():
    with pytest.raises(ValueError, match="zero_mode='gptq' needs an unsigned integer type"):
        bitkern.quantize(_weight(), "int4", zero_mode="gptq")
    with pytest.raises(ValueError, match="zero_mode='asym' is not known; accepted"):
        bitkern.quantize(_weight(), "uint4", zero_mode="asym")


def test_weight_errors():
    with pytest.raises(TypeError, match="weight must be a floating-point torch.Tensor"):
        bitkern.quantize(torch.ones(4, 32, dtype=torch.int32), "int4", group_size=32)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        bitkern.quantize(torch.ones(32), "int4")
    with pytest.raises(ValueError, match="NaN or infinity"):
        bitkern.quantize(torch.full((2, 32), math.inf), "int4", group_size=32)
    with pytest.raises(ValueError, match="at most 8 bits"):
        bitkern.quantize(_weight(), "float16")
    with pytest.raises(ValueError, match="scale_dtype"):
        bitkern.quantize(_weight(), "int4", scale_dtype=torch.float64)
    with pytest.raises(ValueError, match="scales overflow"):
        bitkern.quantize(torch.full((1, 32), 1e6), "int4", group_size=32)


def test_quantized_weight_validates_its_tensors():
    q = bitkern.quantize(_weight(), "uint4", group_size=64)
    parts = dict(ttype=q.ttype, shape=q.shape, group_size=64, zero_mode="gptq", qweight=q.qweight,
                 scales=q.scales, zeros=q.zeros)
    with pytest.raises(ValueError, match=r"scales has shape \(16, 2\), expected \(16, 4\)"):
        bitkern.QuantizedWeight(**{**parts, "scales": q.scales[:, :2]})
    with pytest.raises(TypeError, match="qweight has dtype torch.uint8"):
        bitkern.QuantizedWeight(**{**parts, "qweight": q.qweight.view(torch.uint8)})
    with pytest.raises(TypeError, match="zeros must be a torch.Tensor"):
        bitkern.QuantizedWeight(**{**parts, "zeros": None})
    with pytest.raises(ValueError, match="zeros must be None for zero_mode='none'"):
        bitkern.QuantizedWeight(**{**parts, "ttype": "int4", "zero_mode": "none"})
    assert torch.equal(bitkern.QuantizedWeight(**parts).dequantize(), q.dequantize())
