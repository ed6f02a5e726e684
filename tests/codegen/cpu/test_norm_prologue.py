"""The norm prologue of the CPU kernels (`Matmul.norm`: RMSNorm as Hugging Face's LlamaRMSNorm and as
torch.nn.RMSNorm, LayerNorm as torch.nn.LayerNorm), template by template: x̂ as a kernel computes it, read back
through an identity weight, against the norm modules of transformers and torch; whole kernels against the float64
reference of norm-then-matmul; non-finite x; the AMX kernels' build (no AMX here to run them)."""

import dataclasses

import pytest
import torch
from torch import nn

import bitkern
from bitkern.codegen import pack
from bitkern.codegen.cpu import amx, dot, fma, generic, lut
from bitkern.codegen.cpu.dot import DotConfig
from bitkern.codegen.cpu.generic import GenericConfig
from bitkern.codegen.cpu.matrix import decode_strategies
from bitkern.ops import Matmul
from bitkern.ops.matmul import norm_reference
from bitkern.tuner import host_cpu
from tests.helpers import matrix_device, summed_magnitudes

EPS = 1e-5


def _norm_module(norm: str, k: int, dtype: torch.dtype, generator) -> tuple:
    """(the torch / transformers module computing `norm`, its weight, its bias) with random affine parameters."""
    weight = (1 + 0.5 * torch.randn(k, generator=generator)).to(dtype)
    bias = (0.3 * torch.randn(k, generator=generator)).to(dtype) if norm == "layernorm" else None
    if norm == "rmsnorm":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        module = LlamaRMSNorm(k, eps=EPS)
    elif norm == "torch_rmsnorm":
        module = nn.RMSNorm(k, eps=EPS)
    else:
        module = nn.LayerNorm(k, eps=EPS)
    module = module.to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            module.bias.copy_(bias)
    return module, weight, bias


def _pinned(template: str, spec, n: int, k: int, bucket: tuple):
    """A kernel of `template` for the bucket: AVX512-BF16 in the configuration its bucket calls for (direct rows;
    small M, planes built before the main loop; large M, planes built per row chunk), or the generic template."""
    if template == "generic":
        return generic.TEMPLATE.build(spec, n, k, GenericConfig(32), "tile16", bucket, host_cpu())
    decode = decode_strategies(spec)[0]
    if bucket[1] <= 4:
        config = DotConfig(2, True, 16, 1, 0, decode, rows=1, direct=True)
    elif bucket[1] <= 16:
        config = DotConfig(2, True, 16, 2, 16, decode, rows=4)
    else:
        config = DotConfig(2, False, 32, 2, 16, decode, chunk_prologue=True, rows=4)
    return dot.TEMPLATE.build(spec, n, k, config, "tile16", bucket, matrix_device("dot"))


def _assert_same_values(got, expected, dtype: torch.dtype) -> None:
    """bfloat16: got is expected but for at most 8 values one bf16 rounding away; float32 (no rounding to absorb
    statistics summed in another order): within a few float32 roundings of the row's values."""
    if dtype == torch.float32:
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
        return
    assert bool(((got - expected).abs() <= expected.abs() * 2.0**-7).all())
    assert int((got != expected).sum()) <= 8


TEMPLATES = [pytest.param("dot", marks=pytest.mark.requires_avx512_bf16), "generic"]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("norm", ["rmsnorm", "torch_rmsnorm", "layernorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_kernel_normalizes_x_as_the_norm_module_does(template, norm, dtype):
    """An identity weight (bfloat16, exact) makes y the x̂ the kernel built its planes from; K = 200 is not a
    multiple of 32 (the prologue's tail).  Statistics summed in another order may move a value across a rounding
    boundary of its dtype (bfloat16: one ulp, for a handful of the 7000 values; float32: a few roundings)."""
    k, m = 200, 35
    generator = torch.Generator().manual_seed(3)
    module, weight, bias = _norm_module(norm, k, dtype, generator)
    x = (3 * torch.randn(m, k, generator=generator)).to(dtype)
    eye = bitkern.quantize(torch.eye(k), "bfloat16", group_size=-1)
    spec = Matmul.for_weight(eye, "float32" if dtype == torch.float32 else "bfloat16", output_dtype="float32",
                             norm=norm, norm_eps=EPS)
    kernel = _pinned(template, spec, k, k, (17, 64))
    y = kernel(x, pack(eye), None, None, norm=(weight, bias))
    with torch.no_grad():
        expected = module(x).float()
    _assert_same_values(norm_reference(norm, x, weight, bias, EPS).float(), expected, dtype)  # the reference
    _assert_same_values(y, expected, dtype)


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("name,norm,m", [("int4", "rmsnorm", 1), ("nf4", "layernorm", 16),
                                         ("int8", "torch_rmsnorm", 100)])
def test_kernels_with_a_norm_prologue_match_the_reference(template, name, norm, m):
    """y within the kernels' error bound of the float64 reference of x̂ · Wᵀ + b (x̂ from `norm_reference`), taken
    with c = 2^-8 for every type: a value of x̂ may round the other way (see the test above), which moves y by
    up to 2^-7·|x̂_k·w_k| for that k; with a residual and SwiGLU the output stage runs too."""
    n, k = 64, 256
    generator = torch.Generator().manual_seed(m)
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=64)
    _, weight, bias = _norm_module(norm, k, torch.bfloat16, generator)
    epilogue = "swiglu" if m == 16 else "none"
    spec = Matmul.for_weight(qweight, "bfloat16", bias=True, output_dtype="float32", epilogue=epilogue,
                             residual=epilogue == "none", norm=norm, norm_eps=EPS)
    x = (2 * torch.randn(m, k, generator=generator)).bfloat16()
    linear_bias = torch.randn(n, generator=generator)
    residual = torch.randn(m, n, generator=generator) if spec.residual else None
    bucket = (1, 1) if m == 1 else (2, 16) if m <= 16 else (17, 128)
    y = _pinned(template, spec, n, k, bucket)(x, pack(qweight), linear_bias, residual, norm=(weight, bias))
    _assert_within_the_bound(spec, qweight, x, linear_bias, residual, weight, bias, y)


def _assert_within_the_bound(spec, qweight, x, linear_bias, residual, weight, bias, y) -> None:
    """y within the kernels' error bound of `spec.exact` (see the test above); SwiGLU through the bound of each
    of gate and up."""
    m = x.shape[0]
    x_hat = norm_reference(spec.norm, x, weight, bias, EPS)
    reference = spec.exact(x, qweight, linear_bias, residual, weight, bias)
    magnitude = x_hat.double().abs() @ summed_magnitudes(spec, qweight).T
    if spec.epilogue == "swiglu":  # bound each of gate and up, then through silu(gate)·up
        plain = dataclasses.replace(spec, epilogue="none", residual=False)
        z = plain.exact(x, qweight, linear_bias, None, weight, bias)
        error = 2.0**-8 * magnitude
        pairs = [t.reshape(m, -1, 2, 16) for t in (z, error)]
        gate, up, gate_error, up_error = pairs[0][..., 0, :], pairs[0][..., 1, :], pairs[1][..., 0, :], \
            pairs[1][..., 1, :]
        bound = 1.1 * gate_error * (up.abs() + up_error) + torch.nn.functional.silu(gate).abs() * up_error
        assert float(((y.double() - reference).abs() - bound.reshape(m, -1) - 2.0**-23 * reference.abs()).max()) <= 0
    else:
        bound = 2.0**-8 * magnitude + 2.0**-23 * reference.abs()
        assert float(((y.double() - reference).abs() - bound).max()) <= 0


@pytest.mark.requires_avx512_bf16
def test_non_finite_x_gives_the_norms_nan_rows():
    """A row holding ±Inf or NaN has no finite statistics: torch's norms give NaN for all of it, so does the
    kernel (through its non-finite path); the other rows are untouched."""
    k = 128
    qweight = bitkern.quantize(torch.randn(32, k), "int4", group_size=64)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", norm="rmsnorm", norm_eps=EPS)
    x = torch.randn(3, k).bfloat16()
    x[1, 5] = float("inf")
    weight = torch.ones(k)
    y = _pinned("dot", spec, 32, k, (2, 16))(x, pack(qweight), norm=(weight, None))
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())


def test_the_amx_kernels_build_with_a_norm_prologue():
    """The AMX template shares the tile16 prologue: its kernels with a norm compile for an AMX CPU."""
    cpu = host_cpu()
    device = cpu.at_level("amx")
    qweight = bitkern.quantize(torch.randn(64, 256), "int4")
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", epilogue="swiglu", norm="layernorm")
    config = amx.AmxConfig(2, False, 64, 2, 16, "affine", chunk_prologue=True)  # planes built per row chunk
    kernel = amx.TEMPLATE.build(spec, 64, 256, config, "tile16", (129, 256), device)
    assert kernel.template == "amx" and kernel.spec.norm == "layernorm"


def test_templates_without_a_norm_prologue_say_so():
    from bitkern.codegen.cuda import gemv

    spec = Matmul("int4", "bfloat16", norm="rmsnorm")
    assert "norm='rmsnorm'" in gemv.TEMPLATE.unsupported_epilogue(spec)
    assert all(template.TEMPLATE.unsupported_epilogue(spec) is None for template in (dot, generic, lut))


@pytest.mark.parametrize("name,zero_mode,norm,activation,k,group", [
    ("int4", None, "rmsnorm", "bfloat16", 256, 64),
    ("nf4", None, "layernorm", "bfloat16", 256, 128),
    ("int2", None, "torch_rmsnorm", "float16", 256, 64),
    ("uint4", "gptq", "rmsnorm", "bfloat16", 256, 64),      # zero points: the group sums XS are of x̂
    ("int4", None, "layernorm", "float32", 200, -1),         # K not a multiple of 16: x̂ element by element
])
@pytest.mark.parametrize("few_rows", ["lut", "fma", "fma-blocks"])
def test_lookup_kernels_with_a_norm_prologue_match_the_reference(name, zero_mode, norm, activation, k, group, few_rows):
    """The few-row templates (M <= 4: the decode path) read x̂ (the lookup template builds its tables from it, the
    FMA template multiplies it in): y within the kernels' error bound of the float64 reference of x̂ · Wᵀ + b +
    residual for M = 1..4, and a SwiGLU kernel's y within that of its unfused pair; one build serves every row count
    of the bucket.  The FMA template's blocks of rows (prompts, at x86-64-v3) the same over several prologue chunks."""
    template, config, bucket, rows, device = {
        "lut": (lut.TEMPLATE, lut.LutConfig(n_tiles=2, prefetch=16), (1, 4), (1, 2, 4), host_cpu()),
        "fma": (fma.TEMPLATE, fma.FmaConfig(n_tiles=2, prefetch=16), (1, 4), (1, 2, 4), host_cpu()),
        "fma-blocks": (fma.TEMPLATE, fma.FmaConfig(n_tiles=2, prefetch=16, rows=3, m_chunk=6), (17, 128), (17, 23),
                       host_cpu().at_level("x86-64-v3"))}[few_rows]
    if few_rows.startswith("fma") and name == "nf4":
        pytest.skip("codebook codes go to the lookup template")
    n = 64
    generator = torch.Generator().manual_seed(k + group)
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=group, zero_mode=zero_mode)
    dtype = getattr(torch, activation)
    _, weight, bias = _norm_module(norm, k, dtype, generator)
    linear_bias = torch.randn(n, generator=generator)
    for epilogue in ("none", "swiglu"):
        spec = Matmul.for_weight(qweight, activation, bias=True, output_dtype="float32", epilogue=epilogue,
                                 residual=epilogue == "none", norm=norm, norm_eps=EPS)
        kernel = template.build(spec, n, k, config, "tile16", bucket, device)
        for m in rows:
            x = (2 * torch.randn(m, k, generator=generator)).to(dtype)
            residual = torch.randn(m, n, generator=generator) if spec.residual else None
            y = kernel(x, pack(qweight), linear_bias, residual, norm=(weight, bias))
            _assert_within_the_bound(spec, qweight, x, linear_bias, residual, weight, bias, y)


def test_lookup_kernels_give_the_norms_nan_rows_for_non_finite_x():
    """As the tile16 kernels: a row with ±Inf or NaN is NaN throughout, the other rows are untouched."""
    k = 128
    qweight = bitkern.quantize(torch.randn(32, k), "int4", group_size=64)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", norm="rmsnorm", norm_eps=EPS)
    kernel = lut.TEMPLATE.build(spec, 32, k, lut.LutConfig(n_tiles=1, prefetch=0), "tile16", (1, 4), host_cpu())
    x = torch.randn(3, k).bfloat16()
    x[1, 5] = float("inf")
    y = kernel(x, pack(qweight), norm=(torch.ones(k), None))
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())
    assert torch.equal(y[[0, 2]], kernel(x[[0, 2]], pack(qweight), norm=(torch.ones(k), None)))


def test_the_tuner_offers_the_lookup_template_for_a_normalized_decode():
    from bitkern.tuner.space import usable_templates

    qweight = bitkern.quantize(torch.randn(64, 256), "int4", group_size=64)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="bfloat16", epilogue="swiglu", norm="rmsnorm")
    usable, unused = usable_templates(spec, 64, 256, (1, 1), "tile16", host_cpu())
    assert lut.TEMPLATE in usable, unused.get("lut")


def test_profiled_tuning_times_kernels_with_their_norm_and_residual():
    """Timing candidates calls them with the residual and norm vectors their signatures take."""
    from bitkern.tuner import tune

    qweight = bitkern.quantize(torch.randn(32, 128), "int4", group_size=64)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="bfloat16", residual=True, norm="layernorm")
    tuned = tune(spec, 32, 128, (2, 16), "tile16", host_cpu(), profile=True)
    assert tuned.record.profiled and sum(t.measured_s is not None for t in tuned.record.trials) >= 2
    x, residual = torch.randn(3, 128).bfloat16(), torch.randn(3, 32).bfloat16()
    y = tuned.kernel(x, pack(qweight), None, residual, norm=(torch.ones(128), torch.zeros(128)))
    reference = spec.reference(x, qweight, None, residual, torch.ones(128), torch.zeros(128))
    assert torch.allclose(y.float(), reference.float(), rtol=2e-2, atol=2e-2 * float(reference.abs().max()))
