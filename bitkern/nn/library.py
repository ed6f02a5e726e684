"""bitkern's kernels as torch custom ops (torch.library), so torch.compile traces them without graph breaks.

`torch.ops.bitkern.linear` runs y = x · dequant(W)ᵀ + b through `bitkern.ops.Matmul`, and
`torch.ops.bitkern.conv2d` the implicit-GEMM convolution of a channels-last image through
`bitkern.ops.Conv2d`; their fake implementations give the output's shape and dtype, and their autograd
formulas send gradients to x and the bias only (the quantized weight is frozen).
`torch.ops.bitkern.dequantize` gives the float weight.

A weight crosses the op boundary as its tensors plus a format, all plain op arguments:
qweight, scales, zeros, tensor_scale (raw bits: float metadata travels as same-width integers, see
`bitkern.nn.storage`) and weight_dtype, out_features, in_features, group_size, zero_mode,
scale_dtype, layout.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..codegen import PackedWeight, packed_class
from ..ops import Conv2d, ConvGeometry, Matmul
from ..ops.conv import conv_weight, out_size
from ..ttype import get

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def packed_weight(qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], tensor_scale: Optional[Tensor],
                  weight_dtype: str, out_features: int, in_features: int, group_size: int, zero_mode: str,
                  scale_dtype: torch.dtype, layout: str) -> PackedWeight:
    """The PackedWeight that the op arguments describe (float metadata viewed back from its raw bits)."""
    return packed_class(layout)(layout, get(weight_dtype), (out_features, in_features), group_size, zero_mode,
                                qweight, float_view(scales, scale_dtype), float_view(zeros, scale_dtype),
                                float_view(tensor_scale, torch.float32))


def float_view(bits: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """The float tensor stored as same-width integer bits; uint8 codes (and None) stay as they are."""
    if bits is None or bits.dtype == torch.uint8:
        return bits
    return bits.view(dtype)


@functools.lru_cache(maxsize=None)
def _spec(weight_dtype: str, activation: torch.dtype, output: torch.dtype, group_size: int, zero_mode: str,
          bias: bool, scale_dtype: torch.dtype, geometry: ConvGeometry | None = None) -> Matmul:
    """The Matmul spec of a call (a Conv2d spec when a convolution `geometry` is given)."""
    block = get(weight_dtype).block_size > 1
    fields = dict(output_dtype=output, group_size=group_size, zero_mode=zero_mode, bias=bias,
                  scale_dtype=torch.float16 if block else scale_dtype)
    if geometry is not None:
        return Conv2d(weight_dtype, activation, geometry=geometry, **fields)
    return Matmul(weight_dtype, activation, **fields)


@torch.library.custom_op("bitkern::linear", mutates_args=())
def linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], tensor_scale: Optional[Tensor],
           bias: Optional[Tensor], weight_dtype: str, out_features: int, in_features: int, group_size: int,
           zero_mode: str, scale_dtype: torch.dtype, layout: str, output_dtype: torch.dtype) -> Tensor:
    """y[..., N] = x[..., K] · dequant(W)ᵀ (+ bias), computed in x's dtype, returned in `output_dtype`."""
    weight = packed_weight(qweight, scales, zeros, tensor_scale, weight_dtype, out_features, in_features,
                           group_size, zero_mode, scale_dtype, layout)
    spec = _spec(weight_dtype, x.dtype, output_dtype, group_size, zero_mode, bias is not None, scale_dtype)
    return spec(x, weight, bias)


@linear.register_fake
def _linear_fake(x, qweight, scales, zeros, tensor_scale, bias, weight_dtype, out_features, in_features, group_size,
                 zero_mode, scale_dtype, layout, output_dtype):
    return x.new_empty((*x.shape[:-1], out_features), dtype=output_dtype)


@torch.library.custom_op("bitkern::dequantize", mutates_args=())
def dequantize(qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], tensor_scale: Optional[Tensor],
               weight_dtype: str, out_features: int, in_features: int, group_size: int, zero_mode: str,
               scale_dtype: torch.dtype, layout: str, dtype: torch.dtype) -> Tensor:
    """The float [N, K] weight, in `dtype`."""
    weight = packed_weight(qweight, scales, zeros, tensor_scale, weight_dtype, out_features, in_features,
                           group_size, zero_mode, scale_dtype, layout)
    return weight.to_portable().dequantize(dtype)


@dequantize.register_fake
def _dequantize_fake(qweight, scales, zeros, tensor_scale, weight_dtype, out_features, in_features, group_size,
                     zero_mode, scale_dtype, layout, dtype):
    return qweight.new_empty((out_features, in_features), dtype=dtype)


@torch.library.custom_op("bitkern::conv2d", mutates_args=())
def conv2d(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], tensor_scale: Optional[Tensor],
           bias: Optional[Tensor], weight_dtype: str, out_features: int, in_features: int, group_size: int,
           zero_mode: str, scale_dtype: torch.dtype, layout: str, output_dtype: torch.dtype, kernel_size: list[int],
           stride: list[int], dilation: list[int], padding: list[int]) -> Tensor:
    """y [B, Hout, Wout, Cout] of the channels-last image x [B, H, W, Cin] with the [Cout, kh·kw·Cin] weight
    (taps, then channels); padding is (top, bottom, left, right) zeros."""
    weight = packed_weight(qweight, scales, zeros, tensor_scale, weight_dtype, out_features, in_features,
                           group_size, zero_mode, scale_dtype, layout)
    geometry = ConvGeometry(x.shape[-1], x.shape[1], x.shape[2], tuple(kernel_size), tuple(stride), tuple(dilation),
                            tuple(padding))
    spec = _spec(weight_dtype, x.dtype, output_dtype, group_size, zero_mode, bias is not None, scale_dtype, geometry)
    return spec(x, weight, bias)


@conv2d.register_fake
def _conv2d_fake(x, qweight, scales, zeros, tensor_scale, bias, weight_dtype, out_features, in_features, group_size,
                 zero_mode, scale_dtype, layout, output_dtype, kernel_size, stride, dilation, padding):
    height, width = out_size(x.shape[1], x.shape[2], kernel_size, stride, dilation, padding)
    return x.new_empty((x.shape[0], height, width, out_features), dtype=output_dtype)


def _save_weight(ctx, inputs, output=None) -> None:
    """(setup_context) What both backward formulas need: the weight's tensors and format, and the dtypes of
    x and bias."""
    x, qweight, scales, zeros, tensor_scale, bias, *weight_format = inputs[:14]
    ctx.save_for_backward(qweight, scales, zeros, tensor_scale)
    ctx.weight_format = weight_format[:-1]  # without output_dtype
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _bias_grad(ctx, grad):
    """Σ dy over everything but the output channel (last), or None when the bias needs no gradient."""
    if not ctx.needs_input_grad[5]:
        return None
    return grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)


def _conv2d_setup(ctx, inputs, output):
    _save_weight(ctx, inputs)
    ctx.geometry = (inputs[0].shape, *inputs[14:])


def _conv2d_backward(ctx, grad):
    """dx = the transposed convolution of dy with dequant(W) (float32), dbias = Σ dy; the weight gets none."""
    grad_x = None
    if ctx.needs_input_grad[0]:
        (batch, height, width, channels), kernel_size, stride, dilation, (top, bottom, left, right) = ctx.geometry
        weight = torch.ops.bitkern.dequantize(*ctx.saved_tensors, *ctx.weight_format, torch.float32)
        weight = conv_weight(weight, kernel_size, channels)
        padded = (batch, channels, height + top + bottom, width + left + right)
        grad_padded = torch.nn.grad.conv2d_input(padded, weight, grad.float().permute(0, 3, 1, 2), stride, 0,
                                                 dilation)
        grad_x = grad_padded[:, :, top:top + height, left:left + width].permute(0, 2, 3, 1).to(ctx.x_dtype)
    return (grad_x, None, None, None, None, _bias_grad(ctx, grad)) + (None,) * 12


conv2d.register_autograd(_conv2d_backward, setup_context=_conv2d_setup)


def _linear_backward(ctx, grad):
    """dx = dy · dequant(W) (float32 sums), dbias = Σ dy; the weight tensors get none (frozen)."""
    grad_x = None
    if ctx.needs_input_grad[0]:
        weight = torch.ops.bitkern.dequantize(*ctx.saved_tensors, *ctx.weight_format, torch.float32)
        grad_x = (grad.float() @ weight).to(ctx.x_dtype)
    return (grad_x, None, None, None, None, _bias_grad(ctx, grad)) + (None,) * 8


linear.register_autograd(_linear_backward, setup_context=_save_weight)
