"""The kernels a transformers model directory's bitkern layers call, found without reading its weights, for
`python -m bitkern prebuild --model PATH`: the model is built from its config.json on the meta device and its
nn.Linear layers are replaced as `from_pretrained` with a `BitkernConfig` replaces them, after the checkpoint's own
quantization_config (a checkpoint `save_pretrained` wrote) or, for a float checkpoint, the settings it will be
served with.  A GPTQ, AWQ or bitsandbytes checkpoint is loaded (`bitkern.load_pretrained`): its layers' settings
come from its tensors.
"""

from __future__ import annotations

import os

import torch
import transformers
from transformers import AutoConfig, AutoModel

from ...nn.prepare import input_dtype, kernel_calls
from .config import METHOD, BitkernConfig
from .quantizer import _plan, _replace, kept_modules


def model_kernels(path, settings: BitkernConfig | None = None, dtype=None) -> list[tuple]:
    """(Matmul spec, N, K) of every distinct kernel a forward of the model in directory `path` calls with inputs of
    `dtype` (default: the checkpoint's dtype).  settings: the BitkernConfig a float checkpoint will be loaded with
    (ValueError where it is missing for a float checkpoint, or given for a quantized one)."""
    path = os.fspath(path)
    config = AutoConfig.from_pretrained(path)
    stored = getattr(config, "quantization_config", None)
    method = (stored or {}).get("quant_method") if isinstance(stored, dict) else getattr(stored, "quant_method", None)
    if method is not None and settings is not None:
        raise ValueError(f"{path} holds a {method} checkpoint, whose quantization its config.json gives; the settings "
                         f"(--dtype, --group-size, --zero-mode, --compute-dtype) are for float checkpoints")
    if method is None and settings is None:
        raise ValueError(f"{path} holds a float checkpoint: give the quantization it will be served with (--dtype, "
                         f"and --group-size, --zero-mode, --compute-dtype where not the type's defaults)")
    dtype = dtype if dtype is not None else getattr(config, "dtype", None) or torch.float32
    if method not in (None, METHOD):
        from ..formats.pretrained import load_pretrained

        model = load_pretrained(path, dtype=dtype)
    else:
        model = _meta_model(config, settings or BitkernConfig.from_dict(dict(stored)))
    calls, _ = kernel_calls(model, input_dtype(model, dtype))
    return list(dict.fromkeys((call.spec, call.n, call.k) for call in calls))


def _meta_model(config, settings: BitkernConfig):
    """The model of `config` on the meta device with the layers `settings` converts as bitkern.Linear (empty)."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the skeleton is float; its conversion follows
    architecture = next((getattr(transformers, name) for name in config.architectures or ()
                         if hasattr(transformers, name)), None)
    with torch.device("meta"):
        model = architecture._from_config(config) if architecture is not None else AutoModel.from_config(config)
    linears, _ = _plan(model, settings, kept_modules(model))  # experts modules: not prebuilt yet
    for name, layer_settings in linears.items():
        module = model.get_submodule(name)
        _replace(model, name, layer_settings.layer(module.in_features, module.out_features, module.bias is not None))
    return model
