"""±Inf and NaN in x through every CPU template: the pattern of torch's x·Wᵀ (±Inf where it has them, NaN
only where it has NaN: an infinity times a zero weight, or infinities of both signs), never a row of NaN.

The AMX and AVX512-BF16 templates fold decode offsets and zero points out of their sums and split
fp16/fp32 x into bf16 planes, the lookup template folds zero points: each would turn one infinite x into
a row of NaN (see `bitkern.codegen.cpu.emit.nonfinite`).  The generic template multiplies dequantized weights.
"""

import pytest
import torch

import bitkern
from bitkern.codegen import build_kernel
from bitkern.ops import Conv2d, ConvGeometry, Matmul
from bitkern.ttype import Layout
from bitkern.tuner import host_cpu, m_bucket
from bitkern.tuner.space import enumerate_candidates
from tests.helpers import MATRIX_TEMPLATES, matrix_device

N, K = 48, 128


def _kernel(spec, m, template, direct=None, n=N, k=K):
    """The first configuration of `template` for the bucket of m (a direct AVX512-BF16 one if asked), built for a
    device the tuner gives that template."""
    device = matrix_device(template) if template in ("amx", "dot") else host_cpu()
    bucket = m_bucket(m)
    _, candidates = enumerate_candidates(spec, n, k, bucket, Layout.TILE16, device)
    configs = [c.config for c in candidates if c.template == template and
               (direct is None or getattr(c.config, "direct", None) == direct)]
    assert configs, f"the {template} template serves no configuration of {spec} at M={m}"
    return build_kernel(spec, n, k, template, configs[0], Layout.TILE16, bucket, device)


def _assert_torch_pattern(y, exact):
    """y has NaN exactly where the float64 result has, the same infinities, and the finite values close."""
    y = y.double()
    assert torch.equal(torch.isnan(y), torch.isnan(exact)), (torch.isnan(y).sum(), torch.isnan(exact).sum())
    infinite = torch.isinf(exact)
    assert torch.equal(torch.isinf(y), infinite) and torch.equal(y[infinite], exact[infinite])
    finite = torch.isfinite(exact)
    torch.testing.assert_close(y[finite], exact[finite], rtol=2e-2, atol=0.3)


def _x(m, k, dtype):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[0, 5] = float("inf")  # one +Inf: ±Inf across the row, NaN where the weight is 0
    if m > 1:
        x[1, 7], x[1, 70] = float("inf"), float("-inf")  # both signs: NaN where the weights share a sign
    if m > 2:
        x[2, 100] = float("nan")  # NaN: a row of NaN, as in torch
    return x


def _check_non_finite(template, m, direct, weight, zero_mode, activation):
    """The first configuration of `template` for M rows, on x with ±Inf and NaN, against torch's pattern."""
    group = 32 if bitkern.ttype.get(weight).block_size == 1 else None
    q = bitkern.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)), weight, group_size=group,
                         zero_mode=zero_mode)
    spec = Matmul.for_weight(q, activation)
    kernel = _kernel(spec, m, template, direct)
    x = _x(m, K, getattr(torch, activation))
    exact = spec.exact(x, q)
    assert torch.isinf(exact[0]).sum() > N // 2 and torch.isnan(exact[0]).sum() < N // 2  # mostly ±Inf
    _assert_torch_pattern(kernel(x, bitkern.pack(q)), exact)


CASES = [("amx", 1, None), ("amx", 40, None), ("dot", 1, None), ("dot", 3, True), ("dot", 8, False), ("dot", 40, None),
         ("lut", 1, None), ("lut", 3, None), ("fma", 1, None), ("fma", 4, None), ("generic", 3, None)]
MARKS = {"amx": pytest.mark.requires_amx, "dot": pytest.mark.requires_avx512_bf16}


def _served(cases, weights):
    """Every case with every (weight, zero_mode, activation) but the lookup template's 8-bit codes (it reads 1-, 2-
    and 4-bit codes) and the FMA template's float codes other than 4-bit code books, each matrix template's case marked with the hardware
    it runs on."""
    return [pytest.param(template, m, direct, *weight, marks=MARKS.get(template, ()))
            for template, m, direct in cases for weight in weights
            if not (template == "lut" and bitkern.ttype.get(weight[0]).bits == 8)
            and not (template == "fma" and bitkern.ttype.get(weight[0]).kind not in ("int", "uint")
                     and bitkern.ttype.get(weight[0]).bits != 4)]


@pytest.mark.parametrize("template, m, direct, weight, zero_mode, activation", _served(CASES, [
    ("int4", None, "bfloat16"), ("int4", None, "float32"), ("uint4", "gptq", "float16"), ("nf4", None, "bfloat16"),
    ("uint2", "gptq", "bfloat16"), ("int8", None, "float32")]))
def test_non_finite_x_gives_torchs_infinities(template, m, direct, weight, zero_mode, activation):
    _check_non_finite(template, m, direct, weight, zero_mode, activation)


@pytest.mark.parametrize("template, m, direct, weight, zero_mode, activation", _served(
    [("amx", 40, None), ("dot", 1, None), ("dot", 40, None), ("lut", 3, None), ("fma", 2, None)],
    [("mxfp4", None, "bfloat16"), ("nvfp4", None, "float16"), ("uint4", "hqq", "float32")]))
def test_non_finite_x_with_block_scales_and_float_zero_points(template, m, direct, weight, zero_mode, activation):
    _check_non_finite(template, m, direct, weight, zero_mode, activation)


@pytest.mark.parametrize("template", MATRIX_TEMPLATES)
@pytest.mark.parametrize("channels", [16, 32])  # a staged gather, and one of whole 32-channel runs
def test_non_finite_pixels_of_a_convolution_give_torchs_infinities(channels, template):
    """The gathering prologue of the implicit GEMM: an infinite pixel reaches every output pixel that reads it."""
    geometry = ConvGeometry(channels, 6, 6, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1))
    q = bitkern.quantize(torch.randn(16, geometry.reduction, generator=torch.Generator().manual_seed(0)), "uint4",
                         group_size=16, zero_mode="gptq")
    spec = Conv2d("uint4", "float32", geometry=geometry, group_size=16, zero_mode="gptq")
    image = torch.randn(1, 6, 6, channels, generator=torch.Generator().manual_seed(1))
    image[0, 2, 3, 5] = float("-inf")
    kernel = _kernel(spec, geometry.pixels, template, n=16, k=geometry.reduction)
    _assert_torch_pattern(kernel(image, bitkern.pack(q)).reshape(-1, 16), spec.exact(image, q).reshape(-1, 16))


def test_a_layer_passes_infinities_through_like_torch():
    """End to end through bitkern.Linear (the tuner's choice of template), float32 and bfloat16 compute."""
    torch.manual_seed(0)
    source = torch.nn.Linear(K, N)
    for compute in (None, torch.bfloat16):
        layer = bitkern.Linear.from_float(source, "int4", group_size=32, compute_dtype=compute)
        x = _x(4, K, torch.float32)
        exact = torch.nn.functional.linear((x if compute is None else x.to(compute)).double(),
                                           layer.dequantize_weight(torch.float64), source.bias.double())
        _assert_torch_pattern(layer(x), exact)
