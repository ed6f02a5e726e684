"""`bitkern.Linear`: nn.Linear with its weight stored in a low-precision type, run by one compiled kernel."""

from __future__ import annotations

import torch
from torch import nn

from ..codegen import pack
from ..ops.matmul import ACTIVATION_QUANTS
from ..ttype import QuantizedWeight
from . import library
from .kernel_call import KernelCall
from .storage import QuantizedModule, check_positive


class Linear(QuantizedModule):
    """y = x · dequant(W)ᵀ + b, where W [out_features, in_features] is stored in `dtype` (see
    `bitkern.ttype.names()`) with one scale per `group_size` inputs: a divisor of in_features, -1 for per
    output channel, None for 128 (or the fixed block of block-scaled types: mxfp4 32, nvfp4 16).

    zero_mode: None gives the type's default ("gptq" for unsigned integers, else "none").
    compute_dtype: the activation type the kernel multiplies in (float32, float16, bfloat16; bfloat16 is
    the fast path on AMX CPUs); None computes in x's dtype.  The output has x's dtype either way.
    scale_dtype: storage of the scales.  method: how the scales and zeros are chosen (`bitkern.quantize`'s:
    "rtn" from each group's range, "hqq" optimized per group without data).
    activation_quant: "int8" quantizes x in the kernel per row and 32 inputs
    to int8 (symmetric, a float32 scale each, as llama.cpp's Q8_0) and multiplies the weight's integer codes
    exactly (VNNI; integer weight types, groups of a multiple of 32); "none" (default) multiplies x as it is.
    device: where the layer is made; "meta" makes an empty layer
    to load a checkpoint into.  A new layer is initialised like nn.Linear, then quantized.
    The weight is frozen: gradients flow to x and the bias.

    A layer may store its weight with the input columns permuted (`from_quantized(..., input_order=...)`,
    GPTQ's act-order): its buffer `input_order` then holds the permutation, each call gathers x's columns
    in that order, and `dequantize_weight()` gives the weight in the original column order.
    """

    float_class = nn.Linear
    activation_quants = ACTIVATION_QUANTS

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype="nf4", group_size=None,
                 zero_mode: str | None = None, compute_dtype=None, device=None, scale_dtype=torch.float16,
                 activation_quant: str = "none", method: str = "rtn"):
        super().__init__()
        self.in_features = check_positive("in_features", in_features)
        self.out_features = check_positive("out_features", out_features)
        self._configure((out_features, in_features), dtype, group_size, zero_mode, scale_dtype, compute_dtype,
                        activation_quant, method)
        self.register_buffer("input_order", None)
        self._take_parameters(nn.Linear(in_features, out_features, bias=bias, device=device))

    @classmethod
    def _meta_layer(cls, module: nn.Linear, **settings) -> "Linear":
        return cls(module.in_features, module.out_features, module.bias is not None, device="meta", **settings)

    @classmethod
    def from_quantized(cls, weight, bias: torch.Tensor | None = None, input_order: torch.Tensor | None = None,
                       compute_dtype=None, activation_quant: str = "none", method: str = "rtn") -> "Linear":
        """A layer holding an already quantized weight (a `bitkern.QuantizedWeight`, e.g. from a checkpoint of
        another tool) as it is, laid out for its device's kernels.

        input_order: a permutation of range(in_features) when the weight's columns are stored permuted: the
        layer computes y = x[..., input_order] · dequant(weight)ᵀ + b.
        method: how the weight's scales and zeros were chosen (recorded in the layer's settings, not re-run).
        """
        if not isinstance(weight, QuantizedWeight):
            raise TypeError(f"weight must be a bitkern.QuantizedWeight, got {type(weight).__name__}")
        n, k = weight.shape
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias must be a tensor of shape ({n},) or None, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        order = None if input_order is None else check_input_order(input_order, k)
        layer = cls(k, n, bias is not None, weight.ttype.name, weight.group_size, weight.zero_mode, compute_dtype,
                    device="meta", scale_dtype=weight.scales.dtype if weight.ttype.block_size == 1 else torch.float16,
                    activation_quant=activation_quant, method=method)
        layer._store(pack(weight))
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        layer.input_order = None if order is None else order.to(weight.device)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and (x.dim() < 1 or x.shape[-1] != self.in_features):
            raise ValueError(f"x has shape {tuple(x.shape)}; this Linear has in_features={self.in_features}, "
                             f"so x must be [..., {self.in_features}]")
        x, output_dtype = self._compute_input(x)
        order, bias = self._buffers["input_order"], self._parameters["bias"]
        if order is not None:
            x = torch.gather(x, -1, order.expand(*x.shape[:-1], self.in_features))
        if library.eager(x, bias):
            return library.run_linear(x, self.packed_weight(), self._format_text, bias, output_dtype,
                                      self._activation_quant)
        weight, weight_format = self.op_weight()
        return torch.ops.bitkern.linear(x, weight, weight_format, bias, output_dtype, self._activation_quant)

    def kernel_calls(self, dtype: torch.dtype) -> list[KernelCall]:
        """The kernel a call with an x of `dtype` runs (what `bitkern.prepare` makes ready ahead of it)."""
        spec = library.spec_of(self._format_text, self._compute_dtype or dtype, dtype,
                               self._parameters["bias"] is not None, activation_quant=self._activation_quant)
        return [KernelCall(spec, *self.gemm_shape, self.layout, self.qweight.device)]

    def _gemm_matrix(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.input_order is None else weight.index_select(1, self.input_order)

    def _from_gemm_matrix(self, matrix: torch.Tensor) -> torch.Tensor:
        if self.input_order is None:
            return matrix
        return matrix.index_select(1, torch.argsort(self.input_order))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A state with an `input_order` (a layer stored with permuted inputs) gives this layer one."""
        order = state_dict.get(prefix + "input_order")
        if order is not None:
            state_dict[prefix + "input_order"] = check_input_order(order, self.in_features, prefix + "input_order")
            if self.input_order is None:
                self.input_order = torch.empty(self.in_features, dtype=torch.long, device=self.qweight.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def state_tensors(self) -> tuple[str, ...]:
        return (*super().state_tensors(), "input_order")

    def check_weight_tensors(self, tensors: dict, layout, where: str = "") -> None:
        """The weight's tensors as `QuantizedModule.check_weight_tensors` checks them, and an input_order, where
        given, of shape [in_features] and an integer dtype (its values are checked when it is loaded)."""
        order = tensors.get("input_order")
        if order is not None and (tuple(order[0]) != (self.in_features,) or order[1] not in (torch.int32, torch.int64)):
            raise ValueError(f"{where}input_order has shape {list(order[0])} and dtype {order[1]}; this Linear takes "
                             f"a permutation of range({self.in_features}), int32 or int64 of shape [{self.in_features}]")
        super().check_weight_tensors(tensors, layout, where)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """An nn.Linear holding the dequantized weight (in `dtype`) and this layer's bias."""
        module = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta", dtype=dtype)
        return self._give_parameters(module, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self._weight_repr()}" + (", input_order=permuted" if self.input_order is not None else ""))


def check_input_order(order, in_features: int, argument: str = "input_order") -> torch.Tensor:
    """`order` as an int64 tensor if it is a permutation of range(in_features); ValueError naming `argument`."""
    if not isinstance(order, torch.Tensor) or order.dtype not in (torch.int32, torch.int64) or order.dim() != 1:
        raise TypeError(f"{argument} must be a 1-D int32/int64 tensor (a permutation of range({in_features})), got "
                        f"{order.dtype if isinstance(order, torch.Tensor) else type(order).__name__}")
    if order.is_meta:
        return order.long()
    if order.numel() != in_features or not torch.equal(torch.sort(order.long()).values.cpu(),
                                                        torch.arange(in_features)):
        raise ValueError(f"{argument} must be a permutation of range({in_features}); got {order.numel()} entries "
                         f"that are not")
    return order.long()

