"""Kernels ready before the first token in transformers: `bitkern.prepare` on a fused Llama that runs bitkern's
attention covers every kernel `generate` calls (matmuls with norm prologues and SwiGLU epilogues, decode attention),
and `from_pretrained` with `BitkernConfig(prepare=...)` returns a model whose `generate` tunes nothing."""

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


def test_prepare_in_the_config_is_checked_before_loading():
    with pytest.raises(ValueError, match=r"prepare=\(0,\) must be a positive int or a non-empty sequence"):
        BitkernConfig("int4", prepare=(0,))
