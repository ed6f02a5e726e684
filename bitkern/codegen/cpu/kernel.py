"""A compiled CPU kernel called on torch tensors (zero-copy through DLPack); needs no TVM compiler."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...ops.matmul import Matmul
from .layout import PackedWeight

TEMPLATES = ("amx", "lut", "generic")
ALIGNMENT = 64  # TVM's kernels assume 64-byte aligned tensors and use aligned vector loads
log = logging.getLogger("bitkern")
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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

    def __call__(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y[M, N] for a contiguous x (x[M, K], or a convolution's NHWC image: M = its output pixels) with M
        in m_range (inputs already validated by the caller)."""
        y = torch.empty(self.spec.rows(x), self.n, dtype=_TORCH[self.spec.output_dtype], device=x.device)
        args = [self._as_arg(x), weight.qweight, self._as_arg(weight.scales)]
        if weight.zeros is not None:
            args.append(self._as_arg(weight.zeros))
        if weight.tensor_scale is not None:
            args.append(weight.tensor_scale.reshape(1))
        args += self.constants
        if bias is not None:
            args.append(bias if bias.dtype == torch.float32 and bias.is_contiguous() else
                        bias.to(torch.float32).contiguous())
        self.function(*[aligned(a) for a in args], self._as_arg(y))
        return y

    def _as_arg(self, tensor: torch.Tensor) -> torch.Tensor:
        """The hand-written templates take bfloat16 data as int16 bits."""
        return tensor.view(torch.int16) if self.template != "generic" and tensor.dtype == torch.bfloat16 else tensor


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it that starts on a 64-byte boundary (views that start mid-line would fault
    the kernels' aligned loads; packed weights and torch's own allocations are already aligned)."""
    if tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    log.debug("bitkern: copying a %s tensor that is not %d-byte aligned", tuple(tensor.shape), ALIGNMENT)
    return tensor.clone()
