"""`BitkernHfQuantizer`: transformers' `from_pretrained` / `save_pretrained` hooks for `BitkernConfig`.

Quantize on load: the model skeleton keeps its nn.Linear layers; transformers streams the checkpoint a tensor at
a time and hands each converted layer's float weight to `load_ops.QuantizeOnLoad`, which replaces the layer by a
bitkern.Linear before the next tensor is read, so the float model is never held whole.
Pre-quantized (a checkpoint `save_pretrained` wrote, see `format`): each converted layer becomes a
`_CheckpointSlots` receptacle whose empty tensors carry the checkpoint's names, shapes and dtypes, so
transformers loads the packed tensors as they are; the checkpoint's headers are checked against the slots
before any tensor is read, and after loading every receptacle turns into a bitkern.Linear through
`format.linear_from_checkpoint`.
"""

from __future__ import annotations

import logging
import os

import safetensors
import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer, get_keys_to_not_convert

from ... import Linear, dequantize_model
from ...ttype import torch_dtype
from .config import BitkernConfig
from .format import FORMAT, LayerSettings, checkpoint_tensors, expected_tensors, linear_from_checkpoint, misfits
from .registration import register

log = logging.getLogger("bitkern")
METADATA_KEY = "bitkern_hf_format"  # in each file's safetensors metadata ("bitkern" is `bitkern.save`'s header)
_SAFETENSORS_DTYPES = {"I32": torch.int32, "U8": torch.uint8, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F32": torch.float32}


class BitkernHfQuantizer(HfQuantizer):
    """Quantizes a model's nn.Linear layers with bitkern on load, saves and reloads them pre-quantized."""

    requires_calibration = False

    def __init__(self, quantization_config: BitkernConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.plan: dict[str, LayerSettings] = {}

    def validate_environment(self, device_map=None, **kwargs):
        places = set(device_map.values()) if isinstance(device_map, dict) else set()
        unsupported = sorted(str(p) for p in places if str(p) in ("disk", "mps", "meta"))
        if unsupported:
            raise ValueError(f"bitkern layers run on CPUs and CUDA GPUs; device_map places modules on {unsupported}")

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, _, tensor = param_name.rpartition(".")
        return not self.pre_quantized and tensor == "weight" and module in self.plan

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        config = self.quantization_config
        kept = kept_modules(model)
        if not self.pre_quantized:
            config.modules_to_not_convert = sorted({*config.modules_to_not_convert, *kept})
        self.plan = _plan(model, config, kept)
        if self.pre_quantized:
            slots = {name: _CheckpointSlots(model.get_submodule(name), settings) for name, settings in self.plan.items()}
            if checkpoint_files:
                _check_checkpoint(checkpoint_files, slots, model.base_model_prefix)
            for name, slot in slots.items():
                _replace(model, name, slot)
        return model

    def get_quantize_ops(self):
        from .load_ops import QuantizeOnLoad

        return QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        for name, settings in self.plan.items():
            module = model.get_submodule(name)
            if isinstance(module, _CheckpointSlots):
                _replace(model, name, module.to_linear(name))
            elif type(module) is nn.Linear:  # its weight was not in the checkpoint (tied, or initialised)
                log.info("bitkern: quantizing %s from its weight in the model (the checkpoint had none)", name)
                _replace(model, name, quantize_linear(module, settings))
        if self.quantization_config.prepare is not None:
            from ... import prepare  # defined after `import bitkern` registers this quantizer

            prepare(model, self.quantization_config.prepare)
        return model

    def get_state_dict_and_metadata(self, model):
        """The model's state with every bitkern.Linear's weight as `format` names it, in the portable layout."""
        layers = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
        state = {}
        for key, value in model.state_dict().items():
            module, _, tensor = key.rpartition(".")
            if module not in layers or tensor == "bias":
                state[key] = value
        for name, layer in layers.items():
            state.update({f"{name}.{tensor}": value.contiguous() for tensor, value in checkpoint_tensors(layer).items()})
        return state, {METADATA_KEY: FORMAT}

    def _dequantize(self, model, dtype=None):
        """Every bitkern.Linear back to an nn.Linear holding its dequantized weight, in `dtype` (the model's)."""
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return dequantize_model(model, torch.float32 if dtype is None else dtype)

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        """Adapters (LoRA) train on top; the quantized weights stay frozen."""
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def kept_modules(model) -> list[str]:
    """The modules transformers keeps float whatever the config says (the output embedding, tied weights, the
    model's _keep_in_fp32_modules)."""
    return [*get_keys_to_not_convert(model), *(getattr(model, "_keep_in_fp32_modules", None) or [])]


def quantize_linear(module: nn.Linear, settings: LayerSettings) -> Linear:
    """A bitkern.Linear with `settings` from a float nn.Linear."""
    return Linear.from_float(module, settings.dtype, settings.group_size, settings.zero_mode, settings.compute_dtype,
                             torch_dtype(settings.scale_dtype), settings.activation_quant, settings.method)


class _CheckpointSlots(nn.Module):
    """Stands in for one converted nn.Linear while a pre-quantized checkpoint loads: empty (meta) tensors with the
    checkpoint's names, shapes and dtypes for transformers to fill, and the Linear's bias."""

    def __init__(self, linear: nn.Linear, settings: LayerSettings):
        super().__init__()
        self.in_features, self.out_features, self.settings = linear.in_features, linear.out_features, settings
        self.expected = expected_tensors(settings, linear.in_features, linear.out_features)
        for name, (shape, dtype) in self.expected.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))
        self.bias = linear.bias

    def to_linear(self, name: str) -> Linear:
        """The bitkern.Linear these tensors describe (ValueError naming the module and the tensor that does not fit)."""
        tensors = {tensor: getattr(self, tensor) for tensor in self.expected}
        unfilled = [tensor for tensor, value in tensors.items() if value.is_meta]
        if unfilled:
            raise ValueError(f"{name}: the checkpoint holds no {unfilled} for this bitkern layer")
        try:
            return linear_from_checkpoint(tensors, self.settings, self.in_features, self.out_features, self.bias)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name}: {error}") from None

    def forward(self, *args, **kwargs):
        raise RuntimeError("this bitkern layer is still loading its checkpoint")


def _plan(model, config: BitkernConfig, kept: list[str]) -> dict[str, LayerSettings]:
    """{name: settings} of every nn.Linear to convert; ValueError listing every layer the settings do not fit
    (before anything is replaced)."""
    plan, misfit = {}, []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not config.converts(name, kept):
            continue
        settings = config.layer_settings(name)
        try:
            settings.layer(module.in_features, module.out_features)
        except (TypeError, ValueError) as error:
            misfit.append(f"{name} (in_features {module.in_features}): {error}")
            continue
        plan[name] = settings
    if misfit:
        raise ValueError(f"bitkern cannot quantize these layers as configured: {'; '.join(misfit)}. Give them other "
                         f"settings in overrides={{pattern: {{...}}}} or keep them float in modules_to_not_convert")
    return plan


def _check_checkpoint(files: list[str], slots: dict[str, _CheckpointSlots], prefix: str) -> None:
    """Raise, naming every module and tensor, unless the checkpoint's safetensors headers hold each slot's tensors
    with its shapes and dtypes (keys may carry the base model's prefix or lack it, as transformers allows)."""
    found = {}
    for file in files:
        if str(file).endswith(".safetensors"):
            with safetensors.safe_open(str(file), "pt") as checkpoint:
                for key in checkpoint.keys():
                    piece = checkpoint.get_slice(key)
                    found[key] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype()))
    if not found:
        return
    by_module = {}
    for key, shape_and_dtype in found.items():
        module, _, tensor = key.rpartition(".")
        if tensor != "bias":
            by_module.setdefault(module, {})[tensor] = shape_and_dtype
    problems = []
    for name, slot in slots.items():
        candidates = (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}."))
        tensors = next((by_module[c] for c in candidates if c in by_module), {})
        problems += [f"{name}: {problem}" for problem in misfits(tensors, slot.settings, slot.in_features,
                                                                   slot.out_features)]
    if problems:
        shown = "; ".join(problems[:20]) + (f"; ... ({len(problems) - 20} more)" if len(problems) > 20 else "")
        raise ValueError(f"the bitkern checkpoint in {os.path.dirname(str(files[0]))} does not fit this model (other "
                         f"layer sizes or settings?): {shown}")


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


register()  # where importing this module imported transformers' quantizer registry, its hook came too early
