"""`bitkern.Conv2d`: a 2-D convolution (NCHW) whose weight is stored in a low-precision type.

It runs as an implicit GEMM (`bitkern.ops.Conv2d`): one compiled kernel gathers each output pixel's
receptive field straight from the image while it multiplies, with no im2col matrix.  The kernel reads
the image channels-last, so the weight is stored as the [Cout, kh·kw·Cin] matrix in (kernel row, kernel
column, channel) order and the quantization groups run along that order.  Channels-last input is used
as it is (zero-copy) and gives channels-last output, as torch's convolution does; NCHW-contiguous input
is transposed once and gives contiguous NCHW output.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import REDUCTION_ORDER
from ..ops.conv import conv_weight
from .storage import QuantizedModule, check_positive


class Conv2d(QuantizedModule):
    """nn.Conv2d (groups=1, padding_mode="zeros") with its weight in `dtype`; the other weight arguments
    are those of `bitkern.Linear`, with in_features = in_channels · kernel height · kernel width (activation_quant:
    "none" only)."""

    float_class = nn.Conv2d

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", dtype="nf4", group_size=None,
                 zero_mode: str | None = None, compute_dtype=None, device=None, scale_dtype=torch.float16,
                 activation_quant: str = "none", method: str = "rtn"):
        super().__init__()
        check_positive("in_channels", in_channels)
        check_positive("out_channels", out_channels)
        if groups != 1:
            raise ValueError(f"groups={groups!r} is not supported; accepted: 1")
        if padding_mode != "zeros":
            raise ValueError(f"padding_mode={padding_mode!r} is not supported; accepted: 'zeros'")
        # nn.Conv2d validates and normalises the geometry (and initialises the weight).
        source = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, bias=bias,
                           device="meta")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.dilation = source.kernel_size, source.stride, source.dilation
        self.padding = source.padding
        self._configure(tuple(source.weight.shape), dtype, group_size, zero_mode, scale_dtype, compute_dtype,
                        activation_quant, method)
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type != "meta":
            source = source.to_empty(device=device)
            source.reset_parameters()
        self._take_parameters(source)

    @classmethod
    def _meta_layer(cls, module, **settings) -> "Conv2d":
        return cls(module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
                   module.dilation, getattr(module, "groups", 1), module.bias is not None,
                   getattr(module, "padding_mode", "zeros"), device="meta", **settings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and (x.dim() not in (3, 4) or x.shape[-3] != self.in_channels):
            raise ValueError(f"x has shape {tuple(x.shape)}; this Conv2d takes [batch, {self.in_channels}, height, "
                             f"width] (or unbatched [{self.in_channels}, height, width])")
        if x.dim() == 3:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        x, output_dtype = self._compute_input(x)
        weight, weight_format = self.op_weight()
        y = torch.ops.bitkern.conv2d(x.permute(0, 2, 3, 1).contiguous(), weight, weight_format, self.bias,
                                     output_dtype, list(self.kernel_size), list(self.stride), list(self.dilation),
                                     list(self._padding_sides()))
        y = y.permute(0, 3, 1, 2)  # NCHW sizes over the NHWC result: channels-last strides
        return y if channels_last else y.contiguous()

    def _padding_sides(self) -> tuple[int, int, int, int]:
        """Zero padding as (top, bottom, left, right); "same" puts the odd pixel of an even total at the
        bottom/right, as nn.Conv2d does."""
        if self.padding == "valid":
            return 0, 0, 0, 0
        if self.padding == "same":
            total = [d * (k - 1) for k, d in zip(self.kernel_size, self.dilation)]
            return total[0] // 2, total[0] - total[0] // 2, total[1] // 2, total[1] - total[1] // 2
        return self.padding[0], self.padding[0], self.padding[1], self.padding[1]

    def _gemm_matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """[Cout, Cin, kh, kw] -> [Cout, kh·kw·Cin]: taps, then channels (the order the kernel gathers in)."""
        return weight.permute(0, 2, 3, 1).reshape(self.gemm_shape)

    def _from_gemm_matrix(self, matrix: torch.Tensor) -> torch.Tensor:
        """[Cout, kh·kw·Cin] -> [Cout, Cin, kh, kw] (PyTorch's weight order)."""
        return conv_weight(matrix, self.kernel_size, self.in_channels).contiguous()

    def extra_settings(self) -> dict:
        return {"reduction_order": REDUCTION_ORDER}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> nn.Conv2d:
        """An nn.Conv2d holding the dequantized weight (in `dtype`) and this layer's bias."""
        module = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
                           self.dilation, bias=self.bias is not None, device="meta", dtype=dtype)
        return self._give_parameters(module, dtype)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, bias={self.bias is not None}, "
                f"{self._weight_repr()}")

