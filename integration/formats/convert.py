"""A checkpoint's state dict in any supported format -> bitkern layers (one `ImportedLinear` per quantized linear
module, one `ImportedExperts` per quantized experts module: gpt-oss's MXFP4 ones, and those stored as one linear layer
per expert and projection, as GPTQModel writes Qwen3-MoE and Mixtral, or AutoGPTQ wrote Mixtral under transformers 4)
plus the float tensors that stay as they are.
Every module is converted and checked before anything is returned, so a bad tensor anywhere fails the whole import
and nothing is half-loaded."""

from __future__ import annotations

from . import awq, bnb, gptq, mxfp4
from .checkpoint_names import checkpoint_names
from .expert_linears import gather_experts
from .imported import FormatError, ImportedExperts, ImportedLinear

FORMATS = {module.QUANT_METHOD: module for module in (gptq, awq, bnb, mxfp4)}


def quantization_settings(quantization_config) -> tuple:
    """(format module, its settings) of a quantization_config (a dict or a transformers config object)."""
    config = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else quantization_config
    if not isinstance(config, dict):
        raise TypeError(f"quantization_config must be a dict or a transformers quantization config, got "
                        f"{type(quantization_config).__name__}")
    method = config.get("quant_method")
    if method not in FORMATS:
        raise FormatError(f"quantization_config quant_method={method!r} is not supported; accepted: {list(FORMATS)}")
    return FORMATS[method], FORMATS[method].read_config(config)


def convert_module(tensors: dict, prefix: str, quantization_config) -> ImportedLinear | ImportedExperts:
    """The quantized linear layer stored under `prefix` (e.g. "model.layers.0.mlp.down_proj.") of a checkpoint's
    `tensors` as bitkern holds it (its dequantized weight identical, bit for bit, to the format's own); for "mxfp4",
    the experts module stored there ("model.layers.0.mlp.experts.")."""
    form, settings = quantization_settings(quantization_config)
    return form.convert(tensors, prefix, settings)


def convert_state_dict(state_dict: dict, quantization_config, model_type: str | None = None) -> tuple[dict, dict]:
    """({module name: ImportedLinear or ImportedExperts}, {key: tensor} of everything else) for a checkpoint's whole
    state dict, named as the transformers 5 model of `model_type` (config.json's) names them: an older checkpoint's
    names are renamed as transformers renames them (`checkpoint_names`); `state_dict` itself is not changed."""
    form, settings = quantization_settings(quantization_config)
    prefixes = module_prefixes(form, state_dict)
    if not prefixes:
        raise FormatError(f"the checkpoint holds no {form.QUANT_METHOD} tensors (looked for keys ending in "
                          f"{', '.join(form.TENSORS)})")
    names = checkpoint_names(model_type)
    modules = gather_experts({prefix[:-1]: form.convert(state_dict, prefix, settings) for prefix in prefixes},
                             form.TENSORS[0], names)
    owned = {prefix + name for prefix in prefixes for name in (*form.OWNED, "bias")}
    rest = {names.rename(key): value for key, value in state_dict.items() if key not in owned}
    return {names.rename(name): module for name, module in modules.items()}, rest


def quantized_modules(keys, quantization_config) -> list[str]:
    """Names of the modules that a checkpoint with tensor names `keys` holds quantized (what a loader replaces
    by bitkern.Linear before the tensors are converted); experts stored as one linear layer per expert and projection
    are listed as those layers, as the checkpoint names them."""
    form, _ = quantization_settings(quantization_config)
    return [prefix[:-1] for prefix in module_prefixes(form, keys)]


def module_prefixes(form, keys) -> list[str]:
    """Prefixes ("model.layers.0.self_attn.q_proj.") of the modules with tensors of format `form` among `keys`."""
    return sorted({key[: -len(name)] for key in keys for name in form.TENSORS if key.endswith("." + name)})
