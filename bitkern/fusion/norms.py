"""The norm -> linear groups of `bitkern.fuse` / `explain`: an RMSNorm or LayerNorm whose output only bitkern
Linears read is folded into their kernels' activation prologue (`bitkern.ops.Matmul.norm`), and the norm's module
is replaced by a `FoldedNorm` that passes x through (the residual stream reads the norm's input, not its output).

Patterns (`norm_groups`):
  attention  a module with `input_layernorm` and a `self_attn` whose q_proj, k_proj, v_proj are bitkern Linears
             (Hugging Face Llama-style decoder layers): the norm goes into the q/k/v GEMM (stacked or not);
  mlp        `post_attention_layernorm` and an `mlp` with gate_proj, up_proj: into the gate/up kernel (SwiGLU or
             not);
  sequence   a norm followed by a bitkern Linear in an nn.Sequential (with its activation, fused or not).
A group is priced after the group of its linears (qkv, swiglu, act) is decided, on the linears as that decision
leaves them: unfused, the norm's torch ops run before their kernels; fused, the kernels normalize x themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from ..nn import Linear
from .cost import Call, Decision, Variant
from .modules import EpilogueLinear, FoldedNorm

# Hugging Face RMSNorms whose forward is LlamaRMSNorm's (weight · dtype(x·rstd)), matched by name: fusion imports no
# transformers.  Others (Gemma's 1 + weight, ...) are reported as not fusable.
HF_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# decoder-layer norms and the module and layers that read their output
NORMED = {"input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv"),
          "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj"), "swiglu")}
# torch ops of LlamaRMSNorm's eager forward, each a pass over the row between two bitkern kernels: to(float32), pow,
# mean, add, rsqrt, mul, to(dtype), mul (the casts only where x is not float32); nn.RMSNorm and nn.LayerNorm are one op
HF_RMSNORM_OPS = 8


def norm_arguments(module: nn.Module, k: int, dtype: torch.dtype):
    """(kind, weight, bias, eps) of a norm bitkern folds into the layers of in_features k reading its output, or
    a string saying why it cannot."""
    name = type(module).__name__
    bias = None
    if name in HF_RMSNORMS:
        kind, weight, eps = "rmsnorm", module.weight, module.variance_epsilon
    elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
        if tuple(module.normalized_shape) != (k,):
            return f"a norm over the last {len(module.normalized_shape)} dimensions of shape " \
                   f"{tuple(module.normalized_shape)} (bitkern folds one over in_features={k})"
        weight = module.weight if module.weight is not None else torch.ones(k)
        if isinstance(module, nn.LayerNorm):
            kind, eps = "layernorm", module.eps
            bias = module.bias if module.bias is not None else torch.zeros(k)
        else:
            kind, eps = "torch_rmsnorm", module.eps if module.eps is not None else torch.finfo(dtype).eps
    else:
        return f"{name} is not a norm bitkern folds (accepted: nn.LayerNorm, nn.RMSNorm, {', '.join(HF_RMSNORMS)})"
    if tuple(weight.shape) != (k,):
        return f"a norm weight of shape {tuple(weight.shape)} before layers of in_features={k}"
    return kind, weight, bias, eps


def is_norm(module: nn.Module) -> bool:
    """Whether `module` looks like a norm (its name or class): candidates of the sequence pattern."""
    return isinstance(module, (nn.RMSNorm, nn.LayerNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


@dataclass
class NormCandidate:
    """A norm (`owner.<names[0]>`) and the Linears `holder.<consumers>` that read its output; `inner` is the group
    of those Linears (qkv, swiglu, act) or None; `structure` which of the patterns it is."""

    path: str
    owner: nn.Module
    names: tuple
    holder: nn.Module
    holder_path: str
    consumers: tuple
    structure: str
    inner: object = None
    kind: str = "norm"
    example: torch.Tensor | None = None
    decision: Decision | None = None
    reason: str | None = None
    notes: list = field(default_factory=list)

    @property
    def members(self) -> list:
        return [getattr(self.owner, name) for name in self.names]

    def _layers(self) -> list:
        return [getattr(self.holder, name) for name in self.consumers]

    def _dtype(self) -> torch.dtype:
        """x's dtype: the example's, else the norm weight's (a model cast to one dtype has both)."""
        if self.example is not None:
            return self.example.dtype
        weight = getattr(self.members[0], "weight", None)
        return weight.dtype if isinstance(weight, torch.Tensor) else torch.float32

    def _norm(self):
        return norm_arguments(self.members[0], self._layers()[0].in_features, self._dtype())

    def check(self) -> None:
        """Set `reason` where the group cannot be folded: an unsupported norm or layers, or x in another dtype than
        the layers compute in (the kernel rounds x̂ to x's dtype, as the norm followed by the layer's cast would
        only where the two agree)."""
        described = self._norm()
        layers = self._layers()
        if isinstance(described, str):
            self.reason = described
        elif any(layer.input_order is not None for layer in layers):
            self.reason = "a layer with permuted inputs (input_order)"
        elif any((layer.compute_dtype or self._dtype()) != self._dtype() for layer in layers):
            self.reason = f"x is {self._dtype()} but the layers compute in {layers[0].compute_dtype} (the kernel " \
                          f"would normalize in the wrong dtype); cast the model to the compute dtype"
        else:
            self.notes.append(f"{self.names[0]} -> {', '.join(self.consumers)}")

    def _inner_fused(self) -> bool:
        return self.inner is not None and self.inner.decision is not None and self.inner.decision.fuse

    def signature(self, m: int) -> tuple:
        kind, _, bias, eps = self._norm()
        inner = self.inner.signature(m) if self.inner is not None and self.inner.reason is None else None
        return ("norm", self.structure, kind, eps, bias is not None, inner, self._inner_fused(),
                tuple((layer.op_weight()[1], layer.activation_quant) for layer in self._layers()), self._dtype(), m)

    def _consumer_variant(self) -> Variant:
        """How the Linears run after their own group's decision."""
        if self.inner is not None and self.inner.decision is not None:
            return self.inner.variants()[1 if self._inner_fused() else 0]
        dtype = self._dtype()
        return Variant([Call(layer.op_weight()[1], dtype, dtype, layer.bias is not None,
                             activation_quant=layer.activation_quant) for layer in self._layers()])

    def variants(self) -> tuple:
        """(unfused, fused) `Variant`s: the norm's torch ops and bytes before the Linears' kernels, or none."""
        kind, _, _, eps = self._norm()
        consumer = self._consumer_variant()
        k, size = self._layers()[0].in_features, self._dtype().itemsize
        if kind == "rmsnorm":  # float32 intermediates: each op reads and writes a row of them
            ops = HF_RMSNORM_OPS - 2 * (self._dtype() == torch.float32)
            norm_bytes = ops * 2 * k * 4
        else:
            ops, norm_bytes = 1, 2 * k * size
        unfused = Variant(consumer.calls, consumer.torch_ops + ops, consumer.bytes_per_row + norm_bytes)
        fused = Variant([dataclasses.replace(call, norm=kind, norm_eps=eps) for call in consumer.calls],
                        consumer.torch_ops, consumer.bytes_per_row)
        return unfused, fused

    def _folded(self) -> FoldedNorm:
        kind, weight, bias, eps = self._norm()
        return FoldedNorm(kind, weight, bias, eps)

    def build(self, inner_modules: dict | None = None) -> list:
        """[(owner, path, {name: module})] to set: the `FoldedNorm` where the norm stood, and the Linears' modules
        with the norm attached — `inner_modules` (what the fused inner group built: the norm is attached to them)
        or `EpilogueLinear`s in place of the plain Linears."""
        folded = self._folded()
        placements = [(self.owner, self.path.rpartition(".")[0], {self.names[0]: folded})]
        if inner_modules is not None:
            for module in self._normed_modules(inner_modules):
                object.__setattr__(module, "norm", folded)
            return placements
        wrapped = {}
        for name, layer in zip(self.consumers, self._layers()):
            wrapped[name] = EpilogueLinear(layer, "none")
            object.__setattr__(wrapped[name], "norm", folded)
        return placements + [(self.holder, self.holder_path, wrapped)]

    def _normed_modules(self, inner_modules: dict) -> list:
        """The modules of a fused inner group whose kernels read the norm's output."""
        if self.structure == "qkv":
            return [inner_modules["qkv_fused"]]
        if self.structure == "swiglu":
            return [inner_modules[""].gate_up]
        return [inner_modules[self.consumers[0]]]

    def runners(self) -> tuple:
        """(unfused, fused) callables of the example input, for timing: the norm then the Linears as their group's
        decision leaves them, against the Linears normalizing x in their kernels."""
        x, norm = self.example, self.members[0]
        inner_fused = self._inner_fused()
        plain = self.inner.build() if inner_fused else None
        normed = self.inner.build() if inner_fused else None
        placements = self.build(normed)
        normed_layers = placements[1][2] if not inner_fused else None
        unfused, fused = self._consume(plain, None), self._consume(normed, normed_layers)
        return (lambda: unfused(norm(x))), (lambda: fused(x))

    def _consume(self, inner_modules: dict | None, layers: dict | None):
        """A callable running the Linears on their input: the inner group's fused modules, or the layers (the
        plain ones, or `layers` in their place), with an unfused inner group's torch ops."""
        if inner_modules is not None:
            if self.structure == "qkv":
                stacked = inner_modules["qkv_fused"]
                return lambda h: [stacked.outputs(h, i) for i in range(len(self.consumers))]
            if self.structure == "swiglu":
                return inner_modules[""].gate_up
            return inner_modules[self.consumers[0]]
        modules = [layers[name] if layers else layer for name, layer in zip(self.consumers, self._layers())]
        if self.structure == "swiglu":
            gate, up = modules
            act = self.holder.act_fn
            return lambda h: act(gate(h)) * up(h)
        if self.structure == "sequence" and self.inner is not None and self.inner.reason is None:
            activation = getattr(self.inner.owner, self.inner.names[1])
            return lambda h: activation(modules[0](h))
        return lambda h: [module(h) for module in modules]


def norm_groups(model: nn.Module, groups: list) -> list:
    """The norm -> Linear groups of `model` (see the module docstring), each linked to the group of its Linears
    among `groups` (the other patterns' candidates)."""
    inner = {(id(group.owner), group.names[0] if group.kind == "act" else group.kind): group for group in groups}
    found = []
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        children = dict(module.named_children())
        for norm_name, (holder_name, consumers, pattern) in NORMED.items():
            holder = children.get(holder_name)
            if norm_name in children and holder is not None and \
                    all(isinstance(getattr(holder, name, None), Linear) for name in consumers):
                found.append(NormCandidate(prefix + norm_name, module, (norm_name,), holder, prefix + holder_name,
                                           consumers, pattern, inner.get((id(holder), pattern))))
        if isinstance(module, nn.Sequential):
            items = list(children.items())
            for (name, norm), (next_name, layer) in zip(items, items[1:]):
                if is_norm(norm) and isinstance(layer, Linear):
                    found.append(NormCandidate(prefix + name, module, (name,), module, path, (next_name,),
                                               "sequence", inner.get((id(module), next_name))))
    return found
