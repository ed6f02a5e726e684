"""`python -m bitkern prebuild --model` on mixture-of-experts models: the experts' grouped decode kernels and each
projection's dense kernels are prebuilt, so that loading the checkpoint and generating (a prompt, then one token at a
time) tunes and builds nothing; the list found on the meta device is the one a loaded model gives (Qwen3-MoE,
Mixtral, gpt-oss; a bitkern checkpoint and a float one served with a BitkernConfig); a CUDA target lists the same
kernels, its experts running CUDA's grouped decode kernel."""

import pytest
import torch

import bitkern
from bitkern.__main__ import main
from bitkern.cache import forget
from bitkern.integration.hf.config import BitkernConfig
from bitkern.integration.hf.prebuild import model_requests
from bitkern.nn.prepare import kernel_calls
from bitkern.ops.grouped import GroupedMatmul

PROMPT = 24  # 24 tokens of top-2: 48 token-expert pairs, past the grouped kernels' 32: the dense kernels
TOKENS = (1, PROMPT)
SETTINGS = dict(dtype="int4", group_size=32)
SHAPE = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=128, num_experts_per_tok=2, tie_word_embeddings=False)


def _config(architecture: str):
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

    if architecture == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4, **SHAPE)
    if architecture == "mixtral":
        return MixtralConfig(intermediate_size=32, num_local_experts=4, **SHAPE)
    return GptOssConfig(intermediate_size=32, num_local_experts=4, layer_types=["full_attention"], **SHAPE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{architecture: (float checkpoint, bitkern checkpoint)}: random bfloat16 weights, and the same quantized with
    SETTINGS and saved by save_pretrained."""
    from transformers import AutoModelForCausalLM

    folders = {}
    for architecture in ("qwen3_moe", "mixtral", "gpt_oss"):
        root = tmp_path_factory.mktemp(architecture)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(architecture)).to(torch.bfloat16).save_pretrained(root / "float")
        quantized = AutoModelForCausalLM.from_pretrained(root / "float", quantization_config=BitkernConfig(**SETTINGS))
        quantized.save_pretrained(root / "bitkern")
        folders[architecture] = (root / "float", root / "bitkern")
    return folders


def _load(folder, quantized: bool):
    from transformers import AutoModelForCausalLM

    settings = {} if quantized else {"quantization_config": BitkernConfig(**SETTINGS)}
    return AutoModelForCausalLM.from_pretrained(folder, **settings).eval()


def _loaded_requests(model, target: str = "cpu") -> set:
    """The requests `bitkern.prepare` would make ready for TOKENS on the loaded model, as prebuild requests."""
    from bitkern.cache.prebuild import kernel_requests

    calls, _ = kernel_calls(model, model.dtype, model.config.num_experts_per_tok)
    return {request for call in calls for request in
            kernel_requests([(call.spec, call.n, call.k)], call.rows(TOKENS), target)}


@pytest.mark.parametrize("architecture, quantized", [("qwen3_moe", True), ("mixtral", False)])
def test_generate_after_prebuild_builds_nothing(checkpoints, empty_cache, monkeypatch, capsys, architecture,
                                                quantized):
    folder = checkpoints[architecture][quantized]
    flags = [] if quantized else ["--dtype", "int4", "--group-size", "32"]
    assert main(["prebuild", "--model", str(folder), "--tokens", ",".join(map(str, TOKENS)), *flags]) == 0
    printed = capsys.readouterr().out
    # q and o, k/v at buckets 1 and 17..128; the experts' dense gate/up (as q: 2 new buckets) and down at every
    # bucket up to 24 rows (1, 2..4, 5..16, 17..128); the grouped gate/up with SwiGLU at a token's row, the grouped
    # down summing its two pairs
    assert "prebuild: 12 kernels for cpu (12 built, 0 already cached)" in printed, printed
    assert "(group 32, 4 experts, top 2, SwiGLU)" in printed and "(group 32, 4 experts, top 2, weighted sum)" in printed
    forget()

    def refuse(key, *args):
        raise AssertionError(f"a kernel was tuned during generate: {key}")

    monkeypatch.setattr("bitkern.cache.lookup._tuned", refuse)
    model = _load(folder, quantized)
    assert isinstance(model.model.layers[0].mlp.experts, bitkern.Experts)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                                pad_token_id=0)
    assert tokens.shape == (1, PROMPT + 3)


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("quantized", [True, False], ids=["bitkern-checkpoint", "float-checkpoint"])
def test_the_listing_on_meta_is_the_loaded_models(checkpoints, empty_cache, architecture, quantized):
    folder = checkpoints[architecture][quantized]
    settings = None if quantized else BitkernConfig(**SETTINGS)
    listed = model_requests(folder, TOKENS, settings=settings)
    loaded = _loaded_requests(_load(folder, quantized))
    assert len(listed) == len(set(listed)) and set(listed) == loaded
    grouped = {(r.spec.top_k, r.bucket, r.spec.epilogue, r.spec.combine) for r in listed
               if isinstance(r.spec, GroupedMatmul)}
    # gate/up: a token's row, its 2 experts (SwiGLU in the kernel but for gpt-oss's own gate); down: a token's 2 pairs
    gate = "none" if architecture == "gpt_oss" else "swiglu"
    assert grouped == {(2, (1, 1), gate, False), (2, (1, 1), "none", True)}


def test_a_cuda_target_lists_the_grouped_decode_kernels_as_a_cpu_does(checkpoints, empty_cache):
    """Experts on CUDA run the grouped GEMV for decode (`grouped_gemv`) as CPUs run theirs, without SwiGLU and the
    weighted top-k sum in it: the same dense kernels listed, for sm_90, and the grouped ones a GPU's experts call."""
    folder = checkpoints["qwen3_moe"][True]
    listed = model_requests(folder, TOKENS, "sm_90", dtype=torch.float16)
    on_cpu = model_requests(folder, TOKENS, "cpu", dtype=torch.float16)
    assert listed and all(r.target == "sm_90" for r in listed)
    dense = {(r.spec, r.n, r.k, r.bucket) for r in listed if not isinstance(r.spec, GroupedMatmul)}
    assert dense == {(r.spec, r.n, r.k, r.bucket) for r in on_cpu if not isinstance(r.spec, GroupedMatmul)}
    grouped = {(r.spec.top_k, r.bucket, r.spec.epilogue, r.spec.combine) for r in listed
               if isinstance(r.spec, GroupedMatmul)}
    assert grouped == {(2, (1, 1), "none", False), (1, (2, 4), "none", False)}
