"""bitkern -> GPTQ: exported checkpoints import back to identical weights (v1 and v2 zeros, act-order, every bit
width), and layers quantized by bitkern itself export exactly."""

import pytest
import torch

import bitkern
from bitkern.integration.formats import FormatError, ImportedLinear, export_gptq, import_checkpoint, save_gptq
from bitkern.integration.formats.gptq import convert, export

from tests.integration.formats_fixtures import NAMES, path

GPTQ = [name for name in NAMES if name.startswith("gptq")]


def _same(a: ImportedLinear, b: ImportedLinear):
    for field in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(a.weight, field), getattr(b.weight, field)), field
    assert (a.weight.ttype, a.weight.shape, a.weight.group_size) == (b.weight.ttype, b.weight.shape, b.weight.group_size)
    assert (a.input_order is None) == (b.input_order is None)
    if a.input_order is not None:
        assert torch.equal(a.input_order, b.input_order)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("name", GPTQ)
def test_round_trip_through_a_gptq_checkpoint_gives_identical_weights(tmp_path, name, checkpoint_format):
    model = bitkern.load_pretrained(path(name))
    _, original, _ = import_checkpoint(path(name))
    save_gptq(model, tmp_path, checkpoint_format)
    config, exported, rest = import_checkpoint(tmp_path)
    assert config["quantization_config"]["checkpoint_format"] == checkpoint_format
    assert sorted(exported) == sorted(original)
    for module in original:
        _same(exported[module], original[module])
    assert "lm_head.weight" in rest and "model.norm.weight" in rest


@pytest.mark.parametrize("dtype, zero_mode, bits", [("uint4", "gptq", 4), ("int4", "none", 4), ("uint3", "awq", 3),
                                                    ("int8", "none", 8), ("uint2", "gptq", 2)])
def test_bitkern_quantized_layers_export_exactly(dtype, zero_mode, bits):
    torch.manual_seed(0)
    layer = bitkern.Linear.from_float(torch.nn.Linear(64, 32), dtype, group_size=32, zero_mode=zero_mode)
    tensors = export_gptq(layer, "gptq")
    back = convert({f"m.{k}": v for k, v in tensors.items()}, "m.", {"bits": bits, "group_size": 32,
                                                                   "checkpoint_format": "gptq"})
    assert torch.equal(back.dequantize(), layer.dequantize_weight())
    assert torch.equal(back.bias, layer.bias.detach())


def test_act_order_layers_export_their_group_index():
    torch.manual_seed(0)
    order = torch.randperm(64)
    weight = bitkern.quantize(torch.randn(32, 64), "uint4", group_size=16)
    tensors = export(ImportedLinear(weight, order))
    assert sorted(torch.bincount(tensors["g_idx"].long()).tolist()) == [16] * 4
    back = convert({f"m.{k}": v for k, v in tensors.items()}, "m.", {"bits": 4, "group_size": 16,
                                                                   "checkpoint_format": "gptq"})
    assert torch.equal(back.dequantize(), ImportedLinear(weight, order).dequantize())


@pytest.mark.parametrize("dtype, zero_mode, message", [("nf4", "none", "nf4"), ("uint4", "hqq", "hqq"),
                                                       ("mxfp4", "none", "mxfp4")])
def test_weights_without_an_exact_gptq_form_are_refused(dtype, zero_mode, message):
    layer = bitkern.Linear.from_float(torch.nn.Linear(64, 32), dtype, group_size=32 if dtype != "mxfp4" else None,
                                      zero_mode=zero_mode)
    with pytest.raises(FormatError, match=message):
        export_gptq(layer)
