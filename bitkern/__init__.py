"""bitkern: low-precision GEMM kernels for PyTorch — weights stored in custom types, decoded in the kernel."""

from . import ops, ttype
from .ttype import QuantizedWeight, quantize

__version__ = "0.1.0"

__all__ = ["QuantizedWeight", "__version__", "ops", "quantize", "ttype"]
