"""What an importer makes of one quantized module of a checkpoint (a linear layer, or a mixture-of-experts block's
experts), and the checks that name the tensor at fault."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitkern.ttype import QuantizedWeight


class FormatError(ValueError):
    """A checkpoint's tensors or settings that do not form a valid checkpoint of their format."""


@dataclass
class ImportedLinear:
    """One linear layer of a checkpoint as bitkern holds it: the weight (its dequantization is the format's own,
    bit for bit), the permutation of its input columns (GPTQ act-order: the layer computes
    x[..., input_order] · dequant(weight)ᵀ + bias) and the bias."""

    weight: QuantizedWeight
    input_order: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def to_module(self, compute_dtype=None):
        """A `bitkern.Linear` holding this layer (in the kernel layout of the weight's device)."""
        from bitkern.nn import Linear

        return Linear.from_quantized(self.weight, self.bias, self.input_order, compute_dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] weight in the original column order, computed in float32 and returned in `dtype`."""
        weight = self.weight.dequantize(dtype)
        return weight if self.input_order is None else weight.index_select(1, torch.argsort(self.input_order))


@dataclass
class ImportedExperts:
    """The experts of one mixture-of-experts block of a checkpoint as bitkern holds them: per projection ("gate_up",
    "down"), one weight per expert (their dequantization is the format's own, bit for bit) and the [E, N] bias."""

    weights: dict[str, list[QuantizedWeight]]
    biases: dict[str, torch.Tensor | None]

    def projections(self, dtype: torch.dtype | None = None, compute_dtype=None) -> dict:
        """{"gate_up" / "down": bitkern's ExpertWeights} holding these experts as they are (what the model's experts
        module and the vLLM plugin's experts layer take); the biases in `dtype` (None: as stored)."""
        from bitkern.nn.experts import ExpertWeights

        projections = {}
        for name, weights in self.weights.items():
            bias = self.biases.get(name)
            if bias is not None and dtype is not None:
                bias = bias.to(dtype)
            projections[name] = ExpertWeights.from_quantized(weights, bias, compute_dtype)
        return projections

    def to_module(self, float_module, dtype: torch.dtype | None = None, compute_dtype=None):
        """A `bitkern.Experts` holding these experts with the gate of the model's float experts module
        `float_module` (its geometry must match); the biases in `dtype` (None: as stored)."""
        from bitkern.nn.experts import Experts

        return Experts.from_projections(float_module, self.projections(dtype, compute_dtype))

    def dequantize(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Projection `name`'s [E, N, K] weight, computed in float32 and returned in `dtype`."""
        return torch.stack([weight.dequantize(dtype) for weight in self.weights[name]])


def tensor(tensors: dict, name: str, dtypes: tuple, dims: int) -> torch.Tensor:
    """tensors[name], checked to exist, to have one of `dtypes` and `dims` dimensions."""
    if name not in tensors:
        raise FormatError(f"tensor {name!r} is missing from the checkpoint")
    value = tensors[name]
    if not isinstance(value, torch.Tensor):
        raise FormatError(f"{name!r} is a {type(value).__name__}, not a tensor")
    if value.dtype not in dtypes:
        raise FormatError(f"tensor {name!r} has dtype {value.dtype}; accepted: {[str(d) for d in dtypes]}")
    if value.dim() != dims:
        raise FormatError(f"tensor {name!r} has shape {tuple(value.shape)}; expected {dims} dimensions")
    return value


def expect_shape(name: str, value: torch.Tensor, shape: tuple) -> None:
    if tuple(value.shape) != tuple(shape):
        raise FormatError(f"tensor {name!r} has shape {tuple(value.shape)}; expected {tuple(shape)}")


def bias(tensors: dict, prefix: str, out_features: int) -> torch.Tensor | None:
    """The module's float bias (`prefix.bias`), if the checkpoint has one."""
    name = prefix + "bias"
    if name not in tensors:
        return None
    value = tensor(tensors, name, (torch.float16, torch.bfloat16, torch.float32), 1)
    expect_shape(name, value, (out_features,))
    return value


def setting(config: dict, key: str, accepted, default=None):
    """config[key] (or `default`), checked to be one of `accepted`; FormatError naming the setting otherwise."""
    value = config.get(key, default)
    if value not in accepted:
        raise FormatError(f"quantization_config {key}={value!r} is not supported; accepted: {list(accepted)}")
    return value


def group_size_setting(group_size) -> int:
    """A quantization_config's group size: a positive int, or -1 for one group per row."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise FormatError(f"quantization_config group_size={group_size!r} must be a positive int or -1")
    return group_size
