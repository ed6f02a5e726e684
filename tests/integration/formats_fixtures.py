"""The format fixtures (tests/fixtures/formats, made by tools/format_fixtures/ with the real tools) and the
reference model built from a fixture's float tensors and the tool's own dequantized weights; the check that an imported
model saved with `bitkern.save` loads back bitwise."""

import json
import os

import torch
from safetensors.torch import load_file

DIRECTORY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "formats")
NAMES = sorted(name for name in os.listdir(DIRECTORY) if os.path.isfile(os.path.join(DIRECTORY, name, "reference.safetensors")))


# Mixtral GPTQ checkpoints of transformers 4 (AutoGPTQ, e.g. TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ) name the MoE
# block "block_sparse_moe" and each expert's linear layers w1 (gate), w3 (up) and w2 (down), as transformers 4's
# MixtralBlockSparseTop2MLP did; transformers 5 renames them on load (its conversion mapping for "mixtral"), and vLLM's
# Mixtral loads only these names.
OLD_MIXTRAL_LAYOUT = {".mlp.": ".block_sparse_moe.", ".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


def old_mixtral_name(key: str) -> str:
    """A tensor name of transformers 5's Mixtral in the transformers 4 layout."""
    for new, old in OLD_MIXTRAL_LAYOUT.items():
        key = key.replace(new, old)
    return key


def path(name: str) -> str:
    return os.path.join(DIRECTORY, name)


def reference(name: str) -> dict:
    """{module name: the producing tool's own dequantized [out, in] weight}."""
    return {key.removesuffix(".weight"): value for key, value in load_file(os.path.join(path(name), "reference.safetensors")).items()}


def quantization_config(name: str) -> dict:
    with open(os.path.join(path(name), "config.json")) as file:
        return json.load(file)["quantization_config"]


def reference_model(name: str, dtype=torch.float32, **config_overrides):
    """The fixture's Llama in float with the tool's dequantized weights (the reference implementation's model);
    `config_overrides` replace entries of its config (as vLLM's hf_overrides do)."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(path(name))
    del config.quantization_config
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model = LlamaForCausalLM(config)
    tensors = load_file(os.path.join(path(name), "model.safetensors"))
    state = {key: value for key, value in tensors.items() if key in model.state_dict()}
    state.update({f"{module}.weight": weight for module, weight in reference(name).items()})
    model.load_state_dict({key: value.to(dtype) for key, value in state.items()}, strict=True)
    return model.to(dtype).eval()


def reload_bitwise(model, checkpoint: str, folder):
    """`model` (imported from checkpoint directory `checkpoint`) saved with `bitkern.save` beside its config (without
    the quantization_config) in `folder` and loaded back in float32; its state dict (tensors and each bitkern module's
    settings) asserted equal to `model`'s.  Returns the loaded model."""
    import bitkern

    bitkern.save(model, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(checkpoint, "config.json")) as file:
        config = json.load(file)
    del config["quantization_config"]
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file)
    again = bitkern.load_pretrained(folder, dtype=torch.float32)
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys()
    for key, value in mine.items():
        assert torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key], key
    return again
