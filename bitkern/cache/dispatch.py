"""Dispatch of an operator call to its compiled kernel: what runs when a `bitkern.ops` spec is called.

`bitkern.ops` describes operators and checks their inputs; it executes nothing itself.  Importing this module
attaches `run` to it (`bitkern.ops.execution.attach`), so `Matmul(...)(x, weight)` comes here: the inputs are
checked (a few comparisons on the hot path, the full check otherwise), the kernel of (spec, N, K, M, layout,
device) is found through `kernel_for`, and it runs on x's rows.
"""

from __future__ import annotations

import torch

from ..codegen import PackedWeight
from ..ops import execution
from ..ttype import torch_dtype
from .lookup import kernel_for


def run(spec, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = spec(x, weight, bias) by the compiled kernel (see `bitkern.ops.Matmul.__call__`)."""
    if not isinstance(weight, PackedWeight):
        raise TypeError(f"weight must be packed for the kernels with bitkern.pack(quantized_weight), "
                        f"got {type(weight).__name__}")
    quick = spec.fits(x, weight, bias)
    if not quick:
        spec.check_inputs(x, weight, bias)
    n, k = weight.shape
    kernel_spec, rows, shape = spec.gemm_input(x, n, k, gathered=x.is_cpu)
    if rows.shape[0] == 0:
        return torch.empty(shape, dtype=torch_dtype(spec.output_dtype), device=x.device)
    kernel = kernel_for(kernel_spec, n, k, kernel_spec.rows(rows), weight.layout, None if quick else device_of(x))
    y = kernel(rows, weight, bias)
    return y if y.shape == shape else y.reshape(shape)


def device_of(x: torch.Tensor):
    """The tuner's description of the device x lives on (None: the host CPU)."""
    if x.device.type == "cpu":
        return None
    if x.device.type == "cuda":
        from ..tuner.device import cuda_device

        return cuda_device()
    raise NotImplementedError(f"bitkern has kernels for cpu and cuda tensors, not {x.device.type}")


execution.attach(run)
