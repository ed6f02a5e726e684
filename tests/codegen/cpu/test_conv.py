"""Implicit-GEMM convolution kernels (bitkern.ops.Conv2d) against torch's convolution of the dequantized weight."""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import bitkern
from bitkern.cache import KernelKey
from bitkern.codegen import pack
from bitkern.ops import Conv2d, ConvGeometry, Matmul
from bitkern.ops.conv import im2col
from bitkern.tuner import host_cpu
from bitkern.tuner.space import usable_templates

from bitkern.ttype import torch_dtype
from tests.helpers import assert_within_bound, summed_magnitudes


def _case(name, geometry, batch, activation="bfloat16", output="float32", group=None, bias=False, seed=0,
          cout=24):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(cout, geometry.reduction, generator=generator)
    qweight = bitkern.quantize(weight, name, group_size=group)
    spec = Conv2d.for_weight(qweight, activation, bias=bias, output_dtype=output, geometry=geometry)
    x = torch.randn(batch, geometry.height, geometry.width, geometry.in_channels, generator=generator)
    b = torch.randn(cout, generator=generator) if bias else None
    return spec, qweight, x.to(torch_dtype(activation)), b


def _nchw_conv(spec, x, weight, bias=None):
    """torch's convolution of NHWC x with a [N, (kh, kw, c)] weight matrix, in float64, as NHWC."""
    g = spec.geometry
    kernel = weight.reshape(-1, *g.kernel, g.in_channels).permute(0, 3, 1, 2)
    image = F.pad(x.double().permute(0, 3, 1, 2), (g.padding[2], g.padding[3], g.padding[0], g.padding[1]))
    return F.conv2d(image, kernel, bias, g.stride, 0, g.dilation).permute(0, 2, 3, 1)


def _run(spec, qweight, x, bias=None):
    return _run_kernel(spec, qweight, x, bias, spec(x, pack(qweight), bias))


def _run_kernel(spec, qweight, x, bias, y):
    """y, after checking it against torch's convolution within the kernels' error bound."""
    out_h, out_w = spec.geometry.out_size
    assert y.shape == (x.shape[0], out_h, out_w, qweight.shape[0]) and y.dtype == torch_dtype(spec.output_dtype)
    magnitude = _nchw_conv(spec, x.abs(), summed_magnitudes(spec, qweight))
    assert_within_bound(spec, qweight, y, spec.exact(x, qweight, bias), magnitude)
    return y


def test_reference_is_the_direct_sum_over_taps_and_channels():
    """Conv2d.exact against the definition, summed pixel by pixel (asymmetric padding, stride, dilation)."""
    geometry = ConvGeometry(3, 6, 7, (2, 3), stride=(2, 1), dilation=(1, 2), padding=(1, 0, 2, 1))
    spec, qweight, x, bias = _case("int4", geometry, 2, "float32", group=-1, bias=True)
    weight = qweight.dequantize(torch.float64).reshape(-1, 2, 3, 3)
    expected = torch.zeros(2, *geometry.out_size, weight.shape[0], dtype=torch.float64)
    for b, oh, ow, kh, kw in itertools.product(range(2), *map(range, geometry.out_size), range(2), range(3)):
        ih, iw = oh * 2 - 1 + kh, ow - 2 + kw * 2
        if 0 <= ih < 6 and 0 <= iw < 7:
            expected[b, oh, ow] += weight[:, kh, kw, :] @ x[b, ih, iw].double()
    assert torch.allclose(spec.exact(x, qweight, bias), expected + bias.double(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, activation, group, channels", [
    ("int4", "bfloat16", 32, 64),   # AMX, affine decode; whole 32-channel runs: vector gather
    ("int4", "bfloat16", -1, 5),    # AMX; runs straddle 32-k chunks: staged gather
    ("nf4", "float32", 64, 64),     # AMX, table decode, three bf16 planes
    ("nf4", "float16", -1, 5),
    ("int8", "bfloat16", 96, 64),   # AMX, two nibble planes
    ("uint2", "float16", -1, 64),   # AMX, per-channel
    ("int3", "bfloat16", 32, 64),   # generic template
    ("int3", "float32", 45, 5),     # generic template, channels straddling chunks
    ("mxfp4", "float32", None, 32),
])
def test_weight_types_through_both_gathers(name, activation, group, channels):
    geometry = ConvGeometry(channels, 9, 8, (3, 3), padding=(1, 1, 1, 1))
    _run(*_case(name, geometry, 2, activation, group=group, bias=True))


@st.composite
def conv_cases(draw):
    kernel = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(4))
    height = draw(st.integers(max(1, dilation[0] * (kernel[0] - 1) + 1 - padding[0] - padding[1]), 12))
    width = draw(st.integers(max(1, dilation[1] * (kernel[1] - 1) + 1 - padding[2] - padding[3]), 12))
    channels = draw(st.sampled_from([1, 3, 16, 32, 33, 64]))
    geometry = ConvGeometry(channels, height, width, kernel, stride, dilation, padding)
    name = draw(st.sampled_from(["int4", "nf4", "uint4", "int2", "int8", "int3"]))
    groups = [g for g in (32, 64) if geometry.reduction % g == 0] + [-1]
    return dict(name=name, geometry=geometry, batch=draw(st.integers(1, 3)),
                activation=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
                output=draw(st.sampled_from(["float32", "bfloat16"])), group=draw(st.sampled_from(groups)),
                bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)), cout=draw(st.integers(1, 40)))


@settings(max_examples=40, deadline=None)
@given(case=conv_cases())
def test_fuzzed_geometries(case):
    _run(*_case(**case))


def test_no_im2col_matrix_is_made(monkeypatch):
    """The kernel gathers the patches itself: torch's unfold is never called on the CPU path."""
    def refuse(*args, **kwargs):
        raise AssertionError("im2col (unfold) was called")

    monkeypatch.setattr(F, "unfold", refuse)
    monkeypatch.setattr(torch.Tensor, "unfold", refuse)
    _run(*_case("int4", ConvGeometry(32, 10, 10, (3, 3), padding=(1, 1, 1, 1)), 1, group=96))


@pytest.mark.parametrize("template, fields", [
    pytest.param("amx", dict(n_tiles=2, m_tiles=2), marks=pytest.mark.requires_amx, id="amx"),
    pytest.param("dot", dict(n_tiles=2, rows=4), marks=pytest.mark.requires_avx512_bf16, id="dot")])
@pytest.mark.parametrize("channels", [64, 24])
def test_planes_built_per_chunk_or_in_one_pass_agree(channels, template, fields):
    """Matrix-template configurations (AMX, AVX512-BF16) that build each row chunk's planes inside its task
    (chunk_prologue) and those that build all rows first compute the same result; 3·81 rows leave a partial last
    chunk."""
    from bitkern.codegen import build_kernel
    from bitkern.codegen import template as template_named

    geometry = ConvGeometry(channels, 9, 9, (3, 3), padding=(1, 1, 1, 1))
    spec, qweight, x, bias = _case("int4", geometry, 3, group=-1, bias=True, cout=40)
    packed, results = pack(qweight), []
    for chunk_prologue in (False, True):
        config = template_named(template).config_type(**fields, small_m=False, m_chunk=64, stage_steps=2,
                                                      decode="affine", chunk_prologue=chunk_prologue)
        kernel = build_kernel(spec, 40, geometry.reduction, template, config, "tile16", (129, 1 << 30), host_cpu())
        results.append(_run_kernel(spec, qweight, x, bias, kernel(x, packed, bias).reshape(3, 9, 9, 40)))
    assert torch.equal(*results)


def test_a_convolution_that_reads_only_padding_gives_the_bias():
    """Found by the fuzz: a 1x1 kernel at stride 2 over a one-pixel image padded on the left reads only padding;
    the expression's sums are zero, and the generic template has no weight tile to schedule."""
    from bitkern.codegen import build_kernel
    from bitkern.codegen.cpu.generic import GenericConfig

    geometry = ConvGeometry(1, 1, 1, (1, 1), stride=(1, 2), padding=(0, 0, 1, 0))
    spec, qweight, x, bias = _case("int4", geometry, 2, "float32", group=-1, bias=True, cout=3)
    kernel = build_kernel(spec, 3, 1, "generic", GenericConfig(1), "tile16", (1, 16), host_cpu())
    y = _run_kernel(spec, qweight, x, bias, kernel(x, pack(qweight), bias).reshape(2, 1, 1, 3))
    assert torch.equal(y, bias.expand_as(y))


def test_results_are_bitwise_deterministic():
    spec, qweight, x, _ = _case("nf4", ConvGeometry(32, 14, 14, (3, 3), stride=(2, 2), padding=(1, 1, 1, 1)), 3,
                                group=32)
    packed = pack(qweight)
    first = spec(x, packed)
    assert all(torch.equal(first, spec(x, packed)) for _ in range(3))


def test_lookup_template_is_not_offered_and_key_round_trips():
    geometry = ConvGeometry(32, 8, 8, (3, 3))
    spec = Conv2d("int4", "bfloat16", geometry=geometry)
    _, unused = usable_templates(spec, 16, geometry.reduction, (1, 4), "tile16", host_cpu())
    assert unused["lut"].startswith("a convolution")
    key = KernelKey(spec, 16, geometry.reduction, (1, 4), "tile16", "cpu")
    assert KernelKey.from_dict(key.to_dict()) == key
    plain = dataclasses.replace(key, spec=spec.matmul)
    assert plain.digest != key.digest and isinstance(plain.spec, Matmul) and not isinstance(plain.spec, Conv2d)
    assert spec != Conv2d("int4", "bfloat16", geometry=dataclasses.replace(geometry, height=9))


def test_bad_input_is_rejected_before_any_kernel():
    geometry = ConvGeometry(8, 6, 6, (3, 3), padding=(1, 1, 1, 1))
    spec, qweight, x, _ = _case("int4", geometry, 1, group=72)
    packed = pack(qweight)
    with pytest.raises(ValueError, match=r"x has shape \(1, 8, 6, 6\); this convolution takes channels-last input "
                                         r"\[batch, 6, 6, 8\]"):
        spec(x.permute(0, 3, 1, 2).contiguous(), packed)
    with pytest.raises(TypeError, match="x has dtype torch.float32; this Matmul takes activation_dtype=bfloat16"):
        spec(x.float(), packed)
    with pytest.raises(ValueError, match="this convolution reduces over kh·kw·Cin = 72"):
        Conv2d("int4", "bfloat16", group_size=8, geometry=geometry).check_shape(16, 64)
    with pytest.raises(ValueError, match="does not fit the padded 2x2 input"):
        ConvGeometry(8, 2, 2, (3, 3))
    with pytest.raises(ValueError, match="stride has entry 0; accepted: ints >= 1"):
        ConvGeometry(8, 6, 6, (3, 3), stride=(0, 1))
    with pytest.raises(TypeError, match="geometry must be a ConvGeometry, got NoneType"):
        Conv2d("int4", "bfloat16")


def test_im2col_fallback_agrees_with_the_implicit_gemm():
    """Devices without a gathering kernel (CUDA) run the plain GEMM on the patches: the same rows, so the same result
    up to the order of float32 sums (the two kernels' tiles may differ: 2·K·2^-24 of Σ|w·x| + |b| apart at most)."""
    geometry = ConvGeometry(32, 7, 6, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(2, 0, 1, 1))
    spec, qweight, x, bias = _case("int4", geometry, 2, "float32", group=64, bias=True)
    packed = pack(qweight)
    gemm = spec.matmul(im2col(x, geometry), packed, bias).reshape(2, *geometry.out_size, -1)
    magnitude = _nchw_conv(spec, x.abs(), summed_magnitudes(spec, qweight))
    assert_within_bound(spec, qweight, gemm, spec.exact(x, qweight, bias), magnitude)
    orders_apart = 2 * qweight.shape[1] * 2.0**-24 * (magnitude + bias.abs().double())
    assert bool(((gemm.double() - spec(x, packed, bias).double()).abs() <= orders_apart).all())


def test_conv_kernels_are_stored_on_disk_and_loaded_without_tuning(tmp_path, monkeypatch):
    """Cold path: the first call tunes and stores the kernel under a key holding the geometry; after the
    process map is dropped the kernel loads from disk (tuning would fail) and computes the same bits."""
    import bitkern.tuner
    from bitkern.cache import DiskStore, forget, kernel_for

    geometry = ConvGeometry(32, 6, 5, (3, 3), stride=(1, 2), padding=(1, 1, 1, 1))
    spec, qweight, x, _ = _case("nf4", geometry, 2, group=96)
    packed, store = pack(qweight), DiskStore(tmp_path)
    y = kernel_for(spec, 24, geometry.reduction, spec.rows(x), "tile16", store=store)(x, packed)
    forget()
    monkeypatch.setattr(bitkern.tuner, "tune", None)
    again = kernel_for(spec, 24, geometry.reduction, spec.rows(x), "tile16", store=store)
    assert torch.equal(again(x, packed), y)
    (entry,) = store.entries()
    assert entry["key"]["spec"]["geometry"]["width"] == 5 and entry["key"]["spec"]["geometry"]["stride"] == [1, 2]


@pytest.mark.parametrize("pixels", [1, 2, 3, 5, 9, 12, 16, 17, 33, 64, 100, 128, 129, 3136])
def test_tuning_inputs_stay_inside_the_bucket(pixels):
    """The tuner times a bucket's candidates on spec.input_shape(TUNED_M): for a convolution that must be
    whole images whose rows lie in the bucket (small-M kernels assume at most 16 rows)."""
    from bitkern.tuner.buckets import M_BUCKETS, TUNED_M

    geometry = ConvGeometry(8, 1, pixels, (1, 1))
    spec = Conv2d("int4", "bfloat16", group_size=8, geometry=geometry)
    for low, high in M_BUCKETS:
        if pixels > high:
            continue  # no call of this convolution has so few rows
        shape = spec.input_shape(TUNED_M[(low, high)], geometry.reduction)
        assert low <= spec.rows(torch.empty(shape)) <= high


@pytest.mark.parametrize("batch", [1, 3])
def test_profiled_tuning_times_convolution_candidates(batch):
    """Profile mode builds the shortlist and times it on image batches; the pick computes the reference."""
    from bitkern.tuner import m_bucket, tune

    geometry = ConvGeometry(32, 4, 3, (3, 3), padding=(1, 1, 1, 1))
    spec, qweight, x, _ = _case("int4", geometry, batch, group=96)
    bucket = m_bucket(spec.rows(x))
    tuned = tune(spec, 24, geometry.reduction, bucket, "tile16", host_cpu(), top_k=2, profile=True)
    # two timed, or every candidate where fewer serve (the generic template alone on a CPU without AVX512-BF16)
    assert tuned.record.profiled and sum(t.measured_s is not None for t in tuned.record.trials) == \
        min(2, len(tuned.record.trials))
    _run_kernel(spec, qweight, x, None, tuned.kernel(x, pack(qweight)).reshape(batch, 4, 3, 24))
