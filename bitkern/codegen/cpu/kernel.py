"""A compiled CPU kernel called on torch tensors (zero-copy through DLPack); needs no TVM compiler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...ops.matmul import Matmul
from ...ttype import torch_dtype
from .layout import PackedWeight, aligned
from .runtime import enable_amx

TEMPLATES = ("amx", "dot", "lut", "generic")


@dataclass
class CpuKernel:
    """A compiled kernel for weights of one spec and shape, serving rows M in `m_range` (inclusive).

    constants: tensors the template takes after the weight's (decode tables), made when it was built.
    """

    spec: Matmul
    n: int
    k: int
    template: str
    config: object
    layout: str
    m_range: tuple[int, int]
    function: object
    constants: list = field(default_factory=list)
    record: object = None
    module: object = None  # the TVM module, while it lives in the process that compiled it (for export)
    build_seconds: float | None = None  # code generation and compilation, where this process compiled it

    def __call__(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y[M, N] for a contiguous x (x[M, K], or a convolution's NHWC image: M = its output pixels) with M
        in m_range (inputs already validated by the caller).  AMX kernels ask for the tile permission here, on
        their first call, so that they can be built for a CPU that is not this one."""
        if self.template == "amx":
            enable_amx()
        y = torch.empty(self.spec.rows(x), self.n, dtype=torch_dtype(self.spec.output_dtype), device=x.device)
        bias_argument = () if bias is None else \
            (aligned(bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.float().contiguous()),)
        self.function(aligned(x), *weight.kernel_arguments(), *self.constants, *bias_argument, y)
        return y
