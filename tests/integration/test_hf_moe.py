"""Mixture-of-experts models in transformers with `BitkernConfig`: tiny random Qwen3-MoE, Mixtral and gpt-oss
(built from configs, 2 layers, hidden 64, 8 experts of 32, top-2) get their experts quantized on load to int8 (bit
for bit `bitkern.quantize_model`), with the saved checkpoint's size proving it; logits within 5% of the float
model; save/reload bitwise in a fresh process; greedy tokens equal to a float model of the dequantized weights;
overrides by pattern (experts int4, attention int8), experts kept float by name and logged.  One int8 model per
architecture serves every test (one set of kernels to build)."""

import copy
import logging
import subprocess
import sys

import pytest
import safetensors
import torch
from torch import nn

import bitkern
from bitkern.integration.hf.config import BitkernConfig

PROMPT = torch.tensor([[3, 17, 100, 33, 95, 4, 120, 61]])
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=128, num_experts_per_tok=2, tie_word_embeddings=False)


def _config(arch: str):
    import transformers

    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=8, **SHAPE)
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, **SHAPE)
    return transformers.GptOssConfig(intermediate_size=32, num_local_experts=8, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"], **SHAPE)


ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> a float32 checkpoint of the tiny model (biases random too, where the model has them)."""
    from transformers import AutoModelForCausalLM

    paths = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(arch))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.1)
        paths[arch] = tmp_path_factory.mktemp(arch)
        model.save_pretrained(paths[arch])
    return paths


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """arch -> the model loaded with BitkernConfig("int8", group_size=32) (once each)."""
    from transformers import AutoModelForCausalLM

    models = {}

    def load(arch):
        if arch not in models:
            models[arch] = AutoModelForCausalLM.from_pretrained(
                checkpoints[arch], quantization_config=BitkernConfig("int8", group_size=32)).eval()
        return models[arch]

    return load


def _float_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _logits(model):
    with torch.no_grad():
        return model(PROMPT).logits


def _body_bytes(folder) -> int:
    """Bytes of the checkpoint's tensors but the embeddings and the output layer."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with safetensors.safe_open(str(file), "pt") as checkpoint:
            for key in checkpoint.keys():
                if "embed_tokens" not in key and "lm_head" not in key:
                    total += checkpoint.get_tensor(key).nbytes
    return total


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_are_quantized_on_load_as_quantize_model_does_and_the_checkpoint_shrinks(arch, checkpoints, loaded,
                                                                                         tmp_path):
    model = loaded(arch)
    reference = bitkern.quantize_model(_float_model(checkpoints[arch]), "int8", group_size=32, skip=["lm_head"])
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, bitkern.Experts) and experts.down.weight_dtype == "int8"
    assert not [name for name, p in model.named_parameters() if p.dim() == 3]
    mine, theirs = model.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    for key, tensor in mine.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, theirs[key]), key
    assert torch.equal(_logits(model), _logits(reference))
    model.save_pretrained(tmp_path)
    ratio = _body_bytes(tmp_path) / _body_bytes(checkpoints[arch])
    assert ratio < 0.3, ratio  # int8 in groups of 32 with float16 scales: 8.5 of 32 bits; norms, routers float


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_logits_are_within_five_percent_of_the_float_model(arch, checkpoints, loaded):
    expected = _logits(_float_model(checkpoints[arch]))
    assert float((_logits(loaded(arch)) - expected).norm() / expected.norm()) < 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_a_float_model_of_the_dequantized_weights(arch, loaded):
    model = loaded(arch)
    dequantized = bitkern.dequantize_model(copy.deepcopy(model))
    assert not any(isinstance(m, (bitkern.Experts, bitkern.Linear)) for m in dequantized.modules())
    options = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(PROMPT, **options), dequantized.generate(PROMPT, **options))


RELOAD = """
import sys, torch, bitkern
from transformers import AutoModelForCausalLM
prompt = torch.tensor([[3, 17, 100, 33, 95, 4, 120, 61]])
results = {}
for path in sys.argv[1:-1]:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert all(isinstance(layer.mlp.experts, bitkern.Experts) for layer in model.model.layers)
    with torch.no_grad():
        logits = model(prompt).logits
    results[path] = (logits, model.generate(prompt, max_new_tokens=6, do_sample=False))
torch.save(results, sys.argv[-1])
"""


def test_save_and_reload_in_a_fresh_process_is_bitwise(loaded, tmp_path):
    folders = {arch: tmp_path / arch for arch in ARCHS}
    for arch, folder in folders.items():
        loaded(arch).save_pretrained(folder)
    result = subprocess.run([sys.executable, "-c", RELOAD, *map(str, folders.values()), str(tmp_path / "out.pt")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reloaded = torch.load(tmp_path / "out.pt")
    for arch, folder in folders.items():
        logits, tokens = reloaded[str(folder)]
        assert torch.equal(logits, _logits(loaded(arch))), arch
        assert torch.equal(tokens, loaded(arch).generate(PROMPT, max_new_tokens=6, do_sample=False)), arch


def test_overrides_by_pattern_and_experts_kept_float_are_logged(checkpoints, caplog):
    from transformers import AutoModelForCausalLM

    config = BitkernConfig("int8", group_size=32, overrides={"experts": {"dtype": "int4"}},
                           modules_to_not_convert=["model.layers.1.mlp.experts"])
    with caplog.at_level(logging.INFO, logger="bitkern"):
        model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], quantization_config=config)
    first, second = model.model.layers
    assert first.mlp.experts.gate_up.weight_dtype == first.mlp.experts.down.weight_dtype == "int4"
    assert first.self_attn.q_proj.weight_dtype == "int8" and second.self_attn.o_proj.weight_dtype == "int8"
    assert type(second.mlp.experts).__name__ == "Qwen3MoeExperts" and second.mlp.experts.down_proj.dim() == 3
    assert type(model.lm_head) is nn.Linear
    report = next(r.getMessage() for r in caplog.records if "of the parameters quantized" in r.getMessage())
    assert "model.layers.1.mlp.experts.gate_up_proj [8, 64, 64] (128.0 KiB)" in report
    assert "lm_head.weight [128, 64]" in report


def test_a_checkpoint_for_other_experts_is_refused_naming_them_before_any_tensor_is_read(loaded, tmp_path):
    from transformers import AutoModelForCausalLM

    loaded("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"does not fit this model.*model\.layers\.0\.mlp\.experts\.gate_up: weight "
                                         r"is \[8, 64, 16\] int32, expected \[4, 64, 16\] int32"):
        AutoModelForCausalLM.from_pretrained(tmp_path, num_experts=4)


def test_quantize_on_load_takes_one_experts_weight_at_a_time(checkpoints, monkeypatch):
    """Each 3-D weight (a layer's gate/up or down of all experts) is quantized as transformers hands it over, while
    the model's float experts tensors stay empty (meta): the float experts never exist whole."""
    from transformers import AutoModelForCausalLM

    from bitkern.integration.hf.quantizer import BitkernHfQuantizer

    calls, original = [], BitkernHfQuantizer.quantize_experts_weight

    def recording(self, model, name, parameter, weight):
        materialized = [n for n, p in model.named_parameters() if p.dim() == 3 and not p.is_meta]
        calls.append((name, parameter, tuple(weight.shape), materialized))
        original(self, model, name, parameter, weight)

    monkeypatch.setattr(BitkernHfQuantizer, "quantize_experts_weight", recording)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["mixtral"],
                                                 quantization_config=BitkernConfig("int4", group_size=32))
    assert sorted((name, parameter) for name, parameter, _, _ in calls) == [
        (f"model.layers.{layer}.mlp.experts", parameter) for layer in (0, 1) for parameter in ("down_proj",
                                                                                             "gate_up_proj")]
    assert all(materialized == [] for *_, materialized in calls)
    assert {shape for _, _, shape, _ in calls} == {(8, 64, 32), (8, 64, 64)}
    assert all(isinstance(layer.mlp.experts, bitkern.Experts) for layer in model.model.layers)


def test_settings_that_fit_neither_linears_nor_experts_are_refused_together(checkpoints):
    """One error names every nn.Linear and experts module the settings do not fit, before anything is replaced."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="cannot quantize these layers as configured") as error:
        AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"],
                                             quantization_config=BitkernConfig("int4", group_size=48))
    assert "model.layers.0.self_attn.q_proj (in_features 64)" in str(error.value)
    assert "model.layers.1.mlp.experts: " in str(error.value)
