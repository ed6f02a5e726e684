"""Weight types given as torch dtypes, and biases of dtypes the kernels do not add exactly."""

import pytest
import torch
from torch import nn

import bitkern
from bitkern.ops import Matmul


@pytest.mark.parametrize("dtype, name", [(torch.int8, "int8"), (torch.uint8, "uint8"),
                                         (torch.float8_e4m3fn, "float8_e4m3")])
def test_a_torch_dtype_names_the_weight_type_as_quantize_takes_it(dtype, name):
    torch.manual_seed(0)
    source = nn.Linear(64, 32)
    layer = bitkern.Linear.from_float(source, dtype=dtype, group_size=32)
    assert layer.weight_dtype == name and bitkern.Linear(64, 32, dtype=dtype, group_size=32).weight_dtype == name
    independent = bitkern.quantize(source.weight.detach(), dtype, group_size=32)
    assert independent.ttype.name == name and torch.equal(layer.dequantize_weight(), independent.dequantize())
    assert bitkern.Conv2d(8, 4, 3, dtype=dtype, group_size=8).weight_dtype == name


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool])
def test_a_torch_dtype_without_a_storable_type_is_refused(dtype):
    with pytest.raises(ValueError, match=rf"dtype={dtype} is not supported for weights; accepted: .*int8"):
        bitkern.Linear(64, 32, dtype=dtype)


def test_a_float64_bias_is_refused_not_cast():
    torch.manual_seed(0)
    layer = bitkern.Linear.from_float(nn.Linear(64, 32, dtype=torch.float64), "int4", group_size=32)
    assert layer.bias.dtype == torch.float64  # copied as it is
    with pytest.raises(TypeError, match="bias has dtype torch.float64; the kernels add a float32, float16 or "
                                        "bfloat16 bias"):
        layer(torch.randn(2, 64))
    q = bitkern.quantize(torch.randn(32, 64), "int4", group_size=32)
    with pytest.raises(TypeError, match="bias has dtype torch.float64"):
        Matmul.for_weight(q, "float32", bias=True)(torch.randn(2, 64), bitkern.pack(q), torch.randn(32).double())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_bias_is_added_exactly(dtype):
    """float16 and bfloat16 biases widen to float32 exactly: the same result as their float32 values."""
    q = bitkern.quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)), "int4", group_size=32)
    spec, packed = Matmul.for_weight(q, "float32", bias=True), bitkern.pack(q)
    bias, x = torch.randn(32).to(dtype), torch.randn(3, 64)
    assert torch.equal(spec(x, packed, bias), spec(x, packed, bias.float()))
