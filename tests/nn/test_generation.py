"""quantize_model on a transformers causal LM: the output layer (kept bf16 on bitkern's kernels by default, quantized
on request) and greedy generation through `model.generate`."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bitkern

transformers = pytest.importorskip("transformers")


def _llama(dtype=torch.bfloat16, tied=False):
    """A tiny random-weight Llama (seed 0) in `dtype`."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # a spread of logits like a trained model's, so that greedy picks are not near-ties
        model.lm_head.weight.mul_(8)
    return model


def _greedy(model, tokens: int = 24):
    prompt = torch.randint(3, 1000, (2, 6), generator=torch.Generator().manual_seed(1))
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=tokens,
                          min_new_tokens=tokens, pad_token_id=2)


class _Dispatched(TorchDispatchMode):
    """A dispatch mode that changes nothing: inside it every bitkern call goes through torch.library's op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_bf16_output_layer_runs_on_bitkern_and_greedy_tokens_stay_the_same():
    """The default output layer is the bf16 weight as it is, on bitkern's kernels, and the layers skip torch's
    dispatcher in eager inference: generate gives the tokens of the model whose output layer stays torch's and
    whose layers go through torch.library (before both changes)."""
    model = _llama()
    before = bitkern.quantize_model(copy.deepcopy(model), "int4", compute_dtype=torch.bfloat16, skip=["lm_head"])
    after = bitkern.quantize_model(copy.deepcopy(model), "int4", compute_dtype=torch.bfloat16)
    assert type(before.lm_head) is nn.Linear
    assert isinstance(after.lm_head, bitkern.Linear) and after.lm_head.weight_dtype == "bfloat16"
    assert torch.equal(after.lm_head.dequantize_weight(torch.bfloat16), model.lm_head.weight)
    with _Dispatched():
        expected = _greedy(before)
    assert torch.equal(_greedy(after), expected)


def _logits_against(expected_model, model) -> tuple[float, float]:
    """(relative error of the logits, share of positions whose top token agrees) of `model` against
    `expected_model`, over 32 fixed tokens."""
    tokens = torch.randint(3, 1000, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = expected_model(tokens).logits.float(), model(tokens).logits.float()
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean()
    return float((got - expected).norm() / expected.norm()), float(agree)


@pytest.mark.parametrize("output_layer, bound", [("int8", 0.02), ("int4", 0.2)])
def test_a_quantized_output_layer_is_opt_in_and_its_logits_stay_close_to_float(output_layer, bound, capsys):
    model = _llama()
    quantized = bitkern.quantize_model(copy.deepcopy(model), "int8", output_layer=output_layer)
    assert isinstance(quantized.lm_head, bitkern.Linear) and quantized.lm_head.weight_dtype == output_layer
    error, agree = _logits_against(bitkern.quantize_model(copy.deepcopy(model), "int8"), quantized)
    with capsys.disabled():
        print(f"\ntiny Llama, output layer {output_layer} g128 against bf16: logits relative error {error:.4f}, "
              f"top-1 agreement {agree:.2f}")
    assert error <= bound


@pytest.mark.requires_avx2
@pytest.mark.parametrize("dtype, output_layer, bound", [("int4", "auto", 0.05), ("int8", "int8", 0.05)])
def test_quantized_activations_are_opt_in_and_their_logits_stay_close(dtype, output_layer, bound, capsys):
    """activation_quant="int8" against the same weights multiplying bf16 activations: the logits' relative error and
    how often the top token agrees (printed), and greedy generation running on it."""
    model = _llama()
    plain = bitkern.quantize_model(copy.deepcopy(model), dtype, output_layer=output_layer,
                                   compute_dtype=torch.bfloat16)
    assert {m.activation_quant for m in plain.modules() if isinstance(m, bitkern.Linear)} == {"none"}
    quantized = bitkern.quantize_model(copy.deepcopy(model), dtype, output_layer=output_layer,
                                       compute_dtype=torch.bfloat16, activation_quant="int8")
    error, agree = _logits_against(plain, quantized)
    with capsys.disabled():
        print(f"\ntiny Llama, {dtype} g128 (output layer {output_layer}), int8 activations against bf16 ones: logits "
              f"relative error {error:.4f}, top-1 agreement {agree:.2f}")
    assert error <= bound
    assert _greedy(quantized, 8).shape == (2, 14)


def test_the_output_layer_stays_float_where_bf16_would_change_it():
    """'auto' stores only a bf16 weight as it is: a float32 output layer, or one tied to the input embedding,
    stays torch's; an explicit type is taken as asked, and None quantizes it like any other layer."""
    assert type(bitkern.quantize_model(_llama(torch.float32), "int4").lm_head) is nn.Linear
    tied = bitkern.quantize_model(_llama(tied=True), "int4")
    assert type(tied.lm_head) is nn.Linear and tied.lm_head.weight is tied.model.embed_tokens.weight
    assert bitkern.quantize_model(_llama(torch.float32), "int4", output_layer="bfloat16").lm_head.group_size == 256
    assert bitkern.quantize_model(_llama(), "int4", output_layer=None).lm_head.weight_dtype == "int4"
    with pytest.raises(ValueError, match=r"dtype='int9' is not supported for weights"):
        bitkern.quantize_model(_llama(), "int4", output_layer="int9")
