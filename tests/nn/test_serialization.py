"""bitkern.save / bitkern.load: safetensors files that say how they were quantized."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from torch import nn

import bitkern
from bitkern.demo import TransformerBlock

ROOT = Path(__file__).resolve().parents[2]  # the checkout (tests/nn/ is two below it)
DIM, HEADS, HIDDEN = 128, 4, 256


class Model(nn.Module):
    """A transformer block, a conv stem and a tied embedding/head: every kind of state a file must hold."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, DIM)
        self.block = TransformerBlock(DIM, HEADS, HIDDEN)
        self.head = nn.Linear(DIM, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: stored once
        self.stem = nn.Conv2d(64, 16, 3, padding=1)

    def forward(self, tokens, image):
        return self.head(self.block(self.embed(tokens))), self.stem(image)


def _quantized_model():
    """The block in nf4, the conv stem in uint4 with GPTQ zero points; the tied head stays float."""
    torch.manual_seed(0)
    model = bitkern.quantize_model(Model().eval(), "nf4", group_size=64, skip=["head", "stem"])
    return bitkern.quantize_model(model, "uint4", group_size=64, skip=lambda name, module: name != "stem")


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (2, 5), generator=generator), torch.randn(1, 64, 6, 6, generator=generator)


def test_the_file_metadata_says_how_each_layer_was_quantized(tmp_path):
    path = tmp_path / "model.safetensors"
    bitkern.save(_quantized_model(), path)
    with safetensors.safe_open(path, "pt") as file:
        metadata, keys = file.metadata(), set(file.keys())
    header = json.loads(metadata["bitkern"])
    assert metadata["format"] == "pt"
    assert header["aliases"] == {"head.weight": "embed.weight"}
    assert "head.weight" not in keys and "embed.weight" in keys
    query, stem = header["modules"]["block.query"], header["modules"]["stem"]
    assert query == {"format": "bitkern.weight/1", "class": "Linear", "dtype": "nf4", "group_size": 64,
                     "zero_mode": "none", "method": "rtn", "scale_dtype": "float16", "layout": "tile16",
                     "weight_shape": [DIM, DIM], "compute_dtype": None, "activation_quant": "none"}
    assert stem["class"] == "Conv2d" and stem["weight_shape"] == [16, 64, 3, 3]
    assert stem["dtype"] == "uint4" and stem["zero_mode"] == "gptq"
    assert {"block.query.qweight", "block.query.scales", "stem.zeros", "stem.bias"} <= keys


_FRESH_PROCESS = """
import sys, torch, bitkern
sys.path.insert(0, {root!r})
from tests.nn.test_serialization import Model, _inputs
with torch.device("meta"):
    model = Model()  # float, on meta: the file says what to quantize and how
model.head.weight = model.embed.weight
bitkern.load(model, {path!r})
assert model.block.mlp.gate.weight_dtype == "nf4" and model.stem.weight_dtype == "uint4"
assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
with torch.no_grad():
    text, image = model.eval()(*_inputs())
torch.save({{"text": text, "image": image}}, {out!r})
"""


def test_save_then_load_in_a_fresh_process_gives_identical_outputs(tmp_path):
    model = _quantized_model()
    with torch.no_grad():
        text, image = model(*_inputs())
    path, out = tmp_path / "model.safetensors", tmp_path / "outputs.pt"
    bitkern.save(model, path)
    code = _FRESH_PROCESS.format(root=str(ROOT), path=str(path), out=str(out))
    # The child compiles its own kernels: kernels of LUT-decoded types read back from a warm disk cache
    # currently crash (their table constants come back unaligned), which is the cache's to fix.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BITKERN_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(out)
    assert torch.equal(loaded["text"], text) and torch.equal(loaded["image"], image)  # bitwise


def test_load_into_a_model_already_quantized_the_same_way(tmp_path):
    model = _quantized_model()
    path = tmp_path / "model.safetensors"
    bitkern.save(model, path)
    torch.manual_seed(5)
    other = bitkern.quantize_model(Model().eval(), "nf4", group_size=64, skip=["head", "stem"])
    bitkern.load(other, path)  # the float stem becomes the file's uint4 Conv2d
    assert other.stem.weight_dtype == "uint4"
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(other(*_inputs()), model(*_inputs())))


def test_loading_a_file_made_with_other_settings_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    bitkern.save(_quantized_model(), path)
    torch.manual_seed(0)
    other = bitkern.quantize_model(Model().eval(), "int4", group_size=64, skip=["head"])
    with pytest.raises(ValueError, match="saved with dtype='nf4', but this module has dtype='int4'"):
        bitkern.load(other, path)
    float_file = tmp_path / "float.safetensors"
    bitkern.save(Model(), float_file)
    with pytest.raises(ValueError, match=r"holds no quantized weight for module 'block.query' \(Linear, dtype=int4\)"):
        bitkern.load(other, float_file)


def test_loading_into_a_model_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    bitkern.save(_quantized_model(), path)
    model = Model()
    model.stem = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="holds a quantized Conv2d for 'stem', but the model has a Linear there"):
        bitkern.load(model, path)
    model = Model()
    model.block.query = nn.Linear(DIM, 2 * DIM)
    with pytest.raises(ValueError, match=r"'block.query' with weight shape \[128, 128\], the model's has \[256, 128\]"):
        bitkern.load(model, path)
