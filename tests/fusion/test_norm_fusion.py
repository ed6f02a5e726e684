"""Norm -> linear fusion (`bitkern.fuse`, `explain`): a Llama decoder layer's input_layernorm folded into q/k/v and
its post_attention_layernorm into gate/up (with and without their own stacking), and a LayerNorm / RMSNorm before
a Linear in an nn.Sequential, computing what the unfused modules do within the kernels' error bounds; gradients
reach the input; torch.compile traces a fused tiny Llama in one graph; bad input is named before any kernel is
built."""

import copy

import pytest
import torch
from torch import nn

import bitkern
from bitkern.fusion import explain, plan
from bitkern.fusion.cost import Decision
from bitkern.fusion.modules import EpilogueLinear, FoldedNorm, SwiGLUMLP
from bitkern.nn.library import op_arguments

HIDDEN, MLP = 128, 256


def _llama(dtype: str, layers: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # norms that do something (the model starts them at 1)
        for name, parameter in model.named_parameters():
            if name.endswith("layernorm.weight"):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
    return bitkern.quantize_model(model, dtype, group_size=64, compute_dtype=torch.bfloat16, skip=["lm_head"])


def _layer_inputs(model, tokens: int):
    hidden = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens), dtype=torch.bfloat16)
    positions = torch.arange(tokens)[None]
    return hidden, model.model.rotary_emb(hidden, positions), positions


def _decide_only(monkeypatch, norms_only: bool) -> None:
    """Fuse every group (norms_only: the norm groups only), whatever this machine's timings say."""
    def decide(unfused, fused, m, *runners):
        is_norm = any(call.norm != "none" for call in fused.calls)
        return Decision((2.0, 1.0) if is_norm or not norms_only else (1.0, 2.0))

    monkeypatch.setattr(plan, "decide", decide)


def _norm_calls(model, *inputs) -> list:
    """The norm argument of every bitkern kernel call in one forward pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    norms = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "bitkern":
                norms.append(args[7] if len(args) > 7 else (kwargs or {}).get("norm", "none"))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        model(*inputs)
    return norms


def _assert_close(y, reference, relative: float) -> None:
    """Within `relative` of reference's largest magnitude: the fused kernels make the same sums over x̂, which
    may differ from the norm module's in a rare rounding (see tests/codegen/cpu/test_norm_prologue.py)."""
    assert y.shape == reference.shape
    assert float((y.float() - reference.float()).abs().max()) <= relative * float(reference.float().abs().max())


@pytest.mark.parametrize("dtype", ["int4", "nf4", "int8"])
@pytest.mark.parametrize("tokens", [1, 16, 128])
@pytest.mark.parametrize("stacked", [True, False], ids=["with-qkv-swiglu", "norm-only"])
def test_fused_decoder_layer_matches_the_unfused(dtype, tokens, stacked, monkeypatch):
    model = _llama(dtype)
    hidden, embeddings, positions = _layer_inputs(model, tokens)

    def layer_of(m):
        return lambda h: m.model.layers[0](h, position_embeddings=embeddings, position_ids=positions)

    with torch.no_grad():
        reference = layer_of(model)(hidden)
    fused = copy.deepcopy(model)
    _decide_only(monkeypatch, norms_only=not stacked)
    bitkern.fuse(fused, torch.zeros(1, tokens, dtype=torch.long))
    layer = fused.model.layers[0]
    assert isinstance(layer.input_layernorm, FoldedNorm) and isinstance(layer.post_attention_layernorm, FoldedNorm)
    assert isinstance(layer.mlp, SwiGLUMLP) == stacked
    assert isinstance(layer.self_attn.q_proj, EpilogueLinear) != stacked
    norms = _norm_calls(layer_of(fused), hidden)
    assert norms.count("rmsnorm") == (2 if stacked else 5)  # qkv + gate/up, or q, k, v, gate, up
    with torch.no_grad():  # norm-only: the same sums over the same x̂ (measured: equal); the SwiGLU epilogue
        # rounds silu(gate)·up once where the unfused MLP rounds gate, silu, up and the product (measured 5e-3)
        _assert_close(layer_of(fused)(hidden), reference, 1e-2 if stacked else 2e-3)


def test_fused_tiny_llama_gives_the_same_logits_eager_and_compiled_fullgraph(monkeypatch):
    model = _llama("int4", layers=2)
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(tokens).logits
    report = explain(model, tokens)
    norm_groups = [g for g in report.groups if g.kind == "norm"]
    assert sorted(g.path for g in norm_groups) == [f"model.layers.{i}.{n}" for i in (0, 1)
                                                  for n in ("input_layernorm", "post_attention_layernorm")]
    assert all(g.decision is not None and g.decision.measured is not None for g in norm_groups)
    assert "input_layernorm -> q_proj, k_proj, v_proj" in str(report)
    _decide_only(monkeypatch, norms_only=False)
    bitkern.fuse(model, tokens)
    assert _norm_calls(model, tokens).count("rmsnorm") == 4
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        eager, traced = model(tokens).logits, compiled(tokens).logits
    _assert_close(eager, reference, 2e-2)
    _assert_close(traced, eager, 1e-2)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("activation", [None, nn.GELU])
def test_a_norm_before_a_linear_in_a_sequential_is_folded_and_keeps_gradients(norm, activation, monkeypatch):
    torch.manual_seed(0)
    layers = [nn.LayerNorm(96) if norm == "layernorm" else nn.RMSNorm(96, eps=1e-6), nn.Linear(96, 64)]
    model = nn.Sequential(*layers, *([activation()] if activation else []), nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.copy_(1 + 0.3 * torch.randn(96))
    model = bitkern.quantize_model(model.to(torch.bfloat16), "int4", group_size=32, compute_dtype=torch.bfloat16)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        reference = model(x)
    groups = bitkern.fusion.candidates(model)
    assert sorted(g.kind for g in groups) == sorted(["norm"] + (["act"] if activation else []))
    _decide_only(monkeypatch, norms_only=False)
    bitkern.fuse(model, x)
    assert isinstance(model[0], FoldedNorm) and isinstance(model[1], EpilogueLinear) and model[1].norm is model[0]
    kind = "layernorm" if norm == "layernorm" else "torch_rmsnorm"
    assert _norm_calls(model, x).count(kind) == 1
    x = x.clone().requires_grad_(True)
    y = model(x)
    _assert_close(y.detach(), reference, 2e-2)
    y.float().sum().backward()
    x_ref = x.detach().float().requires_grad_(True)  # the unfused model in float32, dequantized weights

    def linear(layer, h):
        return h @ layer.quantized_weight().dequantize(torch.float32).T + layer.bias.float()

    h = linear(model[1].layer, copy.deepcopy(layers[0]).float()(x_ref))
    linear(model[-1], activation()(h) if activation else h).sum().backward()
    _assert_close(x.grad, x_ref.grad, 5e-2)


def test_unsupported_norms_and_shapes_are_reported_not_fused():
    class GemmaRMSNorm(nn.Module):  # (1 + weight) · x̂: not LlamaRMSNorm's numerics
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.zeros(64)), 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    model = nn.Sequential(GemmaRMSNorm(), bitkern.Linear(64, 32, dtype="int4", group_size=32),
                          nn.Unflatten(-1, (4, 8)), nn.LayerNorm((4, 8)), bitkern.Linear(8, 32, dtype="int4",
                                                                                        group_size=8))
    report = explain(model)
    reasons = [g.reason for g in report.groups]
    assert "GemmaRMSNorm is not a norm bitkern folds" in reasons[0] and "accepted: nn.LayerNorm" in reasons[0]
    assert "a norm over the last 2 dimensions of shape (4, 8)" in reasons[1]
    assert "not fusable" in str(report)
    before = [type(m) for m in model]
    bitkern.fuse(model)
    assert [type(m) for m in model] == before
    assert explain(model, patterns=("qkv", "act")).groups == []  # norm groups only where asked for
    with pytest.raises(ValueError, match="'norms' is not a fusion pattern; accepted"):
        bitkern.fuse(model, patterns=("norms",))


def test_a_float32_model_computing_in_bfloat16_is_not_folded():
    model = nn.Sequential(nn.LayerNorm(64), bitkern.Linear(64, 32, dtype="int4", group_size=32,
                                                           compute_dtype=torch.bfloat16))
    (group,) = explain(model, torch.randn(2, 64)).groups
    assert group.decision is None and "layers compute in torch.bfloat16" in group.reason


def test_bad_norm_inputs_are_named_before_any_kernel_is_built(monkeypatch):
    from bitkern.cache import dispatch

    monkeypatch.setattr(dispatch, "kernel_for", lambda *args, **kwargs: pytest.fail("a kernel was looked up"))
    weight, weight_format = op_arguments(bitkern.pack(bitkern.quantize(torch.randn(32, 64), "int4", group_size=32)))
    x = torch.randn(2, 64, dtype=torch.bfloat16)

    def call(norm, norm_weight, norm_bias=None):
        return torch.ops.bitkern.linear_epilogue(x, weight, weight_format, None, torch.bfloat16, "none", None, norm,
                                                 norm_weight, norm_bias, 1e-6)

    with pytest.raises(ValueError, match=r"norm_weight must be a tensor of shape \(64,\)"):
        call("rmsnorm", torch.ones(63))
    with pytest.raises(ValueError, match="norm_bias must be a tensor of shape"):
        call("layernorm", torch.ones(64))
    with pytest.raises(ValueError, match="norm_bias must be None"):
        call("rmsnorm", torch.ones(64), torch.zeros(64))
    with pytest.raises(ValueError, match="norm='batchnorm' is not supported; accepted"):
        call("batchnorm", torch.ones(64))
    with pytest.raises(ValueError, match="norm_weight must be a float32, float16 or bfloat16"):
        call("rmsnorm", torch.ones(64, dtype=torch.int32))


def test_a_folded_norm_hands_the_kernels_float32_parameters_converted_once_per_version():
    """A bf16 norm weight reaches the kernels as its exact float32 copy, made once (no torch op per call) and made
    again when the weight changes in place; while it is trained it goes as it is (autograd sees it)."""
    weight = nn.Parameter(torch.randn(64).bfloat16())
    folded = FoldedNorm("rmsnorm", weight, None, 1e-5)
    with torch.no_grad():
        first = folded.arguments()["norm_weight"]
        assert first.dtype == torch.float32 and torch.equal(first, weight.float())
        assert folded.arguments()["norm_weight"] is first
        weight.mul_(2)
        again = folded.arguments()["norm_weight"]
    assert again is not first and torch.equal(again, weight.float())
    assert folded.arguments()["norm_weight"] is weight
    assert "_float32" not in str(folded.state_dict().keys())


def test_a_folded_norm_made_under_inference_mode_follows_in_place_changes():
    """A fused model copied under torch.inference_mode holds inference tensors, which have no version counter:
    its folded norm still hands the kernels the weight as it is now, inside inference mode and out."""
    with torch.inference_mode():
        folded = copy.deepcopy(FoldedNorm("rmsnorm", nn.Parameter(torch.randn(64).bfloat16()), None, 1e-5))
        assert torch.equal(folded.arguments()["norm_weight"], folded.weight.float())
        folded.weight.mul_(2)
        assert torch.equal(folded.arguments()["norm_weight"], folded.weight.float())
    assert torch.equal(folded.arguments()["norm_weight"], folded.weight.float())
