"""CUDA backend: the "lop3" weight layout, LOP3 decode functions, TensorCore GEMM (`gemm`), decode GEMV (`gemv`),
TensorCore GEMV (`mma_gemv`) and grouped mixture-of-experts GEMV (`grouped`) templates generated with TVM and compiled
with nvcc, and a cubin launcher for torch tensors.

The registry: `TEMPLATES`, in the order the tuner lists them (each a `CudaTemplate`, `kernel.py`).  Entry
points: `pack(weight)` (a QuantizedWeight in the "lop3" layout); a template's `build` -> `CudaKernel` (callable,
`save`-able; `load_kernel` needs neither TVM nor nvcc).
"""

from importlib import import_module

from .gemm import GemmConfig
from .gemv import GemvConfig
from .grouped import GroupedGemvConfig
from .mma_gemv import MmaGemvConfig
from .kernel import CudaKernel, CudaTemplate, Resources, kernel_from_files, load_kernel
from .layout import Lop3Weight, to_lop3

TEMPLATES = [import_module(f"{__name__}.{name}").TEMPLATE for name in ("gemm", "gemv", "mma_gemv", "grouped")]


def pack(weight) -> Lop3Weight:
    """Lay a QuantizedWeight out for the CUDA kernels (once, at load time, on the weight's device)."""
    return to_lop3(weight)


__all__ = ["CudaKernel", "CudaTemplate", "GemmConfig", "GemvConfig", "GroupedGemvConfig", "Lop3Weight", "MmaGemvConfig", "Resources",
           "TEMPLATES", "kernel_from_files", "load_kernel", "pack"]
