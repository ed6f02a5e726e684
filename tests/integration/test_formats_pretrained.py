"""`bitkern.load_pretrained`: each fixture checkpoint (made by the real tool) loads as a transformers Llama with
bitkern layers and generates the same greedy tokens as the reference implementation's model (the same Llama
with the tool's own dequantized weights)."""

import json
import os
import shutil

import pytest
import torch

import bitkern

from tests.integration.formats_fixtures import NAMES, path, reference_model

PROMPT = torch.tensor([[5, 17, 33, 2, 90, 64]])
NEW_TOKENS = 8


def _greedy(model):
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)


@pytest.mark.parametrize("name", NAMES)
def test_imported_model_generates_the_reference_models_greedy_tokens(name):
    model = bitkern.load_pretrained(path(name), dtype=torch.float32)
    quantized = [m for m in model.modules() if isinstance(m, bitkern.Linear)]
    assert len(quantized) == 14 and not any(type(m) is torch.nn.Linear for m in model.model.layers.modules())
    assert torch.equal(_greedy(model), _greedy(reference_model(name)))


def test_a_saved_bitkern_directory_loads_back_with_the_same_tokens(tmp_path):
    model = bitkern.load_pretrained(path("gptq_4bit_asym_actorder"), dtype=torch.float32)
    bitkern.save(model, tmp_path / "model.safetensors")
    shutil.copy(os.path.join(path("gptq_4bit_asym_actorder"), "config.json"), tmp_path)
    with open(tmp_path / "config.json") as file:
        config = json.load(file)
    del config["quantization_config"]
    with open(tmp_path / "config.json", "w") as file:
        json.dump(config, file)
    loaded = bitkern.load_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.model.layers[0].self_attn.q_proj.input_order is not None
    assert torch.equal(_greedy(loaded), _greedy(model))


def test_unsupported_arguments_are_named():
    with pytest.raises(TypeError, match="device_map"):
        bitkern.load_pretrained(path("awq_4bit_gemm"), device_map="auto")
