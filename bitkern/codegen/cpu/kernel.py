"""Compile a CPU template for one (spec, N, K) and call the result on torch tensors (zero-copy DLPack)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.matmul import Matmul
from . import amx, generic, lut
from .layout import PackedWeight
from .runtime import enable_amx

TEMPLATES = ("amx", "lut", "generic")


@dataclass
class CpuKernel:
    """A compiled kernel for weights of one spec and shape, serving rows M in `m_range` (inclusive)."""

    spec: Matmul
    n: int
    k: int
    template: str
    config: object
    layout: str
    m_range: tuple[int, int]
    function: object
    module: object

    def __call__(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y[M, N] for a contiguous x[M, K] with M in m_range (inputs already validated by the caller)."""
        y = torch.empty(x.shape[0], self.n, dtype=_TORCH[self.spec.output_dtype], device=x.device)
        args = [self._as_arg(x), weight.qweight, self._as_arg(weight.scales)]
        if weight.zeros is not None:
            args.append(self._as_arg(weight.zeros))
        if weight.tensor_scale is not None:
            args.append(weight.tensor_scale.reshape(1))
        if self.template == "amx" and self.config.decode == "lut":
            args.append(self._table(amx.lut_words))
        if self.template == "lut":
            args.append(self._table(lut.value_table))
        if bias is not None:
            args.append(bias.to(torch.float32).contiguous())
        args.append(self._as_arg(y))
        self.function(*args)
        return y

    def _as_arg(self, tensor: torch.Tensor) -> torch.Tensor:
        """The hand-written templates take bfloat16 data as int16 bits."""
        return tensor.view(torch.int16) if self.template != "generic" and tensor.dtype == torch.bfloat16 else tensor

    def _table(self, make) -> torch.Tensor:
        """A constant table argument of the template, made once per kernel."""
        if "_constant_table" not in self.__dict__:
            self.__dict__["_constant_table"] = make(self.spec)
        return self.__dict__["_constant_table"]


_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_kernel(spec: Matmul, n: int, k: int, template: str, config, layout: str, m_range: tuple[int, int],
                 device) -> CpuKernel:
    """Generate the template's code for `config` and compile it for `device` (a tuner CpuDevice)."""
    import tvm

    if template in ("amx", "lut") and layout != "tile16":
        raise ValueError(f"the {template} template reads the tile16 layout, not {layout!r}")
    if template == "amx":
        func = amx.build(spec, n, k, config)
        enable_amx()
    elif template == "lut":
        func = lut.build(spec, n, k, config)
    elif template == "generic":
        func = generic.build(spec, n, k, config, layout)
    else:
        raise ValueError(f"template={template!r} is not known; accepted: {list(TEMPLATES)}")
    # LLVM eliminates common subexpressions itself; TVM's pass is slow on the unrolled templates.
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        module = tvm.compile(tvm.IRModule({"main": func}), target=device.tvm_target())
    return CpuKernel(spec, n, k, template, config, layout, m_range, module["main"], module)
