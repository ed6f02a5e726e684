"""Through the public API on a GPU: Matmul on CUDA tensors and modules moved to CUDA, mixture-of-experts decode steps
by the grouped kernels included (skipped without one)."""

import pytest
import torch

import bitkern
from bitkern.gpukit.matrix import DISPATCH_EXPERTS
from bitkern.ops import Matmul
from tests.helpers import assert_within_epilogue_bound, epilogue_bound

pytestmark = pytest.mark.requires_cuda


@pytest.mark.parametrize("name, activation", [("int4", "float16"), ("nf4", "bfloat16"), ("uint4", "float16")])
@pytest.mark.parametrize("m", [1, 33])
def test_matmul_on_cuda_tensors(name, activation, m):
    q = bitkern.quantize(torch.randn(256, 512), name).to("cuda")
    packed = bitkern.pack(q)
    assert packed.layout == "lop3"
    spec = Matmul.for_weight(q, activation, output_dtype="float32")
    x = torch.randn(m, 512, device="cuda").to(getattr(torch, activation))
    y = spec(x, packed)
    expected = spec.exact(x.cpu(), q.to("cpu"))
    magnitude = x.double().abs().cpu() @ q.to("cpu").dequantize(torch.float64).abs().T
    assert float(((y.double().cpu() - expected).abs() - 2.0**-7 * magnitude).max()) <= 0


@pytest.mark.parametrize("epilogue, residual", [("swiglu", True), ("gelu", False)])
@pytest.mark.parametrize("m", [1, 33])
def test_fused_matmul_on_cuda_tensors(epilogue, residual, m):
    """A fused epilogue through the dispatch on the GPU (the kernels of bitkern.gpukit.matrix.DISPATCH_EPILOGUES),
    against the float64 reference of the unfused computation."""
    generator = torch.Generator().manual_seed(m)
    q = bitkern.quantize(torch.randn(256, 512, generator=generator), "int4")
    spec = Matmul.for_weight(q, "float16", bias=True, output_dtype="float32", epilogue=epilogue, residual=residual)
    x = torch.randn(m, 512, generator=generator).half()
    bias = torch.randn(256, generator=generator)
    r = torch.randn(m, spec.out_features(256), generator=generator) if residual else None
    y = spec(x.cuda(), bitkern.pack(q.to("cuda")), bias.cuda(), None if r is None else r.cuda())
    z = Matmul.for_weight(q, "float16", bias=True, output_dtype="float32").exact(x, q, bias)
    reference = spec.exact(x, q, bias, r)
    bound_z = 2.0**-10 * (x.double().abs() @ q.dequantize(torch.float64).abs().T) + 2.0**-23 * z.abs()
    assert_within_epilogue_bound(spec, y, reference, epilogue_bound(spec, z, bound_z, reference, 2.0**-20))


def test_linear_moved_to_cuda_relays_its_weight():
    """Moved to CUDA, the layer holds its weight in the lop3 layout and computes x · Wᵀ + b (the reference: torch on
    the dequantized weight, so no CPU kernel is needed); moved back, the weight is the same, bit for bit."""
    layer = bitkern.Linear(512, 256, dtype="int4", compute_dtype=torch.float16)
    x = torch.randn(4, 512)
    weight = layer.dequantize_weight()
    expected = torch.nn.functional.linear(x.half().float(), weight, layer.bias)
    layer.to("cuda")
    assert layer.layout == "lop3"
    torch.testing.assert_close(layer(x.cuda()).cpu(), expected, rtol=2e-2, atol=2e-2)
    layer.cpu()
    assert layer.layout == "tile16" and torch.equal(layer.dequantize_weight(), weight)


@pytest.mark.parametrize("entry", DISPATCH_EXPERTS, ids=lambda entry: f"{entry[0]}-{entry[2]}-top{entry[7]}")
def test_experts_on_cuda_run_the_grouped_kernel(entry):
    """A `bitkern.Experts` moved to CUDA runs a decode step by the grouped kernels (the kit's `DISPATCH_EXPERTS`),
    against the float64 computation on its dequantized experts: y_t = Σ_j w_tj · down_e(swiglu(gate_up_e(x_t)))."""
    from bitkern.nn.experts import swiglu

    dtype, group, activation, num_experts, hidden, intermediate, tokens, top_k = entry
    generator = torch.Generator().manual_seed(top_k)
    experts = bitkern.Experts(num_experts, hidden, intermediate, dtype=dtype, group_size=group)
    gate_up = experts.gate_up.dequantize_weight(torch.float64)
    down = experts.down.dequantize_weight(torch.float64)
    x = torch.randn(tokens, hidden, generator=generator).to(getattr(torch, activation))
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            e = int(index[t, j])
            expected[t] += weights[t, j].double() * (swiglu(x[t].double() @ gate_up[e].T) @ down[e].T)
    experts.to("cuda")
    assert experts.gate_up.layout == "lop3"
    x, index, weights = x.cuda(), index.cuda(), weights.cuda()
    assert experts._routes(x, tokens * top_k)  # the grouped kernels serve both projections on this GPU
    y = experts(x, index, weights)
    assert y.shape == (tokens, hidden) and y.dtype == x.dtype
    torch.testing.assert_close(y.double().cpu(), expected, rtol=3e-2, atol=3e-2 * float(expected.abs().max()))
