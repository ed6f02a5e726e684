"""bitkern.Conv2d against torch.nn.functional.conv2d, alone and in a ResNet basic block."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bitkern

from tests.helpers import assert_matches


@pytest.mark.parametrize("geometry", [
    {"kernel_size": 3, "padding": 1},
    {"kernel_size": 3, "stride": 2, "padding": 1, "bias": False},
    {"kernel_size": (3, 1), "stride": (2, 1), "padding": (1, 0), "dilation": (2, 1)},
    {"kernel_size": 4, "padding": "same", "dilation": 2},  # even kernel: one more pixel right/bottom
    {"kernel_size": 1, "padding": "valid"},
])
def test_conv2d_is_f_conv2d_on_the_dequantized_weight(geometry):
    torch.manual_seed(0)
    source = nn.Conv2d(32, 48, **geometry)
    layer = bitkern.Conv2d.from_float(source, "int4", group_size=32)
    x = torch.randn(2, 32, 11, 9)
    weight = layer.dequantize_weight(torch.float64)
    assert weight.shape == source.weight.shape
    bias = None if source.bias is None else source.bias.double()
    reference = F.conv2d(x.double(), weight, bias, source.stride, source.padding, source.dilation).float()
    y = layer(x)
    assert y.is_contiguous()
    assert_matches(y, reference, 1e-5)
    assert_matches(layer(x[0]), reference[0], 1e-5)  # unbatched input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_input_is_used_as_it_is_and_gives_channels_last_output(dtype, monkeypatch):
    """As torch's convolution: the output's memory format follows the input's; no im2col matrix is made."""
    torch.manual_seed(0)
    source = nn.Conv2d(64, 32, 3, stride=(1, 2), padding=(2, 1), dilation=(2, 1))
    layer = bitkern.Conv2d.from_float(source, "int4", group_size=64)
    x = torch.randn(3, 64, 10, 12).to(dtype)
    monkeypatch.setattr(F, "unfold", None)  # the kernel gathers the patches itself
    contiguous, channels_last = layer(x), layer(x.contiguous(memory_format=torch.channels_last))
    assert contiguous.is_contiguous() and not channels_last.is_contiguous()
    assert channels_last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(contiguous, channels_last) and contiguous.dtype == dtype
    weight = layer.dequantize_weight(torch.float64)
    reference = F.conv2d(x.double(), weight, source.bias.double(), source.stride, source.padding, source.dilation)
    assert_matches(contiguous.float(), reference.float(), 1e-5 if dtype == torch.float32 else 2**-7)


def test_state_of_another_reduction_order_is_refused():
    """The weight matrix is (kernel row, kernel column, channel) ordered; a state without that record
    (e.g. PyTorch's (channel, kernel row, kernel column) order) is not loaded."""
    layer = bitkern.Conv2d(8, 16, 3, dtype="int4", group_size=72)
    state = layer.state_dict()
    assert state["_extra_state"]["reduction_order"] == "kernel_row,kernel_col,in_channel"
    del state["_extra_state"]["reduction_order"]
    with pytest.raises(ValueError, match="saved with reduction_order=None, but this module has "
                                         "reduction_order='kernel_row,kernel_col,in_channel'"):
        bitkern.Conv2d(8, 16, 3, dtype="int4", group_size=72).load_state_dict(state)


@pytest.mark.parametrize("geometry", [
    {"kernel_size": 3, "stride": 2, "padding": 1},
    {"kernel_size": (4, 2), "padding": "same", "dilation": (1, 3)},  # asymmetric zero padding
])
def test_conv2d_input_gradient_is_f_conv2d_s(geometry):
    torch.manual_seed(0)
    source = nn.Conv2d(32, 16, **geometry)
    layer = bitkern.Conv2d.from_float(source, dtype="nf4", group_size=32)
    x = torch.randn(2, 32, 9, 9, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = layer(x)
    reference = F.conv2d(x_ref, layer.dequantize_weight(), layer.bias.detach(), source.stride, source.padding,
                         source.dilation)
    grad = torch.randn_like(reference)
    y.backward(grad)
    reference.backward(grad)
    assert_matches(x.grad, x_ref.grad, 1e-5)
    assert_matches(layer.bias.grad, grad.sum((0, 2, 3)), 1e-6)


class BasicBlock(nn.Module):
    """ResNet's basic block with a projection shortcut: conv3x3(stride 2)-BN-ReLU-conv3x3-BN + conv1x1-BN."""

    def __init__(self, inplanes=64, planes=128):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=2, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x))


def _trained_looking_block():
    torch.manual_seed(0)
    block = BasicBlock()
    for module in block.modules():
        if isinstance(module, nn.BatchNorm2d):  # statistics as after training, so BN does not hide errors
            module.running_mean.normal_(0, 0.1)
            module.running_var.uniform_(0.5, 2)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.normal_(0, 0.1)
    return block.eval()


@pytest.mark.parametrize("name, bound", [("int8", 1e-2), ("int4", 0.12), ("nf4", 0.12)])
def test_resnet_block_matches_torch(name, bound):
    """Quantized: equals the block with dequantized float convolutions (F.conv2d) and stays within the
    type's error bound of the float block."""
    block = _trained_looking_block()
    x = torch.randn(2, 64, 16, 16)
    with torch.no_grad():
        expected = block(x)
        quantized = bitkern.quantize_model(copy.deepcopy(block), name, group_size=64)
        assert sum(isinstance(m, bitkern.Conv2d) for m in quantized.modules()) == 3
        y = quantized(x)
        same_weights = bitkern.dequantize_model(copy.deepcopy(quantized))
        assert not any(isinstance(m, bitkern.Conv2d) for m in same_weights.modules())
        assert_matches(y, same_weights(x), 2e-5 if name != "nf4" else 2**-7)
        error = float((y - expected).norm() / expected.norm())
    assert error <= bound, f"{name}: relative error {error:.3g} of the block output"


def test_conv2d_bad_input():
    with pytest.raises(ValueError, match="groups=2 is not supported; accepted: 1"):
        bitkern.Conv2d(8, 8, 3, groups=2)
    with pytest.raises(ValueError, match="padding_mode='reflect' is not supported; accepted: 'zeros'"):
        bitkern.Conv2d.from_float(nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match="group_size=128 does not divide in_features=72"):
        bitkern.Conv2d(8, 8, 3, dtype="int4")
    layer = bitkern.Conv2d(8, 16, 3, dtype="int4", group_size=72)
    with pytest.raises(ValueError, match=r"x has shape \(1, 4, 5, 5\); this Conv2d takes \[batch, 8, height, width\]"):
        layer(torch.randn(1, 4, 5, 5))


def test_constructor_initialises_like_nn_conv2d():
    torch.manual_seed(0)
    layer = bitkern.Conv2d(16, 8, 3, padding=1, dtype="int8", group_size=144)
    torch.manual_seed(0)
    source = nn.Conv2d(16, 8, 3, padding=1)
    assert not layer.qweight.is_meta
    assert_matches(layer.dequantize_weight(), source.weight.detach(), 1e-2)
    assert torch.equal(layer.bias, source.bias)
