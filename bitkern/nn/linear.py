"""`bitkern.Linear`: nn.Linear with its weight stored in a low-precision type, run by one compiled kernel."""

from __future__ import annotations

import torch
from torch import nn

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

    float_class = nn.Linear

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype="nf4", group_size=None,
                 zero_mode: str | None = None, compute_dtype=None, device=None, scale_dtype=torch.float16):
        super().__init__()
        self.in_features = check_positive("in_features", in_features)
        self.out_features = check_positive("out_features", out_features)
        self._configure((out_features, in_features), dtype, group_size, zero_mode, scale_dtype, compute_dtype)
        self._take_parameters(nn.Linear(in_features, out_features, bias=bias, device=device))

    @classmethod
    def _meta_layer(cls, module: nn.Linear, **settings) -> "Linear":
        return cls(module.in_features, module.out_features, module.bias is not None, device="meta", **settings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and (x.dim() < 1 or x.shape[-1] != self.in_features):
            raise ValueError(f"x has shape {tuple(x.shape)}; this Linear has in_features={self.in_features}, "
                             f"so x must be [..., {self.in_features}]")
        x, output_dtype = self._compute_input(x)
        weight, weight_format = self.op_weight()
        return torch.ops.bitkern.linear(x, weight, weight_format, self.bias, output_dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """An nn.Linear holding the dequantized weight (in `dtype`) and this layer's bias."""
        module = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta", dtype=dtype)
        return self._give_parameters(module, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self._weight_repr()}")

