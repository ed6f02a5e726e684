"""`bitkern.compile(model)`: torch.compile of a quantized model's forward, in place, for inference, with the settings
measured fastest for bitkern models.

- One graph (`fullgraph=True`) and no guards on the model's own modules (torch's
  `skip_guard_on_all_nn_modules_unsafe`). Before every call, dynamo would check each module's hooks, attributes and
  parameters again: ~2,600 checks for an 8-layer Llama, ~1 ms of a 12 ms decode step on a 2-core Zen 4. The inputs
  and the KV cache are still checked, so new shapes compile new graphs. The compiled code assumes the modules stay as
  they were: quantize, fuse and move the model first, and call `bitkern.compile` again after changing it.
  Dynamo keeps graphs per code object, and equal settings make equal backends, so the forward is compiled from a copy
  of its function with a code object of its own: a graph made without module guards serves this call's model alone,
  never another model of the same class or an earlier compile.
- On CPU, Inductor's C++ wrapper (`cpp_wrapper`), so the graph runs its kernels from C++ rather than Python.
- bitkern's Inductor pass (`bitkern.fusion.install`), which folds residual adds and activations into the kernels
  where its cost model says that wins.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch import nn

from .inductor import install

log = logging.getLogger("bitkern")


def compile_model(model: nn.Module, **compile_options) -> nn.Module:
    """Replace `model.forward` by torch.compile of it (of the eager forward, if an earlier call compiled it) and
    return the model. `compile_options` are torch.compile's; keys in its `options` override the ones set here.
    With fullgraph=False the modules stay guarded: graphs after a graph break belong to functions other models
    share."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    options = compile_options.pop("options", None)
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict of torch.compile's backend options, got {type(options).__name__}")
    eager = getattr(model.forward, "_torchdynamo_orig_callable", model.forward)
    function = getattr(eager, "__func__", None)
    if getattr(eager, "__self__", None) is not model or not isinstance(function, types.FunctionType):
        raise TypeError(f"model.forward must be a Python method of the model (its class's forward, or a forward "
                        f"bitkern.compile made), got {eager!r}")
    settings = {}
    if compile_options.setdefault("fullgraph", True):
        settings["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    if _device_type(model) == "cpu":
        settings["cpp_wrapper"] = True
    settings.update(options or {})
    install()
    model.forward = torch.compile(types.MethodType(_own_copy(function), model), options=settings, **compile_options)
    log.info("bitkern.compile: %s's forward compiled with %s, %s", type(model).__name__, compile_options,
             {key: getattr(value, "__name__", value) for key, value in settings.items()})
    return model


def _own_copy(function: types.FunctionType) -> types.FunctionType:
    """`function` (same globals, defaults, closure and attributes) with a code object of its own."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return functools.update_wrapper(copy, function)


def _device_type(model: nn.Module) -> str:
    """The device type of the model's first parameter or buffer ("cpu" for a model without tensors)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device.type
    return "cpu"
