"""`bitkern.load_pretrained` of gpt-oss's MXFP4 checkpoints (quant_method "mxfp4": `*_blocks` / `*_scales` experts, as
the released openai/gpt-oss checkpoints store them and transformers' Mxfp4 integration reads them).

The fixture is a tiny random gpt-oss model written as the released checkpoints are laid out: config.json with
quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]} (the released list), bf16 tensors,
uint8 blocks [E, N, K/32, 16] and scales [E, N, K/32] for the experts, float biases, safetensors shards with an index.
Transformers cannot write such a checkpoint here: its Mxfp4 quantizer quantizes and serializes only through the
`kernels` hub package's triton kernels (`triton_kernels_hub.numerics_details.mxfp.downcast_to_mxfp_torch`, the
swizzled triton tensors), which need a download and triton; with `dequantize=True` it keeps float experts and saves
them float.  So `encode_mxfp4` below, written from the OCP MX v1.0 spec (not from bitkern's or transformers' code),
makes the blocks and scales, and transformers' own reader (`convert_moe_packed_tensors`, and `from_pretrained` with
`Mxfp4Config(dequantize=True)`) is the reference every import is checked against."""

import copy
import hashlib
import json
import logging
import os
import re

import pytest
import torch
from safetensors.torch import save_file

import bitkern
from bitkern.integration.formats import FormatError, convert_module, pretrained

from tests.integration.formats_fixtures import reload_bitwise

PROMPT = torch.tensor([[3, 17, 100, 33, 95, 4, 120, 61]])
NEW_TOKENS = 6
LAYERS = 2
EXPERTS = "model.layers.{}.mlp.experts"
# the released gpt-oss-20b / -120b checkpoints' list
RELEASED_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 of a float [E, N, K] weight as gpt-oss stores it: (blocks uint8 [E, N, K/32, 16], scales uint8
    [E, N, K/32]).  Per block of 32 along K: shared exponent X = floor(log2(max|w|)) − 2 (e2m1's largest exponent),
    stored as X + 127; each element the e2m1 code of the nearest magnitude of w / 2^X (clamped to 6) and its sign;
    element 2j in the low nibble of byte j."""
    experts, n, k = weight.shape
    blocks = weight.float().reshape(experts, n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs().argmin(-1)
    codes = (magnitude | (torch.signbit(scaled).long() << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def _config():
    import transformers

    return transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                     num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                     initializer_range=0.2)  # logits far from uniform: distinct greedy tokens


def _checkpoint(not_converted=()) -> tuple[dict, dict]:
    """(config.json as a dict, tensors) of the tiny gpt-oss model in the released layout; the experts modules named
    in `not_converted` stay float (bf16, the model's [E, K, N] layout) and are listed in modules_to_not_convert."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(_config())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    config = model.config.to_dict()
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": RELEASED_NOT_CONVERTED + list(not_converted)}
    tensors = {}
    for key, value in model.state_dict().items():
        module, _, name = key.rpartition(".")
        if name in ("gate_up_proj", "down_proj") and module not in not_converted:
            blocks, scales = encode_mxfp4(value.transpose(1, 2))  # the model's [E, K, N] as [E, N, K]
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        else:
            tensors[key] = value.to(torch.bfloat16).contiguous()
    return config, tensors


def _write(folder, config: dict, tensors: dict) -> str:
    """The checkpoint as safetensors shards (layer 0's tensors, then the rest) with their index, as released."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    shards = {"model-00000-of-00001.safetensors": {}, "model-00001-of-00001.safetensors": {}}
    for key, value in tensors.items():
        shards["model-00000-of-00001.safetensors" if key.startswith("model.layers.0.")
               else "model-00001-of-00001.safetensors"][key] = value
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(value.numel() * value.element_size() for value in tensors.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=2)
    return str(folder)


@pytest.fixture(scope="module")
def stored():
    return _checkpoint()


@pytest.fixture(scope="module")
def checkpoint(stored, tmp_path_factory):
    return _write(tmp_path_factory.mktemp("gpt_oss_mxfp4"), *stored)


@pytest.fixture(scope="module")
def partly_float(tmp_path_factory):
    """A checkpoint whose layer-1 experts modules_to_not_convert keeps float."""
    return _write(tmp_path_factory.mktemp("gpt_oss_mxfp4_partly"), *_checkpoint([EXPERTS.format(1)]))


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
    folder = _write(tmp_path / "checkpoint", config, tensors)
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
        bitkern.load_pretrained(_write(tmp_path / "checkpoint", config, tensors))


def test_an_imported_model_saved_by_bitkern_loads_back_bitwise(checkpoint, loaded, tmp_path):
    model = loaded(torch.float32)
    again = reload_bitwise(model, checkpoint, tmp_path)
    assert isinstance(again.model.layers[0].mlp.experts, bitkern.Experts)
    assert torch.equal(_logits(again), _logits(model))


def test_experts_of_another_geometry_than_the_config_are_named(stored, tmp_path):
    config, tensors = copy.deepcopy(stored[0]), stored[1]
    config["intermediate_size"] = 32
    with pytest.raises(FormatError, match=re.escape(repr(EXPERTS.format(0) + ".gate_up_proj")) + ".*" + re.escape("[4, 64, 64]")):
        bitkern.load_pretrained(_write(tmp_path / "checkpoint", config, tensors))
