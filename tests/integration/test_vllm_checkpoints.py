"""Quantized checkpoints served by a real vLLM CPU engine on bitkern's kernels (`quantization="bitkern"`): the
GPTQ, AWQ and bitsandbytes fixtures made by the real tools (tests/fixtures/formats) give the greedy tokens of the tool's
dequantized model through transformers, and every served layer dequantizes, bit for bit, to the tool's own
weights (vLLM's merged q/k/v and gate/up rows and tensor-parallel slices against the tool's separate layers).

vLLM's CPU attention has no head size 16, the fixtures' (4 heads of 16): vLLM and the reference both read the
same weights as 2 heads of 32 with one key/value head (`HEADS`, vLLM's hf_overrides).
"""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.integration.conftest import TWO_WORKERS
from tests.integration.formats_fixtures import path, reference, reference_model
from tests.integration.greedy import assert_greedy_agrees, greedy_tokens

HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
PROMPTS = [[5, 17, 33, 2, 90, 64], [1, 100, 7], [64, 12, 99, 3, 45, 8, 110, 27]]
NEW_TOKENS = 8
NEAR_TIE = 0.01  # logits; the float16 rounding of the reference's weights moves these models' logits by up to 0.002
CHECKPOINT_FILES = ("config.json", "model.safetensors")  # (the fixture's reference weights stay out of vLLM's reach)
MERGED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
# GPTQModel's act-order Qwen3-MoE (tests/fixtures/formats_moe): its experts are refused as load_pretrained refuses them
MOE_ACT_ORDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "formats_moe",
                             "gptq_qwen3_moe_4bit_actorder")


def checkpoint(tmp_path, name, directory=None):
    """A copy of the fixture's checkpoint files (config and quantized weights only); `directory`: the fixture's folder
    (default: tests/fixtures/formats/`name`)."""
    folder = tmp_path / name
    folder.mkdir()
    for file in CHECKPOINT_FILES:
        shutil.copy(f"{directory or path(name)}/{file}", folder)
    return folder


def engine(model, eager=True, **extra):
    return dict(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=128, kv_cache_memory_bytes=32 * 2**20, enforce_eager=eager,
                quantization="bitkern", hf_overrides=dict(HEADS), **extra)


def check_tokens(served, name):
    """The served greedy tokens are the reference model's (a near tie aside: the tool rounds its dequantized
    weights to float16, bitkern multiplies by the exact products, which round to those bit for bit)."""
    tokens, margins = greedy_tokens(reference_model(name, torch.float32, **HEADS), PROMPTS, NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, pad_token_id=0)
    assert_greedy_agrees(served, tokens, margins, NEAR_TIE)


def expected_weight(weights, name, rank, ranks):
    """The tool's weight that layer `name` of rank `rank` (of `ranks`) must hold: merged rows stacked, column
    slices of q (and of k and v where there are key/value heads enough; else every rank holds them whole),
    row-parallel layers cut along the inputs."""
    prefix, module = re.fullmatch(r"(model\.layers\.\d+\.)(.+)", name).groups()
    if module in MERGED:
        parts = []
        for part in MERGED[module]:
            replicated = part in ("self_attn.k_proj", "self_attn.v_proj") and HEADS["num_key_value_heads"] < ranks
            weight = weights[prefix + part]
            parts.append(weight if replicated else weight.chunk(ranks, 0)[rank])
        return torch.cat(parts)
    assert module in ROW_PARALLEL, name
    return weights[prefix + module].chunk(ranks, 1)[rank]


def check_weights(folder, name, ranks):
    """Every served layer of every rank, rounded to the tool's dtype, equals the tool's own weight bit for bit."""
    weights = reference(name)
    for rank in range(ranks):
        served = torch.load(folder / f"rank{rank}.pt")
        assert len(served) == 4 * 2, sorted(served)
        for layer, weight in served.items():
            tool = expected_weight(weights, layer, rank, ranks)
            bits = {2: torch.int16, 4: torch.int32}[tool.element_size()]
            assert torch.equal(weight.to(tool.dtype).view(bits), tool.view(bits)), layer


SERVED = {"gptq_4bit_asym_actorder": True, "gptq_3bit_asym_actorder": False, "awq_4bit_gemm": True,
          "bnb_nf4_double_quant": True}  # fixture -> eager (False: compiled)


@pytest.fixture(scope="module")
def served(run_vllm, tmp_path_factory):
    """{fixture: (greedy tokens, folder of the served weights)} of an engine per checkpoint of SERVED, all started in
    one vLLM process (one interpreter start and vLLM import for the four)."""
    runs, folders = [], {}
    for name, eager in SERVED.items():
        folder = folders[name] = tmp_path_factory.mktemp(f"served-{name}")
        runs.append({"engine": engine(checkpoint(folder, name), eager), "prompts": PROMPTS, "max_tokens": NEW_TOKENS,
                     "ignore_eos": True, "weights": str(folder)})
    result, _ = run_vllm({"runs": runs})
    return {name: (run["tokens"], folders[name]) for name, run in zip(SERVED, result["runs"])}


@pytest.mark.parametrize("name", list(SERVED), ids=["gptq-4bit-actorder-eager", "gptq-3bit-actorder-compiled",
                                                    "awq-eager", "bnb-nf4-double-quant-eager"])
def test_checkpoint_served_on_bitkern_gives_the_reference_tokens(served, name):
    tokens, folder = served[name]
    check_weights(folder, name, ranks=1)
    check_tokens(tokens, name)


def test_gptq_tensor_parallel_2(run_vllm, tmp_path):
    """Two CPU workers: each loads its partition of the GPTQ tensors (groups of 32 whole on both sides of the
    row-parallel cuts), and together they generate the reference tokens."""
    name = "gptq_4bit_sym"
    result, _ = run_vllm({"engine": engine(checkpoint(tmp_path, name), tensor_parallel_size=2), "prompts": PROMPTS,
                          "max_tokens": NEW_TOKENS, "ignore_eos": True, "weights": str(tmp_path)},
                         TWO_WORKERS)
    check_weights(tmp_path, name, ranks=2)
    check_tokens(result["tokens"], name)


def _edited(tmp_path, name, folder, quantization_config=None, drop=()):
    """A copy of fixture `name` with its quantization_config updated and tensors `drop` left out."""
    target = tmp_path / folder
    target.mkdir()
    config = json.loads(open(f"{path(name)}/config.json").read())
    config["quantization_config"].update(quantization_config or {})
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(f"{path(name)}/model.safetensors")
    save_file({key: value for key, value in tensors.items() if key not in drop}, target / "model.safetensors")
    return target


def test_bad_checkpoints_fail_at_engine_start(run_vllm, tmp_path):
    """What bitkern cannot serve exactly is refused while the engine starts, naming the problem (and the layer)."""
    cases = [
        (engine(_edited(tmp_path, "gptq_4bit_sym", "bits", {"bits": 5})),
         "quantization_config bits=5 is not supported"),
        (engine(_edited(tmp_path, "gptq_4bit_sym", "fp8", {"quant_method": "fp8"})),
         "this one is quantized with quant_method='fp8'"),
        (engine(_edited(tmp_path, "gptq_4bit_sym", "missing", drop=("model.layers.1.mlp.up_proj.qzeros",))),
         "tensor 'model.layers.1.mlp.up_proj.qzeros' is missing"),
        (engine(checkpoint(tmp_path, "gptq_4bit_asym_actorder"), tensor_parallel_size=2),
         "cannot be cut along its inputs"),
        (engine(checkpoint(tmp_path, "moe_actorder", MOE_ACT_ORDER)),
         "model.layers.0.mlp.experts: the checkpoint's experts are act-order GPTQ layers (desc_act=True)"),
    ]
    result, output = run_vllm({"cases": [case for case, _ in cases]}, TWO_WORKERS)
    for (_, message), outcome in zip(cases, result["outcomes"]):
        assert outcome["error"] is not None, (message, outcome)
        assert message in outcome["message"] or message in output, (message, outcome)
