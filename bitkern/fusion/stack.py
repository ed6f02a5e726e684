"""Stacked weights: several `bitkern.Linear` layers that read one input as one layer whose rows are theirs, so
one kernel call computes all their outputs (horizontal fusion), optionally in SwiGLU order (`swiglu_rows`)."""

from __future__ import annotations

import torch

from ..nn import Linear
from ..ops.matmul import swiglu_rows
from ..ttype import QuantizedWeight


def stackable(layers: list) -> str | None:
    """Why `layers` cannot be stacked into one weight, or None: bitkern Linears of one input size, weight type,
    group size, zero mode, scale dtype and compute dtype, without permuted inputs or per-tensor scales."""
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
        fields = ("in_features", "weight_dtype", "group_size", "zero_mode", "scale_dtype", "compute_dtype")
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
    order = swiglu_rows(layers[0].out_features) if swiglu else None

    def stack(tensors):
        if tensors[0] is None:
            return None
        stacked = torch.cat(tensors, dim=0)
        return stacked if order is None else stacked.index_select(0, order.to(stacked.device))

    n = sum(layer.out_features for layer in layers)
    first = weights[0]
    weight = QuantizedWeight(first.ttype, (n, first.shape[1]), first.group_size, first.zero_mode,
                             stack([w.qweight for w in weights]), stack([w.scales for w in weights]),
                             stack([w.zeros for w in weights]))
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = stack([layer.bias.detach() if layer.bias is not None else
                      torch.zeros(layer.out_features, dtype=torch.float32, device=layer.qweight.device)
                      for layer in layers])
    return Linear.from_quantized(weight, bias, compute_dtype=layers[0].compute_dtype)
