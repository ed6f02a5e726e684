"""`bitkern.load_pretrained` of gpt-oss's MXFP4 checkpoints (quant_method "mxfp4": `*_blocks` / `*_scales` experts, as
the released openai/gpt-oss checkpoints store them and transformers' Mxfp4 integration reads them).

The fixture (tests/integration/gpt_oss_fixture.py) is a tiny random gpt-oss model written as the released
checkpoints are laid out, its blocks and scales made by `encode_mxfp4` from the OCP MX v1.0 spec; transformers' own
reader (`convert_moe_packed_tensors`, and `from_pretrained` with `Mxfp4Config(dequantize=True)`) is the reference every
import is checked against."""

import copy
import hashlib
import logging
import os
import re

import pytest
import torch

import bitkern
from bitkern.integration.formats import FormatError, convert_module, pretrained

from tests.integration.formats_fixtures import reload_bitwise
from tests.integration.gpt_oss_fixture import EXPERTS, LAYERS, gpt_oss_checkpoint, write_checkpoint

PROMPT = torch.tensor([[3, 17, 100, 33, 95, 4, 120, 61]])
NEW_TOKENS = 6
@pytest.fixture(scope="module")
def stored():
    return gpt_oss_checkpoint()


@pytest.fixture(scope="module")
def checkpoint(stored, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"), *stored)


@pytest.fixture(scope="module")
def partly_float(tmp_path_factory):
    """A checkpoint whose layer-1 experts modules_to_not_convert keeps float."""
    return write_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4_partly"), *gpt_oss_checkpoint([EXPERTS.format(1)]))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    models = {}

    def load(dtype):
        if dtype not in models:
            models[dtype] = bitkern.load_pretrained(checkpoint, dtype=dtype)
        return models[dtype]

    return load


def _transformers_dequantized(path, dtype):
    """The model as transformers' Mxfp4 integration loads it dequantized (its own reading of the blocks)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                                dtype=dtype).eval()


def _logits(model):
    with torch.no_grad():
        return model(PROMPT).logits.float()


def _greedy(model):
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32 if tensor.element_size() == 4 else torch.int16)


def test_imported_experts_dequantize_bit_for_bit_as_transformers_mxfp4_integration(stored, checkpoint, loaded):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, tensors = stored
    model = loaded(torch.float32)
    reference = _transformers_dequantized(checkpoint, torch.float32)
    for layer in range(LAYERS):
        experts = model.model.layers[layer].mlp.experts
        theirs = reference.model.layers[layer].mlp.experts
        assert isinstance(experts, bitkern.Experts)
        for name, projection in experts.projections.items():
            assert projection.weight_dtype == "mxfp4" and projection.group_size == 32
            key = f"{EXPERTS.format(layer)}.{name}_proj"
            blocks, scales = tensors[key + "_blocks"], tensors[key + "_scales"]
            for dtype in (torch.float32, torch.bfloat16):
                expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
                assert torch.equal(_bits(projection.dequantize_weight(dtype).transpose(1, 2)), _bits(expected)), key
            # transformers' whole load path (Mxfp4Dequantize into the float model) holds the same weights
            assert torch.equal(_bits(projection.dequantize_weight().transpose(1, 2)),
                               _bits(getattr(theirs, f"{name}_proj"))), key
            assert torch.equal(projection.bias, tensors[key + "_bias"].float())
            # the codes and scales are the checkpoint's bytes, not requantized
            for expert, weight in enumerate(projection.quantized_weights()):
                assert torch.equal(weight.scales, scales[expert])
                assert torch.equal(weight.qweight.view(torch.uint8), blocks[expert].reshape(blocks.shape[1], -1))


def test_every_code_and_scale_converts_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(1)
    experts, hidden, intermediate = 3, 96, 64
    prefix = "model.layers.0.mlp.experts."
    tensors = {}
    for name, (n, k) in {"gate_up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}.items():
        tensors[prefix + name + "_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8)
        scales = torch.randint(0, 255, (experts, n, k // 32), dtype=torch.uint8)
        scales.view(-1)[:2] = torch.tensor([0, 254], dtype=torch.uint8)  # e8m0's smallest and largest finite
        tensors[prefix + name + "_scales"] = scales
        tensors[prefix + name + "_bias"] = torch.randn(experts, n, dtype=torch.bfloat16)
    imported = convert_module(tensors, prefix, {"quant_method": "mxfp4", "modules_to_not_convert": None})
    for name in ("gate_up", "down"):
        expected = convert_moe_packed_tensors(tensors[f"{prefix}{name}_proj_blocks"],
                                              tensors[f"{prefix}{name}_proj_scales"], dtype=torch.float32)
        assert torch.equal(_bits(imported.dequantize(name).transpose(1, 2)), _bits(expected)), name


def test_logits_and_greedy_tokens_match_the_transformers_model_dequantized(checkpoint, loaded):
    for dtype, tolerance in ((torch.bfloat16, 0.03), (torch.float32, 1e-5)):
        model, reference = loaded(dtype), _transformers_dequantized(checkpoint, dtype)
        assert all(isinstance(model.model.layers[i].mlp.experts, bitkern.Experts) for i in range(LAYERS))
        assert next(model.parameters()).dtype == dtype
        expected = _logits(reference)
        error = float((_logits(model) - expected).norm() / expected.norm())
        assert error < tolerance, (dtype, error)
        tokens = _greedy(reference)
        assert len(set(tokens[0, PROMPT.shape[1]:].tolist())) > 1  # not one token repeated: a telling comparison
        assert torch.equal(_greedy(model), tokens), dtype


def test_modules_to_not_convert_stay_float_and_are_logged(partly_float, caplog):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    with caplog.at_level(logging.INFO, logger="bitkern"):
        model = bitkern.load_pretrained(partly_float, dtype=torch.float32)
    layers = model.model.layers
    assert isinstance(layers[0].mlp.experts, bitkern.Experts)
    assert type(layers[1].mlp.experts) is GptOssExperts
    assert type(layers[0].self_attn.q_proj) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    reference = _transformers_dequantized(partly_float, torch.float32)
    assert torch.equal(layers[1].mlp.experts.gate_up_proj, reference.model.layers[1].mlp.experts.gate_up_proj)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(EXPERTS.format(1) in message and "float" in message for message in warnings), warnings
    assert not any(EXPERTS.format(0) + " " in message for message in warnings), warnings
    report = [r.getMessage() for r in caplog.records if "of the parameters quantized" in r.getMessage()]
    assert report and f"{EXPERTS.format(1)}.gate_up_proj [4, 64, 128]" in report[0], report
    expected = _logits(reference)
    assert float((_logits(model) - expected).norm() / expected.norm()) < 1e-4


def _drop(key):
    return lambda config, tensors: tensors.pop(key)


def _set(key, value):
    return lambda config, tensors: tensors.__setitem__(key, value(tensors[key]).contiguous())


def _nan_scale(scales):
    scales = scales.clone()
    scales[1, 2, 0] = 255
    return scales


LAYER0 = EXPERTS.format(0) + "."
BAD = {
    "missing scales": (_drop(LAYER0 + "down_proj_scales"), LAYER0 + "down_proj_scales", "missing"),
    "missing blocks": (_drop(LAYER0 + "gate_up_proj_blocks"), LAYER0 + "gate_up_proj_blocks", "missing"),
    "missing bias": (_drop(LAYER0 + "gate_up_proj_bias"), LAYER0 + "gate_up_proj_bias", "missing"),
    "blocks not bytes": (_set(LAYER0 + "down_proj_blocks", lambda t: t.view(torch.int8)), LAYER0 + "down_proj_blocks",
                         "dtype"),
    "scales of other blocks": (_set(LAYER0 + "gate_up_proj_scales", lambda t: t[:, :-1]),
                               LAYER0 + "gate_up_proj_scales", "shape"),
    "blocks not of 32": (_set(LAYER0 + "down_proj_blocks", lambda t: t.reshape(*t.shape[:2], -1, 8)),
                         LAYER0 + "down_proj_blocks", "shape"),
    "NaN scale": (_set(LAYER0 + "down_proj_scales", _nan_scale), LAYER0 + "down_proj_scales", "255"),
    "bias of other experts": (_set(LAYER0 + "down_proj_bias", lambda t: t[:-1]), LAYER0 + "down_proj_bias", "shape"),
    "listed not to convert": (lambda config, tensors: config["quantization_config"]["modules_to_not_convert"].append(
        EXPERTS.format(0)), LAYER0 + "gate_up_proj_blocks", "modules_to_not_convert"),
}


def _files(folder) -> dict:
    return {name: (hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest(),
                   os.stat(os.path.join(folder, name)).st_mtime_ns) for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("case", BAD)
def test_bad_or_missing_tensors_are_named_before_a_model_exists_and_the_files_stay(case, stored, tmp_path,
                                                                                   monkeypatch):
    change, tensor, what = BAD[case]
    config, tensors = copy.deepcopy(stored[0]), dict(stored[1])
    change(config, tensors)
    folder = write_checkpoint(tmp_path / "checkpoint", config, tensors)
    before = _files(folder)

    def build(*args, **kwargs):
        raise AssertionError("a model was built from a checkpoint that fails the checks")

    monkeypatch.setattr(pretrained, "_build", build)
    with pytest.raises(FormatError, match=re.escape(repr(tensor)) + ".*" + what):
        bitkern.load_pretrained(folder)
    assert _files(folder) == before


def test_experts_neither_quantized_nor_float_are_named(stored, tmp_path):
    config, tensors = stored
    tensors = {key: value for key, value in tensors.items() if not key.startswith(EXPERTS.format(1) + ".")}
    with pytest.raises(FormatError, match=re.escape(EXPERTS.format(1) + ".gate_up_proj")):
        bitkern.load_pretrained(write_checkpoint(tmp_path / "checkpoint", config, tensors))


def test_an_imported_model_saved_by_bitkern_loads_back_bitwise(checkpoint, loaded, tmp_path):
    model = loaded(torch.float32)
    again = reload_bitwise(model, checkpoint, tmp_path)
    assert isinstance(again.model.layers[0].mlp.experts, bitkern.Experts)
    assert torch.equal(_logits(again), _logits(model))


def test_experts_of_another_geometry_than_the_config_are_named(stored, tmp_path):
    config, tensors = copy.deepcopy(stored[0]), stored[1]
    config["intermediate_size"] = 32
    with pytest.raises(FormatError, match=re.escape(repr(EXPERTS.format(0) + ".gate_up_proj")) + ".*" + re.escape("[4, 64, 64]")):
        bitkern.load_pretrained(write_checkpoint(tmp_path / "checkpoint", config, tensors))
