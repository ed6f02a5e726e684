"""Importing checkpoints made by the real tools (GPTQ: gptqmodel, AWQ: AutoAWQ's packing, bitsandbytes):
the bitkern weight dequantizes bit for bit to the tool's own dequantization, and the layer computes the
reference matmul on it; bad checkpoints are refused naming the tensor, before anything is made."""

import hashlib
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

import bitkern
from bitkern import ttype
from bitkern.integration.formats import (FormatError, convert_module, convert_state_dict, import_checkpoint,
                                        quantized_modules)
from bitkern.integration.formats.bitstream import block_codes, pack_stream, unpack_stream

from tests.integration.formats_fixtures import DIRECTORY, NAMES, path, quantization_config, reference


def _bits(tensor):
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.mark.parametrize("name", NAMES)
def test_dequantized_weights_equal_the_tools_own_bit_for_bit(name):
    _, modules, _ = import_checkpoint(path(name))
    expected = reference(name)
    assert sorted(modules) == sorted(expected) == quantized_modules(_tensors(name), quantization_config(name))
    for module, imported in modules.items():
        tool = expected[module]
        assert torch.equal(_bits(imported.dequantize(tool.dtype)), _bits(tool)), module
        layer = imported.to_module()  # the kernel layout, and the input order undone
        assert torch.equal(_bits(layer.dequantize_weight(tool.dtype)), _bits(tool)), module


def _relative_error(y, reference):
    return float((y.double() - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("name", NAMES)
def test_layers_compute_the_reference_matmul_on_the_tools_weight(name):
    """The tools' dequantized weight is the exact float32 product (q - z)·s (or table value · absmax) rounded
    to the tool's dtype; bitkern's kernels multiply by the exact product.  So the layer matches the matmul
    on its own float32 weight as closely as any bitkern layer (codebook types: through a bfloat16 table,
    2^-8), and the matmul on the tool's rounded weight within that rounding."""
    _, modules, _ = import_checkpoint(path(name))
    expected = reference(name)
    torch.manual_seed(0)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        layer = modules[module].to_module()
        x = torch.randn(3, layer.in_features)
        y = layer(x)
        codebook = layer.weight_dtype in ("nf4", "bnb_fp4")
        own = x.double().matmul(layer.dequantize_weight(torch.float64).T)
        assert _relative_error(y, own) <= (2**-8 if codebook else 1e-5), module
        tool = expected[module]
        rounding = 2**-9 if tool.dtype == torch.float16 else 2**-7
        assert _relative_error(y, x.double().matmul(tool.double().T)) <= max(rounding, 2**-8 if codebook else 0)


def test_types_formats_and_act_order_are_the_ones_the_tools_wrote():
    kinds = {}
    for name in NAMES:
        _, modules, _ = import_checkpoint(path(name))
        weight = modules["model.layers.0.self_attn.q_proj"]
        kinds[name] = (weight.weight.ttype.name, weight.weight.zero_mode, weight.weight.scales.dtype,
                       weight.input_order is not None)
    assert kinds["gptq_3bit_asym_actorder"] == ("uint3", "gptq", torch.float16, True)
    assert kinds["gptq_4bit_sym"] == ("uint4", "gptq", torch.float16, False)
    assert kinds["awq_4bit_gemm"] == ("uint4", "awq", torch.float16, False)
    assert kinds["bnb_nf4_double_quant"] == ("nf4", "none", torch.float32, False)
    assert kinds["bnb_fp4_double_quant"] == ("bnb_fp4", "none", torch.float32, False)


def test_v1_zero_points_of_zero_are_restored_as_gptqmodel_does():
    """gptqmodel stores GPTQ v1 zeros minus one with whole-word arithmetic, so a zero of 0 borrows from the next
    field; the fixture's non-negative rows give such zeros, and they dequantize as the tool's."""
    _, modules, _ = import_checkpoint(path("gptq_4bit_asym_actorder"))
    assert int((modules["model.layers.0.self_attn.q_proj"].weight.zeros == 0).sum()) > 0


def test_bitsandbytes_code_tables_are_bitkerns_types():
    tables = load_file(os.path.join(DIRECTORY, "bnb_4bit_tables.safetensors"))
    for quant_type, name in (("nf4", "nf4"), ("fp4", "bnb_fp4")):
        assert torch.equal(_bits(tables[quant_type]), _bits(ttype.get(name).values)), name
    assert not torch.equal(tables["fp4"] * 6, ttype.get("fp4_e2m1").values.abs().sort().values.repeat(2)[:16])


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([2, 3, 4, 8]), st.integers(1, 3), st.integers(1, 4), st.integers(0, 2**31))
def test_bit_streams_round_trip(bits, blocks, columns, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (blocks * block_codes(bits), columns), generator=generator, dtype=torch.uint8)
    words = pack_stream(codes, bits, 0)
    assert words.dtype == torch.int32 and words.shape[0] == blocks * block_codes(bits) * bits // 32
    assert torch.equal(unpack_stream(words, bits, 0), codes)
    assert torch.equal(unpack_stream(pack_stream(codes.T, bits, 1), bits, 1), codes.T)


def test_bitsandbytes_weights_stored_in_another_quant_storage_dtype_import_the_same():
    """bnb_4bit_quant_storage (e.g. bfloat16 for FSDP) stores the same packed bytes under another dtype."""
    tensors = _tensors("bnb_nf4")
    weight = tensors[MODULE + "weight"]
    stored = dict(tensors, **{MODULE + "weight": weight.reshape(-1, 2).view(torch.bfloat16)})
    expected = convert_module(tensors, MODULE, quantization_config("bnb_nf4")).dequantize()
    assert torch.equal(convert_module(stored, MODULE, quantization_config("bnb_nf4")).dequantize(), expected)


def test_bitsandbytes_blocks_spanning_whole_rows_give_each_row_its_blocks_scale():
    """bitsandbytes blocks run over the row-major weight: the fixture's [64, 128] layer read as [256, 32] has
    blocks of 64 covering two rows each, and dequantizes to the tool's weight in that shape."""
    import json

    tensors = _tensors("bnb_nf4")
    state = MODULE + "weight.quant_state.bitsandbytes__nf4"
    settings = json.loads(bytes(tensors[state].tolist()))
    assert settings["shape"] == [64, 128] and settings["blocksize"] == 64
    tensors[state] = torch.tensor(list(json.dumps({**settings, "shape": [256, 32]}).encode()), dtype=torch.uint8)
    imported = convert_module(tensors, MODULE, quantization_config("bnb_nf4"))
    assert imported.weight.group_size == 32
    tool = reference("bnb_nf4")[MODULE[:-1]]
    assert torch.equal(_bits(imported.dequantize(tool.dtype)), _bits(tool.reshape(256, 32)))


# -- bad input ---------------------------------------------------------------------------------------------

MODULE = "model.layers.0.mlp.down_proj."


def _tensors(name):
    return load_file(os.path.join(path(name), "model.safetensors"))


def _broken(name, change):
    tensors = _tensors(name)
    change(tensors)
    return tensors


@pytest.mark.parametrize("name, change, tensor", [
    ("gptq_4bit_sym", lambda t: t.pop(MODULE + "qzeros"), MODULE + "qzeros"),
    ("gptq_4bit_sym", lambda t: t.update({MODULE + "scales": t[MODULE + "scales"][:-1]}), MODULE + "scales"),
    ("gptq_4bit_sym", lambda t: t.update({MODULE + "qweight": t[MODULE + "qweight"].float()}), MODULE + "qweight"),
    ("gptq_3bit_asym_actorder", lambda t: t.update({MODULE + "qweight": t[MODULE + "qweight"][:-1]}),
     MODULE + "qweight"),
    ("gptq_4bit_asym_actorder", lambda t: t[MODULE + "g_idx"].__setitem__(0, 1 - t[MODULE + "g_idx"][0]),
     MODULE + "g_idx"),
    ("gptq_4bit_sym", lambda t: t[MODULE + "g_idx"].__setitem__(0, 99), MODULE + "g_idx"),
    ("awq_4bit_gemm", lambda t: t.pop(MODULE + "scales"), MODULE + "scales"),
    ("awq_4bit_gemm", lambda t: t.update({MODULE + "qzeros": t[MODULE + "qzeros"][:, :-1]}), MODULE + "qzeros"),
    ("bnb_nf4_double_quant", lambda t: t.pop(MODULE + "weight.nested_absmax"), MODULE + "weight.nested_absmax"),
    ("bnb_nf4", lambda t: t.update({MODULE + "weight": t[MODULE + "weight"][:-2]}), MODULE + "weight"),
    ("bnb_nf4", lambda t: t[MODULE + "weight.quant_map"].__setitem__(1, 0.5), MODULE + "weight.quant_map"),
    ("bnb_nf4", lambda t: t.pop(MODULE + "weight.quant_state.bitsandbytes__nf4"), MODULE + "weight.quant_state"),
])
def test_bad_tensors_are_refused_naming_the_tensor(name, change, tensor):
    tensors = _broken(name, change)
    before = {key: value.clone() for key, value in tensors.items()}
    with pytest.raises(FormatError, match=tensor.replace(".", r"\.")):
        convert_state_dict(tensors, quantization_config(name))
    assert before.keys() == tensors.keys() and all(torch.equal(before[k], tensors[k]) for k in before)


@pytest.mark.parametrize("name, update, setting", [
    ("gptq_4bit_sym", {"bits": 5}, "bits=5"),
    ("gptq_4bit_sym", {"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ("awq_4bit_gemm", {"version": "gemv"}, "version='gemv'"),
    ("awq_4bit_gemm", {"bits": 3}, "bits=3"),
    ("bnb_nf4", {"load_in_4bit": False, "load_in_8bit": True}, "load_in_8bit"),
    ("bnb_nf4", {"quant_method": "hqq"}, "quant_method='hqq'"),
])
def test_unsupported_settings_are_refused_naming_the_setting(name, update, setting):
    with pytest.raises(FormatError, match=setting.replace("(", r"\(")):
        convert_module(_tensors(name), MODULE, {**quantization_config(name), **update})


def _digest(directory):
    return {file: hashlib.sha256(open(os.path.join(directory, file), "rb").read()).hexdigest()
            for file in sorted(os.listdir(directory))}


def test_a_bad_checkpoint_directory_fails_before_any_model_is_made_and_stays_as_it_was(tmp_path):
    directory = tmp_path / "broken"
    shutil.copytree(path("gptq_4bit_asym_actorder"), directory)
    tensors = _tensors("gptq_4bit_asym_actorder")
    tensors["model.layers.1.self_attn.v_proj.g_idx"][:2] = 0
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    before = _digest(directory)
    with pytest.raises(FormatError, match=r"model\.layers\.1\.self_attn\.v_proj\.g_idx"):
        bitkern.load_pretrained(directory)
    assert _digest(directory) == before


def test_quantized_modules_the_model_lacks_are_named(tmp_path):
    directory = tmp_path / "extra"
    shutil.copytree(path("awq_4bit_gemm"), directory)
    tensors = _tensors("awq_4bit_gemm")
    for key in [k for k in tensors if k.startswith(MODULE)]:
        tensors[key.replace("mlp.down_proj", "mlp.side_proj")] = tensors[key].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.side_proj"):
        bitkern.load_pretrained(directory)
