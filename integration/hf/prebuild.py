"""The kernels a transformers model directory's bitkern layers call, found without reading its weights, for
`python -m bitkern prebuild --model PATH`: the model is built from its config.json on the meta device and its
nn.Linear layers are replaced as `from_pretrained` with a `BitkernConfig` replaces them, after the checkpoint's own
quantization_config (a checkpoint `save_pretrained` wrote) or, for a float checkpoint, the settings it will be
served with, and its experts modules (mixture of experts) by empty `bitkern.Experts`.  A GPTQ, AWQ or bitsandbytes
checkpoint is loaded (`bitkern.load_pretrained`): its layers' settings come from its tensors.  The kernels are those
`bitkern.prepare` makes ready (`kernel_calls`), experts' grouped ones for the config's num_experts_per_tok.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import transformers
from transformers import AutoConfig, AutoModel

from ...cache.prebuild import Request, kernel_requests
from ...nn.experts import GROUPED_LAYOUTS, Experts
from ...nn.kernel_call import KernelCall
from ...nn.prepare import input_dtype, kernel_calls
from ...ops.grouped import GroupedMatmul
from ...tuner.buckets import m_bucket
from ...tuner.device import device_for
from ...tuner.space import usable_templates
from .config import METHOD, BitkernConfig
from .quantizer import _plan, _replace, kept_modules

log = logging.getLogger("bitkern")


def model_requests(path, tokens: tuple[int, ...], target: str = "cpu", settings: BitkernConfig | None = None,
                   dtype=None) -> list[Request]:
    """The prebuild requests of every kernel a forward over each count of `tokens` of the model in directory `path`
    runs on `target`, each at the M buckets it runs at (see `model_kernels` for `settings` and `dtype`)."""
    calls = model_kernels(path, settings, dtype, target)
    return list(dict.fromkeys(request for call in calls for request in
                              kernel_requests([(call.spec, call.n, call.k)], call.rows(tokens), target)))


def model_kernels(path, settings: BitkernConfig | None = None, dtype=None, target: str = "cpu") -> list[KernelCall]:
    """The distinct kernels a forward of the model in directory `path` calls on `target` with inputs of `dtype`
    (default: the checkpoint's dtype), with the token counts they run at.  settings: the BitkernConfig a float
    checkpoint will be loaded with (ValueError where it is missing for a float checkpoint, or given for a quantized
    one).  Experts layers' grouped kernels are listed for the config's num_experts_per_tok where `target` has them;
    elsewhere their dense kernels serve every token count (as the experts run there)."""
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
    dtype = input_dtype(model, dtype)
    top_k = getattr(config, "num_experts_per_tok", None)
    device = device_for(target)
    calls, unlisted = kernel_calls(model, dtype, top_k)
    if not _runs_grouped(calls, device):  # e.g. a GPU's grouped kernels, without SwiGLU and the weighted sum in them
        calls, _ = kernel_calls(model, dtype, top_k, fused=False)
        if _runs_grouped(calls, device):
            log.info("bitkern prebuild: %s runs the experts of %s through grouped kernels without SwiGLU and the "
                     "weighted top-k sum in them", target, path)
        else:
            log.info("bitkern prebuild: %s runs the experts of %s through their dense kernels at every token count "
                     "(no grouped kernels there)", target, path)
            calls, _ = kernel_calls(model, dtype)
    if unlisted:
        log.warning("bitkern prebuild: not prebuilt, so tuned on their first call: %s", ", ".join(unlisted))
    return calls


def _meta_model(config, settings: BitkernConfig):
    """The model of `config` on the meta device with the layers `settings` converts as bitkern.Linear (empty)."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the skeleton is float; its conversion follows
    architecture = next((getattr(transformers, name) for name in config.architectures or ()
                         if hasattr(transformers, name)), None)
    with torch.device("meta"):
        model = architecture._from_config(config) if architecture is not None else AutoModel.from_config(config)
    linears, experts = _plan(model, settings, kept_modules(model))
    for name, layer_settings in linears.items():
        module = model.get_submodule(name)
        _replace(model, name, layer_settings.layer(module.in_features, module.out_features, module.bias is not None))
    for name, parameters in experts.items():
        _replace(model, name, Experts.empty_like(model.get_submodule(name),
                                                 lambda parameter: dataclasses.asdict(parameters[parameter])))
    return model


def _runs_grouped(calls: list[KernelCall], device) -> bool:
    """Whether experts run the grouped kernels among `calls` on `device` (the experts listed them by this CPU's
    templates; True where there are none): a template for each on the device, reading them in its kernels' layout
    (tile16 on CPUs, lop3 on CUDA GPUs)."""
    layout = GROUPED_LAYOUTS[device.kind]
    return all(usable_templates(call.spec, call.n, call.k, m_bucket(1), layout, device)[0] for call in calls
               if isinstance(call.spec, GroupedMatmul))
