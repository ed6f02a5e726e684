"""`bitkern.load_pretrained(path)`: a GPTQ / AWQ / bitsandbytes-4bit checkpoint directory, a gpt-oss MXFP4 one (or
one written with `bitkern.save`, or by `save_pretrained` of a model quantized with `bitkern.BitkernConfig`) as a
transformers model whose quantized layers are `bitkern.Linear` (and whose quantized experts, gpt-oss's MXFP4 ones or
GPTQModel's per-expert GPTQ layers, are `bitkern.Experts`).

A `save_pretrained` checkpoint (quant_method "bitkern") loads through transformers' `from_pretrained` and bitkern's
quantizer (`bitkern.integration.hf`), which checks the files against the model before reading a tensor.

The model is built from its config without initialising weights (transformers' `no_init_weights`), every
quantized module is converted and checked first (`convert_state_dict`: a bad checkpoint fails before any
model exists), then the converted layers replace the model's nn.Linear modules (converted experts its float experts
modules) and the float tensors are assigned; what stays float is logged.  Transformers is not patched.
"""

from __future__ import annotations

import logging
import os

import torch

from .checkpoint import bitkern_metadata, read_config, read_tensors, weight_files
from .convert import convert_state_dict
from .imported import FormatError, ImportedExperts

ACCEPTED_KWARGS = ("dtype", "torch_dtype", "attn_implementation", "compute_dtype")
log = logging.getLogger("bitkern")


def load_pretrained(path, **from_pretrained_kwargs):
    """The transformers model of checkpoint directory `path` with bitkern layers, ready to `generate`.

    Keyword arguments: dtype (float tensors and activations; default: as stored), attn_implementation
    (as in from_pretrained), compute_dtype (what the bitkern layers multiply in; default: the input's).
    """
    unknown = sorted(set(from_pretrained_kwargs) - set(ACCEPTED_KWARGS))
    if unknown:
        raise TypeError(f"load_pretrained got unsupported arguments {unknown}; accepted: {list(ACCEPTED_KWARGS)}")
    path = os.fspath(path)
    dtype = from_pretrained_kwargs.get("dtype", from_pretrained_kwargs.get("torch_dtype"))
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype!r} is not supported; accepted: torch.float32, torch.float16, torch.bfloat16")
    config = read_config(path)
    quantization_config = config.get("quantization_config")
    if (quantization_config or {}).get("quant_method") == "bitkern":
        model = _from_pretrained(path, dtype, from_pretrained_kwargs)
        if "compute_dtype" not in from_pretrained_kwargs:  # the compute dtypes the checkpoint's config gives
            return model.eval()
        return _finish(model, from_pretrained_kwargs["compute_dtype"])
    if bitkern_metadata(path):
        import bitkern

        model = _build(path, dtype, from_pretrained_kwargs)
        bitkern.load(model, weight_files(path)[0])
        return _finish(model, from_pretrained_kwargs.get("compute_dtype"))
    if quantization_config is None:
        raise FormatError(f"{path}/config.json has no quantization_config and its weights are not bitkern's: "
                          f"not a quantized checkpoint (load it with transformers, then bitkern.quantize_model)")
    modules, rest = convert_state_dict(read_tensors(path), quantization_config, config.get("model_type"))
    model = _build(path, dtype, from_pretrained_kwargs)
    _replace_modules(model, modules, dtype)
    _assign(model, rest, dtype)
    _log_float(model)
    return _finish(model, from_pretrained_kwargs.get("compute_dtype"))


def _build(path: str, dtype, kwargs):
    """The model of the directory's config (its architecture's class, without the quantization_config), float
    tensors allocated but not initialised."""
    import transformers
    from transformers.initialization import no_init_weights

    model_config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(model_config, "quantization_config"):
        del model_config.quantization_config
    model_class = _model_class(model_config)
    options = {"dtype": dtype or model_config.dtype or torch.float32}
    if "attn_implementation" in kwargs:
        options["attn_implementation"] = kwargs["attn_implementation"]
    with no_init_weights():
        if model_class is transformers.AutoModelForCausalLM:
            return model_class.from_config(model_config, **options)
        return model_class._from_config(model_config, **options)


def _from_pretrained(path: str, dtype, kwargs):
    """A checkpoint `save_pretrained` wrote from a bitkern model, loaded by its architecture's `from_pretrained`
    (bitkern's quantizer lays out the packed tensors; `import bitkern` registered it)."""
    import transformers

    options = {} if dtype is None else {"dtype": dtype}
    if "attn_implementation" in kwargs:
        options["attn_implementation"] = kwargs["attn_implementation"]
    return _model_class(transformers.AutoConfig.from_pretrained(path)).from_pretrained(path, **options)


def _model_class(model_config):
    """The transformers class the config's first architecture names, else the causal LM auto class."""
    import transformers

    architectures = model_config.architectures or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    return transformers.AutoModelForCausalLM if model_class is None else model_class


def _replace_modules(model, modules: dict, dtype) -> None:
    """Check that every converted module has an nn.Linear (or float experts module) of its shape in the model, then
    swap them in."""
    layers = {}
    for name, imported in modules.items():
        try:
            target = model.get_submodule(name)
        except AttributeError:
            raise FormatError(f"the checkpoint holds a quantized module {name!r}, which the model lacks") from None
        if isinstance(imported, ImportedExperts):
            layers[name] = _experts(name, target, imported, dtype)
            continue
        n, k = imported.weight.shape
        if not isinstance(target, torch.nn.Linear) or (target.out_features, target.in_features) != (n, k):
            raise FormatError(f"the checkpoint holds {name!r} as a [{n}, {k}] linear layer; the model has "
                              f"{type(target).__name__} {tuple(getattr(target, 'weight', torch.empty(0)).shape)}")
        if (target.bias is not None) != (imported.bias is not None):
            raise FormatError(f"tensor {name + '.bias'!r} is {'missing' if target.bias is not None else 'unexpected'}")
        layers[name] = imported.to_module()
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)


def _experts(name: str, target, imported: ImportedExperts, dtype):
    """The bitkern.Experts of converted experts `imported` in place of the model's float experts module `target`."""
    from bitkern.nn.experts import FLOAT_PARAMETERS, check_float_experts, float_bias, float_projections, gemm_shape

    try:
        check_float_experts(target)
    except ValueError as error:
        raise FormatError(f"the checkpoint holds quantized experts {name!r}; the model's module there does not take "
                          f"them: {error}") from None
    if sorted(float_projections(target)) != sorted(imported.weights):
        raise FormatError(f"the checkpoint holds experts {name!r} with projections {sorted(imported.weights)}; the "
                          f"model's {type(target).__name__} has {float_projections(target)}")
    for projection, weights in imported.weights.items():
        stored = (len(weights), *weights[0].shape)
        tensor_name = f"{name}.{FLOAT_PARAMETERS[projection]}"
        if stored != gemm_shape(target, projection):
            raise FormatError(f"the checkpoint holds {tensor_name!r} as {len(weights)} experts of {list(stored[1:])} "
                              f"[out, in]; the model's is {list(gemm_shape(target, projection))} [experts, out, in]")
        if (float_bias(target, projection) is not None) != (imported.biases.get(projection) is not None):
            raise FormatError(f"tensor {tensor_name + '_bias'!r} is "
                              f"{'missing' if float_bias(target, projection) is not None else 'unexpected'}")
    return imported.to_module(target, dtype)


def _log_float(model) -> None:
    """Warn of every experts module left float (name, size), and log the share of parameters held quantized."""
    from bitkern.nn.experts import is_float_experts
    from bitkern.nn.report import log_float_report

    for name, module in model.named_modules():
        if is_float_experts(module):
            parameters = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
            nbytes = sum(p.numel() * p.element_size() for p in parameters)
            log.warning("bitkern: experts %s stay float as the checkpoint stores them: %d parameters, %.1f MiB",
                        name, sum(p.numel() for p in parameters), nbytes / 2**20)
    log_float_report(model)


def _assign(model, tensors: dict, dtype) -> None:
    """Assign the float tensors; every tensor the model expects must be there (tied ones come from their twin)."""
    floats = {key: value.to(dtype) if dtype is not None and value.is_floating_point() else value
              for key, value in tensors.items()}
    result = model.load_state_dict(floats, strict=False, assign=True)
    if result.unexpected_keys:
        raise FormatError(f"the checkpoint holds tensors the model does not have: {result.unexpected_keys}")
    model.tie_weights()
    import bitkern
    from bitkern.nn.experts import ExpertWeights

    loaded = {value.data_ptr() for value in floats.values()}
    state = model.state_dict()
    missing = [key for key in result.missing_keys if not isinstance(
        model.get_submodule(key.rpartition(".")[0]), (bitkern.Linear, ExpertWeights))
        and state[key].data_ptr() not in loaded]
    if missing:
        raise FormatError(f"tensors missing from the checkpoint: {missing}")


def _finish(model, compute_dtype):
    """The model in eval mode, its bitkern layers multiplying in `compute_dtype` (None: the input's dtype)."""
    import bitkern
    from bitkern.nn.experts import ExpertWeights

    for module in model.modules():
        if isinstance(module, (bitkern.Linear, ExpertWeights)):
            module.compute_dtype = compute_dtype
    return model.eval()
