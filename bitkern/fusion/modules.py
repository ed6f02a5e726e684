"""The modules `bitkern.fuse` puts in place of module patterns: one kernel call where there were several.

`EpilogueLinear`: a bitkern.Linear whose kernel applies an activation or SwiGLU in its output stage
(`torch.ops.bitkern.linear_epilogue`).  `SharedInputLinears` with its `StackedOutput` members: layers that read
one input (q/k/v) as one GEMM over their stacked weight; each member stands where a layer stood, and the first
member called with an input runs the GEMM for all of them.  `SwiGLUMLP`: down(silu(gate(x)) · up(x)) as two kernel
calls.  `FoldedNorm`: stands where an RMSNorm/LayerNorm stood whose consumers (an `EpilogueLinear`, a
`SharedInputLinears`) normalize x in their kernels' prologue; it passes x through.
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn import Linear, library
from ..nn.kernel_call import KernelCall
from .stack import stacked_layer


class FoldedNorm(nn.Module):
    """Stands where a norm stood whose consumers apply it in their kernels' prologue: forward returns x as it
    is.  It keeps the norm's parameters (`weight`, and `bias` for "layernorm") under the norm's names, its `kind`
    (a `bitkern.ops.Matmul` norm) and `eps`, which the consumers read on every call."""

    def __init__(self, kind: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        super().__init__()
        self.kind, self.eps = kind, float(eps)
        self._float32 = {}  # name -> ((storage, version, dtype), float32 copy): see `_for_kernel`
        for name, value in (("weight", weight), ("bias", bias)):
            if isinstance(value, nn.Parameter) or value is None:
                setattr(self, name, value)
            else:  # a norm without affine parameters: ones and zeros
                self.register_buffer(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def arguments(self) -> dict:
        """The norm arguments of `torch.ops.bitkern.linear_epilogue`."""
        return {"norm": self.kind, "norm_weight": self._for_kernel("weight"), "norm_bias": self._for_kernel("bias"),
                "norm_eps": self.eps}

    def _for_kernel(self, name: str) -> torch.Tensor | None:
        """The parameter as the kernels read it, float32, converted once per version of it (exact): converting on
        every call is a torch op between two kernel calls, which at 1 token costs more than the norm it saves
        (measured: a 3072x2048 int4 GEMV with a bf16 LlamaRMSNorm folded, 242 µs converting per call, 163 µs
        not).  Under torch.compile the conversion is a node of the graph (one small Inductor kernel; inside the op it
        is two torch ops per call); while the parameter is being trained, it goes as it is.  An inference tensor
        (made under torch.inference_mode, e.g. a deepcopy there) has no version to key on: converted per call."""
        value = getattr(self, name)
        if value is None or value.dtype == torch.float32:
            return value
        if torch.compiler.is_compiling() or value.is_inference():
            return value.to(torch.float32)
        if (value.requires_grad and torch.is_grad_enabled()) or type(value) not in (torch.Tensor, nn.Parameter):
            return value
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), value._version, value.dtype, value.device)
        cached = self._float32.get(name)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self._float32[name] = (key, value.detach().float().contiguous())
        return cached[1]

    def extra_repr(self) -> str:
        return f"{self.kind}, eps={self.eps}: applied in the following kernels' prologue"


def fused_call(layer: Linear, x: torch.Tensor, epilogue: str = "none", residual: torch.Tensor | None = None,
               norm: FoldedNorm | None = None) -> torch.Tensor:
    """f(x̂ · Wᵀ + b) (+ residual) of a bitkern.Linear in one kernel call: x̂ = x, or x normalized by `norm` in
    the kernel's prologue (x must then already be in the layer's compute dtype: the norm's rounding is to it)."""
    if x.shape[-1] != layer.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}; this layer takes [..., {layer.in_features}]")
    weight, weight_format = layer.op_weight()
    compute = layer.compute_dtype or x.dtype
    if norm is not None and x.dtype != compute:
        raise ValueError(f"x is {x.dtype} but the layer computes in {compute}: a folded norm takes x in the "
                         f"layer's compute dtype")
    arguments = (x.to(compute), weight_format, layer.bias, x.dtype, epilogue, residual)
    norm_arguments = {} if norm is None else norm.arguments()
    if layer.activation_quant != "none":
        norm_arguments["activation_quant"] = layer.activation_quant
    others = (residual, norm_arguments.get("norm_weight"), norm_arguments.get("norm_bias"))
    plain = all(t is None or type(t) is torch.Tensor for t in others)  # a tensor subclass must see the op
    if library.eager(x, layer.bias) and plain and not (torch.is_grad_enabled() and
                                                       any(t is not None and t.requires_grad for t in others)):
        # nothing for autograd or a compiler to see: the op's body on the weight object, without the dispatcher
        return library.run_linear_epilogue(arguments[0], layer.packed_weight(), *arguments[1:], **norm_arguments)
    return torch.ops.bitkern.linear_epilogue(arguments[0], weight, *arguments[1:], **norm_arguments)


def fused_calls(layer: Linear, dtype: torch.dtype, epilogue: str = "none", norm: FoldedNorm | None = None) -> list:
    """The kernel `fused_call` runs for an x of `dtype` (what `bitkern.prepare` makes ready ahead of it)."""
    norm_fields = {} if norm is None else {"norm": norm.kind, "norm_eps": norm.eps}
    spec = library.spec_of(layer.op_weight()[1], layer.compute_dtype or dtype, dtype, layer.bias is not None,
                           epilogue=epilogue, activation_quant=layer.activation_quant, **norm_fields)
    return [KernelCall(spec, *layer.gemm_shape, layer.layout, layer.qweight.device)]


class EpilogueLinear(nn.Module):
    """y = f(x̂ · Wᵀ + b) (+ residual) in one kernel: `layer` a bitkern.Linear (SwiGLU: its stacked gate/up
    weight), `epilogue` a `bitkern.ops.Matmul` epilogue; `norm` (a `FoldedNorm`, set by the fusion of a norm
    before it) makes x̂ the normalized x."""

    def __init__(self, layer: Linear, epilogue: str):
        super().__init__()
        if layer.input_order is not None:
            raise ValueError("layer has permuted inputs (input_order); fused layers take plain ones")
        self.layer, self.epilogue = layer, epilogue
        self.out_features = layer.out_features // (2 if epilogue == "swiglu" else 1)
        object.__setattr__(self, "norm", None)  # the norm's owner registers it, not its consumers

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return fused_call(self.layer, x, self.epilogue, residual, self.norm)

    def kernel_calls(self, dtype: torch.dtype) -> list:
        """The kernel a call with an x of `dtype` and no residual runs (a residual is given by rewrites under
        torch.compile only)."""
        return fused_calls(self.layer, dtype, self.epilogue, self.norm)

    def extra_repr(self) -> str:
        norm = "" if self.norm is None else f", norm={self.norm.kind!r} in the prologue"
        return f"epilogue={self.epilogue!r}, out_features={self.out_features}{norm}"


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
        object.__setattr__(self, "norm", None)  # a `FoldedNorm` its GEMM applies in the prologue (see EpilogueLinear)

    def outputs(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member `index`'s output for x: computed with the others' on the first call with x."""
        # the version counter tells an input modified in place since; inference tensors have none, and under
        # torch.compile the trace is one forward pass
        version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
        fresh = self._input is None or self._input[0] is not x or self._input[1] != version
        if fresh or index in self._taken:
            y = self.layer(x) if self.norm is None else fused_call(self.layer, x, norm=self.norm)
            self._outputs = y.split(self.sizes, dim=-1)
            self._input, self._taken = (x, version), set()
        self._taken.add(index)
        output = self._outputs[index]
        if len(self._taken) == len(self.sizes):  # every member has its output: hold no tensor longer
            self._input, self._outputs, self._taken = None, None, set()
        return output

    def kernel_calls(self, dtype: torch.dtype) -> list:
        """The kernel of the stacked GEMM for an x of `dtype`."""
        return self.layer.kernel_calls(dtype) if self.norm is None else fused_calls(self.layer, dtype, norm=self.norm)


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
