"""bitkern: low-precision GEMM kernels for PyTorch — weights stored in custom types, decoded in the kernel."""

import os

import torch

# TVM sizes its thread pool once, from this variable; follow torch's intra-op thread count.
os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))

from . import ops, ttype  # noqa: E402  (the thread count must be set before TVM loads)
from .codegen import PackedWeight, pack  # noqa: E402
from .ttype import QuantizedWeight, quantize  # noqa: E402

__version__ = "0.1.0"

__all__ = ["PackedWeight", "QuantizedWeight", "__version__", "ops", "pack", "quantize", "ttype"]
