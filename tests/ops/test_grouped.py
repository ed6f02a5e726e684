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
