"""Calibrated quantization of a whole model (`quantize_model(..., method="gptq", calibration=...)`): GPTQ layer
by layer, each layer's input Hessian collected by a forward hook while the model runs the calibration inputs.

Layers are taken in the order the model first calls them, and each sees its inputs as the layers before it
produce them once quantized (GPTQ's sequential scheme: later layers correct for earlier layers' error).  One
layer's Hessian exists at a time; per layer the model runs every calibration input, stopping at that layer (a
layer called more than once per forward, e.g. a shared one, lets the forward run to its end); layers that read
the same input tensor (q/k/v projections, gate/up) share one Hessian and one set of passes.  A quantized layer
stands in the model as an nn.Linear with its dequantized weight until every layer is done (no kernel is built
while calibrating); then the bitkern layers take their places.  Entry point: `quantize_calibrated`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..ttype.gptq import Hessian, gptq
from .linear import Linear

log = logging.getLogger("bitkern")


class _Stop(Exception):
    """Raised by a hook to end a forward once the layer being calibrated has seen its inputs."""


def quantize_calibrated(model: nn.Module, targets: list, calibration: Iterable, replace: Callable,
                        act_order: bool = False, static_groups: bool = False,
                        damp: float | None = None) -> list[tuple[str, Linear]]:
    """Quantize the nn.Linear `targets` [(name, module, settings)] of `model` (settings: `Linear.from_float`'s;
    those with method "gptq" by GPTQ against `calibration`, the others as `from_float` does) and put each in
    its place with `replace(name, module)`.  calibration: the model's inputs, each called as model(**item) for
    a mapping, model(*item) for a tuple, model(item) otherwise.  act_order, static_groups, damp (None: `gptq`'s
    default): GPTQ's options.  Returns [(name, bitkern layer)]."""
    inputs = list(calibration) if isinstance(calibration, Iterable) and not isinstance(
        calibration, (torch.Tensor, str, Mapping)) else None
    if not inputs:
        raise ValueError(f"calibration must be a non-empty iterable of model inputs (a tensor, a tuple of "
                         f"positional arguments or a dict of keyword arguments each), got {calibration!r:.80}")
    calls = _calls(model, [module for _, module, _ in targets], inputs[0])
    ordered = sorted(targets, key=lambda target: calls[target[1]].rank if target[1] in calls else len(calls))
    layers, hessians = [], {}
    for name, module, settings in ordered:
        if settings["method"] == "gptq" and module not in calls:
            log.warning("bitkern: %s is not called by the calibration inputs; quantized without data "
                        "(method='hqq')", name or "(model)")
            settings = {**settings, "method": "hqq"}
        if settings["method"] != "gptq":
            layer = Linear.from_float(module, **settings)
        else:
            key = calls[module].shared_input
            if key is None or key not in hessians:
                hessians = {}  # one Hessian at a time: kept for the next layers that read the same input
                hessians[key] = _hessian(model, module, inputs, calls[module].count)
            hessian = hessians[key]
            options = {key: settings[key] for key in ("dtype", "group_size", "zero_mode", "scale_dtype")}
            damping = {} if damp is None else {"damp": float(damp)}
            weight, order = gptq(module.weight, hessian.matrix, **options, act_order=act_order,
                                 static_groups=static_groups, **damping)
            layer = Linear.from_quantized(weight, module.bias, order, settings["compute_dtype"],
                                          settings["activation_quant"], method="gptq")
            replace(name, layer.dequantize(module.weight.dtype))  # stands in until the end: no kernel builds
        layers.append((name, layer))
    for name, layer in layers:
        replace(name, layer)
    return layers


@dataclass
class _Calls:
    """How one forward calls a module: the rank of its first call among the modules', how many times, and the
    id of the input it shares with other modules (q/k/v projections read one tensor: one Hessian serves them), or
    None where it is called more than once."""

    rank: int
    count: int
    shared_input: int | None


def _calls(model: nn.Module, modules: list, item) -> dict:
    """{module: _Calls} for the modules one forward of `item` calls."""
    calls, inputs = {}, []

    def count(module, args):
        if module in calls:
            calls[module].count += 1
            calls[module].shared_input = None
        else:
            inputs.append(args[0])  # held until the forward ends, so that no other tensor takes its id
            calls[module] = _Calls(len(calls), 1, id(args[0]))

    handles = [module.register_forward_pre_hook(count) for module in modules]
    try:
        _forward(model, item)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _hessian(model: nn.Module, module: nn.Module, inputs: list, calls: int) -> Hessian:
    """Σ x·xᵀ of `module`'s input over every calibration input, the forward stopped after its `calls` calls."""
    hessian = Hessian(module.in_features, module.weight.device)
    seen = 0

    def accumulate(_, args):
        nonlocal seen
        hessian.add(args[0])
        seen += 1
        if seen == calls:
            raise _Stop

    handle = module.register_forward_pre_hook(accumulate)
    try:
        for item in inputs:
            seen = 0
            try:
                _forward(model, item)
            except _Stop:
                pass
    finally:
        handle.remove()
    return hessian


def _forward(model: nn.Module, item) -> None:
    with torch.no_grad():
        if isinstance(item, Mapping):
            model(**item)
        elif isinstance(item, tuple):
            model(*item)
        else:
            model(item)
