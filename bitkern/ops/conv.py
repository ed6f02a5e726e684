"""The quantized 2-D convolution as an implicit GEMM: a Matmul whose activation rows are gathered from the
input image instead of read from a [M, K] matrix.

    y[b, oh, ow, n] = Σ_{kh, kw, c} x[b, oh·s - pad_top + kh·d, ow·s - pad_left + kw·d, c] · W[n, (kh, kw, c)]

Input and output are channels-last (NHWC: x [B, H, W, Cin], y [B, Hout, Wout, Cout], i.e. y is the
GEMM's [M, N] with M = B·Hout·Wout); the weight is the [Cout, kh·kw·Cin] matrix in (kernel row, kernel
column, channel) order, so each tap's channels are one contiguous run of x and of a row of the GEMM.
Pixels outside the image read as zero (zero padding).  On CPUs the kernel gathers each row from the image
as it builds its bf16 activation tiles, so no im2col matrix is made; the CUDA kernels have no gathering
prologue yet and run the same GEMM on `im2col` rows (`Conv2d.gemm_input`).  H and W are static (part of the kernel's cache
key); the batch is dynamic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .matmul import Matmul

REDUCTION_ORDER = "kernel_row,kernel_col,in_channel"


@dataclass(frozen=True)
class ConvGeometry:
    """Static sizes of a convolution: input channels and image size, kernel, stride, dilation and zero
    padding as (top, bottom, left, right) (asymmetric for padding="same" with even kernels)."""

    in_channels: int
    height: int
    width: int
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)

    def __post_init__(self):
        for name in ("in_channels", "height", "width"):
            _check_int(name, getattr(self, name), 1)
        for name, size, low in (("kernel", 2, 1), ("stride", 2, 1), ("dilation", 2, 1), ("padding", 4, 0)):
            value = tuple(getattr(self, name))
            if len(value) != size:
                raise ValueError(f"{name}={value!r} must have {size} entries")
            for entry in value:
                _check_int(name, entry, low)
            object.__setattr__(self, name, value)
        if min(self.out_size) < 1:
            raise ValueError(f"the {self.kernel} kernel (dilation {self.dilation}) does not fit the padded "
                             f"{self.height}x{self.width} input: output size {self.out_size}")

    @property
    def out_size(self) -> tuple[int, int]:
        """(Hout, Wout)."""
        return out_size(self.height, self.width, self.kernel, self.stride, self.dilation, self.padding)

    @property
    def pixels(self) -> int:
        """Output pixels per image: GEMM rows per batch entry."""
        return self.out_size[0] * self.out_size[1]

    @property
    def reduction(self) -> int:
        """K of the GEMM: kh · kw · Cin."""
        return self.kernel[0] * self.kernel[1] * self.in_channels


def out_size(height, width, kernel, stride, dilation, padding) -> tuple:
    """(Hout, Wout) of a convolution; the sizes may be symbolic (torch.compile's fake tensors)."""
    top, bottom, left, right = padding
    return ((height + top + bottom - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1,
            (width + left + right - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1)


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} has entry {value!r}; accepted: ints >= {low}")


@dataclass(frozen=True, kw_only=True)
class Conv2d(Matmul):
    """Spec of the implicit-GEMM convolution: a Matmul spec (weight type, activation, output, groups,
    zero mode, bias) plus the static `geometry`.  Called on NHWC x, it returns NHWC y."""

    geometry: ConvGeometry = field(default=None)

    def __post_init__(self):
        if isinstance(self.geometry, dict):
            object.__setattr__(self, "geometry", ConvGeometry(**self.geometry))
        if not isinstance(self.geometry, ConvGeometry):
            raise TypeError(f"geometry must be a ConvGeometry, got {type(self.geometry).__name__}")
        super().__post_init__()
        if self.epilogue != "none" or self.residual or self.norm != "none":
            raise ValueError(f"epilogue={self.epilogue!r}, residual={self.residual}, norm={self.norm!r}: a "
                             f"convolution has no epilogue but its bias and no norm prologue; accepted: "
                             f"epilogue='none', residual=False, norm='none'")
        object.__setattr__(self, "_hash", hash((self._hash, self.geometry)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def matmul(self) -> Matmul:
        """The same spec as a plain Matmul (for x already laid out as GEMM rows)."""
        fields = {name: getattr(self, name) for name in Matmul.__dataclass_fields__}
        return Matmul(**fields)

    def check_shape(self, n: int, k: int) -> None:
        super().check_shape(n, k)
        if k != self.geometry.reduction:
            raise ValueError(f"weight has in_features={k}; this convolution reduces over kh·kw·Cin = "
                             f"{self.geometry.reduction}")

    def rows(self, x: torch.Tensor) -> int:
        return x.shape[0] * self.geometry.pixels

    def input_shape(self, m: int, k: int) -> tuple:
        """An image batch of at most m rows (whole images; one image if it alone has more), so that a kernel
        tuned for an M bucket is timed on rows inside that bucket."""
        g = self.geometry
        return max(1, m // g.pixels), g.height, g.width, g.in_channels

    def fits(self, x, weight, bias, residual=None, norm_weight=None, norm_bias=None) -> bool:
        return False  # the image's geometry is checked in full on every call

    def gemm_input(self, x: torch.Tensor, n: int, k: int, gathered: bool = True) -> tuple:
        """The NHWC image itself for kernels that gather its rows (`gathered`), else the plain GEMM on its
        im2col rows (kernels without a gathering prologue)."""
        shape = (x.shape[0], *self.geometry.out_size, n)
        if not gathered:
            return self.matmul, im2col(x.contiguous(), self.geometry), shape
        return self, x.contiguous(), shape

    def check_inputs(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None, residual=None,
                     norm_weight=None, norm_bias=None) -> None:
        g = self.geometry
        if isinstance(x, torch.Tensor) and (x.dim() != 4 or tuple(x.shape[1:]) != (g.height, g.width, g.in_channels)):
            raise ValueError(f"x has shape {tuple(x.shape)}; this convolution takes channels-last input "
                             f"[batch, {g.height}, {g.width}, {g.in_channels}]")
        super().check_inputs(x.new_empty((0, g.reduction)) if isinstance(x, torch.Tensor) else x, weight, bias,
                             residual, norm_weight, norm_bias)
        self.check_shape(*weight.shape)

    def exact(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None, residual=None) -> torch.Tensor:
        """The result in float64 by torch's own convolution of the dequantized weight (NHWC)."""
        self.check_inputs(x, weight, bias, residual)
        g = self.geometry
        kernel = conv_weight(weight.to_portable().dequantize(torch.float64), g.kernel, g.in_channels)
        y = F.conv2d(_padded_nchw(x.double(), g), kernel, None if bias is None else bias.double(), g.stride, 0,
                     g.dilation)
        return y.permute(0, 2, 3, 1)


def conv_weight(matrix: torch.Tensor, kernel, in_channels: int) -> torch.Tensor:
    """The [Cout, Cin, kh, kw] convolution weight (a view) of the GEMM's [Cout, kh·kw·Cin] matrix."""
    return matrix.reshape(-1, *kernel, in_channels).permute(0, 3, 1, 2)


def _padded_nchw(x: torch.Tensor, g: ConvGeometry) -> torch.Tensor:
    """NHWC x as NCHW with the geometry's zero padding applied."""
    top, bottom, left, right = g.padding
    return F.pad(x.permute(0, 3, 1, 2), (left, right, top, bottom))


def im2col(x: torch.Tensor, g: ConvGeometry) -> torch.Tensor:
    """The im2col rows [B·Hout·Wout, kh·kw·Cin] of NHWC x, in the weight's (kh, kw, c) order."""
    # [B, Cin·kh·kw, L] in (c, kh, kw) order
    columns = F.unfold(_padded_nchw(x, g), g.kernel, g.dilation, 0, g.stride)
    columns = columns.reshape(x.shape[0], g.in_channels, g.kernel[0] * g.kernel[1], -1)
    return columns.permute(0, 3, 2, 1).reshape(-1, g.reduction)


def spec_from_dict(fields: dict) -> Matmul:
    """The Matmul, Conv2d or GroupedMatmul spec whose `dataclasses.asdict` gave `fields` (as the cache's manifests
    store it)."""
    if "experts" in fields:
        from .grouped import GroupedMatmul

        return GroupedMatmul(**fields)
    return Conv2d(**fields) if "geometry" in fields else Matmul(**fields)
