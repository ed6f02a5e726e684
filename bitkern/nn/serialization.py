"""`bitkern.save` / `bitkern.load`: a model's state in one safetensors file that says how it was quantized.

The file holds every tensor of `model.state_dict()`; its metadata (key "bitkern", JSON) holds each
quantized module's settings (class, type, group size, zero mode, scale dtype, layout, weight shape) and
the names of tied tensors stored once.  `load` reads the settings from the file, so the model it loads
into can be the float model (even built on the meta device): its nn.Linear / nn.Conv2d become bitkern
modules as the file says.
"""

from __future__ import annotations

import json
import os

import safetensors
import safetensors.torch
import torch
from torch import nn

from .conv import Conv2d
from .linear import Linear
from .storage import QuantizedModule, log

FILE_FORMAT = "bitkern.safetensors/1"
_EXTRA = "._extra_state"
_CLASSES = {"Linear": (Linear, nn.Linear), "Conv2d": (Conv2d, nn.Conv2d)}


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Write `model.state_dict()` to `path` (safetensors) with the quantization settings in its metadata."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    tensors, settings = {}, {}
    for key, value in model.state_dict().items():
        if key.endswith("_extra_state"):
            if not isinstance(model.get_submodule(_module_name(key)), QuantizedModule):
                raise ValueError(f"{key}: only bitkern modules' extra state can be saved, "
                                 f"{type(model.get_submodule(_module_name(key))).__name__} has one")
            settings[_module_name(key)] = value
        else:
            tensors[key] = value
    tensors, aliases = _store_shared_once(tensors)
    metadata = {"format": "pt", "bitkern": json.dumps({"format": FILE_FORMAT, "modules": settings,
                                                       "aliases": aliases})}
    safetensors.torch.save_file(tensors, os.fspath(path), metadata=metadata)


def load(model: nn.Module, path: str | os.PathLike, device=None, strict: bool = True) -> nn.Module:
    """Load a file written by `save` into `model` and return it.

    Float nn.Linear / nn.Conv2d modules that the file holds quantized are replaced by bitkern modules with
    the file's settings; bitkern modules must have the file's settings.  Tensors are assigned (not
    copied), so `model` may be built on the meta device.  device: where the tensors go (default: where
    `model`'s tensors are, or the CPU for a meta model).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    path = os.fspath(path)
    with safetensors.safe_open(path, "pt") as file:
        metadata = file.metadata() or {}
    header = json.loads(metadata.get("bitkern", "null")) or {"format": FILE_FORMAT, "modules": {}, "aliases": {}}
    if header.get("format") != FILE_FORMAT:
        raise ValueError(f"{path} has bitkern metadata of format {header.get('format')!r}; this bitkern reads "
                         f"{FILE_FORMAT!r}")
    modules = header["modules"]
    for name, settings in modules.items():
        _prepare_module(model, name, settings, path)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedModule) and name not in modules:
            raise ValueError(f"{path} holds no quantized weight for module {name!r} "
                             f"({type(module).__name__}, dtype={module.weight_dtype}): the file was made from "
                             f"a model quantized otherwise; load it into the float model instead")
    state = safetensors.torch.load_file(path, device=str(_target_device(model) if device is None else device))
    for alias, kept in header["aliases"].items():
        state[alias] = state[kept]
    state.update({name + _EXTRA if name else "_extra_state": settings for name, settings in modules.items()})
    model.load_state_dict(state, strict=strict, assign=True)
    still_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        log.warning("bitkern: after loading %s these tensors are still on the meta device (the file has none "
                    "for them; e.g. non-persistent buffers): %s", path, still_meta)
    return model


def _prepare_module(model: nn.Module, name: str, settings: dict, path: str) -> None:
    """Make the module at `name` a bitkern module of the file's class (empty, on meta) if it is a float one."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{path} holds a quantized {settings.get('class')} {name!r}, which the model lacks") from None
    quantized, float_class = _CLASSES.get(settings.get("class"), (None, None))
    if not name and not isinstance(module, QuantizedModule):
        raise ValueError(f"{path} holds a quantized model root; build bitkern.{settings.get('class')} with the "
                         f"file's settings ({settings}) and load into it")
    if quantized is None:
        raise ValueError(f"{path}: module {name!r} has class {settings.get('class')!r}; this bitkern knows "
                         f"{list(_CLASSES)}")
    if isinstance(module, QuantizedModule):
        return  # its settings are checked by load_state_dict, before any tensor is copied
    if type(module) is not float_class:
        raise ValueError(f"{path} holds a quantized {settings['class']} for {name!r}, but the model has a "
                         f"{type(module).__name__} there")
    if list(module.weight.shape) != settings["weight_shape"]:
        raise ValueError(f"{path} holds {name!r} with weight shape {settings['weight_shape']}, the model's "
                         f"has {list(module.weight.shape)}")
    module = module.to("meta") if not module.weight.is_meta else module
    layer = quantized.from_float(module, dtype=settings["dtype"], group_size=settings["group_size"],
                                 zero_mode=settings["zero_mode"], compute_dtype=settings.get("compute_dtype"),
                                 scale_dtype=getattr(torch, settings["scale_dtype"]))
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)


def _target_device(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def _module_name(key: str) -> str:
    return key[: -len(_EXTRA)] if key.endswith(_EXTRA) else ""


def _store_shared_once(tensors: dict) -> tuple[dict, dict]:
    """Tensors that are the same view of the same storage (tied weights) stored once, the others given their
    own contiguous copy (safetensors holds no shared storage); returns (tensors, {alias: kept name})."""
    kept, aliases, out, storages = {}, {}, {}, {}
    for name, tensor in tensors.items():
        view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tuple(tensor.stride()), tensor.dtype, tensor.device)
        if view in kept:
            aliases[name] = kept[view]
            continue
        kept[view] = name
        storage = view[0], tensor.device
        shared = storage in storages and tensor.numel() > 0
        storages[storage] = name
        out[name] = tensor.clone() if shared or not tensor.is_contiguous() else tensor
    return out, aliases
