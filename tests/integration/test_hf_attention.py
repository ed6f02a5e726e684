"""The attention implementation "bitkern" (`bitkern.integration.hf.attention`): greedy generation gives
transformers' "sdpa" tokens and logits (left padding, static and dynamic caches, float32 and bfloat16, a bitkern
int4 model); eager decode steps run bitkern's decode-attention kernel with the query groups packed over the KV
heads (SDPA on the packed groups where it does not apply), and torch.compile's graph keeps them packed
(transformers' "sdpa" repeats K and V there); prompts and models without groups go to "sdpa"; a mask per query
head is honoured; bad input is named."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv

import bitkern
from bitkern.integration.hf import attention
from bitkern.integration.hf.attention import grouped_query_attention, use_grouped_attention
from bitkern.nn.attention import decode_attention

HEADS, KV_HEADS, DIM = 8, 2, 16


def _llama(kv_heads: int = KV_HEADS, dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HEADS * DIM, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=kv_heads, vocab_size=256,
                         max_position_embeddings=128)
    return LlamaForCausalLM(config).to(dtype).eval()


def _generate(model, **options):
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding of the second row
    with torch.inference_mode():
        return model.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True, **options)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The (query, key) shapes of every call of bitkern's decode-attention kernel."""
    calls = []

    def spy(query, key, value, mask=None, scale=None):
        calls.append((tuple(query.shape), tuple(key.shape)))
        return decode_attention(query, key, value, mask, scale)

    monkeypatch.setattr(attention, "decode_attention", spy)
    return calls


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The (query, key) shapes of every SDPA call the "bitkern" function makes itself."""
    calls = []

    def spy(query, key, value, **kwargs):
        calls.append((tuple(query.shape), tuple(key.shape)))
        return F.scaled_dot_product_attention(query, key, value, **kwargs)

    monkeypatch.setattr(attention, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generation_matches_sdpa_with_the_groups_packed(dtype, cache, kernel_calls, sdpa_calls):
    model = _llama(dtype=dtype)
    options = {"cache_implementation": "static"} if cache == "static" else {}
    reference = _generate(model, **options)
    assert use_grouped_attention(model) is model and model.config._attn_implementation == "bitkern"
    grouped = _generate(model, **options)
    assert torch.equal(grouped.sequences, reference.sequences)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for ours, theirs in zip(grouped.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    # each of the 9 decode steps of each layer ran the kernel on [batch x KV heads, group, dim] queries
    assert kernel_calls and all(q == (2 * KV_HEADS, HEADS // KV_HEADS, DIM) and k[0] == 2 * KV_HEADS
                                for q, k in kernel_calls)
    assert len(kernel_calls) == 9 * 2 and sdpa_calls == []


def test_a_bitkern_int4_model_generates_the_same_tokens():
    model = bitkern.quantize_model(_llama(dtype=torch.bfloat16), "int4", group_size=32,
                                   compute_dtype=torch.bfloat16, skip=["lm_head"])
    reference = _generate(model, cache_implementation="static")
    assert torch.equal(_generate(use_grouped_attention(model), cache_implementation="static").sequences,
                       reference.sequences)


def test_torch_compile_keeps_the_groups_packed():
    """The compiled decode step's graph calls bitkern's decode-attention op on [B x KV heads, group, D] queries and
    the cache's own KV heads (under "sdpa" the same graph holds K and V repeated to every query head), and computes
    what eager does."""
    from transformers import StaticCache

    model = use_grouped_attention(_llama())
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=capture, dynamic=False)
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(prompt, past_key_values=cache, use_cache=True)
        token, position = torch.tensor([[3]]), torch.tensor([5])
        expected = model(token, past_key_values=caches[0], use_cache=True, cache_position=position).logits
        logits = compiled(token, past_key_values=caches[1], use_cache=True, cache_position=position).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    shapes = [(tuple(node.args[0].meta["example_value"].shape), tuple(node.args[1].meta["example_value"].shape))
              for graph in graphs for node in graph.graph.nodes
              if node.op == "call_function" and "bitkern.decode_attention" in str(node.target)]
    assert shapes == [((KV_HEADS, HEADS // KV_HEADS, DIM), (KV_HEADS, 32, DIM))] * 2
    assert not any(node.target is F.scaled_dot_product_attention for graph in graphs for node in graph.graph.nodes)
    torch._dynamo.reset()


def test_prompts_and_models_without_groups_go_to_sdpa(sdpa_calls):
    without_groups = _llama(kv_heads=HEADS)
    reference = _generate(without_groups)
    assert torch.equal(_generate(use_grouped_attention(without_groups)).sequences, reference.sequences)
    assert sdpa_calls == []  # a prompt of 7 rows and a model without groups: transformers' sdpa
    grouped = _llama()
    module = grouped.model.layers[0].self_attn
    query, key = torch.randn(1, HEADS, 4, DIM), torch.randn(1, KV_HEADS, 4, DIM)
    ours, _ = grouped_query_attention(module, query, key, key, None, scaling=DIM ** -0.5)
    theirs = F.scaled_dot_product_attention(query, repeat_kv(key, 4), repeat_kv(key, 4), is_causal=True,
                                            scale=DIM ** -0.5)
    torch.testing.assert_close(ours, theirs.transpose(1, 2))


def test_a_mask_per_query_head_reaches_its_head():
    module = _llama().model.layers[0].self_attn
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, HEADS, 1, DIM, generator=generator)
    key, value = (torch.randn(2, KV_HEADS, 12, DIM, generator=generator) for _ in range(2))
    mask = torch.randn(2, HEADS, 1, 12, generator=generator)  # an additive bias per query head
    ours, _ = grouped_query_attention(module, query, key, value, mask, scaling=0.25)
    theirs = F.scaled_dot_product_attention(query, repeat_kv(key, 4), repeat_kv(value, 4), attn_mask=mask,
                                            scale=0.25)
    torch.testing.assert_close(ours, theirs.transpose(1, 2))


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel"):
        use_grouped_attention(torch.nn.Linear(2, 2))
    model = use_grouped_attention(_llama())
    assert model.model.layers[0].self_attn.config._attn_implementation == "bitkern"
