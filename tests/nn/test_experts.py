"""`bitkern.Experts` (bitkern/nn/experts.py): quantized mixture-of-experts experts against a pure-torch float64
reference over every type family, top-k 1..8, experts without tokens and one expert taking every token; a
transformers experts module (gpt-oss: transposed weights, biases, its clamped gate) through `from_float`;
`quantize_model` / `dequantize_model`, `bitkern.save` / `bitkern.load` (transactional), bad input refused by name
before any kernel is built.  Shapes are tiny: hidden 64, intermediate 32, so each kernel builds in well under a
second."""

import logging

import pytest
import torch
from torch import nn

import bitkern
from bitkern.nn.experts import ExpertWeights, swiglu

HIDDEN, INTERMEDIATE = 64, 32


def reference(experts: bitkern.Experts, x, top_k_index, top_k_weights, gate=swiglu) -> torch.Tensor:
    """Σ_k w · down_e(gate(gate_up_e(x) + b)) + b, token by token in float64 from the dequantized weights."""
    gate_up, down = (experts.gate_up.dequantize_weight(torch.float64), experts.down.dequantize_weight(torch.float64))
    biases = [None if p.bias is None else p.bias.double() for p in (experts.gate_up, experts.down)]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for slot in range(top_k_index.shape[1]):
            e = int(top_k_index[token, slot])
            h = gate_up[e] @ x[token].double() + (0 if biases[0] is None else biases[0][e])
            y = down[e] @ gate(h.unsqueeze(0))[0] + (0 if biases[1] is None else biases[1][e])
            out[token] += float(top_k_weights[token, slot]) * y
    return out


def _relative_error(actual, expected) -> float:
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30))


def _routing(tokens: int, experts: int, top_k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=generator)
    weights, index = scores.topk(top_k, dim=-1)
    return index, torch.softmax(weights, dim=-1)


# every type family: integers of 2 to 8 bits (symmetric and with zero points), code books, float4, MX and NVFP4
# (block scales; a tensor scale per expert), float8
TYPES = {"int2": 32, "int3": 32, "uint4": 32, "int4": 32, "int8": 32, "nf4": 32, "fp4_e2m1": 32, "mxfp4": None,
         "nvfp4": None, "float8_e4m3": -1}


@pytest.mark.parametrize("dtype", list(TYPES))
def test_experts_match_the_reference_in_every_type_family(dtype):
    torch.manual_seed(1)
    experts = bitkern.Experts(4, HIDDEN, INTERMEDIATE, dtype=dtype, group_size=TYPES[dtype])
    x = torch.randn(6, HIDDEN)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])  # 3 rows per expert: one M bucket
    weights = torch.rand(6, 2)
    out = experts(x, index, weights)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert _relative_error(out, reference(experts, x, index, weights)) < 1e-5
    assert experts.gate_up.weight_dtype == experts.down.weight_dtype == dtype


@pytest.mark.parametrize("top_k", range(1, 9))
def test_top_k_from_one_to_eight(top_k):
    torch.manual_seed(2)
    experts = bitkern.Experts(8, HIDDEN, INTERMEDIATE, dtype="int4", group_size=32)
    x = torch.randn(5, HIDDEN)
    index, weights = _routing(5, 8, top_k, seed=top_k)
    assert _relative_error(experts(x, index, weights), reference(experts, x, index, weights)) < 1e-5


def test_experts_without_tokens_and_one_expert_taking_every_token():
    torch.manual_seed(3)
    experts = bitkern.Experts(8, HIDDEN, INTERMEDIATE, dtype="int4", group_size=32)
    x = torch.randn(20, HIDDEN)
    every = torch.zeros(20, 1, dtype=torch.long) + 5  # expert 5 takes all 20 tokens, the 7 others none
    weights = torch.rand(20, 1)
    assert _relative_error(experts(x, every, weights), reference(experts, x, every, weights)) < 1e-5
    empty = experts(x[:0], every[:0], weights[:0])
    assert empty.shape == (0, HIDDEN)


@pytest.mark.parametrize("activation_quant", ["none", "int8"])
def test_a_compiled_graph_runs_a_prompts_experts_in_one_op_with_the_eager_results(activation_quant):
    """fullgraph: the rows per expert (an empty one, one taking most) reach `expert_blocks` as a tensor, not as
    shapes; the graph gives the eager module's output, and the op refuses counts that do not sum to the rows."""
    torch.manual_seed(8)
    experts = bitkern.Experts(4, HIDDEN, INTERMEDIATE, dtype="int4", group_size=32, activation_quant=activation_quant)
    x = torch.randn(40, HIDDEN)  # 80 token-expert pairs: the prompt path
    index = torch.tensor([[0, 1]] * 30 + [[1, 3]] * 10)  # expert 2 takes none, expert 1 every token
    weights = torch.rand(40, 2)
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = experts(x, index, weights)
        assert torch.equal(compiled(x, index, weights), expected)
        weight = [experts.down._buffers[name] for name in bitkern.nn.storage.WEIGHT_BUFFERS]
        with pytest.raises(ValueError, match="counts must give the rows of each expert"):
            torch.ops.bitkern.expert_blocks(x[:, :INTERMEDIATE], weight, experts.down._format_text,
                                            torch.tensor([1, 2, 3, 4]), None, torch.float32)
    torch._dynamo.reset()


def test_int8_activations_quantize_each_experts_rows_in_the_kernel():
    torch.manual_seed(7)
    experts = bitkern.Experts(4, HIDDEN, INTERMEDIATE, dtype="int4", group_size=32, activation_quant="int8")
    assert experts.gate_up.activation_quant == experts.down.activation_quant == "int8"
    x = torch.randn(6, HIDDEN)
    index, weights = _routing(6, 4, 2)
    assert _relative_error(experts(x, index, weights), reference(experts, x, index, weights)) < 0.03


def test_int8_activations_decode_by_the_grouped_vnni_kernel_eager_and_compiled(monkeypatch):
    """A few tokens with activation_quant="int8" take the grouped kernels (the grouped VNNI template), one call per
    projection, eager and in a fullgraph compiled graph alike; the result is the per-expert path's (the dense VNNI
    kernel, expert by expert) up to the kernels' float32 sums."""
    from bitkern.nn import experts as experts_module

    torch.manual_seed(9)
    experts = bitkern.Experts(8, HIDDEN, INTERMEDIATE, dtype="int4", group_size=32, activation_quant="int8")
    x = torch.randn(3, HIDDEN)
    assert all(p.routes(x) for p in experts.projections.values())
    routed_calls = []
    routed = ExpertWeights.routed
    monkeypatch.setattr(ExpertWeights, "routed",
                        lambda self, *a, **kw: routed_calls.append(1) or routed(self, *a, **kw))
    index, weights = _routing(3, 8, 4)
    with torch.no_grad():
        fast = experts(x, index, weights)
        assert len(routed_calls) == 2
        torch._dynamo.reset()
        compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")(x, index, weights)
        torch._dynamo.reset()
        with monkeypatch.context() as patch:
            patch.setattr(experts_module, "GROUPED_PAIRS", 0)
            slow = experts(x, index, weights)
    assert torch.equal(compiled, fast)
    assert _relative_error(fast, slow.double()) < 1e-4
    assert _relative_error(fast, reference(experts, x, index, weights)) < 0.03


def test_bfloat16_inputs_give_bfloat16_outputs():
    torch.manual_seed(4)
    experts = bitkern.Experts(4, HIDDEN, INTERMEDIATE, dtype="int8", group_size=32)
    x = torch.randn(3, HIDDEN)
    index, weights = _routing(3, 4, 2)
    out = experts(x.bfloat16(), index, weights.bfloat16())
    assert out.dtype == torch.bfloat16
    assert _relative_error(out.float(), reference(experts, x, index, weights)) < 0.02


def _gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=4,
                          num_experts_per_tok=2)
    config._experts_implementation = "eager"
    module = GptOssExperts(config)
    torch.manual_seed(5)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.5)
    return module


def test_a_transformers_experts_module_with_biases_transposed_weights_and_its_own_gate():
    """gpt-oss stores [E, K, N] weights with biases and gates with a clamped, interleaved SwiGLU: the quantized
    experts keep its gate and equal its own forward over the dequantized weights."""
    module = _gpt_oss_experts()
    experts = bitkern.Experts.from_float(module, {"dtype": "int8", "group_size": 32})
    assert experts.gate_up.bias is not None and experts.gate_up.weight_shape == (4, 2 * INTERMEDIATE, HIDDEN)
    x = torch.randn(5, HIDDEN) * 3
    index, weights = _routing(5, 4, 2)
    float_module = experts.dequantize(torch.float32)
    assert type(float_module) is type(module) and float_module.gate_up_proj.shape == module.gate_up_proj.shape
    with torch.no_grad():
        expected = float_module(x, index, weights)
    assert _relative_error(experts(x, index, weights), expected.double()) < 1e-5
    assert _relative_error(experts(x, index, weights), reference(experts, x, index, weights, module._apply_gate)) < 1e-5


def test_bad_input_is_refused_by_name_before_any_kernel_is_built(monkeypatch):
    experts = bitkern.Experts(4, HIDDEN, INTERMEDIATE, dtype="int4", group_size=32)
    monkeypatch.setattr(ExpertWeights, "grouped", lambda *a, **k: pytest.fail("a kernel ran"))
    x = torch.randn(2, HIDDEN)
    index, weights = _routing(2, 4, 2)
    with pytest.raises(ValueError, match="top_k_index holds expert ids outside"):
        experts(x, index + 3, weights)
    with pytest.raises(TypeError, match="top_k_index must be an int32/int64"):
        experts(x, index.float(), weights)
    with pytest.raises(ValueError, match="top_k_weights must be"):
        experts(x, index, weights[:, :1])
    with pytest.raises(ValueError, match=f"hidden_states must be a \\[tokens, {HIDDEN}\\]"):
        experts(x[:, :10], index, weights)
    with pytest.raises(ValueError, match="dtype='int5' is not supported"):
        bitkern.Experts(4, HIDDEN, INTERMEDIATE, dtype="int5")
    with pytest.raises(ValueError, match="num_experts=0"):
        bitkern.Experts(0, HIDDEN, INTERMEDIATE)
    with pytest.raises(TypeError, match="gate must be a callable"):
        bitkern.Experts(4, HIDDEN, INTERMEDIATE, gate="silu")
    with pytest.raises(ValueError, match="module must be a transformers experts module"):
        bitkern.Experts.from_float(nn.Linear(4, 4), {"dtype": "int4"})


def _tiny_qwen3_moe(num_experts: int = 4):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTERMEDIATE,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            vocab_size=128, num_experts=num_experts, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(6)
    return Qwen3MoeForCausalLM(config).eval(), config


def test_quantize_model_quantizes_experts_reports_the_share_and_dequantizes_back(caplog):
    model, _ = _tiny_qwen3_moe()
    experts_weight = model.model.layers[0].mlp.experts.down_proj.detach().clone()
    with caplog.at_level(logging.INFO, logger="bitkern"):
        bitkern.quantize_model(model, "int4", group_size=32, skip=["model.layers.1.mlp.experts"])
    assert isinstance(model.model.layers[0].mlp.experts, bitkern.Experts)
    assert not isinstance(model.model.layers[1].mlp.experts, bitkern.Experts)
    assert "quantized 8 layers and 1 experts modules to int4" in caplog.text
    report = next(r.getMessage() for r in caplog.records if "of the parameters quantized" in r.getMessage())
    assert "model.layers.1.mlp.experts.gate_up_proj [4, 64, 64] (64.0 KiB)" in report
    assert "model.embed_tokens.weight [128, 64]" in report and "model.layers.0.mlp.gate.weight [4, 64]" in report
    down = model.model.layers[0].mlp.experts.down
    bitkern.dequantize_model(model)
    restored = model.model.layers[0].mlp.experts
    assert type(restored).__name__ == "Qwen3MoeExperts"
    assert torch.equal(restored.down_proj, down.dequantize_weight())
    assert (restored.down_proj - experts_weight).abs().max() < 0.1 * experts_weight.abs().max()


def test_save_and_load_round_trip_into_a_float_model_and_a_bad_file_changes_nothing(tmp_path):
    model, config = _tiny_qwen3_moe()
    from transformers import Qwen3MoeForCausalLM

    bitkern.quantize_model(model, "nf4", group_size=32)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        expected = model(ids).logits
    bitkern.save(model, tmp_path / "model.safetensors")
    target = Qwen3MoeForCausalLM(config).eval()
    bitkern.load(target, tmp_path / "model.safetensors")
    assert isinstance(target.model.layers[1].mlp.experts, bitkern.Experts)
    with torch.no_grad():
        assert torch.equal(target(ids).logits, expected)

    other, _ = _tiny_qwen3_moe()
    bitkern.quantize_model(other, "int4", group_size=32)
    bitkern.save(other, tmp_path / "int4.safetensors")
    fresh = Qwen3MoeForCausalLM(config).eval()
    with pytest.raises(ValueError, match="int4.safetensors"):  # fits the float model, not nf4 experts
        bitkern.load(target, tmp_path / "int4.safetensors")
    assert target.model.layers[1].mlp.experts.down.weight_dtype == "nf4"
    wider, _ = _tiny_qwen3_moe(num_experts=8)
    with pytest.raises(ValueError, match="experts"):
        bitkern.load(wider, tmp_path / "int4.safetensors")
    assert all(not isinstance(m, bitkern.Experts) for m in wider.modules())
    bitkern.load(fresh, tmp_path / "int4.safetensors")
    assert fresh.model.layers[0].mlp.experts.gate_up.weight_dtype == "int4"


def test_shared_experts_follow_the_other_layers_and_the_router_stays_float(caplog):
    """Qwen2-MoE: the shared expert's nn.Linears take the model's settings like any layer; the router, a bare
    parameter, stays float and is listed by name and size."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTERMEDIATE,
                            shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, num_experts=4, num_experts_per_tok=2,
                            tie_word_embeddings=False)
    model = Qwen2MoeForCausalLM(config)
    with caplog.at_level(logging.INFO, logger="bitkern"):
        bitkern.quantize_model(model, "int4", group_size=32)
    block = model.model.layers[0].mlp
    assert isinstance(block.experts, bitkern.Experts)
    assert all(isinstance(getattr(block.shared_expert, name), bitkern.Linear) and
               getattr(block.shared_expert, name).weight_dtype == "int4" for name in ("gate_proj", "up_proj",
                                                                                      "down_proj"))
    assert "model.layers.0.mlp.gate.weight [4, 64] (1.0 KiB)" in caplog.text


def _tiny_moe_layer(arch: str):
    """The experts module of layer 0 of a tiny random Qwen3-MoE or Mixtral, quantized to int4 (groups of 32)."""
    import transformers

    shape = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=128, num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=INTERMEDIATE, num_experts=8,
                                             **shape)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(intermediate_size=INTERMEDIATE, num_local_experts=8, **shape)
        model = transformers.MixtralForCausalLM(config)
    torch.manual_seed(8)
    bitkern.quantize_model(model.eval(), "int4", group_size=32)
    return model.model.layers[0].mlp.experts


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_decode_runs_one_grouped_call_per_projection_equal_to_the_per_expert_path(arch, monkeypatch):
    """A few tokens (at most GROUPED_PAIRS token-expert pairs) take the grouped kernel, one call per projection, the
    model's SwiGLU (transformers' default gate with silu) in the first one's output stage and the weighted top-k sum in
    the second one's; its output equals the per-expert path's (dense kernels, expert by expert) within the kernels'
    bound, both against the float64 reference; more pairs (a prompt) take the per-expert path."""
    from bitkern.nn import experts as experts_module

    experts = _tiny_moe_layer(arch)
    assert isinstance(experts, bitkern.Experts) and experts.gate_is_swiglu
    routed_calls, per_expert_calls = [], []
    routed, grouped = ExpertWeights.routed, ExpertWeights.grouped
    monkeypatch.setattr(ExpertWeights, "routed",
                        lambda self, *a, **kw: routed_calls.append(kw) or routed(self, *a, **kw))
    monkeypatch.setattr(ExpertWeights, "grouped", lambda self, *a: per_expert_calls.append(1) or grouped(self, *a))
    for tokens, top_k in ((1, 2), (1, 8), (4, 8), (3, 5)):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        index, weights = _routing(tokens, 8, top_k, seed=tokens + top_k)
        routed_calls.clear()
        fast = experts(x, index, weights)
        assert len(routed_calls) == 2 and not per_expert_calls
        assert routed_calls[0].get("epilogue") == "swiglu" and routed_calls[1].get("weights") is weights
        with monkeypatch.context() as patch:
            patch.setattr(experts_module, "GROUPED_PAIRS", 0)
            slow = experts(x, index, weights)
        assert per_expert_calls and len(routed_calls) == 2
        per_expert_calls.clear()
        expected = reference(experts, x, index, weights, experts.gate)
        assert _relative_error(fast, expected) < 1e-5 and _relative_error(slow, expected) < 1e-5
        assert _relative_error(fast, slow.double()) < 1e-5
    prompt = torch.randn(17, HIDDEN)
    index, weights = _routing(17, 8, 2)
    routed_calls.clear()
    experts(prompt, index, weights)
    assert per_expert_calls and not routed_calls


def test_decode_with_biases_bfloat16_and_types_the_grouped_kernel_does_not_serve():
    """gpt-oss's biases go through the grouped kernel; bfloat16 rows; int3 codes and nvfp4's tensor scales keep the
    per-expert path (no grouped template serves them), with the same results."""
    module = _gpt_oss_experts()
    experts = bitkern.Experts.from_float(module, {"dtype": "int8", "group_size": 32})
    assert all(p.routes(torch.zeros(1, 1)) for p in experts.projections.values())
    assert not experts.gate_is_swiglu  # its clamped gate on interleaved rows runs as gpt-oss defines it
    x = torch.randn(2, HIDDEN) * 3
    index, weights = _routing(2, 4, 2)
    expected = reference(experts, x, index, weights, module._apply_gate)
    assert _relative_error(experts(x, index, weights), expected) < 1e-5
    out = experts(x.bfloat16(), index, weights.bfloat16())
    assert out.dtype == torch.bfloat16 and _relative_error(out.float(), expected) < 0.02
    for dtype, group in (("int3", 32), ("nvfp4", None)):
        other = bitkern.Experts(4, HIDDEN, INTERMEDIATE, dtype=dtype, group_size=group)
        assert not any(p.routes(x) for p in other.projections.values())
        assert _relative_error(other(x, index, weights), reference(other, x, index, weights)) < 1e-5


def test_the_fused_output_stages_follow_the_gate_and_the_routing_weights_gradient(monkeypatch, caplog):
    """SwiGLU goes into the first grouped kernel only for the SwiGLU gate (a new module's default; not a custom gate
    callable, not a transformers module with another activation); the weighted sum goes into the last unless the
    routing weights need a gradient; which steps ran in the kernels is logged; the results agree either way."""
    from bitkern.nn import experts as experts_module

    torch.manual_seed(12)
    experts = bitkern.Experts(6, HIDDEN, INTERMEDIATE, dtype="int4", group_size=32)
    custom = bitkern.Experts(6, HIDDEN, INTERMEDIATE, dtype="int4", group_size=32, gate=swiglu)
    custom.load_state_dict(experts.state_dict())
    assert experts.gate_is_swiglu and not custom.gate_is_swiglu
    x = torch.randn(2, HIDDEN)
    index, weights = _routing(2, 6, 3)
    experts_module._note_path.__wrapped__.cache_clear()  # (inside torch.compiler.disable)
    with caplog.at_level(logging.INFO, logger="bitkern"), torch.no_grad():
        fused, unfused = experts(x, index, weights), custom(x, index, weights)
    assert "projection, the SwiGLU and the weighted top-k sum in its output stage" in caplog.text
    assert "projection, the weighted top-k sum in its output stage" in caplog.text  # the custom gate's
    expected = reference(experts, x, index, weights)
    assert _relative_error(fused, expected) < 1e-5 and _relative_error(unfused, expected) < 1e-5
    assert experts._fusions(x, weights.requires_grad_()) == (True, False)
    assert experts._fusions(x, weights.detach()) == (True, True)
    qwen = _tiny_moe_layer("qwen3_moe")
    monkeypatch.setattr(qwen.float_template, "act_fn", nn.GELU())
    assert not experts_module.gates_by_swiglu(qwen.float_template)
