"""The modules `bitkern.fuse` puts in place of module patterns: one kernel call where there were several.

`EpilogueLinear`: a bitkern.Linear whose kernel applies an activation or SwiGLU in its output stage
(`torch.ops.bitkern.linear_epilogue`).  `SharedInputLinears` with its `StackedOutput` members: layers that read
one input (q/k/v) as one GEMM over their stacked weight; each member stands where a layer stood, and the first
member called with an input runs the GEMM for all of them.  `SwiGLUMLP`: down(silu(gate(x)) · up(x)) as two kernel
calls.
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn import Linear, library
from .stack import stacked_layer


class EpilogueLinear(nn.Module):
    """y = f(x · Wᵀ + b) (+ residual) in one kernel: `layer` a bitkern.Linear (SwiGLU: its stacked gate/up
    weight), `epilogue` a `bitkern.ops.Matmul` epilogue."""

    def __init__(self, layer: Linear, epilogue: str):
        super().__init__()
        if layer.input_order is not None:
            raise ValueError("layer has permuted inputs (input_order); fused layers take plain ones")
        self.layer, self.epilogue = layer, epilogue
        self.out_features = layer.out_features // (2 if epilogue == "swiglu" else 1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layer
        if x.shape[-1] != layer.in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}; this layer takes [..., {layer.in_features}]")
        compute = layer.compute_dtype or x.dtype
        rows = x if x.dtype is compute else x.to(compute)
        if library.eager(rows, layer.bias, residual):  # inference in eager mode: the op's body, no dispatcher
            return library.run_linear(rows, layer.packed_weight(), layer.op_weight()[1], layer.bias, x.dtype,
                                      self.epilogue, residual)
        weight, weight_format = layer.op_weight()
        return torch.ops.bitkern.linear_epilogue(rows, weight, weight_format, layer.bias, x.dtype, self.epilogue,
                                                 residual)

    def extra_repr(self) -> str:
        return f"epilogue={self.epilogue!r}, out_features={self.out_features}"


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) · up(x)) (Llama's MLP) as two kernels: gate/up stacked with the SwiGLU epilogue, then
    down."""

    def __init__(self, gate: Linear, up: Linear, down: nn.Module):
        super().__init__()
        self.gate_up = EpilogueLinear(stacked_layer([gate, up], swiglu=True), "swiglu")
        self.down_proj = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up(x))


class SharedInputLinears(nn.Module):
    """Layers reading one input, stacked into one GEMM (`layer`); `sizes` their output sizes.  `outputs(x)` runs
    the GEMM once per input (tensor object and version) and hands each member its slice (a view)."""

    def __init__(self, layers: list):
        super().__init__()
        self.layer = stacked_layer(layers)
        self.sizes = [layer.out_features for layer in layers]
        self._input, self._outputs, self._taken = None, None, set()

    def outputs(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member `index`'s output for x: computed with the others' on the first call with x."""
        # the version counter tells an input modified in place since; inference tensors have none, and under
        # torch.compile the trace is one forward pass
        version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
        fresh = self._input is None or self._input[0] is not x or self._input[1] != version
        if fresh or index in self._taken:
            self._outputs = self.layer(x).split(self.sizes, dim=-1)
            self._input, self._taken = (x, version), set()
        self._taken.add(index)
        output = self._outputs[index]
        if len(self._taken) == len(self.sizes):  # every member has its output: hold no tensor longer
            self._input, self._outputs, self._taken = None, None, set()
        return output


class StackedOutput(nn.Module):
    """Stands where one of a `SharedInputLinears` group's layers stood: its slice of the group's GEMM."""

    def __init__(self, group: SharedInputLinears, index: int):
        super().__init__()
        object.__setattr__(self, "group", group)  # the owner registers the group once, not in every member
        self.index, self.out_features = index, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.outputs(x, self.index)

    def extra_repr(self) -> str:
        return f"member {self.index} of a stacked GEMM, out_features={self.out_features}"
