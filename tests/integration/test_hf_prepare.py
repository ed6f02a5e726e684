"""Kernels ready before the first token in transformers: `bitkern.prepare` on a fused Llama that runs bitkern's
attention covers every kernel `generate` calls (matmuls with norm prologues and SwiGLU epilogues, decode attention),
and `from_pretrained` with `BitkernConfig(prepare=...)` returns a model whose `generate` tunes nothing; a Qwen3-MoE's
experts get their grouped and dense kernels ready too."""

import pytest
import torch

import bitkern
from bitkern.cache import forget
from bitkern.integration.hf.config import BitkernConfig

PROMPT = 16  # with one-token decode steps: the token counts (1, 16)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """One user cache for the module (the two tests share no kernel), no system cache, cost-model tuning."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BITKERN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        patch.setenv("BITKERN_SYSTEM_CACHE_DIR", str(tmp_path_factory.mktemp("system") / "absent"))
        patch.setenv("BITKERN_TUNING", "model")
        forget()
        yield
    forget()


def _forbid_building(monkeypatch):
    """From here on, tuning a matmul kernel or building an attention kernel fails the test."""
    def refuse(what):
        def raising(key, *args):
            raise AssertionError(f"{what} during generate: {key}")
        return raising

    monkeypatch.setattr("bitkern.cache.lookup._tuned", refuse("a kernel was tuned"))
    monkeypatch.setattr("bitkern.cache.attention._build", refuse("an attention kernel was built"))


def _generate(model, batch: int = 1):
    prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                              pad_token_id=0)


def test_prepare_covers_a_fused_model_with_bitkern_attention(caches, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from bitkern.integration.hf import use_grouped_attention

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    bitkern.quantize_model(model, "int4", group_size=32, skip=["lm_head"])
    bitkern.fuse(model)
    use_grouped_attention(model)
    report = bitkern.prepare(model, tokens=(1, PROMPT), progress=False)
    # q/k/v stacked with the norm prologue, o, gate/up with the norm and SwiGLU, down: x buckets 1 and 5..16;
    # attention for 2 query heads per KV head, head dim 16, no mask and a bool one
    assert (report.kernels, report.built, report.loaded) == (4 * 2 + 2, 4 * 2 + 2, 0), report
    _forbid_building(monkeypatch)
    _generate(model)


def test_from_pretrained_with_prepare_returns_a_ready_model(caches, tiny_llama, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    with caplog.at_level("INFO", logger="bitkern"):
        model = AutoModelForCausalLM.from_pretrained(
            tiny_llama, dtype=torch.float32, quantization_config=BitkernConfig("int4", group_size=64,
                                                                               prepare=(1, PROMPT)))
    assert "bitkern.prepare: 8 kernels for 1, 16 tokens (8 built" in caplog.text  # q, k/v, o, gate/up, down
    assert "prepare" not in model.config.quantization_config.to_dict()  # a loading option, not saved
    _forbid_building(monkeypatch)
    _generate(model.eval())


def test_prepare_covers_the_experts_of_a_moe_model(caches, monkeypatch, caplog):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from bitkern.nn.prepare import prepare as prepare_model

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=128, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    bitkern.quantize_model(model, "int8", group_size=32, skip=["lm_head"])
    counts = (1, 2, 24)  # 1 and 2 tokens: the grouped kernels (at most 32 pairs of top-2); 24: the dense ones
    report = bitkern.prepare(model, tokens=counts, progress=False, warmup=False)
    # q/o and k/v at 3 buckets; the experts' dense gate/up and down at every bucket up to 24 rows (an expert's
    # share of the prompt: 1, 2..4, 5..16, 17..128); the grouped gate/up (with SwiGLU) and the grouped down (summing
    # a token's pairs) at 1 and 2 tokens
    assert report.kernels == 2 * 3 + 2 * 4 + 2 + 2, report
    _forbid_building(monkeypatch)
    with torch.inference_mode():
        for count in counts:
            model(input_ids=torch.randint(0, config.vocab_size, (1, count)))
    with caplog.at_level("INFO", logger="bitkern"):
        unknown = prepare_model(model, counts, progress=False)
    assert unknown.kernels == 2 * 3 + 2 * 4 and unknown.built == 0
    assert "model.layers.0.mlp.experts (grouped kernels: top_k unknown)" in caplog.text


def test_prepare_in_the_config_is_checked_before_loading():
    with pytest.raises(ValueError, match=r"prepare=\(0,\) must be a positive int or a non-empty sequence"):
        BitkernConfig("int4", prepare=(0,))


def _llama(positions: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=positions)
    model = LlamaForCausalLM(config).eval()
    bitkern.quantize_model(model, "int4", group_size=32, skip=["lm_head"])
    return model


def _forward_lengths(model) -> list:
    """The sequence lengths of the forwards `model` runs from now on."""
    lengths = []
    model.register_forward_pre_hook(lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape),
                                    with_kwargs=True)
    return lengths


def test_prepare_warms_a_transformers_model_up_at_its_small_counts(caches, caplog):
    model = _llama()
    lengths = _forward_lengths(model)
    weights = {name: t.clone() for name, t in (*model.named_parameters(), *model.named_buffers())}
    rng = torch.get_rng_state()
    with caplog.at_level("INFO", logger="bitkern"):
        report = bitkern.prepare(model, tokens=(1, 12, PROMPT, 130), progress=False)
    # one forward per bucket, the smallest count of each (12 and 16 share 5..16); 130 > 128: prepared, not run
    assert report.warmed == (1, 12) and lengths == [(1, 1), (1, 12)]
    assert "warmed up at 1, 12 tokens" in str(report) and "warmed up with a forward at 1, 12 tokens" in caplog.text
    assert torch.equal(torch.get_rng_state(), rng) and not model.training
    assert all(torch.equal(t, weights[name]) for name, t in (*model.named_parameters(), *model.named_buffers()))


def test_prepare_without_warmup_runs_no_forward(caches):
    model = _llama()
    lengths = _forward_lengths(model)
    assert bitkern.prepare(model, tokens=(1, PROMPT), progress=False, warmup=False).warmed == () and lengths == []


def test_warmup_skips_what_the_model_cannot_take_and_says_so(caches, caplog):
    model = _llama(positions=8)
    lengths = _forward_lengths(model)
    with caplog.at_level("INFO", logger="bitkern"):
        assert bitkern.prepare(model, tokens=(1, PROMPT), progress=False).warmed == (1,)
    assert lengths == [(1, 1)] and f"no warm-up forward at [{PROMPT}] tokens (past the model's 8 positions)" \
        in caplog.text
    model.train()
    with caplog.at_level("INFO", logger="bitkern"):
        assert bitkern.prepare(model, tokens=1, progress=False).warmed == ()
    assert lengths == [(1, 1)] and "no warm-up forward (the model is in training mode)" in caplog.text


def test_a_failed_warmup_forward_is_logged_and_keeps_the_prepared_kernels(caches, caplog):
    model = _llama()

    def refuse_long(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            raise RuntimeError("this model takes one token at a time")

    model.register_forward_pre_hook(refuse_long, with_kwargs=True)
    with caplog.at_level("INFO", logger="bitkern"):
        report = bitkern.prepare(model, tokens=(1, PROMPT), progress=False)
    assert report.warmed == (1,) and report.kernels == 4 * 2  # 4 weight shapes x buckets 1 and 5..16
    assert f"the warm-up forward at {PROMPT} tokens failed (RuntimeError: this model takes one token at a time)" \
        in caplog.text
