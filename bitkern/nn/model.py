"""Whole-model conversion: `quantize_model` swaps nn.Linear / nn.Conv2d for bitkern's modules in place,
`dequantize_model` swaps them back to float modules."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .conv import Conv2d
from .experts import Experts, experts_in_features, experts_targets
from .linear import Linear
from .. import ttype
from ..ttype.quantize import CALIBRATED_METHODS, CAST_TYPES, check_group_size, check_method
from .calibration import quantize_calibrated
from .report import log_float_report
from .storage import QuantizedModule, check_weight_dtype, default_group_size

log = logging.getLogger("bitkern")

_QUANTIZED = {nn.Linear: Linear, nn.Conv2d: Conv2d}


def quantize_model(model: nn.Module, dtype="nf4", group_size=None, zero_mode: str | None = None, compute_dtype=None,
                   scale_dtype=torch.float16, skip: Iterable[str] | Callable | None = None,
                   output_layer: str | None = "auto", activation_quant: str = "none", method: str = "rtn",
                   calibration: Iterable | None = None, act_order: bool = False,
                   static_groups: bool = False, damp: float | None = None) -> nn.Module:
    """Replace every nn.Linear and nn.Conv2d of `model` by a bitkern.Linear / bitkern.Conv2d in `dtype`, and every
    mixture-of-experts experts module of transformers (3-D expert weights, see `bitkern.nn.experts`) by a
    `bitkern.Experts` whose projections are quantized one expert at a time with the same settings.

    skip: module names to leave in float (a name covers its submodules), or a predicate
    `skip(name, module) -> bool`.  Only modules of exactly these classes are replaced: subclasses (such as
    nn.MultiheadAttention's out_proj, whose weight its owner reads directly) stay float, and this is logged.
    Layers whose input size `group_size` does not divide are reported together, before anything is replaced.
    Weights on the meta device give empty layers to load a checkpoint into.  Returns `model` (or the new module
    when `model` itself is a Linear/Conv2d/experts module).  The share of the parameters quantized and every weight
    left float (name and size) are logged.

    output_layer: what becomes of the model's output layer (transformers' `get_output_embeddings()`, an
    nn.Linear; a name in `skip` leaves it as it is): "auto" (default) stores a bfloat16 weight as it is in
    bitkern's "bfloat16" type (the same values, streamed by bitkern's kernels: the same logits up to float
    summation order) unless it is the input embedding's (tied), and leaves any other weight float; a weight type
    name stores it in that type, opt-in ("bfloat16" casts it, "int8" or the layers' type quantize it as
    llama.cpp's Q6_K output layer does, with `group_size` and the type's default zero mode); None quantizes it
    like any other layer.

    activation_quant: "int8" makes the Linear layers quantize their input per row and 32 inputs to int8 in the
    kernel (`bitkern.Linear`'s option, as llama.cpp's Q8_0 activations); an output layer kept in bfloat16 and the
    convolutions multiply x as it is.

    method: how every quantized layer's scales and zeros are chosen (`bitkern.quantize`'s: "rtn", "hqq"; or
    "gptq", calibrated: each nn.Linear by GPTQ against its inputs when the model runs `calibration`, an iterable
    of model inputs, each a tensor, a tuple of positional arguments or a dict of keyword arguments; act_order,
    static_groups and damp (the fraction of the Hessian's mean diagonal added to it, 0.01 when None; larger
    values trust a small calibration set less) are GPTQ's options, see `bitkern.ttype.gptq`); checked against
    `dtype` before any layer is quantized.  An output layer kept in bfloat16 is cast ("rtn").
    """
    weight_type = ttype.get(check_weight_dtype(dtype))
    check_method(weight_type, method, calibrated=calibration is not None)
    _check_calibration_options(method, calibration, act_order, static_groups, damp)
    skipped = _skip_predicate(model, skip)
    options = {"dtype": dtype, "group_size": group_size, "zero_mode": zero_mode, "compute_dtype": compute_dtype,
               "scale_dtype": scale_dtype, "activation_quant": activation_quant, "method": method}
    plain = {**options, "activation_quant": "none"}  # what convolutions take
    head, head_options = _output_layer(model, output_layer, options)
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, tuple(_QUANTIZED)) or skipped(name, module):
            continue
        if module is head:
            if head_options is not None:
                targets.append((name, module, head_options))
        elif type(module) in _QUANTIZED:
            targets.append((name, module, options if type(module) is nn.Linear else plain))
        else:
            log.info("bitkern: %s stays float: %s is a subclass of nn.Linear/nn.Conv2d, whose weight its owner "
                     "may read directly (as nn.MultiheadAttention does)", name or "(model)", type(module).__name__)
    experts = _experts_targets(model, skipped, method)
    _check_group_size([(name, _in_features(module)) for name, module, settings in targets
                       if settings in (options, plain)]
                      + [entry for name, module in experts for entry in experts_in_features(name, module)],
                      weight_type, group_size)
    if method in CALIBRATED_METHODS:
        _check_calibrated_targets(targets)
        replaced = quantize_calibrated(model, targets, calibration, lambda name, layer: name and _replace(
            model, name, layer), act_order, static_groups, damp)
    else:
        replaced = [(name, _QUANTIZED[type(module)].from_float(module, **settings))
                    for name, module, settings in targets]
    before = sum(m.weight.numel() * m.weight.element_size() for _, m, _ in targets) + sum(
        p.numel() * p.element_size() for _, m in experts for p in m.parameters() if p.dim() == 3)
    replaced += [(name, Experts.from_float(module, options)) for name, module in experts]
    for name, layer in replaced:
        if name:
            _replace(model, name, layer)
    after = sum(layer.nbytes for _, layer in replaced)
    log.info("bitkern: quantized %d layers and %d experts modules to %s (weights %.1f MiB -> %.1f MiB)",
             len(replaced) - len(experts), len(experts), dtype, before / 2**20, after / 2**20)
    result = replaced[0][1] if replaced and replaced[0][0] == "" else model
    log_float_report(result)
    return result


def _output_layer(model: nn.Module, output_layer, options: dict) -> tuple[nn.Module | None, dict | None]:
    """The model's output layer when `output_layer` treats it apart, and the settings it is stored with (None:
    left as it is)."""
    if output_layer is None:
        return None, None
    if output_layer != "auto":
        check_weight_dtype(output_layer)
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if type(head) is not nn.Linear:
        return None, None
    settings = {**options, "dtype": output_layer, "zero_mode": None}
    if output_layer == "auto":
        embedding = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
        tied = embedding is not None and getattr(embedding, "weight", None) is head.weight
        if head.weight.dtype != torch.bfloat16 or tied:
            return head, None
        settings["dtype"] = "bfloat16"
    if settings["dtype"] in CAST_TYPES:
        settings["group_size"] = -1  # scale 1 whatever the group: one per row is the least to store
        settings["activation_quant"] = "none"  # a float weight multiplies x as it is
        settings["method"] = "rtn"  # a cast has no scale or zero to optimize
    return head, settings


def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Replace every bitkern module of `model` by its float nn.Linear / nn.Conv2d / experts module (weights in
    `dtype`)."""
    if isinstance(model, (QuantizedModule, Experts)):
        return model.dequantize(dtype)
    done = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (QuantizedModule, Experts)) and not any(name.startswith(d + ".") for d in done):
            _replace(model, name, module.dequantize(dtype))
            done.append(name)
    return model


def _skip_predicate(model: nn.Module, skip) -> Callable:
    if skip is None:
        return lambda name, module: False
    if callable(skip):
        return skip
    if isinstance(skip, str) or not isinstance(skip, Iterable):
        raise TypeError(f"skip must be a list of module names or a callable (name, module) -> bool, got {skip!r}")
    names = list(skip)
    known = {name for name, _ in model.named_modules()}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"skip names {unknown} match no module of the model; module names look like "
                         f"{sorted(known - {''})[:5]}")
    return lambda name, module: any(name == s or name.startswith(s + ".") for s in names)


def _experts_targets(model: nn.Module, skipped: Callable, method: str) -> list:
    """The experts modules to quantize; none with a calibrated method (logged), which quantizes nn.Linear only."""
    experts = experts_targets(model, skipped)
    if experts and method in CALIBRATED_METHODS:
        log.warning("bitkern: method=%r calibrates nn.Linear layers only; these experts modules stay float: %s",
                    method, ", ".join(name or "(model)" for name, _ in experts))
        return []
    return experts


def _check_group_size(targets, weight_type, group_size) -> None:
    """Raise once, listing every layer (name, in_features) whose input size the group size does not divide."""
    misfits = []
    for name, in_features in targets:
        try:
            check_group_size(weight_type, default_group_size(weight_type, group_size), in_features)
        except ValueError:
            if weight_type.block_size > 1 and group_size not in (None, weight_type.block_size):
                raise
            misfits.append(f"{name or '(model)'} (in_features {in_features})")
    if misfits:
        raise ValueError(f"group_size={default_group_size(weight_type, group_size)} does not divide the input size "
                         f"of these layers: {', '.join(misfits)}; pick a group size that divides them, or -1 (per channel), or pass "
                         f"them in skip=[...]")


def _check_calibration_options(method: str, calibration, act_order, static_groups, damp=None) -> None:
    """calibration, act_order, static_groups and damp belong to the calibrated methods only."""
    if method in CALIBRATED_METHODS:
        for argument, value in (("act_order", act_order), ("static_groups", static_groups)):
            if not isinstance(value, bool):
                raise TypeError(f"{argument} must be a bool, got {value!r}")
        if damp is not None and (isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 <= damp < 1):
            raise ValueError(f"damp={damp!r} must be a number in [0, 1): the fraction of the Hessian's mean "
                             f"diagonal added to it (None: 0.01)")
        return
    for argument, value, unset in (("calibration", calibration, None), ("act_order", act_order, False),
                                   ("static_groups", static_groups, False), ("damp", damp, None)):
        if value is not unset:
            raise ValueError(f"{argument}= is taken by method={CALIBRATED_METHODS[0]!r} only; method={method!r} "
                             f"quantizes without data")


def _check_calibrated_targets(targets) -> None:
    """Raise once, listing the convolutions, which the calibrated methods do not quantize."""
    convolutions = [name or "(model)" for name, module, _ in targets if type(module) is not nn.Linear]
    if convolutions:
        raise ValueError(f"method={CALIBRATED_METHODS[0]!r} quantizes nn.Linear layers only; these are nn.Conv2d: "
                         f"{', '.join(convolutions)}; pass them in skip=[...]")


def _in_features(module: nn.Module) -> int:
    return module.weight[0].numel()


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)
