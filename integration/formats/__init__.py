"""Checkpoints of other quantization tools on bitkern's kernels, bit for bit, and bitkern weights back out.

Importers: GPTQ (AutoGPTQ / GPTQModel: 2/3/4/8 bits, sym and asym, v1 and v2 zeros, act-order), AWQ
(AutoAWQ "gemm") and bitsandbytes 4-bit (nf4, fp4, double quantization).  Each turns a module's tensors into
an `ImportedLinear` (a `bitkern.QuantizedWeight` whose dequantization equals the tool's own, the input
permutation of act-order layers, the bias); `ImportedLinear.to_module()` makes the `bitkern.Linear`.
gpt-oss's MXFP4 experts (quant_method "mxfp4") become an `ImportedExperts` per experts module (one mxfp4
`QuantizedWeight` per expert and projection, the checkpoint's bytes as they are, and the biases);
`ImportedExperts.to_module(float_experts)` makes the `bitkern.Experts`.  Mixture-of-experts checkpoints that store one
linear layer per expert and projection (GPTQModel's GPTQ of Qwen3-MoE and Mixtral; AutoGPTQ's of Mixtral under
transformers 4, whose names transformers' conversion mapping renames: `checkpoint_names`) become an `ImportedExperts`
per experts module too (`expert_linears`).

Entry points: `convert_module(tensors, prefix, quantization_config)` (one module),
`convert_state_dict(state_dict, quantization_config, model_type)` (a whole checkpoint: modules and the float rest),
`quantized_modules(keys, quantization_config)` (which modules a checkpoint holds quantized),
`import_checkpoint(path)` (a checkpoint directory), `save_gptq(model, path)` / `export_gptq(layer)` (GPTQ out).
"""

from .checkpoint import read_config, read_tensors
from .convert import FORMATS, convert_module, convert_state_dict, quantized_modules
from .export import export_gptq, save_gptq
from .imported import FormatError, ImportedExperts, ImportedLinear


def import_checkpoint(path) -> tuple[dict, dict, dict]:
    """(config, {module name: ImportedLinear or ImportedExperts}, {key: float tensor}) of a GPTQ / AWQ / bitsandbytes /
    gpt-oss MXFP4 checkpoint directory (config.json with its quantization_config, safetensors weights)."""
    config = read_config(path)
    if "quantization_config" not in config:
        raise FormatError(f"{path}/config.json has no quantization_config: not a quantized checkpoint")
    modules, rest = convert_state_dict(read_tensors(path), config["quantization_config"], config.get("model_type"))
    return config, modules, rest


__all__ = ["FORMATS", "FormatError", "ImportedExperts", "ImportedLinear", "convert_module", "convert_state_dict",
           "export_gptq", "import_checkpoint", "quantized_modules", "read_config", "read_tensors", "save_gptq"]
