"""`bitkern.ops.GroupedMatmul`: the routed (mixture-of-experts) matmul spec — its fields checked by name, its float64
reference equal to each expert's `Matmul` reference row by row, bad inputs refused naming the argument, and the
spec's round trip through the cache's manifest form."""

import dataclasses

import pytest
import torch

import bitkern
from bitkern.ops import GroupedMatmul, Matmul, spec_from_dict

E, N, K = 5, 32, 128


def _case(dtype="int4", bias=False, tokens=4, top_k=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = bitkern.quantize(torch.randn(E * N, K, generator=generator), dtype, group_size=64)
    spec = GroupedMatmul(dtype, "float32", group_size=64, zero_mode=weight.zero_mode, bias=bias, experts=E,
                         top_k=top_k)
    x = torch.randn(tokens, K, generator=generator)
    indices = torch.randint(0, E, (tokens, top_k), generator=generator)
    return spec, weight, x, indices, torch.randn(E, N, generator=generator) if bias else None


@pytest.mark.parametrize("bias", [False, True])
def test_the_reference_is_each_experts_matmul(bias):
    spec, weight, x, indices, b = _case(bias=bias)
    y = spec.exact(x, weight, indices, b)
    assert y.shape == (4, 3, N) and y.dtype == torch.float64
    rows = weight.dequantize(torch.float64).view(E, N, K)
    for m in range(4):
        for j in range(3):
            e = int(indices[m, j])
            expected = x[m].double() @ rows[e].T + (0 if b is None else b[e].double())
            assert torch.allclose(y[m, j], expected, rtol=0, atol=1e-12)
    assert spec.reference(x, weight, indices, b).dtype == torch.float32


def test_int8_activations_are_each_experts_matmul_with_int8_activations():
    """activation_quant="int8": each pair is the dense spec's reference of its expert (x quantized once per row)."""
    spec, weight, x, indices, b = _case(dtype="nf4", bias=True)
    spec = dataclasses.replace(spec, activation_quant="int8")
    y = spec.exact(x, weight, indices, b)
    dense = spec.matmul
    rows = [bitkern.quantize(weight.dequantize(torch.float32)[e * N:(e + 1) * N], "nf4", group_size=64)
            for e in range(E)]
    for m in range(4):
        for j in range(3):
            e = int(indices[m, j])
            expected = dense.exact(x[m:m + 1], rows[e], b[e])[0]
            assert torch.allclose(y[m, j], expected, rtol=0, atol=1e-9)
    assert not torch.allclose(y, dataclasses.replace(spec, activation_quant="none").exact(x, weight, indices, b))


def test_the_spec_is_a_matmul_with_experts_and_top_k_and_round_trips():
    spec = GroupedMatmul("nf4", "bfloat16", group_size=64, experts=8, top_k=2, bias=True)
    assert isinstance(spec, Matmul) and spec.experts == 8 and Matmul("nf4").experts == 0
    assert spec.matmul == Matmul("nf4", "bfloat16", group_size=64, bias=True)
    again = spec_from_dict(dataclasses.asdict(spec))
    assert again == spec and hash(again) == hash(spec) and type(again) is GroupedMatmul
    assert spec != GroupedMatmul("nf4", "bfloat16", group_size=64, experts=8, top_k=1, bias=True)


@pytest.mark.parametrize("fields, named", [({"experts": 0}, "experts=0"), ({"top_k": True}, "top_k=True"),
                                           ({"epilogue": "silu"}, "epilogue='silu'"),
                                           ({"norm": "rmsnorm"}, "norm='rmsnorm'"),
                                           ({"activation_quant": "int4"}, "activation_quant='int4'")])
def test_bad_fields_are_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        GroupedMatmul("int4", "float32", **{"experts": 4, "top_k": 2, **fields})


def test_bad_inputs_are_refused_by_name():
    spec, weight, x, indices, _ = _case()
    with pytest.raises(ValueError, match=r"indices must be an int32 or int64 tensor \[4, top_k=3\]"):
        spec.exact(x, weight, indices[:, :2])
    with pytest.raises(ValueError, match="indices must be"):
        spec.exact(x, weight, indices.float())
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 5\) \(min 0, max 5\)"):
        spec.exact(x, weight, torch.where(indices == indices.max(), 5, indices))
    with pytest.raises(ValueError, match=r"outside \[0, 5\) \(min -1"):
        spec.exact(x, weight, indices - 1)
    with pytest.raises(ValueError, match="x must be a \\[rows, 128\\] tensor"):
        spec.exact(x[0], weight, indices)
    with pytest.raises(TypeError, match="x has dtype torch.float16"):
        spec.exact(x.half(), weight, indices)
    with pytest.raises(ValueError, match="bias must be None"):
        spec.exact(x, weight, indices, torch.zeros(E, N))
    biased = dataclasses.replace(spec, bias=True)
    with pytest.raises(ValueError, match=r"bias must be a float32, float16 or bfloat16 tensor \[5, 32\]"):
        biased.exact(x, weight, indices, torch.zeros(N))
    with pytest.raises(ValueError, match="weight has 160 rows, not a stack of experts=3"):
        dataclasses.replace(spec, experts=3).exact(x, weight, indices)
    with pytest.raises(TypeError, match="weight must be a bitkern QuantizedWeight"):
        spec.exact(x, torch.zeros(E * N, K), indices)


def test_experts_of_rows_not_a_multiple_of_16_and_tensor_scales_are_refused():
    spec = GroupedMatmul("int4", "float32", group_size=64, experts=2, top_k=1)
    with pytest.raises(ValueError, match="out_features=24: a grouped matmul's experts have a multiple of 16 rows"):
        spec.check_shape(24, K)
    weight = bitkern.quantize(torch.randn(2 * N, K), "nvfp4")
    nvfp4 = GroupedMatmul("nvfp4", "float32", group_size=16, experts=2, top_k=1)
    with pytest.raises(ValueError, match="has one scale per tensor"):
        nvfp4.exact(torch.randn(1, K), weight, torch.zeros(1, 1, dtype=torch.long))


def test_swiglu_takes_each_experts_halves_and_combine_sums_the_weighted_pairs():
    """epilogue="swiglu": silu of an expert's first N/2 outputs times its last N/2; combine: x a row per pair, y the
    routing weights' sum over a token's pairs; both from each expert's plain Matmul reference."""
    spec, weight, x, indices, b = _case(bias=True)
    rows = weight.dequantize(torch.float64).view(E, N, K)
    fused = dataclasses.replace(spec, epilogue="swiglu", combine=True)
    pairs = torch.randn(4 * 3, K, generator=torch.Generator().manual_seed(3))
    weights = torch.rand(4, 3, generator=torch.Generator().manual_seed(4))
    y = fused.exact(pairs, weight, indices, b, weights)
    assert y.shape == fused.output_shape(4, N) == (4, N // 2)
    for m in range(4):
        expected = torch.zeros(N // 2, dtype=torch.float64)
        for j in range(3):
            e = int(indices[m, j])
            z = pairs[3 * m + j].double() @ rows[e].T + b[e].double()
            expected += weights[m, j].double() * torch.nn.functional.silu(z[:N // 2]) * z[N // 2:]
        assert torch.allclose(y[m], expected, rtol=0, atol=1e-10)
    gated = dataclasses.replace(spec, epilogue="swiglu").exact(x, weight, indices, b)
    z = spec.exact(x, weight, indices, b)
    assert gated.shape == (4, 3, N // 2)
    assert torch.allclose(gated, torch.nn.functional.silu(z[..., :N // 2]) * z[..., N // 2:], rtol=0, atol=1e-12)
    assert fused.matmul == spec.matmul and fused != spec and hash(fused) != hash(spec)
    assert spec_from_dict(dataclasses.asdict(fused)) == fused


def test_the_routing_weights_of_combine_are_checked_by_name():
    spec, weight, x, indices, _ = _case()
    combined = dataclasses.replace(spec, combine=True)
    pairs = torch.randn(12, K)
    with pytest.raises(ValueError, match="weights are required: the spec has combine=True"):
        combined.exact(pairs, weight, indices)
    with pytest.raises(ValueError, match="weights must be None: the spec has combine=False"):
        spec.exact(x, weight, indices, weights=torch.ones(4, 3))
    with pytest.raises(ValueError, match=r"x has 10 rows; combine=True takes a row per \(token, expert\) pair"):
        combined.exact(pairs[:10], weight, indices, weights=torch.ones(4, 3))
    with pytest.raises(ValueError, match=r"weights must be a float32, float16 or bfloat16 tensor \[4, 3\]"):
        combined.exact(pairs, weight, indices, weights=torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"weights must be"):
        combined.exact(pairs, weight, indices, weights=torch.ones(4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"indices must be an int32 or int64 tensor \[4, top_k=3\]"):
        combined.exact(pairs, weight, indices[:3], weights=torch.ones(4, 3))
    with pytest.raises(TypeError, match="combine=1 must be a bool"):
        GroupedMatmul("int4", "float32", experts=4, top_k=2, combine=1)
    with pytest.raises(ValueError, match="epilogue='swiglu' needs a stacked weight of a multiple of 32 rows"):
        dataclasses.replace(spec, epilogue="swiglu").check_shape(48, K)
