"""The decode attention registered with transformers (integration/hf/attention.py): one query row against a float64
reference of softmax attention with grouped key/value heads, prompts through transformers' own "sdpa", and greedy
generation of a quantized Llama unchanged by it."""

import copy

import pytest
import torch

import bitkern
from bitkern.integration.hf.attention import NAME, decode_attention, use_decode_attention

transformers = pytest.importorskip("transformers")


class _Attention(torch.nn.Module):
    """What transformers passes as `module`: the attention layer (its grouping and training flag are read)."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _reference(query, key, value, mask, scale):
    """softmax(q·kᵀ·scale + mask)·v in float64, key/value heads repeated for their query heads; [b, rows, h, d]."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query.double() @ key.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ value).transpose(1, 2)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_one_row_matches_the_reference(dtype, tolerance, kv_heads, mask):
    generator = torch.Generator().manual_seed(kv_heads)
    batch, heads, length, dim = 2, 8, 37, 64
    query = torch.randn(batch, 1, heads, dim, generator=generator).to(dtype).transpose(1, 2)  # as the layer's view
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator).to(dtype) for _ in range(2))
    masks = {"none": None, "bool": torch.rand(batch, 1, 1, length, generator=generator) > 0.3,
             "additive": torch.randn(batch, 1, 1, length, generator=generator).to(dtype)}
    masks["bool"][..., 0] = True  # every row attends somewhere
    output, weights = decode_attention(_Attention(heads // kv_heads), query, key, value, masks[mask], scaling=0.3)
    expected = _reference(query, key, value, masks[mask], 0.3)
    assert weights is None and output.dtype == dtype and output.shape == (batch, 1, heads, dim)
    assert torch.allclose(output.double(), expected, atol=tolerance, rtol=tolerance)


def test_prompt_rows_go_to_sdpa():
    """More than one query row (the prompt) runs transformers' "sdpa" function itself: the same tensor."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 5, 64, generator=generator)
    key, value = (torch.randn(1, 2, 5, 64, generator=generator) for _ in range(2))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    module = _Attention(4)
    assert torch.equal(decode_attention(module, query, key, value, mask)[0],
                       sdpa_attention_forward(module, query, key, value, mask)[0])


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generation_is_unchanged(cache):
    """A bf16 Llama quantized to int4 and fused (the benchmark's model, tiny) generates the same greedy tokens with
    the decode attention as with "sdpa", for a batch with a left-padded row (the mask matters)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                      bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # a spread of logits like a trained model's, so that greedy picks are not near-ties
        model.lm_head.weight.mul_(8)
    bitkern.quantize_model(model, "int4", compute_dtype=torch.bfloat16)
    bitkern.fuse(model)
    decoding = copy.deepcopy(model)
    use_decode_attention(decoding)
    assert decoding.config._attn_implementation == NAME and model.config._attn_implementation == "sdpa"
    prompt = torch.randint(3, 1000, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding

    def greedy(llama):
        return llama.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=20, eos_token_id=None,
                              pad_token_id=2, cache_implementation=cache if cache == "static" else None)

    assert torch.equal(greedy(decoding), greedy(model))
