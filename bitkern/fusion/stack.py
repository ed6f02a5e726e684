"""Stacked weights: several `bitkern.Linear` layers that read one input as one layer whose rows are theirs, so
one kernel call computes all their outputs (horizontal fusion), optionally in SwiGLU order (`swiglu_rows`);
`swiglu_ordered` puts an already stacked [gate; up] layer (vLLM's gate_up_proj) in that order, and
`unstack_swiglu` gives such a layer's output back in [gate; up] order."""

from __future__ import annotations

import torch

from ..nn import Linear
from ..ops.matmul import SWIGLU_BLOCK, swiglu_rows
from ..ttype import QuantizedWeight


def stackable(layers: list) -> str | None:
    """Why `layers` cannot be stacked into one weight, or None: bitkern Linears of one input size, weight type,
    group size, zero mode, scale dtype, compute dtype and activation quantization, without permuted inputs or
    per-tensor scales."""
    if len(layers) < 2 or not all(isinstance(layer, Linear) for layer in layers):
        return "not two or more bitkern.Linear layers"
    first = layers[0]
    for layer in layers:
        if layer.input_order is not None:
            return "a layer with permuted inputs (input_order)"
        if layer.tensor_scale is not None:
            return "a per-tensor scale (each layer has its own)"
        if layer.qweight.is_meta:
            return "a layer without weights (meta)"
        fields = ("in_features", "weight_dtype", "group_size", "zero_mode", "scale_dtype", "compute_dtype",
                  "activation_quant")
        for name in fields:
            if getattr(layer, name) != getattr(first, name):
                return f"layers with different {name}"
    return None


def stacked_layer(layers: list, swiglu: bool = False) -> Linear:
    """One Linear holding the rows of `layers` one after another (swiglu: the two layers gate and up, their rows
    interleaved as epilogue="swiglu" reads them); biases stack the same way (zeros for a layer without)."""
    reason = stackable(layers)
    if reason:
        raise ValueError(f"layers cannot be stacked: {reason}")
    weights = [layer.quantized_weight() for layer in layers]
    n = sum(layer.out_features for layer in layers)
    first = weights[0]
    weight = QuantizedWeight(first.ttype, (n, first.shape[1]), first.group_size, first.zero_mode,
                             *(_cat([getattr(w, name) for w in weights]) for name in ("qweight", "scales", "zeros")))
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([layer.bias.detach() if layer.bias is not None else
                          torch.zeros(layer.out_features, dtype=torch.float32, device=layer.qweight.device)
                          for layer in layers])
    order = swiglu_rows(layers[0].out_features) if swiglu else None
    return _with_rows(weight, bias, order, None, layers[0])


def swiglu_ordered(layer: Linear) -> Linear:
    """The Linear of `layer` (a [gate; up] stack of 2n rows, n a multiple of SWIGLU_BLOCK) with its rows (and
    bias) in `swiglu_rows` order: what epilogue="swiglu" reads.  Its plain output is `unstack_swiglu`'s input."""
    if not isinstance(layer, Linear):
        raise TypeError(f"layer must be a bitkern.Linear, got {type(layer).__name__}")
    if layer.out_features % (2 * SWIGLU_BLOCK):
        raise ValueError(f"a [gate; up] layer for SwiGLU needs a multiple of {2 * SWIGLU_BLOCK} rows, got "
                         f"{layer.out_features}")
    if layer.tensor_scale is not None:
        raise ValueError("a layer with a per-tensor scale cannot be reordered (the scale covers gate and up)")
    bias = None if layer.bias is None else layer.bias.detach()
    return _with_rows(layer.quantized_weight(), bias, swiglu_rows(layer.out_features // 2), layer.input_order, layer)


def unstack_swiglu(y: torch.Tensor) -> torch.Tensor:
    """y[..., 2n] computed with a `swiglu_ordered` weight, in [gate; up] order (views and one copy, which
    torch.compile fuses into the ops that read it)."""
    return y.unflatten(-1, (-1, 2, SWIGLU_BLOCK)).transpose(-3, -2).flatten(-3)


def _cat(tensors: list):
    return None if tensors[0] is None else torch.cat(tensors, dim=0)


def _with_rows(weight: QuantizedWeight, bias, order, input_order, like: Linear) -> Linear:
    """A Linear of `weight` and `bias` with their rows taken in `order` (None: as they are), computing as `like`."""
    def pick(tensor):
        return tensor if tensor is None or order is None else tensor.index_select(0, order.to(tensor.device))

    weight = QuantizedWeight(weight.ttype, weight.shape, weight.group_size, weight.zero_mode, pick(weight.qweight),
                             pick(weight.scales), pick(weight.zeros))
    return Linear.from_quantized(weight, pick(bias), input_order=input_order, compute_dtype=like.compute_dtype,
                                 activation_quant=like.activation_quant)
