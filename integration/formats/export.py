"""bitkern layers out as a GPTQ checkpoint that GPTQ tools (gptqmodel, transformers) load, so a user is never
locked in: `save_gptq(model, path)` writes config.json (with a GPTQ quantization_config),
quantize_config.json and model.safetensors."""

from __future__ import annotations

import json
import os

import safetensors.torch
import torch

from bitkern.nn import Linear

from . import gptq
from .imported import FormatError, ImportedLinear


def export_gptq(layer: Linear, checkpoint_format: str = "gptq") -> dict:
    """The GPTQ tensors (qweight, qzeros, scales, g_idx, bias) of one `bitkern.Linear`."""
    if not isinstance(layer, Linear):
        raise TypeError(f"layer must be a bitkern.Linear, got {type(layer).__name__}")
    bias = None if layer.bias is None else layer.bias.detach()
    return gptq.export(ImportedLinear(layer.quantized_weight().to("cpu"), layer.input_order, bias), checkpoint_format)


def save_gptq(model: torch.nn.Module, path, checkpoint_format: str | None = None) -> None:
    """Write a transformers model whose quantized layers are bitkern.Linear as a GPTQ checkpoint directory.

    Every bitkern.Linear must share one bit width and group size (GPTQ's config holds one of each) and have an
    exact GPTQ form (see `gptq.export`); float tensors are written as they are.  checkpoint_format: "gptq"
    (v1, zeros stored minus one, what most loaders read) or "gptq_v2"; None picks v1 for symmetric models and
    v2 for asymmetric ones (gptqmodel refuses asymmetric v1 checkpoints that it did not write itself, since a
    zero of 0 stored minus one reads differently in different tools).  Nothing is written if a layer fails.
    """
    layers = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
    if not layers:
        raise FormatError("the model has no bitkern.Linear layers to export")
    shapes = {(module.quantized_weight().ttype.bits, module.group_size, module.in_features) for module in layers.values()}
    bits = {s[0] for s in shapes}
    group_sizes = {s[1] if s[1] != s[2] else -1 for s in shapes}
    if len(bits) != 1 or len(group_sizes) != 1:
        raise FormatError(f"GPTQ checkpoints hold one bit width and one group size; the model's layers have bits "
                          f"{sorted(bits)} and group sizes {sorted(group_sizes)}")
    symmetric = all(_symmetric(module) for module in layers.values())
    checkpoint_format = checkpoint_format or ("gptq" if symmetric else "gptq_v2")
    tensors = {}
    for name, module in layers.items():
        for key, value in export_gptq(module, checkpoint_format).items():
            tensors[f"{name}.{key}"] = value.contiguous()
    for key, value in model.state_dict().items():
        if key.rpartition(".")[0] not in layers:
            tensors[key] = value.contiguous()
    quantization_config = {"quant_method": "gptq", "bits": bits.pop(), "group_size": group_sizes.pop(),
                           "sym": symmetric, "desc_act": any(m.input_order is not None for m in layers.values()),
                           "checkpoint_format": checkpoint_format, "pack_dtype": "int32"}
    config = model.config.to_dict() if hasattr(model, "config") else {}
    config["quantization_config"] = quantization_config
    os.makedirs(path, exist_ok=True)
    safetensors.torch.save_file(_unshared(tensors), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    for name, content in (("config.json", config), ("quantize_config.json", quantization_config)):
        with open(os.path.join(path, name), "w") as file:
            json.dump(content, file, indent=2, default=str)


def _symmetric(layer: Linear) -> bool:
    """Whether every zero point is the middle code (GPTQ's sym=True)."""
    weight = layer.quantized_weight()
    if weight.zeros is None:
        return True
    return bool((weight.zeros == 1 << (weight.ttype.bits - 1)).all())


def _unshared(tensors: dict) -> dict:
    """Tensors sharing storage (tied embeddings) given their own copies, as safetensors requires."""
    seen, out = set(), {}
    for key, value in tensors.items():
        pointer = value.untyped_storage().data_ptr()
        out[key] = value.clone() if pointer in seen else value
        seen.add(pointer)
    return out
