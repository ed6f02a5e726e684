"""quantize_model / dequantize_model on a transformer block made of torch layers."""

import copy
import logging

import pytest
import torch
from torch import nn

import bitkern
from bitkern.demo import TransformerBlock

from tests.helpers import assert_matches

# Error bounds of the block's output, relative.  Round-to-nearest with one absmax scale per 128 weights
# leaves a relative RMS weight error of about step/√12/σ: 0.4% for int8, 7% for int4 (absmax/7 steps) on
# nn.Linear's uniform initial weights, 9% for nf4 (its levels fit Gaussian weights, not uniform ones), 10%
# for nvfp4 and 15% for mxfp4 (power-of-two scales).  Products of two quantized projections (q·k, gate·up)
# make the block's error about 1.5x its layers' weight error; the bounds leave a further margin.
ERROR_BOUNDS = {"int8": 1e-2, "int4": 0.15, "uint4": 0.15, "nf4": 0.2, "nvfp4": 0.2, "mxfp4": 0.3}
DIM, HEADS, HIDDEN = 256, 4, 512


def _block():
    torch.manual_seed(0)
    return TransformerBlock(DIM, HEADS, HIDDEN).eval()


def _update_error(model, float_model, x):
    """Relative error of the block's residual update (output - input): what the layers contribute."""
    update = float_model(x) - x
    return float((model(x) - x - update).norm() / update.norm())


@pytest.mark.parametrize("name", list(ERROR_BOUNDS))
def test_quantized_block_agrees_with_the_float_block_within_the_type_bound(name):
    block = _block()
    x = torch.randn(2, 24, DIM)
    with torch.no_grad():
        quantized = bitkern.quantize_model(copy.deepcopy(block), name)
        layers = [m for m in quantized.modules() if isinstance(m, bitkern.Linear)]
        assert len(layers) == 7 and not any(type(m) is nn.Linear for m in quantized.modules())
        # the kernels compute exactly the block with dequantized float layers ...
        assert_matches(quantized(x), bitkern.dequantize_model(copy.deepcopy(quantized))(x),
                       2e-5 if name != "nf4" else 2**-7)
        # ... and that block is within the type's bound of the float one
        error = _update_error(quantized, block, x)
    assert error <= ERROR_BOUNDS[name], f"{name}: relative error {error:.3g}"


def test_bfloat16_compute_stays_within_the_bound():
    block = _block()
    x = torch.randn(1, 8, DIM)
    with torch.no_grad():
        quantized = bitkern.quantize_model(copy.deepcopy(block), "int8", compute_dtype=torch.bfloat16)
        y = quantized(x)
        assert y.dtype == torch.float32
        assert _update_error(quantized, block, x) <= 2e-2  # bf16 activations add ~2^-9 per product


def test_skip_by_name_and_by_predicate():
    quantized = bitkern.quantize_model(_block(), "int4", skip=["mlp.down", "query"])
    assert type(quantized.mlp.down) is nn.Linear and type(quantized.query) is nn.Linear
    assert isinstance(quantized.mlp.gate, bitkern.Linear)
    quantized = bitkern.quantize_model(_block(), "int4", skip=["mlp"])  # a name covers its submodules
    assert type(quantized.mlp.gate) is nn.Linear and isinstance(quantized.key, bitkern.Linear)
    quantized = bitkern.quantize_model(_block(), "int4", skip=lambda name, module: module.out_features == HIDDEN)
    assert type(quantized.mlp.gate) is nn.Linear and isinstance(quantized.mlp.down, bitkern.Linear)
    with pytest.raises(ValueError, match=r"skip names \['mlp.dwn'\] match no module"):
        bitkern.quantize_model(_block(), "int4", skip=["mlp.dwn"])


def test_layers_the_group_size_does_not_divide_are_listed_before_anything_changes():
    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 96), nn.Linear(96, 8))
    with pytest.raises(ValueError, match=r"group_size=128 does not divide the input size of these layers: "
                                         r"1 \(in_features 64\), 2 \(in_features 96\).*skip="):
        bitkern.quantize_model(model, "int4")
    assert all(type(m) is nn.Linear for m in model)
    with pytest.raises(ValueError, match="dtype='int12' is not supported for weights; accepted:"):
        bitkern.quantize_model(model, "int12")


def test_multihead_attention_keeps_its_float_projection(caplog):
    model = nn.ModuleDict({"attention": nn.MultiheadAttention(64, 4), "head": nn.Linear(64, 8)})
    with caplog.at_level(logging.INFO, logger="bitkern"):
        bitkern.quantize_model(model, "int4", group_size=32)
    assert type(model["attention"].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(model["head"], bitkern.Linear)
    assert "attention.out_proj stays float: NonDynamicallyQuantizableLinear is a subclass" in caplog.text


def test_a_bare_layer_comes_back_replaced_and_dequantize_model_undoes_it():
    layer = bitkern.quantize_model(nn.Linear(128, 32), "int8")
    assert isinstance(layer, bitkern.Linear)
    assert type(bitkern.dequantize_model(layer)) is nn.Linear
    block = bitkern.dequantize_model(bitkern.quantize_model(_block(), "int4"), dtype=torch.bfloat16)
    assert all(type(m) is nn.Linear and m.weight.dtype == torch.bfloat16
               for m in block.modules() if isinstance(m, (nn.Linear, bitkern.Linear)))


def test_a_model_on_the_meta_device_gets_empty_layers_that_trace():
    with torch.device("meta"):
        model = TransformerBlock(DIM, HEADS, HIDDEN)
    bitkern.quantize_model(model, "nf4")
    assert model.mlp.up.qweight.is_meta
    assert model(torch.empty(1, 3, DIM, device="meta")).shape == (1, 3, DIM)
