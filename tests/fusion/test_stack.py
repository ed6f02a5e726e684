"""Stacked weights (q/k/v as one GEMM; gate/up in SwiGLU order): each slice of the stacked kernel's output lies
within the kernels' error bound of its own layer's float64 reference, for int4/nf4/int8 and M in 1, 16, 128."""

import pytest
import torch

import bitkern
from bitkern.fusion.modules import EpilogueLinear, SharedInputLinears
from bitkern.fusion.stack import stackable, stacked_layer
from bitkern.ops import Matmul
from tests.helpers import assert_matches_reference


def _layers(dtype: str, sizes: list, bias: bool, seed: int = 0) -> list:
    torch.manual_seed(seed)
    return [bitkern.Linear(128, n, bias, dtype, 64, compute_dtype=torch.bfloat16) for n in sizes]


@pytest.mark.parametrize("dtype", ["int4", "nf4", "int8"])
def test_stacked_slices_match_each_layers_reference(dtype):
    layers = _layers(dtype, [64, 32, 32], bias=True)
    group = SharedInputLinears(layers)
    for m in (1, 16, 128):
        x = torch.randn(m, 128).bfloat16()
        outputs = [group.outputs(x, i) for i in range(3)]
        for layer, y in zip(layers, outputs):
            qweight = layer.quantized_weight()
            spec = Matmul.for_weight(qweight, "bfloat16", bias=True, output_dtype="bfloat16")
            assert_matches_reference(spec, qweight, x, layer.bias.detach().float(), y)


def test_members_share_one_gemm_per_input():
    group = SharedInputLinears(_layers("int4", [32, 32], bias=False))
    x = torch.randn(2, 128)
    first = group.outputs(x, 0)
    assert group.outputs(x, 1).data_ptr() == first.data_ptr() + 32 * first.element_size()  # views of one output
    x.add_(1)  # modified in place: computed again
    assert not torch.equal(group.outputs(x, 0), first)


def test_swiglu_stack_matches_silu_gate_times_up():
    gate, up = _layers("int4", [48, 48], bias=True, seed=1)
    fused = EpilogueLinear(stacked_layer([gate, up], swiglu=True), "swiglu")
    x = torch.randn(5, 128)
    with torch.no_grad():
        reference = torch.nn.functional.silu(gate(x)) * up(x)
        y = fused(x)
    assert y.shape == reference.shape
    assert torch.allclose(y, reference, atol=2e-2 * float(reference.abs().max()))


def test_what_cannot_be_stacked_is_named():
    a, b = _layers("int4", [32, 32], bias=False)
    c = bitkern.Linear(64, 32, False, "int4", 64)
    assert stackable([a, c]) == "layers with different in_features"
    assert stackable([a]) == "not two or more bitkern.Linear layers"
    with pytest.raises(ValueError, match="cannot be stacked: layers with different in_features"):
        stacked_layer([a, c])
    assert stackable([a, b]) is None
