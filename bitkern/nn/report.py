"""What a quantized model holds in float: the share of its parameters that bitkern stores quantized, and every
weight left float by name and size, logged once a model is quantized (`quantize_model`, transformers' load)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from .storage import QuantizedModule

log = logging.getLogger("bitkern")


@dataclass(frozen=True)
class FloatReport:
    """quantized: weights stored quantized (elements); floating: float parameters (elements); matrices: (name,
    shape, bytes) of every float parameter of two or more dimensions; vectors: (count, bytes) of the others (norms,
    biases)."""

    quantized: int
    floating: int
    matrices: tuple
    vectors: tuple

    @property
    def share(self) -> float:
        """The fraction of the model's parameters stored quantized."""
        total = self.quantized + self.floating
        return self.quantized / total if total else 0.0

    def __str__(self) -> str:
        listed = ", ".join(f"{name} {list(shape)} ({_size(nbytes)})" for name, shape, nbytes in self.matrices)
        count, nbytes = self.vectors
        return (f"{self.share:.1%} of the parameters quantized; left float: {listed or 'no matrices'}"
                f"{f' and {count} vectors (norms, biases; {_size(nbytes)})' if count else ''}")


def float_report(model: nn.Module) -> FloatReport:
    """The share of `model`'s parameters stored quantized and its float parameters (tied ones counted once)."""
    quantized = sum(int(torch.Size(module.weight_shape).numel()) for module in model.modules()
                    if isinstance(module, QuantizedModule))
    floating, matrices, vectors = 0, [], [0, 0]
    for name, parameter in model.named_parameters():  # a tied parameter once
        if not parameter.is_floating_point():
            continue
        floating += parameter.numel()
        nbytes = parameter.numel() * parameter.element_size()
        if parameter.dim() >= 2:
            matrices.append((name, tuple(parameter.shape), nbytes))
        else:
            vectors[0] += 1
            vectors[1] += nbytes
    return FloatReport(quantized, floating, tuple(matrices), tuple(vectors))


def log_float_report(model: nn.Module) -> FloatReport:
    """Log `float_report(model)` (bitkern's logger, INFO) and return it."""
    report = float_report(model)
    log.info("bitkern: %s", report)
    return report


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
