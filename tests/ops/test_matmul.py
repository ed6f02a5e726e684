"""The Matmul spec: hashable, validated; its reference against an independent computation."""

import pytest
import torch

import bitkern
from bitkern.ops import Matmul


def _q(name="uint4", n=24, k=128, group_size=32, **options):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    return bitkern.quantize(w, name, group_size=group_size, **options)


def test_spec_is_hashable_and_normalised():
    a = Matmul("uint4", torch.float16, zero_mode="gptq", group_size=32)
    b = Matmul("uint4", "float16", "float32", "float16", 32, "gptq")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.output_dtype == "float16"
    assert Matmul("int4", "int8", "int32").output_dtype == "float32"
    assert Matmul.for_weight(_q(), "bfloat16") == Matmul("uint4", "bfloat16", group_size=32, zero_mode="gptq")


@pytest.mark.parametrize("name, activation, output", [
    ("uint4", torch.float32, "float32"), ("nf4", torch.float16, "float16"), ("int8", torch.bfloat16, "bfloat16"),
    ("mxfp4", torch.float32, "float16"), ("int4", torch.int8, "float32")])
def test_reference_matches_an_independent_computation(name, activation, output):
    group = 32
    q = _q(name, group_size=group)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    x = x.mul(20).round().clamp(-128, 127).to(activation) if activation == torch.int8 else x.to(activation)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(2))
    accumulate = "int32" if activation == torch.int8 else "float32"
    spec = Matmul(name, activation, accumulate, output, group, q.zero_mode, bias=True)
    y = spec.reference(x, q, bias)
    # independent: dequantize group by group from the unpacked codes, then a float64 matmul
    codes = q.codes().long().reshape(24, 4, group)
    values = q.ttype.values[codes].double() if q.zero_mode == "none" else \
        codes.double() - q.zeros.double().unsqueeze(-1)
    weight = (values * q.scale_values().double().unsqueeze(-1)).reshape(24, 128)
    expected = x.double() @ weight.T + bias.double()
    assert y.dtype == getattr(torch, output)
    torch.testing.assert_close(y, expected.to(y.dtype), rtol=1e-6, atol=1e-6)


def test_reference_handles_batched_inputs():
    q = _q()
    x = torch.randn(2, 3, 128)
    y = Matmul.for_weight(q, "float32").reference(x, q)
    assert y.shape == (2, 3, 24)


def test_spec_errors_name_the_argument():
    with pytest.raises(ValueError, match="unknown type 'int5'; known types"):
        Matmul("int5")
    with pytest.raises(ValueError, match=r"activation_dtype='float64' is not supported; accepted: \['float32'"):
        Matmul("int4", "float64")
    with pytest.raises(ValueError, match="accumulate_dtype='float32' with activation_dtype='int8'"):
        Matmul("int4", "int8", "float32")
    with pytest.raises(ValueError, match="activation_dtype='int8' needs a weight type that converts to int8"):
        Matmul("nf4", "int8", "int32")
    with pytest.raises(ValueError, match="output_dtype='int8' is not supported"):
        Matmul("int4", output_dtype="int8")
    with pytest.raises(ValueError, match="layout='tn' is not supported; accepted: \\['nt'\\]"):
        Matmul("int4", layout="tn")
    with pytest.raises(ValueError, match="zero_mode='gptq' needs an unsigned integer type"):
        Matmul("int4", zero_mode="gptq")
    with pytest.raises(ValueError, match="group_size=64: type 'mxfp4' has a fixed block"):
        Matmul("mxfp4", group_size=64)
    with pytest.raises(ValueError, match="group_size=0 must be a positive int"):
        Matmul("int4", group_size=0)


def test_input_errors_name_the_argument():
    q = _q()
    spec = Matmul.for_weight(q, "float32")
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match=r"x has shape \(2, 64\); its last dimension must be in_features=128"):
        spec.reference(torch.randn(2, 64), q)
    with pytest.raises(TypeError, match="x has dtype torch.float16; this Matmul takes activation_dtype=float32"):
        spec.reference(x.half(), q)
    with pytest.raises(ValueError, match="bias must be None"):
        spec.reference(x, q, torch.zeros(24))
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \(24,\), got \(23,\)"):
        Matmul.for_weight(q, "float32", bias=True).reference(x, q, torch.zeros(23))
    with pytest.raises(ValueError, match="weight has group_size=32 but the Matmul spec has group_size=128"):
        Matmul("uint4", "float32", zero_mode="gptq").reference(x, q)
    with pytest.raises(TypeError, match="weight must be a bitkern QuantizedWeight"):
        spec.reference(x, torch.zeros(24, 128))


def _quick_case(**changes):
    """(spec, x, packed weight, bias) of a valid CPU call, with `changes` applied to one of them."""
    q = _q("int4", n=32, k=128, group_size=32)
    spec = Matmul.for_weight(q, "bfloat16", bias=changes.pop("spec_bias", True))
    case = {"x": torch.randn(3, 128).bfloat16(), "weight": bitkern.pack(q), "bias": torch.randn(32)}
    case.update(changes)
    return spec, case["x"], case["weight"], case["bias"]


@pytest.mark.parametrize("changes", [
    {},
    {"x": torch.randn(3, 128)},                                   # activation dtype
    {"x": torch.randn(3, 64).bfloat16()},                         # K
    {"x": torch.tensor(1.0).bfloat16()},                          # 0-dim
    {"x": torch.nn.Parameter(torch.randn(3, 128).bfloat16())},    # a Tensor subclass
    {"x": [[1.0] * 128]},                                         # not a tensor
    {"bias": None},                                               # the spec has a bias
    {"bias": torch.randn(31)},
    {"spec_bias": False},                                         # a bias the spec has not
    {"weight": bitkern.pack(_q("uint4", n=32, k=128, group_size=32))},
    {"weight": bitkern.pack(_q("int4", n=32, k=128, group_size=64))},
    {"weight": bitkern.pack(_q("int4", n=32, k=128, group_size=32, scale_dtype=torch.bfloat16))},
])
def test_quick_check_accepts_only_what_the_full_check_accepts(changes):
    """Matmul calls skip check_inputs when a few comparisons pass: those must imply that it passes."""
    spec, x, weight, bias = _quick_case(**changes)
    try:
        spec.check_inputs(x, weight, bias)
        valid = True
    except (TypeError, ValueError):
        valid = False
    assert spec.fits(x, weight, bias) <= valid
    assert spec.fits(x, weight, bias) == (changes == {})  # these are the only valid case here
