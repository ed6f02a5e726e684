"""Whole-model conversion: `quantize_model` swaps nn.Linear / nn.Conv2d for bitkern's modules in place,
`dequantize_model` swaps them back to float modules."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .conv import Conv2d
from .linear import Linear
from .. import ttype
from ..ttype.quantize import check_group_size
from .storage import QuantizedModule, check_weight_dtype, default_group_size

log = logging.getLogger("bitkern")

_QUANTIZED = {nn.Linear: Linear, nn.Conv2d: Conv2d}


def quantize_model(model: nn.Module, dtype="nf4", group_size=None, zero_mode: str | None = None, compute_dtype=None,
                   scale_dtype=torch.float16, skip: Iterable[str] | Callable | None = None) -> nn.Module:
    """Replace every nn.Linear and nn.Conv2d of `model` by a bitkern.Linear / bitkern.Conv2d in `dtype`.

    skip: module names to leave in float (a name covers its submodules), or a predicate
    `skip(name, module) -> bool`.  Only modules of exactly these classes are replaced: subclasses (such as
    nn.MultiheadAttention's out_proj, whose weight its owner reads directly) stay float, and this is logged.
    Layers whose input size `group_size` does not divide are reported together, before anything is replaced.  Weights on the meta device give empty layers to load
    a checkpoint into.  Returns `model` (or the new module when `model` itself is a Linear/Conv2d).
    """
    weight_type = ttype.get(check_weight_dtype(dtype))
    skipped = _skip_predicate(model, skip)
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, tuple(_QUANTIZED)) or skipped(name, module):
            continue
        if type(module) in _QUANTIZED:
            targets.append((name, module))
        else:
            log.info("bitkern: %s stays float: %s is a subclass of nn.Linear/nn.Conv2d, whose weight its owner "
                     "may read directly (as nn.MultiheadAttention does)", name or "(model)", type(module).__name__)
    options = {"dtype": dtype, "group_size": group_size, "zero_mode": zero_mode, "compute_dtype": compute_dtype,
               "scale_dtype": scale_dtype}
    _check_group_size(targets, weight_type, group_size)
    replaced = [(name, _QUANTIZED[type(module)].from_float(module, **options)) for name, module in targets]
    for name, layer in replaced:
        if name:
            _replace(model, name, layer)
    before = sum(m.weight.numel() * m.weight.element_size() for _, m in targets)
    after = sum(layer.nbytes for _, layer in replaced)
    log.info("bitkern: quantized %d layers to %s (weights %.1f MiB -> %.1f MiB)", len(replaced), dtype,
             before / 2**20, after / 2**20)
    return replaced[0][1] if replaced and replaced[0][0] == "" else model


def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Replace every bitkern module of `model` by its float nn.Linear / nn.Conv2d (weights in `dtype`)."""
    if isinstance(model, QuantizedModule):
        return model.dequantize(dtype)
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedModule):
            _replace(model, name, module.dequantize(dtype))
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


def _check_group_size(targets, weight_type, group_size) -> None:
    """Raise once, listing every layer whose input size the group size does not divide."""
    misfits = []
    for name, module in targets:
        try:
            check_group_size(weight_type, default_group_size(weight_type, group_size), _in_features(module))
        except ValueError:
            if weight_type.block_size > 1 and group_size not in (None, weight_type.block_size):
                raise
            misfits.append(f"{name or '(model)'} (in_features {_in_features(module)})")
    if misfits:
        raise ValueError(f"group_size={default_group_size(weight_type, group_size)} does not divide the input size "
                         f"of these layers: {', '.join(misfits)}; pick a group size that divides them, or -1 (per channel), or pass "
                         f"them in skip=[...]")


def _in_features(module: nn.Module) -> int:
    return module.weight[0].numel()


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)
