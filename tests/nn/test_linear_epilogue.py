"""torch.ops.bitkern.linear_epilogue (the kernels' fused output stage: activation, SwiGLU gating, residual add)
against the float64 reference of the unfused computation, within the kernels' error bound carried through the
epilogue; gradients to x, bias and residual; torch.compile fullgraph."""

import pytest
import torch

import bitkern
from bitkern.nn.library import op_arguments
from bitkern.ops import Matmul
from bitkern.ops.matmul import swiglu_rows
from tests.helpers import assert_epilogue_matches_reference

N, K = 64, 256


def _case(dtype: str, epilogue: str, m: int, residual: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    qweight = bitkern.quantize(torch.randn(N, K, generator=generator), dtype, group_size=128)
    x = torch.randn(m, K, generator=generator).bfloat16()
    bias = torch.randn(N, generator=generator)
    spec = Matmul.for_weight(qweight, "bfloat16", bias=True, output_dtype="float32", epilogue=epilogue,
                             residual=residual)
    r = torch.randn(m, spec.out_features(N), generator=generator) if residual else None
    return spec, qweight, x, bias, r


@pytest.mark.parametrize("dtype", ["int4", "nf4", "int8"])
@pytest.mark.parametrize("epilogue,residual", [("silu", False), ("gelu", False), ("relu", True), ("none", True),
                                               ("swiglu", False)])
def test_fused_matches_unfused_reference(dtype, epilogue, residual):
    for m in (1, 16, 128):
        spec, qweight, x, bias, r = _case(dtype, epilogue, m, residual, seed=m)
        weight, weight_format = op_arguments(bitkern.pack(qweight))
        y = torch.ops.bitkern.linear_epilogue(x, weight, weight_format, bias, torch.float32, epilogue, r)
        assert_epilogue_matches_reference(spec, qweight, x, bias, r, y)


def test_swiglu_rows_interleave_gate_and_up():
    order = swiglu_rows(32)
    assert order[:16].tolist() == list(range(16)) and order[16:32].tolist() == list(range(32, 48))
    assert sorted(order.tolist()) == list(range(64))
    with pytest.raises(ValueError, match="multiple of 16"):
        swiglu_rows(24)


@pytest.mark.parametrize("epilogue", ["silu", "swiglu"])
def test_gradients_flow_to_x_bias_and_residual(epilogue):
    spec, qweight, x, bias, r = _case("int4", epilogue, 3, residual=True)
    weight, weight_format = op_arguments(bitkern.pack(qweight))
    x, bias, r = (t.clone().requires_grad_(True) for t in (x, bias, r))
    y = torch.ops.bitkern.linear_epilogue(x, weight, weight_format, bias, torch.float32, epilogue, r)
    grad = torch.randn_like(y)
    y.backward(grad)
    w = qweight.dequantize(torch.float32)
    xr, br, rr = (t.detach().float().requires_grad_(True) for t in (x, bias, r))
    from bitkern.ops.matmul import epilogue_reference
    (epilogue_reference(epilogue, xr @ w.T + br) + rr).backward(grad)
    for got, want in ((x.grad, xr.grad), (bias.grad, br.grad), (r.grad, rr.grad)):
        assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_compiles_fullgraph_with_the_fake():
    spec, qweight, x, bias, r = _case("int4", "swiglu", 2, residual=True)
    weight, weight_format = op_arguments(bitkern.pack(qweight))

    def fused(x, r):
        return torch.ops.bitkern.linear_epilogue(x, weight, weight_format, bias, torch.float32, "swiglu", r) * 2

    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, r), fused(x, r))


def test_bad_epilogue_is_named_before_any_kernel_is_built():
    qweight = bitkern.quantize(torch.randn(N, K), "int4")
    with pytest.raises(ValueError, match="epilogue='tanh'"):
        Matmul.for_weight(qweight, "bfloat16", epilogue="tanh")
    with pytest.raises(ValueError, match="swiglu"):
        Matmul.for_weight(qweight, "bfloat16", epilogue="swiglu").check_shape(48, K)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", residual=True)
    with pytest.raises(ValueError, match="residual must be a tensor of shape"):
        spec(torch.randn(2, K).bfloat16(), bitkern.pack(qweight), None, torch.randn(3, N))


@pytest.mark.parametrize("epilogue,residual", [("swiglu", True), ("gelu", False)])
def test_amx_kernels_build_with_epilogues(epilogue, residual):
    """The AMX template shares the tile16 output stage: its epilogue kernels compile for an AMX CPU (run where
    one is present, by the matrix-template tests); SwiGLU configurations pair their tiles."""
    from bitkern.codegen.cpu import amx
    from bitkern.tuner import host_cpu

    cpu = host_cpu()
    device = cpu.at_level("amx")
    spec, *_ = _case("int4", epilogue, 1, residual)
    configs = amx.TEMPLATE.configs(spec, N, K, (1, 16), device, None)
    assert configs and (epilogue != "swiglu" or all(c.n_tiles % 2 == 0 for c in configs))
    kernel = amx.TEMPLATE.build(spec, N, K, configs[0], "tile16", (1, 16), device)
    assert kernel.template == "amx" and kernel.spec.epilogue == epilogue
