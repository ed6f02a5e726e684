"""`bitkern.save` / `bitkern.load`: a model's state in one safetensors file that says how it was quantized.

The file holds every tensor of `model.state_dict()`; its metadata (key "bitkern", JSON) holds each
quantized module's settings (class, type, group size, zero mode, scale dtype, layout, weight shape) and
the names of tied tensors stored once.  `load` reads the settings from the file, so the model it loads
into can be the float model (even built on the meta device): its nn.Linear / nn.Conv2d become bitkern
modules as the file says.

A file is hostile until checked: `load` checks all of it against the model first (the metadata's schema,
every module's settings, the set of tensor names, every tensor's shape and dtype as the safetensors header
gives them, without reading the data), builds the new bitkern modules off the model, and only then swaps
them in and assigns the tensors.  Any problem raises ValueError naming the file, and the model is left
exactly as it was.
"""

from __future__ import annotations

import json
import os

import safetensors
import safetensors.torch
import torch
from torch import nn

from .conv import Conv2d
from .experts import FLOAT_PARAMETERS, ExpertWeights, Experts, is_float_experts
from .linear import Linear
from .storage import QuantizedModule, log

FILE_FORMAT = "bitkern.safetensors/1"
_EXTRA = "._extra_state"
_CLASSES = {"Linear": (Linear, nn.Linear), "Conv2d": (Conv2d, nn.Conv2d), "ExpertWeights": (ExpertWeights, None)}
_HEADER = {"format": str, "modules": dict, "aliases": dict}
_SETTINGS = {"class": str, "dtype": str, "group_size": int, "zero_mode": str, "scale_dtype": str, "layout": str,
             "weight_shape": list}
# safetensors' dtype names (the header's), for checking tensors before reading them
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
           "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


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
    `model`'s tensors are, or the CPU for a meta model).  strict: the file's tensors and the model's must
    be the same set (the quantized modules' weights are always required).

    Raises ValueError, naming the file, for a file that is not a safetensors file, holds malformed bitkern
    metadata or does not fit the model (OSError where it cannot be read); the model is then unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    path = os.fspath(path)
    metadata, tensors = _header(path)
    header = _parsed(metadata, tensors, path)
    replacements = _planned_experts(model, header["modules"], path)
    for name, settings in header["modules"].items():
        layer = _planned_module(model, name, settings, path, replacements)
        if layer is not None:
            replacements[name] = layer
    for name, module in model.named_modules():
        if isinstance(module, QuantizedModule) and name not in header["modules"]:
            raise ValueError(f"{path} holds no quantized weight for module {name!r} "
                             f"({type(module).__name__}, dtype={module.weight_dtype}): the file was made from "
                             f"a model quantized otherwise; load it into the float model instead")
    files = {**tensors, **{alias: tensors[kept] for alias, kept in header["aliases"].items()}}
    _check_tensors(model, header["modules"], replacements, files, strict, path)
    try:
        state = safetensors.torch.load_file(path, device=str(_target_device(model) if device is None else device))
    except safetensors.SafetensorError as error:
        raise ValueError(f"{path}: its tensors cannot be read ({error})") from None
    for alias, kept in header["aliases"].items():
        state[alias] = state[kept]
    state.update({name + _EXTRA if name else "_extra_state": settings for name, settings in header["modules"].items()})
    try:
        _swap_in(model, replacements, state, strict)
    except ValueError as error:  # a value only the data shows (e.g. an input_order that is no permutation)
        raise ValueError(f"{path}: {error}") from None
    still_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        log.warning("bitkern: after loading %s these tensors are still on the meta device (the file has none "
                    "for them; e.g. non-persistent buffers): %s", path, still_meta)
    return model


def _header(path: str) -> tuple[dict, dict]:
    """(the file's metadata, {tensor name: (shape, dtype)}) from its safetensors header alone."""
    try:
        with safetensors.safe_open(path, "pt") as file:
            metadata = file.metadata() or {}
            tensors = {}
            for key in file.keys():
                piece = file.get_slice(key)
                tensors[key] = (tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype(), piece.get_dtype()))
    except safetensors.SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
    return metadata, tensors


def _parsed(metadata: dict, tensors: dict, path: str) -> dict:
    """The bitkern metadata, checked against its schema (a file without it is a float model's)."""
    if "bitkern" not in metadata:
        return {"format": FILE_FORMAT, "modules": {}, "aliases": {}}
    try:
        header = json.loads(metadata["bitkern"])
    except ValueError as error:
        raise ValueError(f"{path}: its bitkern metadata is not valid JSON ({error})") from None
    if not isinstance(header, dict) or set(header) != set(_HEADER) or \
            not all(isinstance(header[field], kind) for field, kind in _HEADER.items()):
        raise ValueError(f"{path}: its bitkern metadata must be a JSON object with exactly "
                         f"{ {field: kind.__name__ for field, kind in _HEADER.items()} }, got {_clip(header)}")
    if header["format"] != FILE_FORMAT:
        raise ValueError(f"{path} has bitkern metadata of format {header['format']!r}; this bitkern reads "
                         f"{FILE_FORMAT!r}")
    for name, settings in header["modules"].items():
        wrong = [field for field, kind in _SETTINGS.items()
                 if not isinstance(settings, dict) or not _is(settings.get(field), kind)]
        if wrong or not all(_is(size, int) for size in settings["weight_shape"]) or \
                not _is(settings.get("compute_dtype"), (str, type(None))) or \
                not _is(settings.get("activation_quant", "none"), str):
            raise ValueError(f"{path}: the settings of module {name!r} are not {_SETTINGS} (+ compute_dtype: str or "
                             f"null, activation_quant: str); got {_clip(settings)}")
    for alias, kept in header["aliases"].items():
        if not isinstance(kept, str) or kept not in tensors or alias in tensors:
            raise ValueError(f"{path}: alias {alias!r} -> {_clip(kept)} must name a tensor of the file, and be none "
                             f"itself")
    return header


def _planned_experts(model: nn.Module, modules: dict, path: str) -> dict:
    """{name: new empty bitkern.Experts (on meta)} for each float experts module of the model whose projections the
    file holds quantized (`ExpertWeights` named `<experts module>.<projection>`)."""
    planned = {}
    for name, settings in modules.items():
        parent, _, projection = name.rpartition(".")
        if settings["class"] != "ExpertWeights" or parent in planned:
            continue
        try:
            module = model.get_submodule(parent)
        except AttributeError:
            raise ValueError(f"{path} holds quantized experts {name!r}, which the model lacks") from None
        if isinstance(module, Experts):
            continue
        if not is_float_experts(module):
            raise ValueError(f"{path} holds quantized experts {name!r}, but the model has a {type(module).__name__} "
                             f"at {parent!r}, not a transformers experts module")
        projections = {FLOAT_PARAMETERS[p]: _layer_settings(modules[f"{parent}.{p}"]) for p in ("gate_up", "up", "down")
                       if f"{parent}.{p}" in modules}
        try:
            planned[parent] = Experts.empty_like(module, lambda parameter: projections[parameter])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}: experts {parent!r} (projections {sorted(projections)}) do not fit the "
                             f"model's {type(module).__name__}: {error}") from None
    return planned


def _layer_settings(settings: dict) -> dict:
    """A module's settings in the file as the constructor's keyword arguments."""
    return dict(dtype=settings["dtype"], group_size=settings["group_size"], zero_mode=settings["zero_mode"],
                compute_dtype=settings.get("compute_dtype"),
                scale_dtype=getattr(torch, settings["scale_dtype"], settings["scale_dtype"]),
                activation_quant=settings.get("activation_quant", "none"), method=settings.get("method", "rtn"))


def _planned_module(model: nn.Module, name: str, settings: dict, path: str,
                    replacements: dict) -> QuantizedModule | None:
    """The new, empty bitkern module (on meta, off the model) that replaces the float module at `name`, or None
    where the model already has a bitkern module there, or one is planned there (its settings are checked here)."""
    try:
        module = _module_at(model, name, replacements)
    except AttributeError:
        raise ValueError(f"{path} holds a quantized {settings['class']} {name!r}, which the model lacks") from None
    quantized, float_class = _CLASSES.get(settings["class"], (None, None))
    if quantized is None:
        raise ValueError(f"{path}: module {name!r} has class {settings['class']!r}; this bitkern knows "
                         f"{list(_CLASSES)}")
    if isinstance(module, QuantizedModule):
        layer = None
    elif not name:
        raise ValueError(f"{path} holds a quantized model root; build bitkern.{settings['class']} with the "
                         f"file's settings ({settings}) and load into it")
    elif type(module) is not float_class:
        raise ValueError(f"{path} holds a quantized {settings['class']} for {name!r}, but the model has a "
                         f"{type(module).__name__} there")
    elif list(module.weight.shape) != settings["weight_shape"]:
        raise ValueError(f"{path} holds {name!r} with weight shape {settings['weight_shape']}, the model's "
                         f"has {list(module.weight.shape)}")
    else:
        try:
            layer = quantized._meta_layer(module, **_layer_settings(settings))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: module {name!r}: {error}") from None
    try:
        (layer or module)._check_settings(settings)
    except ValueError as error:
        raise ValueError(f"{path}: module {name!r}: {error}") from None
    return layer


def _check_tensors(model: nn.Module, modules: dict, replacements: dict, files: dict, strict: bool, path: str) -> None:
    """Every tensor the file holds against the model it is loaded into (with the planned bitkern modules): the
    quantized weights' shapes and dtypes as their settings imply, every other tensor's shape as the model's
    (and float where the model's is float), and under `strict` the same set of names."""
    expected = {}
    quantized = set(modules)
    for key, tensor in model.state_dict(keep_vars=True).items():
        if _owner(key) not in quantized and _owner(key) not in replacements and not key.endswith("_extra_state"):
            expected[key] = tensor
    for name, settings in modules.items():
        module = _module_at(model, name, replacements)
        prefix = f"{name}." if name else ""
        given = {name: files[prefix + name] for name in module.state_tensors() if prefix + name in files}
        try:
            module.check_weight_tensors(given, settings["layout"], prefix)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        if module.bias is not None:
            expected[prefix + "bias"] = torch.empty(module.bias_shape, device="meta")
        expected.update({prefix + buffer: None for buffer in given})
    for key, tensor in expected.items():
        if tensor is None or key not in files:
            continue
        shape, dtype = files[key]
        if shape != tuple(tensor.shape):
            raise ValueError(f"{path}: tensor {key!r} has shape {list(shape)}, the model's has {list(tensor.shape)}")
        if tensor.is_floating_point() and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{path}: tensor {key!r} has dtype {dtype}; the model's {key} is {tensor.dtype}")
    missing, unexpected = sorted(set(expected) - set(files)), sorted(set(files) - set(expected))
    if strict and (missing or unexpected):
        raise ValueError(f"{path} does not hold the model's tensors: missing {missing[:8]}, unexpected "
                         f"{unexpected[:8]} (load with strict=False to load what matches)")


def _swap_in(model: nn.Module, replacements: dict, state: dict, strict: bool) -> None:
    """Put the new modules in and assign the checked tensors; should anything still fail, every module of the
    model gets its parameters, buffers, children and attributes back as they were."""
    saved = [(module, dict(module.__dict__), dict(module._parameters), dict(module._buffers), dict(module._modules))
             for module in model.modules()]
    try:
        for name, layer in replacements.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
        model.load_state_dict(state, strict=strict, assign=True)
    except BaseException:
        for module, attributes, parameters, buffers, children in saved:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            for live, before in ((module._parameters, parameters), (module._buffers, buffers),
                                 (module._modules, children)):
                live.clear()
                live.update(before)
        raise


def _module_at(model: nn.Module, name: str, replacements: dict) -> nn.Module:
    """The module called `name` once the planned replacements are in (AttributeError where there is none)."""
    if name in replacements:
        return replacements[name]
    parent, _, child = name.rpartition(".")
    if parent in replacements:
        return replacements[parent].get_submodule(child)
    return model.get_submodule(name)


def _is(value, kind) -> bool:
    """isinstance, where a bool is no int."""
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is int)


def _clip(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _owner(key: str) -> str:
    """The module name a state key belongs to."""
    return key.rpartition(".")[0]


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
