"""`bitkern.compile`: the model's forward compiled in place with Inductor's C++ wrapper and no guards on the model's
modules, giving the eager model's results; the inputs are still guarded, compiling again picks up a change to the
modules, and two models of one class compiled apart never share a graph."""

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import bitkern

transformers = pytest.importorskip("transformers")


class Scaled(nn.Module):
    """y = factor · W₄x: `factor` a plain attribute the forward reads (a module attribute dynamo would guard)."""

    def __init__(self, seed: int = 0, factor: float = 1.0, dtype: str = "int4"):
        super().__init__()
        torch.manual_seed(seed)
        self.layer = bitkern.quantize_model(nn.Linear(64, 32, bias=False), dtype, group_size=32,
                                            compute_dtype=torch.float32)
        self.factor = factor

    def forward(self, x):
        return self.factor * self.layer(x)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from an empty dynamo cache, and leaves none behind."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=None):
        yield
    torch._dynamo.reset()


def test_the_module_is_not_guarded_its_inputs_are_and_compiling_again_sees_a_change():
    model = Scaled()
    x, rows = torch.randn(2, 64), torch.randn(5, 64)
    with torch.no_grad():
        expected = model.layer(x)
        assert bitkern.compile(model) is model
        _, code = run_and_get_code(model, x)
        assert torch.equal(model(x), expected)
        assert torch.equal(model(rows), model.layer(rows))  # a new input shape: a new graph, not the old one's rows
        model.factor = 2.0  # not seen: the compiled code does not check the module's attributes
        assert torch.equal(model(x), expected)
        bitkern.compile(model)
        assert torch.equal(model(x), 2 * expected)
    assert any("extern \"C\"" in source or "AOTI_TORCH" in source for source in code), \
        "the graph did not run through Inductor's C++ wrapper"


def test_two_models_of_one_class_compiled_apart_run_their_own_graphs():
    first, second = Scaled(), Scaled(seed=1, factor=3.0, dtype="nf4")
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = first.layer(x), 3 * second.layer(x)
        bitkern.compile(first, options={"cpp_wrapper": False})
        bitkern.compile(second, options={"cpp_wrapper": False})
        assert torch.equal(first(x), expected[0]) and torch.equal(second(x), expected[1])


@pytest.mark.parametrize("options", [dict(options={"cpp_wrapper": False, "guard_filter_fn": None}, dynamic=False),
                                     dict(options={"cpp_wrapper": False}, fullgraph=False)])
def test_options_given_override_the_defaults_and_graph_breaks_keep_the_guards(options):
    model = Scaled()
    x = torch.randn(2, 64)
    with torch.no_grad():
        bitkern.compile(model, **options)
        _, code = run_and_get_code(model, x)
        model.factor = 3.0  # guarded again: seen at the next call
        assert torch.equal(model(x), 3 * model.layer(x))
    assert not any("AOTI_TORCH" in source for source in code)


def _llama():
    """A tiny Llama, quantized to int4 and fused."""
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return bitkern.fuse(_quantized(transformers.LlamaForCausalLM(config), 64))


def _qwen3_moe():
    """A tiny Qwen3-MoE, top-2 of 4 experts, quantized to int4: a 20-token prompt's 40 token-expert pairs run the
    experts' dense blocks inside the graph (`expert_blocks`), the decode steps the grouped kernels."""
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, vocab_size=128, num_experts=4, num_experts_per_tok=2,
                                         tie_word_embeddings=False, eos_token_id=2)
    return _quantized(transformers.Qwen3MoeForCausalLM(config), 32)


def _quantized(model, group_size: int):
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # logits spread like a trained model's: greedy picks are not near-ties
    return bitkern.quantize_model(model, "int4", group_size=group_size, compute_dtype=torch.bfloat16)


@pytest.mark.parametrize("make, prompt_tokens", [(_llama, 6), (_qwen3_moe, 20)], ids=["llama", "qwen3-moe"])
def test_a_compiled_model_generates_the_eager_tokens(make, prompt_tokens):
    torch.manual_seed(0)
    model = make()
    prompt = torch.randint(3, 128, (1, prompt_tokens), generator=torch.Generator().manual_seed(1))

    def greedy():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8,
                              min_new_tokens=8, pad_token_id=2, cache_implementation="static")

    with torch.inference_mode():
        expected = greedy()
        bitkern.compile(model, dynamic=False)
        assert torch.equal(greedy(), expected)


def test_what_is_not_a_module_or_an_options_dict_is_refused():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        bitkern.compile(lambda x: x)
    with pytest.raises(TypeError, match="options must be a dict"):
        bitkern.compile(Scaled(), options=["cpp_wrapper"])
    model = Scaled()
    model.forward = lambda x: x
    with pytest.raises(TypeError, match="model.forward must be a Python method of the model"):
        bitkern.compile(model)

