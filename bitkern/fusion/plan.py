"""`fuse` and `explain` for eager models: find the module patterns bitkern can run in fewer kernel calls, price
each with the cost model (`cost.decide`), and rewrite in place those that win.

Patterns (Hugging Face Llama-style names, or any module with the same attributes):
  qkv     a module whose q_proj, k_proj, v_proj are stackable bitkern.Linear layers: one GEMM, three views;
  swiglu  a module with gate_proj, up_proj, down_proj and a SiLU act_fn (LlamaMLP): gate and up as one kernel with
          the SwiGLU epilogue, the module replaced by a `SwiGLUMLP`;
  act     a bitkern.Linear followed by nn.ReLU / nn.SiLU / nn.GELU in an nn.Sequential: one kernel with the
          activation epilogue;
  norm    an RMSNorm / LayerNorm before the layers of one of these (input_layernorm -> q/k/v,
          post_attention_layernorm -> gate/up, a norm before a Linear in an nn.Sequential): folded into their
          kernels' prologue (`norms.py`), priced after their own group is decided.
Groups with the same signature (pattern, weight formats, dtypes, rows) are priced once (repeated layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..nn import Linear
from ..ttype import WeightFormat
from .cost import Call, Decision, Variant, decide
from .modules import EpilogueLinear, SharedInputLinears, StackedOutput, SwiGLUMLP
from .norms import NormCandidate, norm_groups
from .stack import stackable

ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu", nn.GELU: "gelu"}
PATTERNS = ("qkv", "swiglu", "act", "norm")


@dataclass
class Candidate:
    """A group of modules one fused module can replace: `owner.<names>` are its members."""

    kind: str
    path: str
    owner: nn.Module
    names: tuple
    example: torch.Tensor | None = None
    decision: Decision | None = None
    reason: str | None = None  # why it cannot be fused at all
    notes: list = field(default_factory=list)

    @property
    def members(self) -> list:
        return [getattr(self.owner, name) for name in self.names]

    def signature(self, m: int) -> tuple:
        layers = self._layers()
        compute = layers[0].compute_dtype or self._dtype()
        return (self.kind, tuple((layer.op_weight()[1], layer.activation_quant) for layer in layers), compute,
                self._dtype(), m, tuple(layer.bias is not None for layer in layers))

    def _layers(self) -> list:
        return self.members[:2] if self.kind == "swiglu" else self.members[:3] if self.kind == "qkv" else \
            self.members[:1]

    def _dtype(self) -> torch.dtype:
        """x's dtype: the example's, else the layers' compute dtype (a model quantized with one runs in it), else
        float32."""
        if self.example is not None:
            return self.example.dtype
        return self._layers()[0].compute_dtype or torch.float32

    def variants(self) -> tuple:
        """(unfused, fused) `Variant`s."""
        layers = self._layers()
        compute, output = layers[0].compute_dtype or self._dtype(), self._dtype()

        quant = layers[0].activation_quant  # stacked layers share it (`stack.stackable`)

        def call(layer, epilogue="none"):
            return Call(layer.op_weight()[1], compute, output, layer.bias is not None, epilogue,
                        activation_quant=layer.activation_quant)

        size = output.itemsize
        casts = int(compute != output)  # each layer converts x to its compute dtype: a torch op per kernel call
        if self.kind == "qkv":
            stacked = stacked_format(layers)
            return Variant([call(layer) for layer in layers], torch_ops=3 * casts), Variant(
                [Call(stacked, compute, output, any(layer.bias is not None for layer in layers),
                      activation_quant=quant)], torch_ops=casts)
        if self.kind == "swiglu":
            width = layers[0].out_features
            # silu reads gate, writes its result; the product reads both and writes y
            unfused = Variant([call(layer) for layer in layers], torch_ops=2 + 2 * casts, bytes_per_row=5 * width * size)
            return unfused, Variant([Call(stacked_format(layers), compute, output, layers[0].bias is not None
                                          or layers[1].bias is not None, "swiglu", activation_quant=quant)],
                                    torch_ops=casts)
        epilogue = ACTIVATIONS[type(self.members[1])]
        return (Variant([call(layers[0])], torch_ops=1 + casts, bytes_per_row=2 * layers[0].out_features * size),
                Variant([call(layers[0], epilogue)], torch_ops=casts))

    def build(self) -> dict:
        """{name: module} to set on the owner (built before anything is replaced)."""
        if self.kind == "qkv":
            group = SharedInputLinears(self.members)
            return {"qkv_fused": group, **{name: StackedOutput(group, i) for i, name in enumerate(self.names)}}
        if self.kind == "swiglu":
            gate, up, down = self.members[:3]
            return {"": SwiGLUMLP(gate, up, down)}
        layer, activation = self.members
        return {self.names[0]: EpilogueLinear(layer, ACTIVATIONS[type(activation)]), self.names[1]: nn.Identity()}

    def runners(self) -> tuple:
        """(unfused, fused) callables of the example input, for timing (the fused modules built for them)."""
        x, fused = self.example, self.build()
        members = self.members
        if self.kind == "qkv":
            return (lambda: [layer(x) for layer in members]), (lambda: fused["qkv_fused"].layer(x))
        if self.kind == "swiglu":
            gate, up, _, act = members
            return (lambda: act(gate(x)) * up(x)), (lambda: fused[""].gate_up(x))
        layer, activation = members
        return (lambda: activation(layer(x))), (lambda: fused[self.names[0]](x))


def stacked_format(layers: list) -> str:
    """The weight format string of the layers' stacked weight (rows added up; the rest is theirs)."""
    described = WeightFormat.decode(layers[0].op_weight()[1])
    return replace(described, shape=(sum(layer.out_features for layer in layers), layers[0].in_features)).encode()


def candidates(model: nn.Module, patterns: tuple = PATTERNS) -> list:
    """Every group of `model` one of `patterns` matches (see the module docstring), in module order, norm groups
    last."""
    for pattern in patterns:
        if pattern not in PATTERNS:
            raise ValueError(f"patterns: {pattern!r} is not a fusion pattern; accepted: {list(PATTERNS)}")
    found = []
    for path, module in model.named_modules():
        names = dict(module.named_children())
        if all(isinstance(names.get(n), Linear) for n in ("q_proj", "k_proj", "v_proj")):
            group = Candidate("qkv", path, module, ("q_proj", "k_proj", "v_proj"))
            group.reason = stackable(group.members)
            found.append(group)
        if all(isinstance(names.get(n), Linear) for n in ("gate_proj", "up_proj")) and "down_proj" in names and \
                is_silu(getattr(module, "act_fn", None)):
            group = Candidate("swiglu", path, module, ("gate_proj", "up_proj", "down_proj", "act_fn"))
            group.reason = "the model itself (fuse the module that holds it)" if not path else \
                stackable(group.members[:2]) or (None if group.members[0].out_features % 16 == 0 else
                                                 "an intermediate size that is not a multiple of 16")
            found.append(group)
        if isinstance(module, nn.Sequential):
            items = list(names.items())
            for (name, layer), (next_name, activation) in zip(items, items[1:]):
                if isinstance(layer, Linear) and type(activation) in ACTIVATIONS and \
                        getattr(activation, "approximate", "none") == "none":
                    group = Candidate("act", path, module, (name, next_name))
                    group.reason = "permuted inputs (input_order)" if layer.input_order is not None else None
                    found.append(group)
    found = [group for group in found if group.kind in patterns]
    return found + (norm_groups(model, found) if "norm" in patterns else [])


def is_silu(module) -> bool:
    """nn.SiLU, or transformers' SiLUActivation (what Llama's act_fn is), matched by name: fusion imports no
    transformers."""
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def analyse(model: nn.Module, example_inputs: tuple, patterns: tuple = PATTERNS) -> list:
    """The candidates of `model` (of `patterns`), each with its decision (priced once per signature; measured on
    the inputs the group saw in one forward pass of `example_inputs`, when given)."""
    groups = candidates(model, patterns)
    if example_inputs:
        _capture_inputs(model, groups, example_inputs)
    decided = {}
    for group in groups:  # norm groups come last: their layers' groups are decided by then
        if isinstance(group, NormCandidate):
            group.check()
        if group.reason:
            continue
        m = 1 if group.example is None else group.example.reshape(-1, group.example.shape[-1]).shape[0]
        key = group.signature(m)
        if key not in decided:
            unfused, fused = group.variants()
            runners = group.runners() if group.example is not None else (None, None)
            decided[key] = decide(unfused, fused, m, *runners)
        else:
            group.notes.append("same signature as an earlier group: its decision reused")
        group.decision = decided[key]
    return groups


def _capture_inputs(model: nn.Module, groups: list, example_inputs: tuple) -> None:
    """Run the model once, recording the input each group's first member receives."""
    hooks = []
    for group in groups:
        def record(module, args, group=group):
            if group.example is None and args and isinstance(args[0], torch.Tensor):
                group.example = args[0].detach()
        hooks.append(group.members[0].register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for hook in hooks:
            hook.remove()


def fuse(model: nn.Module, *example_inputs, patterns: tuple = PATTERNS) -> nn.Module:
    """Rewrite, in place, the groups of `model` (of `patterns`, default all) that the cost model fuses (measured on
    `example_inputs` when given, else modeled for one row) and return the model.  Every fused module is built
    before any is put in place, so a failure leaves the model as it was."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    placements, built = [], {}  # (owner, its path, {name: module}); the modules each fused group built
    for group in analyse(model, example_inputs, patterns):
        if group.decision is None or not group.decision.fuse:
            continue
        if isinstance(group, NormCandidate):  # attached to its layers' fused modules where their group built some
            placements += group.build(built.get(id(group.inner)))
        else:
            built[id(group)] = group.build()
            placements.append((group.owner, group.path, built[id(group)]))
    parents = dict(model.named_modules())
    for owner, path, modules in placements:
        for name, module in modules.items():
            if name:
                setattr(owner, name, module)
            else:  # the group replaces its owner
                parent_path, _, attribute = path.rpartition(".")
                setattr(parents[parent_path], attribute, module)
    return model


@dataclass
class Report:
    """What `explain` found: one line per candidate group."""

    groups: list

    def rows(self) -> list:
        rows = []
        for group in self.groups:
            decision = group.decision
            if decision is None:
                rows.append((group.path or "(model)", group.kind, "not fusable", "", "", group.reason))
                continue
            modeled = decision.estimated[0] / decision.estimated[1]
            measured = "" if decision.measured is None else f"{decision.measured[0] / decision.measured[1]:.2f}x"
            unfused, fused = group.variants()
            counts = f"{len(unfused.calls)} kernel calls + {unfused.torch_ops} torch ops -> {len(fused.calls)} + " \
                     f"{fused.torch_ops}"
            rows.append((group.path or "(model)", group.kind, "fuse" if decision.fuse else "keep",
                         f"{modeled:.2f}x", measured, "; ".join([counts, *group.notes, *decision.notes])))
        return rows

    def __str__(self) -> str:
        header = ("group", "pattern", "decision", "modeled gain", "measured gain", "notes")
        rows = [header, *self.rows()]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header) - 1)]
        return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
                         for row in rows)


def explain(model: nn.Module, *example_inputs, patterns: tuple = PATTERNS) -> Report:
    """Each candidate group of `model` (of `patterns`), the decision `fuse` would make and its modeled (and, with
    example inputs, measured) gain; the model is not changed."""
    return Report(analyse(model, example_inputs, patterns))
