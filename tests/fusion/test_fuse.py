"""bitkern.fuse and bitkern.fusion.explain on a small Hugging Face Llama and on plain modules: the fused model
computes what the unfused one did (the kernels' error bounds: same sums, fewer calls), with fewer kernel calls;
repeated layers are priced once; a failed fuse leaves the model as it was; gradients reach the input;
torch.compile traces a fused MLP in one graph."""

import copy

import pytest
import torch
from torch import nn

import bitkern
from bitkern.fusion import explain, plan
from bitkern.fusion.modules import EpilogueLinear, StackedOutput, SwiGLUMLP


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    bitkern.quantize_model(model, "int4", group_size=64, compute_dtype=torch.bfloat16, skip=["lm_head"])
    return model


def _kernel_calls(model, *inputs) -> int:
    """bitkern op calls in one forward pass (counted through torch's dispatcher)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "bitkern":
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        model(*inputs)
    return Count.calls


def test_fused_llama_computes_the_same_logits_with_fewer_kernel_calls(llama, monkeypatch):
    model = copy.deepcopy(llama)
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(tokens).logits
    calls_before = _kernel_calls(model, tokens)
    report = explain(model, tokens)
    kinds = sorted((g.path, g.kind) for g in report.groups if g.kind != "norm")
    assert kinds == [("model.layers.0.mlp", "swiglu"), ("model.layers.0.self_attn", "qkv"),
                     ("model.layers.1.mlp", "swiglu"), ("model.layers.1.self_attn", "qkv")]
    # a float32 model computing in bfloat16: its norms are reported, not folded (tests/fusion/test_norm_fusion.py)
    norms = [g for g in report.groups if g.kind == "norm"]
    assert len(norms) == 4 and all("layers compute in torch.bfloat16" in g.reason for g in norms)
    assert sum("decision reused" in " ".join(g.notes) for g in report.groups) == 2  # layer 1 priced as layer 0
    assert "modeled gain" in str(report) and "model.layers.1.mlp" in str(report)
    assert all(g.decision.measured is not None for g in report.groups if g.kind != "norm")
    monkeypatch.setattr(plan.Decision, "fuse", property(lambda self: True))  # whatever this machine's timings say
    bitkern.fuse(model, tokens)
    with torch.no_grad():
        logits = model(tokens).logits
    # the stacked kernels compute every output with the same sums as the separate ones
    assert torch.allclose(logits, reference, atol=1e-3 * float(reference.abs().max()))
    assert _kernel_calls(model, tokens) == calls_before - 2 * (2 + 1)  # per layer: q/k/v 3 -> 1, gate/up 2 -> 1


def test_fuse_rewrites_every_pattern_and_keeps_gradients(monkeypatch):
    torch.manual_seed(0)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
            self.down_proj, self.act_fn = nn.Linear(96, 64), nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)
            self.mlp = MLP()
            self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

        def forward(self, x):
            return self.head(self.mlp(x) + self.q_proj(x) + torch.cat([self.k_proj(x), self.v_proj(x)], -1))

    model = bitkern.quantize_model(Block(), "nf4", group_size=32, compute_dtype=torch.bfloat16)
    x = torch.randn(3, 64)
    with torch.no_grad():
        reference = model(x)
    groups = bitkern.fusion.candidates(model)
    assert sorted(g.kind for g in groups) == ["act", "qkv", "swiglu"]
    monkeypatch.setattr(plan.Decision, "fuse", property(lambda self: True))  # every rewrite, whatever the timings
    bitkern.fuse(model)
    assert isinstance(model.q_proj, StackedOutput) and isinstance(model.mlp, SwiGLUMLP)
    assert isinstance(model.head[0], EpilogueLinear) and isinstance(model.head[1], nn.Identity)
    x = x.clone().requires_grad_(True)
    y = model(x)
    # The fused kernels' template may differ from the separate layers' (the tuner ranks each shape on its own), and
    # the bf16-product templates (dot, AMX) round nf4's values to bfloat16 where FMA and lookup keep them exact: up to
    # 2^-8 of sum |x·w| apart per layer (tests.helpers.assert_within_bound), where a fusion error is of y's size
    assert torch.allclose(y, reference, atol=2.0**-7 * float(reference.abs().max()))
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_residual_of_a_tensor_subclass_goes_through_the_op():
    """The eager shortcut past torch's dispatcher is for plain tensors only: a residual of a tensor subclass sees
    `torch.ops.bitkern.linear_epilogue` (as x of one would), and the result is the plain call's."""

    class Marked(torch.Tensor):
        seen = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    layer = bitkern.quantize_model(nn.Sequential(nn.Linear(64, 32)), "int4", group_size=32,
                                   compute_dtype=torch.bfloat16)[0]
    fused = EpilogueLinear(layer, "relu")
    x, residual = torch.randn(2, 64).bfloat16(), torch.randn(2, 32).bfloat16()
    with torch.no_grad():
        plain = fused(x, residual)
        marked = fused(x, residual.as_subclass(Marked))
    assert torch.ops.bitkern.linear_epilogue in Marked.seen
    assert torch.equal(marked.as_subclass(torch.Tensor), plain)


def test_a_failed_fuse_leaves_the_model_unchanged(monkeypatch):
    model = nn.Module()
    model.attn = nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(model.attn, name, bitkern.Linear(64, 32, dtype="int4", group_size=32))
    model.seq = nn.Sequential(bitkern.Linear(64, 64, dtype="int4", group_size=32), nn.GELU())
    before = {name: id(module) for name, module in model.named_modules()}

    def broken(self):
        if self.kind == "act":
            raise RuntimeError("out of memory")
        return original(self)

    original = plan.Candidate.build
    monkeypatch.setattr(plan.Candidate, "build", broken)
    monkeypatch.setattr(plan.Decision, "fuse", property(lambda self: True))
    monkeypatch.setattr(plan, "decide", lambda *args: plan.Decision((2.0, 1.0)))
    with pytest.raises(RuntimeError, match="out of memory"):
        bitkern.fuse(model)
    assert {name: id(module) for name, module in model.named_modules()} == before


def test_groups_that_cannot_be_stacked_are_reported_not_fused():
    model = nn.Module()
    model.q_proj = bitkern.Linear(64, 32, dtype="int4", group_size=32)
    model.k_proj = bitkern.Linear(64, 32, dtype="nf4", group_size=32)
    model.v_proj = bitkern.Linear(64, 32, dtype="int4", group_size=32)
    report = explain(model)
    assert report.groups[0].reason == "layers with different weight_dtype"
    assert "not fusable" in str(report)
    bitkern.fuse(model)
    assert isinstance(model.q_proj, bitkern.Linear)


def test_without_example_inputs_groups_are_priced_in_the_dtype_their_layers_compute_in(llama):
    """A model quantized with compute_dtype=bfloat16 runs bf16 activations: the modeled decision prices the bf16
    kernels it will call (float32 ones would be other kernels, tuned for nothing); without a compute dtype, float32."""
    groups = [group for group in explain(llama).groups if group.kind in ("qkv", "swiglu")]
    assert {group.kind for group in groups} == {"qkv", "swiglu"}
    for group in groups:
        for variant in group.variants():
            assert {(call.activation, call.output) for call in variant.calls} == {(torch.bfloat16, torch.bfloat16)}
    model = nn.Module()
    model.gate_proj, model.up_proj = (bitkern.Linear(64, 96, False, "int4", 32) for _ in range(2))
    model.down_proj, model.act_fn = bitkern.Linear(96, 64, False, "int4", 32), nn.SiLU()
    (group,) = explain(model).groups
    assert {(call.activation, call.output) for call in group.variants()[0].calls} == {(torch.float32, torch.float32)}


def test_fused_mlp_compiles_fullgraph():
    gate, up = bitkern.Linear(64, 96, False, "int4", 32), bitkern.Linear(64, 96, False, "int4", 32)
    mlp = SwiGLUMLP(gate, up, bitkern.Linear(96, 64, True, "int4", 32))
    x = torch.randn(2, 64)
    compiled = torch.compile(mlp, fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(x), mlp(x))


def test_a_fused_llama_generates_the_greedy_tokens_of_the_unfused_one(monkeypatch):
    """The benchmark's way (benchmarks/llama_cpp.py): a bf16 Llama quantized to int4, then fused, through `generate`
    with a static cache gives the greedy tokens of the unfused model through torch.library's ops (the path before
    fusion and the eager calls); the fused layers' eager calls give the logits of their op exactly."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    class Dispatched(TorchDispatchMode):  # changes nothing: inside it every bitkern call goes through its op
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # a spread of logits like a trained model's, so that greedy picks are not near-ties
        model.lm_head.weight.mul_(8)
    unfused = bitkern.quantize_model(model, "int4", compute_dtype=torch.bfloat16)
    fused = copy.deepcopy(unfused)
    monkeypatch.setattr(plan.Decision, "fuse", property(lambda self: True))  # whatever the cost model says here
    bitkern.fuse(fused)
    assert isinstance(fused.model.layers[0].mlp, SwiGLUMLP)
    assert isinstance(fused.model.layers[0].self_attn.q_proj, StackedOutput)
    prompt = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(1))

    def greedy(llama):
        return llama.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=24,
                              eos_token_id=None, pad_token_id=2, cache_implementation="static")

    with Dispatched():
        expected = greedy(unfused)
        dispatched_logits = fused(prompt).logits
    assert torch.equal(greedy(fused), expected)
    with torch.inference_mode():
        assert torch.equal(fused(prompt).logits, dispatched_logits)
