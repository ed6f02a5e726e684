"""bitkern: low-precision GEMM kernels for PyTorch — weights stored in custom types, decoded in the kernel."""

import os

import torch

# TVM sizes its thread pool once, from this variable; follow torch's intra-op thread count.
os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))

from . import ops, ttype  # noqa: E402  (the thread count must be set before TVM loads)
from .codegen import PackedWeight, pack  # noqa: E402
from .ttype import QuantizedWeight, quantize  # noqa: E402
from . import nn  # noqa: E402
from .nn import Conv2d, Linear, dequantize_model, load, quantize_model, save  # noqa: E402

from .integration.hf import registration as _hf_registration  # noqa: E402

_hf_registration.install()  # transformers finds bitkern checkpoints' method once it loads (imports no transformers)

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "BitkernConfig":  # the transformers quantization config; importing it imports transformers
        try:
            from .integration.hf import BitkernConfig
        except ImportError as error:
            raise ImportError(f"bitkern.BitkernConfig needs transformers (pip install transformers): {error}") from error
        return BitkernConfig
    raise AttributeError(f"module 'bitkern' has no attribute {name!r}")


__all__ = ["Conv2d", "Linear", "PackedWeight", "QuantizedWeight", "__version__", "dequantize_model", "load", "nn",
           "ops", "pack", "quantize", "quantize_model", "save", "ttype"]
