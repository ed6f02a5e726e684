"""torch.nn modules over bitkern's kernels: quantized Linear and Conv2d, whole-model quantization, files.

Entry points: `Linear`, `Conv2d`, `quantize_model` / `dequantize_model`, `save` / `load` (safetensors).
The kernels are torch custom ops (`torch.ops.bitkern.linear`, `torch.ops.bitkern.dequantize`).
"""

from . import library  # noqa: F401  (registers the custom ops)
from .conv import Conv2d
from .linear import Linear
from .model import dequantize_model, quantize_model
from .serialization import load, save

__all__ = ["Conv2d", "Linear", "dequantize_model", "load", "quantize_model", "save"]
