"""`bitkern.Linear`: nn.Linear with its weight stored in a low-precision type, run by one compiled kernel."""

from __future__ import annotations

import torch
from torch import nn

from ..codegen import pack
from ..ttype import QuantizedWeight
from .storage import QuantizedModule, check_positive


class Linear(QuantizedModule):
    """y = x · dequant(W)ᵀ + b, where W [out_features, in_features] is stored in `dtype` (see
    `bitkern.ttype.names()`) with one scale per `group_size` inputs: a divisor of in_features, -1 for per
    output channel, None for 128 (or the fixed block of block-scaled types: mxfp4 32, nvfp4 16).

    zero_mode: None gives the type's default ("gptq" for unsigned integers, else "none").
    compute_dtype: the activation type the kernel multiplies in (float32, float16, bfloat16; bfloat16 is
    the fast path on AMX CPUs); None computes in x's dtype.  The output has x's dtype either way.
    scale_dtype: storage of the scales.  device: where the layer is made; "meta" makes an empty layer
    to load a checkpoint into.  A new layer is initialised like nn.Linear, then quantized.
    The weight is frozen: gradients flow to x and the bias.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype="nf4", group_size=None,
                 zero_mode: str | None = None, compute_dtype=None, device=None, scale_dtype=torch.float16):
        super().__init__()
        self.in_features = check_positive("in_features", in_features)
        self.out_features = check_positive("out_features", out_features)
        self._configure((out_features, in_features), dtype, group_size, zero_mode, scale_dtype, compute_dtype)
        source = nn.Linear(in_features, out_features, bias=bias, device=device)
        self._set_weight(source.weight)
        self.register_parameter("bias", None if source.bias is None else nn.Parameter(source.bias.detach()))

    @classmethod
    def from_float(cls, module: nn.Linear, dtype="nf4", group_size=None, zero_mode: str | None = None,
                   compute_dtype=None, scale_dtype=torch.float16) -> "Linear":
        """Quantize an nn.Linear (its weight's device and values; the bias is copied as it is)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"module must be a torch.nn.Linear, got {type(module).__name__}")
        layer = cls(module.in_features, module.out_features, module.bias is not None, dtype, group_size, zero_mode,
                    compute_dtype, device="meta", scale_dtype=scale_dtype)
        layer._set_weight(module.weight)
        if module.bias is not None:
            layer.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
        return layer

    @classmethod
    def from_quantized(cls, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                       compute_dtype=None) -> "Linear":
        """A Linear holding an already quantized weight (a checkpoint's tensors as a QuantizedWeight, in the
        portable layout), laid out for the kernels of the weight's device; `bias` (float, [out_features]) is
        taken as it is."""
        if not isinstance(weight, QuantizedWeight):
            raise TypeError(f"weight must be a bitkern.QuantizedWeight, got {type(weight).__name__}")
        out_features, in_features = weight.shape
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (out_features,)):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a tensor of shape ({out_features},), got {got}")
        block = weight.ttype.block_size > 1
        if weight.zero_mode == "hqq" and weight.zeros.dtype != weight.scales.dtype:
            raise ValueError(f"hqq zeros have dtype {weight.zeros.dtype}, the scales {weight.scales.dtype}; a "
                             f"Linear stores both in one scale dtype")
        layer = cls(in_features, out_features, bias is not None, weight.ttype.name, weight.group_size,
                    weight.zero_mode, compute_dtype, device="meta",
                    scale_dtype=torch.float16 if block else weight.scales.dtype)
        layer._store(pack(weight))
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and (x.dim() < 1 or x.shape[-1] != self.in_features):
            raise ValueError(f"x has shape {tuple(x.shape)}; this Linear has in_features={self.in_features}, "
                             f"so x must be [..., {self.in_features}]")
        x, output_dtype = self._compute_input(x)
        weight = self._weight_args()
        return torch.ops.bitkern.linear(x, *weight[:4], self.bias, *weight[4:], output_dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """An nn.Linear holding the dequantized weight (in `dtype`) and this layer's bias."""
        module = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta", dtype=dtype)
        module.weight = nn.Parameter(self.dequantize_weight(dtype))
        if self.bias is not None:
            module.bias = nn.Parameter(self.bias.detach().to(dtype).clone(), requires_grad=self.bias.requires_grad)
        return module

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self._weight_repr()}")

