"""CUDA backend: the "lop3" weight layout, LOP3 decode functions, TensorCore GEMM and decode GEMV
templates generated with TVM and compiled with nvcc, and a cubin launcher for torch tensors.

Entry points: `pack(weight)` (a QuantizedWeight in the "lop3" layout), `build_kernel(spec, n, k, template,
config, arch, m_range)` -> `CudaKernel` (callable, `save`-able; `load_kernel` needs neither TVM nor nvcc),
the template configurations `GemmConfig` / `GemvConfig` and their `resources(spec, k, config)` (for the
tuner's per-architecture limits).
"""

from .gemm import GemmConfig, Resources
from .gemv import GemvConfig
from .kernel import TEMPLATES, CudaKernel, build_kernel, kernel_from_files, load_kernel
from .layout import LAYOUT, Lop3Weight, to_lop3


def pack(weight) -> Lop3Weight:
    """Lay a QuantizedWeight out for the CUDA kernels (once, at load time, on the weight's device)."""
    return to_lop3(weight)


def resources(spec, k: int, config) -> Resources:
    """Shared memory, threads and estimated registers per thread block of a template configuration for a
    weight with K = k columns (the tuner checks them against an architecture's limits)."""
    from . import gemm, gemv

    if isinstance(config, GemmConfig):
        return gemm.resources(spec, k, config)
    if isinstance(config, GemvConfig):
        return gemv.resources(spec, k, config)
    raise TypeError(f"config must be a GemmConfig or GemvConfig, got {type(config).__name__}")


__all__ = ["CudaKernel", "GemmConfig", "GemvConfig", "LAYOUT", "Lop3Weight", "Resources", "TEMPLATES",
           "build_kernel", "kernel_from_files", "load_kernel", "pack", "resources"]
