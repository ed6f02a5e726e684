"""`BitkernHfQuantizer`: transformers' `from_pretrained` / `save_pretrained` hooks for `BitkernConfig`.

Quantize on load: the model skeleton keeps its nn.Linear layers; transformers streams the checkpoint a tensor at
a time and hands each converted layer's float weight to `load_ops.QuantizeOnLoad`, which replaces the layer by a
bitkern.Linear before the next tensor is read, so the float model is never held whole.
Pre-quantized (a checkpoint `save_pretrained` wrote, see `format`): each converted layer becomes a
`_CheckpointSlots` receptacle whose empty tensors carry the checkpoint's names, shapes and dtypes, so
transformers loads the packed tensors as they are; the checkpoint's headers are checked against the slots
before any tensor is read, and after loading every receptacle turns into a bitkern.Linear through
`format.linear_from_checkpoint`.
Mixture-of-experts experts modules (transformers' 3-D expert weights, see `bitkern.nn.experts`) follow the same
plan: on load each 3-D weight (one layer's gate/up or down, all experts) is quantized as it arrives and held until
the module's tensors are in, then the module becomes a `bitkern.Experts`; a pre-quantized checkpoint fills an
`_ExpertsSlots` receptacle per module.  After loading, the share of the parameters quantized and every weight left
float are logged.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import safetensors
import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer, get_keys_to_not_convert

from ... import Linear, dequantize_model
from ...nn.experts import (FLOAT_PARAMETERS, ExpertWeights, Experts, experts_targets, float_bias, float_projections,
                           gemm_shape, gemm_weight, is_float_experts)
from ...nn.report import log_float_report
from ...ttype import torch_dtype
from .config import BitkernConfig
from .format import (FORMAT, LayerSettings, checkpoint_tensors, compare, expected_experts_tensors, expected_tensors,
                     experts_checkpoint_tensors, experts_from_checkpoint, linear_from_checkpoint, misfits)
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
        # {experts module: {its float parameter: settings}}, and the projections quantized on load so far
        self.experts_plan: dict[str, dict[str, LayerSettings]] = {}
        self.pending: dict[str, dict[str, ExpertWeights]] = {}

    def validate_environment(self, device_map=None, **kwargs):
        places = set(device_map.values()) if isinstance(device_map, dict) else set()
        unsupported = sorted(str(p) for p in places if str(p) in ("disk", "mps", "meta"))
        if unsupported:
            raise ValueError(f"bitkern layers run on CPUs and CUDA GPUs; device_map places modules on {unsupported}")

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, _, tensor = param_name.rpartition(".")
        if self.pre_quantized:
            return False
        return (tensor == "weight" and module in self.plan) or tensor in self.experts_plan.get(module, ())

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        config = self.quantization_config
        kept = kept_modules(model)
        if not self.pre_quantized:
            config.modules_to_not_convert = sorted({*config.modules_to_not_convert, *kept})
        self.plan, self.experts_plan = _plan(model, config, kept)
        if self.pre_quantized:
            slots = {name: _CheckpointSlots(model.get_submodule(name), settings) for name, settings in self.plan.items()}
            experts = {name: _ExpertsSlots(model.get_submodule(name), settings)
                       for name, settings in self.experts_plan.items()}
            if checkpoint_files:
                projections = {f"{name}.{projection}": slot for name, module in experts.items()
                               for projection, slot in module.named_children()}
                _check_checkpoint(checkpoint_files, {**slots, **projections}, model.base_model_prefix,
                                  _renamings(model))
            for name, slot in {**slots, **experts}.items():
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
        for name, settings in self.experts_plan.items():
            module = model.get_submodule(name)
            if isinstance(module, _ExpertsSlots):
                _replace(model, name, module.to_experts(name))
            elif is_float_experts(module):
                _replace(model, name, self._experts_of(name, module, settings))
        self.pending = {}
        log_float_report(model)
        if self.quantization_config.prepare is not None:
            from ... import prepare  # defined after `import bitkern` registers this quantizer

            prepare(model, self.quantization_config.prepare)
        return model

    def quantize_experts_weight(self, model, name: str, parameter: str, weight: torch.Tensor) -> None:
        """Quantize the 3-D weight `parameter` of the float experts module `name` as it is read, and hold it until the
        module becomes a bitkern.Experts (the float tensor is freed now)."""
        module = model.get_submodule(name)
        projection = next(p for p in float_projections(module) if FLOAT_PARAMETERS[p] == parameter)
        experts = weight.transpose(1, 2) if module.is_transposed else weight
        self.pending.setdefault(name, {})[projection] = ExpertWeights.from_float_weight(
            experts, **dataclasses.asdict(self.experts_plan[name][parameter]))

    def _experts_of(self, name: str, module: nn.Module, settings: dict) -> Experts:
        """The bitkern.Experts of a float experts module whose 3-D weights were quantized on load (a weight the
        checkpoint lacked is quantized from the model's own tensor, logged), with the module's biases."""
        pending = self.pending.get(name, {})
        projections = {}
        for projection in float_projections(module):
            parameter = FLOAT_PARAMETERS[projection]
            held = pending.get(projection)
            if held is None:
                log.info("bitkern: quantizing %s.%s from its tensor in the model (the checkpoint had none)", name,
                         parameter)
                projections[projection] = ExpertWeights.from_float_weight(
                    gemm_weight(module, projection), float_bias(module, projection),
                    **dataclasses.asdict(settings[parameter]))
                continue
            bias = float_bias(module, projection)
            held._set_bias(None if bias is None else bias.detach())
            projections[projection] = held
        return Experts.from_projections(module, projections)

    def get_state_dict_and_metadata(self, model):
        """The model's state with every bitkern.Linear's and experts projection's weight as `format` names it, in the
        portable layout."""
        layers = {name: module for name, module in model.named_modules() if isinstance(module, (Linear, ExpertWeights))}
        state = {}
        for key, value in model.state_dict().items():
            module, _, tensor = key.rpartition(".")
            if module not in layers or tensor == "bias":
                state[key] = value
        for name, layer in layers.items():
            tensors = (experts_checkpoint_tensors if isinstance(layer, ExpertWeights) else checkpoint_tensors)(layer)
            state.update({f"{name}.{tensor}": value.contiguous() for tensor, value in tensors.items()})
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

    def misfits(self, found: dict) -> list[str]:
        """What keeps the checkpoint's tensors {name: (shape, dtype)} from filling these slots."""
        return misfits(found, self.settings, self.in_features, self.out_features)

    def forward(self, *args, **kwargs):
        raise RuntimeError("this bitkern layer is still loading its checkpoint")


class _ProjectionSlots(nn.Module):
    """Stands in for one projection of a converted experts module while a pre-quantized checkpoint loads: empty
    (meta) tensors with the checkpoint's names, shapes and dtypes ([E, ...]), and the projection's bias."""

    def __init__(self, module: nn.Module, projection: str, settings: LayerSettings):
        super().__init__()
        self.num_experts, self.out_features, self.in_features = gemm_shape(module, projection)
        self.settings = settings
        self.expected = expected_experts_tensors(settings, self.num_experts, self.in_features, self.out_features)
        for name, (shape, dtype) in self.expected.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))
        bias = float_bias(module, projection)
        self.bias = None if bias is None else nn.Parameter(torch.empty_like(bias, device="meta"), requires_grad=False)

    def misfits(self, found: dict) -> list[str]:
        return compare(found, self.expected, self.settings.dtype)

    def to_projection(self, name: str) -> ExpertWeights:
        """The experts projection these tensors describe (ValueError naming the module and the tensor)."""
        tensors = {tensor: getattr(self, tensor) for tensor in self.expected}
        unfilled = [tensor for tensor, value in tensors.items() if value.is_meta] + (
            ["bias"] if self.bias is not None and self.bias.is_meta else [])
        if unfilled:
            raise ValueError(f"{name}: the checkpoint holds no {unfilled} for these bitkern experts")
        try:
            return experts_from_checkpoint(tensors, self.settings, self.num_experts, self.in_features,
                                           self.out_features, self.bias)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name}: {error}") from None


class _ExpertsSlots(nn.Module):
    """Stands in for one converted experts module while a pre-quantized checkpoint loads: a `_ProjectionSlots` per
    projection, and the float module (without its tensors) whose gate the bitkern.Experts keeps."""

    def __init__(self, module: nn.Module, settings: dict[str, LayerSettings]):
        super().__init__()
        for projection in float_projections(module):
            self.add_module(projection, _ProjectionSlots(module, projection, settings[FLOAT_PARAMETERS[projection]]))
        self.__dict__["float_module"] = module

    def to_experts(self, name: str) -> Experts:
        return Experts.from_projections(self.float_module, {projection: slots.to_projection(f"{name}.{projection}")
                                                            for projection, slots in self.named_children()})

    def forward(self, *args, **kwargs):
        raise RuntimeError("these bitkern experts are still loading their checkpoint")


def _plan(model, config: BitkernConfig, kept: list[str]) -> tuple[dict, dict]:
    """({name: settings} of every nn.Linear to convert, {name: {float parameter: settings}} of every experts module,
    each projection's settings those of its float parameter's name, e.g. "model.layers.0.mlp.experts.down_proj");
    ValueError listing every layer and experts module the settings do not fit (before anything is replaced)."""
    linears, experts, misfit = {}, {}, []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not config.converts(name, kept):
            continue
        settings = config.layer_settings(name)
        try:
            settings.layer(module.in_features, module.out_features)
            linears[name] = settings
        except (TypeError, ValueError) as error:
            misfit.append(f"{name} (in_features {module.in_features}): {error}")
    for name, module in experts_targets(model, lambda name, module: not config.converts(name, kept)):
        settings = {FLOAT_PARAMETERS[p]: config.layer_settings(f"{name}.{FLOAT_PARAMETERS[p]}")
                    for p in float_projections(module)}
        try:
            Experts.empty_like(module, lambda parameter: dataclasses.asdict(settings[parameter]))
            experts[name] = settings
        except (TypeError, ValueError) as error:
            misfit.append(f"{name}: {error}")
    if misfit:
        raise ValueError(f"bitkern cannot quantize these layers as configured: {'; '.join(misfit)}. Give them other "
                         f"settings in overrides={{pattern: {{...}}}} or keep them float in modules_to_not_convert")
    return linears, experts


def _renamings(model) -> list:
    """The key renamings transformers applies to this model's checkpoints as it loads them (e.g. Mixtral's
    "block_sparse_moe" -> "mlp")."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return [entry for entry in get_model_conversion_mapping(model) if isinstance(entry, WeightRenaming)]


def _check_checkpoint(files: list[str], slots: dict[str, nn.Module], prefix: str, renamings: list = ()) -> None:
    """Raise, naming every module and tensor, unless the checkpoint's safetensors headers hold each slot's tensors
    with its shapes and dtypes (keys renamed by `renamings` as transformers loads them; keys may carry the base
    model's prefix or lack it, as transformers allows)."""
    from transformers.core_model_loading import rename_source_key

    found = {}
    for file in files:
        if str(file).endswith(".safetensors"):
            with safetensors.safe_open(str(file), "pt") as checkpoint:
                for key in checkpoint.keys():
                    piece = checkpoint.get_slice(key)
                    found[rename_source_key(key, list(renamings), [])[0]] = (
                        tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype()))
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
        problems += [f"{name}: {problem}" for problem in slot.misfits(tensors)]
    if problems:
        shown = "; ".join(problems[:20]) + (f"; ... ({len(problems) - 20} more)" if len(problems) > 20 else "")
        raise ValueError(f"the bitkern checkpoint in {os.path.dirname(str(files[0]))} does not fit this model (other "
                         f"layer sizes or settings?): {shown}")


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


register()  # where importing this module imported transformers' quantizer registry, its hook came too early
