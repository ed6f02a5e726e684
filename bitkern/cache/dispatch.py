"""Dispatch of an operator call to its compiled kernel: what runs when a `bitkern.ops` spec is called.

`bitkern.ops` describes operators and checks their inputs; it executes nothing itself.  Importing this module
attaches `run` to it (`bitkern.ops.execution.attach`), so `Matmul(...)(x, weight)` comes here: the inputs are
checked (a few comparisons on the hot path, the full check otherwise), the kernel of (spec, N, K, M, layout,
device) is found through `kernel_for`, and it runs on x's rows; a `GroupedMatmul`'s calls come to `run_grouped`.
The torch ops' CPU calls also bind their kernel to the weight (`bound`), and later calls of the same signature run
it through `run_bound` / `run_grouped_bound`.
Inside `rehearsal(device)` the same calls (grouped ones too), with host tensors, run as on a GPU up to the driver (a GPU
kit's dry run).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from ..codegen import PackedWeight, layout_for, to_layout
from ..ops import execution
from ..ttype import torch_dtype
from ..tuner.buckets import m_bucket
from . import bound
from .lookup import kernel_for

_rehearsal = contextvars.ContextVar("bitkern_rehearsal", default=None)  # (device, store, launches) inside rehearsal()


def run(spec, x: torch.Tensor, weight, bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
        norm_bias: torch.Tensor | None = None, bind: tuple | None = None) -> torch.Tensor:
    """y = spec(x, weight, bias, residual, norm_weight, norm_bias) by the compiled kernel (see
    `bitkern.ops.Matmul.__call__`); `bind`: (the weight's tensors, the call's signature) to bind a CPU call's kernel
    to, for the later calls of that signature (`bound`)."""
    if not isinstance(weight, PackedWeight):
        raise TypeError(f"weight must be packed for the kernels with bitkern.pack(quantized_weight), "
                        f"got {type(weight).__name__}")
    rehearsing = _rehearsal.get()
    if rehearsing is not None:
        return _rehearse(spec, x, weight, bias, residual, *rehearsing)
    quick = spec.fits(x, weight, bias, residual, norm_weight, norm_bias)
    if not quick:
        spec.check_inputs(x, weight, bias, residual, norm_weight, norm_bias)
    n, k = weight.shape
    kernel_spec, rows, shape = spec.gemm_input(x, n, k, gathered=x.is_cpu)
    if rows.shape[0] == 0:
        return torch.empty(shape, dtype=torch_dtype(spec.output_dtype), device=x.device)
    kernel = kernel_for(kernel_spec, n, k, kernel_spec.rows(rows), weight.layout, None if quick else device_of(x))
    if bind is not None and x.is_cpu and kernel_spec is spec:
        bound.keep(*bind, kernel, weight)
    if norm_weight is not None:  # a norm prologue (CPU templates only)
        y = kernel(rows, weight, bias, None if residual is None else residual.reshape(rows.shape[0], -1),
                   norm=(norm_weight, norm_bias))
    else:
        y = kernel(rows, weight, bias) if residual is None else \
            kernel(rows, weight, bias, residual.reshape(rows.shape[0], -1))
    return y if y.shape == shape else y.reshape(shape)


@functools.lru_cache(maxsize=None)
def serves_grouped(spec, n: int, k: int, device_type: str = "cpu") -> bool:
    """Whether a kernel template serves the `GroupedMatmul` spec on experts' [N, K] weights on this machine's
    `device_type` ("cpu": this CPU, in tile16; "cuda": the current GPU, in lop3)."""
    from ..tuner.device import cuda_device, host_cpu
    from ..tuner.space import usable_templates

    device = cuda_device() if device_type == "cuda" else host_cpu()
    return bool(usable_templates(spec, n, k, m_bucket(1), layout_for(None, device.kind), device)[0])


def run_grouped(spec, x: torch.Tensor, weight, indices: torch.Tensor, bias: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, checked: bool = False, bind: tuple | None = None) -> torch.Tensor:
    """y = spec(x, weight, indices, bias, weights) of a `bitkern.ops.GroupedMatmul` by its compiled kernel (on x's
    device: the host CPU or a CUDA GPU; see `GroupedMatmul.__call__`); `checked`: the caller has already checked the
    inputs (`GroupedMatmul.check_routed`); `bind` as for `run`."""
    if not isinstance(weight, PackedWeight):
        raise TypeError(f"weight must be packed for the kernels with bitkern.pack(quantized_weight), "
                        f"got {type(weight).__name__}")
    rehearsing = _rehearsal.get()
    if rehearsing is not None:
        return _rehearse_grouped(spec, x, weight, indices, bias, weights, *rehearsing)
    if not checked:
        spec.check_routed(x, weight, indices, bias, weights)
    rows, k = weight.shape
    n = rows // spec.experts
    tokens = indices.shape[0]
    if tokens == 0:
        return torch.empty(spec.output_shape(0, n), dtype=torch_dtype(spec.output_dtype), device=x.device)
    if x.is_cuda:  # before any kernel is tuned
        from ..codegen.cuda.grouped import check_pairs

        check_pairs(tokens, spec.top_k, n)
    kernel = kernel_for(spec, n, k, tokens, weight.layout, device_of(x))
    if bind is not None and x.is_cpu:
        bound.keep(*bind, kernel, weight)
    routing = {"indices": indices} if weights is None else {"indices": indices, "weights": weights}
    return kernel(x if x.is_contiguous() else x.contiguous(), weight, bias, **routing)


def bound_call(tensors, signature: tuple) -> bound.Bound | None:
    """The CPU call bound to the weight `tensors` for `signature` by an earlier `run` / `run_grouped` (their `bind`),
    or None (none yet, or inside a rehearsal, whose calls run as on a GPU)."""
    return None if _rehearsal.get() is not None else bound.find(tensors, signature)


def run_bound(call: bound.Bound, x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              norm_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`run`'s result for a call of a bound call's signature, by its kernel at once."""
    kernel = call.kernel
    _, rows, shape = kernel.spec.gemm_input(x, kernel.n, kernel.k)
    y = kernel.run(rows, call.arguments(qweight), bias,
                   None if residual is None else residual.reshape(rows.shape[0], -1),
                   () if norm_weight is None else (norm_weight, norm_bias))
    return y if y.shape == shape else y.reshape(shape)


def run_grouped_bound(call: bound.Bound, x: torch.Tensor, qweight: torch.Tensor, indices: torch.Tensor,
                      bias: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """`run_grouped`'s result for a call of a bound call's signature: the expert ids checked, then its kernel."""
    call.kernel.spec.check_expert_ids(indices)
    return call.kernel.run(x, call.arguments(qweight), bias, indices, weights)


@contextlib.contextmanager
def rehearsal(device, store=None):
    """Inside, every call of a bitkern op (modules, torch.ops.bitkern, specs) with host tensors runs as it would on
    a GPU of `device` (a CUDA architecture's description) up to the driver: the inputs checked, the kernel found
    (in `store`, default the cache's; no TVM where it is there), the weight in the layout the kernel reads, the
    arguments packed and each launch checked against the kernel's cubin (name, parameters, limits).  Nothing is
    launched: y comes back allocated but unset.  Yields the list the launches (`compile.LaunchCall`) go to."""
    if getattr(device, "kind", None) != "cuda":
        raise ValueError(f"device must describe a CUDA architecture (bitkern.tuner.cuda_device), got {device!r}")
    launches = []
    token = _rehearsal.set((device, store, launches))
    try:
        yield launches
    finally:
        _rehearsal.reset(token)


def _rehearse(spec, x, weight, bias, residual, device, store, launches) -> torch.Tensor:
    from ..codegen.cuda.launcher import check_launches

    spec.check_inputs(x, weight, bias, residual)
    n, k = weight.shape
    layout = layout_for(weight.ttype, device.kind)
    if weight.layout != layout:
        weight = to_layout(weight.to_portable(), layout)
    kernel_spec, rows, shape = spec.gemm_input(x, n, k, gathered=False)
    if rows.shape[0] == 0:
        return torch.empty(shape, dtype=torch_dtype(spec.output_dtype), device=x.device)
    kernel = kernel_for(kernel_spec, n, k, kernel_spec.rows(rows), layout, device, store)
    y, calls = kernel.plan(rows, weight, bias, None if residual is None else residual.reshape(rows.shape[0], -1))
    check_launches(kernel.binary.cubin, calls, device.shared_bytes_per_block)
    launches.extend(calls)
    return y if y.shape == shape else y.reshape(shape)


def _rehearse_grouped(spec, x, weight, indices, bias, weights, device, store, launches) -> torch.Tensor:
    from ..codegen.cuda.launcher import check_launches

    spec.check_routed(x, weight, indices, bias, weights)
    rows, k = weight.shape
    n = rows // spec.experts
    layout = layout_for(weight.ttype, device.kind)
    if weight.layout != layout:
        weight = to_layout(weight.to_portable(), layout)
    if x.shape[0] == 0:
        return torch.empty((0, spec.top_k, n), dtype=torch_dtype(spec.output_dtype), device=x.device)
    from ..codegen.cuda.grouped import check_pairs

    check_pairs(x.shape[0], spec.top_k, n)
    kernel = kernel_for(spec, n, k, x.shape[0], layout, device, store)
    y, calls = kernel.plan(x.contiguous(), weight, bias, indices=indices)
    check_launches(kernel.binary.cubin, calls, device.shared_bytes_per_block)
    launches.extend(calls)
    return y


def device_of(x: torch.Tensor):
    """The tuner's description of the device x lives on (None: the host CPU)."""
    if x.device.type == "cpu":
        return None
    if x.device.type == "cuda":
        from ..tuner.device import cuda_device

        return cuda_device()
    raise NotImplementedError(f"bitkern has kernels for cpu and cuda tensors, not {x.device.type}")


execution.attach(run, run_grouped)
