"""Through the public API on a GPU: Matmul on CUDA tensors and modules moved to CUDA (skipped without one)."""

import pytest
import torch

import bitkern
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
