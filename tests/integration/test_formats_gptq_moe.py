"""`bitkern.load_pretrained` of GPTQ mixture-of-experts checkpoints as GPTQModel writes them: one GPTQ linear layer per
expert and projection (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.{qweight,qzeros,scales,g_idx}`); and Mixtral
ones of transformers 4 (AutoGPTQ: `model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.*`), here the GPTQModel
Mixtral fixture with its tensors renamed so (the bytes are GPTQModel's), the names as transformers itself writes them.

The fixtures (tests/fixtures/formats_moe, made by tools/format_fixtures/make_gptq_moe.py with gptqmodel 7.6.0 itself)
are tiny random Qwen3-MoE and Mixtral models (2 layers, hidden 64, 4 experts of 64, top-2) quantized by GPTQModel to
4 bits in groups of 32 (Qwen3-MoE symmetric, Mixtral asymmetric; and a Qwen3-MoE with act-order), each stored with
GPTQModel's own dequantization of every quantized linear layer (its TorchLinear's `dequantize_weight`)."""

import hashlib
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import bitkern
from bitkern.integration.formats import FormatError, import_checkpoint, pretrained, quantized_modules
from bitkern.nn.experts import FLOAT_PARAMETERS, GROUPED_PAIRS, is_float_experts

from tests.integration.formats_fixtures import old_mixtral_name, reload_bitwise

DIRECTORY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "formats_moe")
FIXTURES = ("gptq_qwen3_moe_4bit_sym", "gptq_mixtral_4bit_asym")
ACT_ORDER = "gptq_qwen3_moe_4bit_actorder"
LAYERS, EXPERTS = 2, 4
SHORT = torch.tensor([[3, 17, 100, 33, 95, 4, 120, 61]])  # 16 token-expert pairs: the grouped kernels
LONG = torch.arange(5, 125, 5).unsqueeze(0)  # 48 pairs: one dense kernel call per expert with tokens
assert SHORT.numel() * 2 <= GROUPED_PAIRS < LONG.numel() * 2


def _path(name: str) -> str:
    return os.path.join(DIRECTORY, name)


def _reference(name: str) -> dict:
    """{linear layer name: GPTQModel's dequantized [out, in] float16 weight}, per expert for the experts."""
    tensors = load_file(os.path.join(_path(name), "reference.safetensors"))
    return {key.removesuffix(".weight"): value for key, value in tensors.items()}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


@pytest.fixture(scope="module")
def loaded():
    return {name: bitkern.load_pretrained(_path(name), dtype=torch.float32) for name in FIXTURES}


def _float_model(name: str, weights: dict):
    """The fixture's model in float32 with `weights` ({linear layer name: [out, in]}, per expert for the experts:
    gate_proj, up_proj, down_proj) and the checkpoint's float tensors."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(_path(name))
    del config.quantization_config
    model = getattr(transformers, config.architectures[0])(config)
    state = {key: value for key, value in load_file(os.path.join(_path(name), "model.safetensors")).items()
             if key in model.state_dict()}
    for layer in range(LAYERS):
        module_name = f"model.layers.{layer}.mlp.experts"
        module = model.get_submodule(module_name)
        stacked = {"gate_up": torch.stack([torch.cat([weights[f"{module_name}.{e}.gate_proj"],
                                                      weights[f"{module_name}.{e}.up_proj"]]) for e in range(EXPERTS)]),
                   "down": torch.stack([weights[f"{module_name}.{e}.down_proj"] for e in range(EXPERTS)])}
        for projection, weight in stacked.items():
            state[f"{module_name}.{FLOAT_PARAMETERS[projection]}"] = \
                weight.transpose(1, 2) if module.is_transposed else weight
    state.update({f"{key}.weight": value for key, value in weights.items() if ".experts." not in key})
    model.load_state_dict({key: value.float() for key, value in state.items()}, strict=True)
    return model.eval()


def _logits(model, prompt):
    with torch.no_grad():
        return model(prompt).logits.float()


def _relative_error(logits, expected) -> float:
    return float((logits - expected).norm() / expected.norm())


@pytest.mark.parametrize("name", FIXTURES)
def test_experts_load_as_bitkern_experts_that_dequantize_bit_for_bit_as_gptqmodels(name, loaded):
    model, reference = loaded[name], _reference(name)
    config, modules, _ = import_checkpoint(_path(name))
    experts_modules = [f"model.layers.{layer}.mlp.experts" for layer in range(LAYERS)]
    dense = sorted(key for key in reference if ".experts." not in key)
    assert sorted(modules) == sorted(dense + experts_modules)
    keys = load_file(os.path.join(_path(name), "model.safetensors")).keys()
    assert quantized_modules(keys, config["quantization_config"]) == sorted(reference)  # per expert, as stored
    for module_name in experts_modules:
        experts = model.get_submodule(module_name)
        assert isinstance(experts, bitkern.Experts), module_name
        gate_up, down = experts.projections["gate_up"], experts.projections["down"]
        intermediate = down.in_features
        for projection in (gate_up, down):
            assert (projection.weight_dtype, projection.group_size, projection.zero_mode) == ("uint4", 32, "gptq")
            assert projection.routes(torch.zeros(1, projection.in_features))  # the grouped kernels serve it
        gate_up_weight, down_weight = gate_up.dequantize_weight(torch.float16), down.dequantize_weight(torch.float16)
        for e in range(EXPERTS):
            for weight, key in ((gate_up_weight[e, :intermediate], "gate_proj"),
                                (gate_up_weight[e, intermediate:], "up_proj"), (down_weight[e], "down_proj")):
                assert torch.equal(_bits(weight), _bits(reference[f"{module_name}.{e}.{key}"])), (module_name, e, key)
    for module_name in dense:
        assert torch.equal(_bits(model.get_submodule(module_name).dequantize_weight(torch.float16)),
                           _bits(reference[module_name])), module_name
    # nothing quantized in the checkpoint is left float: only lm_head (stored float) is an nn.Linear
    assert [n for n, m in model.named_modules() if type(m) is torch.nn.Linear] == ["lm_head"]
    assert not any(is_float_experts(m) for m in model.modules())


def _own_weights(name: str) -> dict:
    """{linear layer name (per expert for the experts): bitkern's float32 dequantization of the checkpoint}."""
    _, modules, _ = import_checkpoint(_path(name))
    weights = {}
    for module_name, imported in modules.items():
        if not module_name.endswith(".experts"):
            weights[module_name] = imported.dequantize()
            continue
        intermediate = imported.weights["down"][0].shape[1]
        gate_up, down = imported.dequantize("gate_up"), imported.dequantize("down")
        for e in range(EXPERTS):
            weights.update({f"{module_name}.{e}.gate_proj": gate_up[e, :intermediate],
                            f"{module_name}.{e}.up_proj": gate_up[e, intermediate:],
                            f"{module_name}.{e}.down_proj": down[e]})
    return weights


@pytest.mark.parametrize("name", FIXTURES)
def test_experts_compute_gptqmodels_dequantized_experts_within_their_float16_rounding(name, loaded):
    """GPTQModel's dequantized weights are the products (q − z)·s rounded to float16; bitkern multiplies by the exact
    products.  So each experts module matches the float experts holding GPTQModel's weights within that rounding
    (2^-9), for a few tokens (the grouped kernels) and many (the dense kernels per expert)."""
    model, gptqmodel = loaded[name], _float_model(name, _reference(name))
    generator = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        module_name = f"model.layers.{layer}.mlp.experts"
        ours, theirs = model.get_submodule(module_name), gptqmodel.get_submodule(module_name)
        for tokens in (8, 24):
            x = torch.randn(tokens, 64, generator=generator)
            index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:2] for _ in range(tokens)])
            weights = torch.rand(tokens, 2, generator=generator)
            with torch.no_grad():
                expected = theirs(x, index, weights)
                assert _relative_error(ours(x, index, weights), expected) < 2**-9, (module_name, tokens)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_and_greedy_tokens_match_a_float_model_of_the_dequantized_weights(name, loaded):
    """The float model holds the exact products (q − z)·s, whose float16 rounding is GPTQModel's dequantization bit
    for bit; the loaded model's logits match it as closely as any bitkern float32 layer does (1e-5: comparing with
    the float16-rounded weights instead, a token whose router scores nearly tie may take another expert), prompts of
    a few tokens through the grouped kernels, longer ones through the dense kernels per expert."""
    model, weights, reference = loaded[name], _own_weights(name), _reference(name)
    assert sorted(weights) == sorted(reference)
    for key, weight in weights.items():
        assert torch.equal(_bits(weight.half()), _bits(reference[key])), key
    exact = _float_model(name, weights)
    for prompt in (SHORT, LONG):
        assert _relative_error(_logits(model, prompt), _logits(exact, prompt)) < 1e-5, prompt.shape
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = exact.generate(SHORT, **options)
        assert len(set(tokens[0, SHORT.shape[1]:].tolist())) > 1  # not one token repeated: a telling comparison
        assert torch.equal(model.generate(SHORT, **options), tokens)


def _files(folder) -> dict:
    return {name: (hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest(),
                   os.stat(os.path.join(folder, name)).st_mtime_ns) for name in sorted(os.listdir(folder))}


@pytest.fixture
def no_model(monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("a model was built from a checkpoint that fails the checks")

    monkeypatch.setattr(pretrained, "_build", build)


def test_act_order_experts_are_refused_naming_the_g_idx_before_a_model_exists(no_model):
    before = _files(_path(ACT_ORDER))
    with pytest.raises(FormatError, match=re.escape("'model.layers.0.mlp.experts.0.gate_proj.g_idx'") + ".*act-order"):
        bitkern.load_pretrained(_path(ACT_ORDER))
    assert _files(_path(ACT_ORDER)) == before


EXPERT = "model.layers.1.mlp.experts.2."


def _drop(prefix):
    return lambda tensors: {key: value for key, value in tensors.items() if not key.startswith(prefix)}


def _changed(key, value):
    return lambda tensors: {**tensors, key: value(tensors)}


BAD = {
    "an expert's projection missing": (_drop(EXPERT + "up_proj."), EXPERT + "up_proj.qweight", "missing"),
    "an expert's scales in another dtype": (
        _changed(EXPERT + "down_proj.scales", lambda t: t[EXPERT + "down_proj.scales"].to(torch.bfloat16)),
        EXPERT + "down_proj.qweight", "share one format"),
    "a bias on the gate only": (_changed(EXPERT + "gate_proj.bias", lambda t: torch.zeros(64, dtype=torch.float16)),
                                EXPERT + "up_proj.bias", "missing"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_experts_are_refused_naming_the_tensor_before_a_model_exists(case, tmp_path, no_model):
    change, tensor, what = BAD[case]
    folder = tmp_path / "checkpoint"
    shutil.copytree(_path(FIXTURES[0]), folder)
    save_file(change(load_file(folder / "model.safetensors")), folder / "model.safetensors", metadata={"format": "pt"})
    before = _files(folder)
    with pytest.raises(FormatError, match=re.escape(repr(tensor)) + ".*" + what):
        bitkern.load_pretrained(folder)
    assert _files(folder) == before


def test_experts_of_another_number_than_the_config_are_named(tmp_path):
    folder = tmp_path / "checkpoint"
    shutil.copytree(_path(FIXTURES[0]), folder)
    save_file(_drop("model.layers.1.mlp.experts.3.")(load_file(folder / "model.safetensors")),
              folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match=re.escape("'model.layers.1.mlp.experts.gate_up_proj'") + ".*3 experts"):
        bitkern.load_pretrained(folder)


def test_an_imported_model_saved_by_bitkern_loads_back_bitwise(loaded, tmp_path):
    model = loaded[FIXTURES[1]]
    again = reload_bitwise(model, _path(FIXTURES[1]), tmp_path)
    assert isinstance(again.model.layers[0].mlp.experts, bitkern.Experts)
    assert torch.equal(_logits(again, SHORT), _logits(model, SHORT))


def test_the_old_layout_is_what_transformers_writes_for_mixtral(tmp_path):
    """transformers 5 saves a Mixtral in the transformers 4 layout (its conversion mapping reversed): w1 and w3 are
    the halves of gate_up_proj (gate, up), w2 is down_proj, the router is block_sparse_moe.gate; old_mixtral_name
    agrees."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=4,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                             vocab_size=128))
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    experts = model.model.layers[0].mlp.experts
    assert not experts.is_transposed
    for e in range(4):
        layers = {key: stored[old_mixtral_name(f"model.layers.0.mlp.experts.{e}.{key}.weight")]
                  for key in ("gate_proj", "up_proj", "down_proj")}
        assert torch.equal(torch.cat([layers["gate_proj"], layers["up_proj"]]), experts.gate_up_proj[e])
        assert torch.equal(layers["down_proj"], experts.down_proj[e])
    assert torch.equal(stored[old_mixtral_name("model.layers.0.mlp.gate.weight")],
                       model.model.layers[0].mlp.gate.weight)


@pytest.fixture(scope="module")
def old_mixtral(tmp_path_factory):
    """The GPTQModel-made Mixtral fixture with its tensors renamed to the transformers 4 layout (bytes unchanged)."""
    folder = tmp_path_factory.mktemp("old-mixtral")
    for name in ("config.json", "quantize_config.json"):
        shutil.copy(os.path.join(_path(FIXTURES[1]), name), folder / name)
    tensors = load_file(os.path.join(_path(FIXTURES[1]), "model.safetensors"))
    renamed = {old_mixtral_name(key): value for key, value in tensors.items()}
    assert "model.layers.1.block_sparse_moe.experts.3.w3.qzeros" in renamed  # every expert and router tensor moved
    assert "model.layers.0.block_sparse_moe.gate.weight" in renamed and not any(".mlp." in key for key in renamed)
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_old_mixtral_names_load_as_the_same_experts_bit_for_bit_and_generate_the_same_tokens(old_mixtral, loaded):
    name = FIXTURES[1]
    model, reference = bitkern.load_pretrained(old_mixtral, dtype=torch.float32), _reference(name)
    stored = load_file(old_mixtral / "model.safetensors")
    for layer in range(LAYERS):
        module_name = f"model.layers.{layer}.mlp.experts"
        experts = model.get_submodule(module_name)
        assert isinstance(experts, bitkern.Experts), module_name
        intermediate = experts.projections["down"].in_features
        gate_up = experts.projections["gate_up"].dequantize_weight(torch.float16)
        down = experts.projections["down"].dequantize_weight(torch.float16)
        for e in range(EXPERTS):
            for weight, key in ((gate_up[e, :intermediate], "gate_proj"), (gate_up[e, intermediate:], "up_proj"),
                                (down[e], "down_proj")):
                assert torch.equal(_bits(weight), _bits(reference[f"{module_name}.{e}.{key}"])), (module_name, e, key)
        router = model.get_submodule(f"model.layers.{layer}.mlp.gate").weight
        assert torch.equal(router, stored[f"model.layers.{layer}.block_sparse_moe.gate.weight"].float())
    assert [n for n, m in model.named_modules() if type(m) is torch.nn.Linear] == ["lm_head"]
    exact = _float_model(name, _own_weights(name))
    assert _relative_error(_logits(model, LONG), _logits(exact, LONG)) < 1e-5
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = exact.generate(SHORT, **options)
        assert len(set(tokens[0, SHORT.shape[1]:].tolist())) > 1
        assert torch.equal(model.generate(SHORT, **options), tokens)
        assert torch.equal(loaded[name].generate(SHORT, **options), tokens)


OLD_EXPERT = "model.layers.1.block_sparse_moe.experts.2."
OLD_BAD = {
    "an expert's up projection (w3) missing": (_drop(OLD_EXPERT + "w3."), OLD_EXPERT + "w3.qweight", "missing"),
    "an expert's down projection (w2) scales in another dtype": (
        _changed(OLD_EXPERT + "w2.scales", lambda t: t[OLD_EXPERT + "w2.scales"].to(torch.bfloat16)),
        OLD_EXPERT + "w2.qweight", "share one format"),
}


@pytest.mark.parametrize("case", OLD_BAD)
def test_bad_old_mixtral_experts_are_refused_naming_the_stored_tensor(case, old_mixtral, tmp_path, no_model):
    change, tensor, what = OLD_BAD[case]
    folder = tmp_path / "checkpoint"
    shutil.copytree(old_mixtral, folder)
    save_file(change(load_file(folder / "model.safetensors")), folder / "model.safetensors", metadata={"format": "pt"})
    before = _files(folder)
    with pytest.raises(FormatError, match=re.escape(repr(tensor)) + ".*" + what):
        bitkern.load_pretrained(folder)
    assert _files(folder) == before
