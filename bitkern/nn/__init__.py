"""torch.nn modules over bitkern's kernels: quantized Linear, Conv2d and mixture-of-experts Experts, whole-model
quantization, files.

Entry points: `Linear`, `Conv2d`, `Experts`, `quantize_model` / `dequantize_model`, `save` / `load` (safetensors),
`decode_attention` (one query row per head over a KV cache, on bitkern's CPU kernel); `prepare.prepare` makes a
model's kernels ready before its first call (`bitkern.prepare`).
The kernels are torch custom ops (`torch.ops.bitkern.linear`, `torch.ops.bitkern.dequantize`,
`torch.ops.bitkern.decode_attention`).
"""

from . import library  # noqa: F401  (registers the custom ops)
from .attention import decode_attention
from .conv import Conv2d
from .experts import Experts
from .linear import Linear
from .model import dequantize_model, quantize_model
from .serialization import load, save

__all__ = ["Conv2d", "Experts", "Linear", "decode_attention", "dequantize_model", "load", "quantize_model", "save"]
