"""`bitkern.nn.Experts`: a mixture-of-experts block's experts with every expert's gate/up and down weights stored in a
bitkern type, called as transformers' experts modules are: `experts(hidden_states, top_k_index, top_k_weights)`.

Each projection is an `ExpertWeights`: the [E, N, K] weights of E experts quantized one expert at a time and
stored stacked (buffers [E, ...] of what `bitkern.Linear` stores for one [N, K] weight, in its kernel layout).
`Experts.from_float` takes the experts module of a transformers 5 model (one that follows `ExpertsInterface`'s
convention: 3-D `gate_up_proj`/`up_proj` and `down_proj`, optional biases, `is_transposed`, the model's own
`_apply_gate` or `act_fn`).

A call of a few tokens (decode: at most GROUPED_PAIRS token-expert pairs) runs each projection as one call of the
grouped kernel (`ExpertWeights.routed`, `bitkern.ops.GroupedMatmul`), which reads each selected expert's weights
once, with SwiGLU and the weighted top-k sum in its output stage where it has them (`Experts._fusions`); a prompt
sorts the (token, expert) pairs by expert and multiplies each projection over the experts' blocks of rows in
`ExpertWeights.grouped`, one call of `bitkern.Linear`'s matmul kernel per expert that has tokens.  Which path runs is
logged once.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from .. import ttype
from ..codegen import pack, packed_class, to_layout
from ..cache.dispatch import serves_grouped
from ..ops.grouped import STACK_ROWS, swiglu_halves as swiglu  # the default gate: silu(gate) · up over [gate | up]
from ..ops.matmul import ACTIVATION_QUANTS
from ..ttype import Layout, QuantizedWeight, WeightFormat
from . import library
from .kernel_call import ALL_TOKENS, KernelCall
from .storage import WEIGHT_BUFFERS, QuantizedModule, check_positive

log = logging.getLogger("bitkern")

# the float experts module's 3-D parameters, by the name of the bitkern projection that stores them
FLOAT_PARAMETERS = {"gate_up": "gate_up_proj", "up": "up_proj", "down": "down_proj"}
# calls of at most this many token-expert pairs (decode: 4 tokens of top-8) run the grouped kernels, one call per
# projection; more (prompts) run each expert's rows through the dense kernels, which block rows
GROUPED_PAIRS = 32
GROUPED_LAYOUTS = {"cpu": Layout.TILE16, "cuda": Layout.LOP3}  # the layout the grouped kernels of a device type read


class ExpertWeights(QuantizedModule):
    """y_e = x · dequant(W_e)ᵀ + b_e for the experts e of one projection: W [num_experts, out_features, in_features]
    stored per expert as `bitkern.Linear` stores its weight (the same settings: dtype, group_size, zero_mode,
    scale_dtype, compute_dtype, activation_quant, method), in buffers with a leading expert dimension; bias
    [num_experts, out_features] or None.  Called with rows sorted by expert and each expert's row count."""

    activation_quants = ACTIVATION_QUANTS

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False, dtype="nf4",
                 group_size=None, zero_mode: str | None = None, compute_dtype=None, device=None,
                 scale_dtype=torch.float16, activation_quant: str = "none", method: str = "rtn"):
        super().__init__()
        self.num_experts = check_positive("num_experts", num_experts)
        self.in_features = check_positive("in_features", in_features)
        self.out_features = check_positive("out_features", out_features)
        self._configure((num_experts, out_features, in_features), dtype, group_size, zero_mode, scale_dtype,
                        compute_dtype, activation_quant, method)
        weight = torch.empty(self.weight_shape, device=device)
        if weight.device.type != "meta":
            nn.init.kaiming_uniform_(weight.view(-1, in_features), a=5 ** 0.5)
        self._set_weight(weight)
        self.register_parameter("bias", nn.Parameter(torch.zeros(self.bias_shape, device=device), requires_grad=False)
                                if bias else None)

    @property
    def gemm_shape(self) -> tuple[int, int]:
        """(N, K) of one expert's weight."""
        return self.weight_shape[1], self.weight_shape[2]

    @property
    def bias_shape(self) -> tuple:
        return (self.num_experts, self.weight_shape[1])

    def extra_settings(self) -> dict:
        return {"num_experts": self.num_experts}

    @classmethod
    def _meta_layer(cls, module: "ExpertWeights", **settings) -> "ExpertWeights":
        return cls(module.num_experts, module.in_features, module.out_features, module.bias is not None,
                   device="meta", **settings)

    @classmethod
    def from_float_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **settings) -> "ExpertWeights":
        """The projection holding `weight` [E, N, K] quantized one expert at a time (and `bias` [E, N] as it is);
        settings: the constructor's."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise ValueError(f"weight must be a 3-D tensor [num_experts, out_features, in_features], got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        experts, n, k = weight.shape
        layer = cls(experts, k, n, bias is not None, device="meta", **settings)
        layer._set_weight(weight)
        layer._set_bias(bias)
        return layer

    @classmethod
    def from_quantized(cls, weights: list[QuantizedWeight], bias: torch.Tensor | None = None, compute_dtype=None,
                       activation_quant: str = "none", method: str = "rtn") -> "ExpertWeights":
        """The projection holding already quantized experts' weights (one `bitkern.QuantizedWeight` each, all of one
        format, e.g. from a checkpoint) as they are, laid out for their device's kernels."""
        if not weights or not all(isinstance(w, QuantizedWeight) for w in weights):
            raise TypeError("weights must be a non-empty list of bitkern.QuantizedWeight, one per expert")
        first = weights[0]
        formats = {(w.ttype.name, tuple(w.shape), w.group_size, w.zero_mode) for w in weights}
        if len(formats) > 1:
            raise ValueError(f"weights must share one type, shape, group size and zero mode; got {sorted(formats)}")
        n, k = first.shape
        layer = cls(len(weights), k, n, bias is not None, first.ttype.name, first.group_size, first.zero_mode,
                    compute_dtype, device="meta",
                    scale_dtype=first.scales.dtype if first.ttype.block_size == 1 else torch.float16,
                    activation_quant=activation_quant, method=method)
        layer._store_experts([pack(w) for w in weights])
        layer._set_bias(bias)
        return layer

    def _set_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != self.bias_shape):
            raise ValueError(f"bias must be a tensor of shape {self.bias_shape} or None, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach().clone(),
                                                                               requires_grad=False))

    # -- storage: one weight per expert, stacked ---------------------------------------------------------------

    def _set_weight(self, weight: torch.Tensor) -> None:
        """Quantize a float [E, N, K] weight one expert at a time into the kernel layout of its device."""
        if tuple(weight.shape) != self.weight_shape:
            raise ValueError(f"weight has shape {tuple(weight.shape)}, expected {self.weight_shape}")
        if weight.is_meta:
            self._store_empty(self.layout, weight.device)
            return
        self._store_experts([pack(ttype.quantize(expert.detach().contiguous(), self.weight_dtype,
                                                 group_size=self.group_size, zero_mode=self.zero_mode,
                                                 scale_dtype=self.scale_dtype, method=self.method))
                             for expert in weight])

    def _store_experts(self, weights: list) -> None:
        """Hold the experts' packed weights (one format) stacked in this module's buffers."""
        self.layout = weights[0].layout
        arguments = [library.op_arguments(weight) for weight in weights]
        self._format_text = arguments[0][1]
        for index, name in enumerate(WEIGHT_BUFFERS):
            parts = [tensors[index] for tensors, _ in arguments]
            self.register_buffer(name, None if parts[0] is None else torch.stack(parts))
        self.__dict__.pop("_packed", None)

    def _store_empty(self, layout, device) -> None:
        empty = packed_class(layout).empty(self.weight_format(layout), "meta")
        self.layout = empty.layout
        tensors, self._format_text = library.op_arguments(empty)
        for name, tensor in zip(WEIGHT_BUFFERS, tensors):
            self.register_buffer(name, None if tensor is None else
                                 torch.empty((self.num_experts, *tensor.shape), dtype=tensor.dtype, device=device))
        self.__dict__.pop("_packed", None)

    def _relayout(self, target) -> None:
        self._store_experts([to_layout(weight.to_portable(), target) for weight in self.packed_weights()])

    def _relaid_tensors(self, tensors: list, source_layout, target) -> list:
        weight_format = self.weight_format(source_layout)
        experts = [to_layout(library.weight_of([None if t is None else t[e] for t in tensors], weight_format)
                             .to_portable(), target) for e in range(self.num_experts)]
        stacked = zip(*(library.op_arguments(weight)[0] for weight in experts))
        return [None if parts[0] is None else torch.stack(parts) for parts in stacked]

    def op_weight(self, expert: int) -> tuple[list, str]:
        """Expert `expert`'s weight as the (weight, weight_format) arguments of the custom ops."""
        buffers = self._buffers
        return [None if buffers[name] is None else buffers[name][expert] for name in WEIGHT_BUFFERS], \
            self._format_text

    def packed_weights(self) -> list:
        """Each expert's weight as a `bitkern.PackedWeight` (views of the buffers); the same objects while the
        buffers are the same tensors, so that what they derive for the kernels is made once."""
        buffers = tuple(self._buffers[name] for name in WEIGHT_BUFFERS)
        kept = self.__dict__.get("_packed")
        if kept is None or kept[1] is not self._format_text or any(a is not b for a, b in zip(kept[0], buffers)):
            weight_format = WeightFormat.decode(self._format_text)
            weights = [library.weight_of(self.op_weight(e)[0], weight_format) for e in range(self.num_experts)]
            kept = self.__dict__["_packed"] = (buffers, self._format_text, weights)
        return kept[2]

    def packed_weight(self):
        raise TypeError("ExpertWeights holds one weight per expert: use packed_weights()")

    def quantized_weights(self) -> list[QuantizedWeight]:
        """Each expert's weight in the portable layout (`bitkern.QuantizedWeight`)."""
        return [weight.to_portable() for weight in self.packed_weights()]

    def quantized_weight(self):
        raise TypeError("ExpertWeights holds one weight per expert: use quantized_weights()")

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float [E, N, K] weight this module computes with."""
        return torch.stack([torch.ops.bitkern.dequantize(*self.op_weight(e), dtype) for e in range(self.num_experts)])

    def check_weight_tensors(self, tensors: dict, layout, where: str = "") -> None:
        """As `QuantizedModule.check_weight_tensors` for one expert, each tensor with a leading num_experts."""
        for name, (shape, _) in tensors.items():
            if len(shape) == 0 or shape[0] != self.num_experts:
                raise ValueError(f"{where}{name} has shape {list(shape)}; this {type(self).__name__} stores "
                                 f"{self.num_experts} experts, so its first dimension must be {self.num_experts}")
        super().check_weight_tensors({name: (tuple(shape)[1:], dtype) for name, (shape, dtype) in tensors.items()},
                                     layout, where)

    # -- computation ---------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        """y [S, out_features] of x [S, in_features], whose rows are sorted by expert: counts[e] rows for expert e
        (a list, or an integer tensor [E], which a compiled graph keeps as data)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be a [rows, {self.in_features}] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if len(counts) != self.num_experts:
            raise ValueError(f"counts must give the rows of each of the {self.num_experts} experts, summing to "
                             f"x's {x.shape[0]} rows; got {len(counts)} counts")
        x, output_dtype = self._compute_input(x)
        return self.grouped(x, counts, output_dtype)

    def grouped(self, x: torch.Tensor, counts, output_dtype: torch.dtype) -> torch.Tensor:
        """The projection over the experts' blocks of rows: one call of the dense matmul kernel per expert with rows
        (prompts; `routed` serves a few tokens in one call).  Inside a compiled graph (nothing to differentiate)
        one `expert_blocks` op makes those calls, so the rows per expert stay data; else they are made here."""
        bias = self._parameters["bias"]
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
        if torch.compiler.is_compiling() and isinstance(counts, torch.Tensor) and not needs_grad:
            weight = [self._buffers[name] for name in WEIGHT_BUFFERS]
            return torch.ops.bitkern.expert_blocks(x, weight, self._format_text, counts, bias, output_dtype,
                                                   self._activation_quant)
        if not torch.compiler.is_compiling():  # (a graph break under torch.compile)
            _note_path(False)
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        if library.eager(x, bias):
            linear, weight_at = library.run_linear, self.packed_weights().__getitem__
        else:
            linear, weight_at = torch.ops.bitkern.linear, (lambda e: self.op_weight(e)[0])
        return library.run_expert_blocks(x, counts, linear, weight_at, self._format_text, bias, output_dtype,
                                         self._activation_quant)

    def kernel_call(self, spec, tokens: tuple[int, int], rows_per_token: int = 1, up_to: bool = False) -> KernelCall:
        """The KernelCall of `spec` on this projection's weights (one expert's N and K) at `tokens`' counts."""
        return KernelCall(spec, *self.gemm_shape, self.layout, self.qweight.device, tokens, rows_per_token, up_to)

    def routes(self, x: torch.Tensor, epilogue: str = "none", combine: bool = False) -> bool:
        """Whether the grouped kernel serves this projection for rows like x (a CPU tensor with the weight in tile16 or
        a CUDA one with it in lop3, a type without a tensor scale, out_features a multiple of 16, and a template for
        them, for the activation quantization and for `epilogue` and `combine` in its output stage, on x's device).
        A meta projection (no weights yet: what `prebuild --model` lists) is judged in the layout its weights take on
        x's device."""
        laid_out = self.qweight.is_meta or self.layout == GROUPED_LAYOUTS.get(x.device.type)
        if x.device.type not in GROUPED_LAYOUTS or not laid_out or ttype.get(self.weight_dtype).tensor_scale or \
                self.out_features % STACK_ROWS:
            return False
        return _grouped_kernel_serves(self._stacked_format(), self._compute_dtype or x.dtype, x.dtype,
                                      self._parameters["bias"] is not None, self.num_experts, x.device.type,
                                      self._activation_quant, epilogue, combine)

    def routed(self, x: torch.Tensor, indices: torch.Tensor, checked: bool = False, epilogue: str = "none",
               weights: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, top_k, out_features] of x [M, in_features] with each row's top_k experts (indices [M, top_k]) by one
        call of the grouped kernel (`routes` must hold for `epilogue` and the weights); epilogue "swiglu": silu of the
        first half of each expert's outputs times the second (out_features / 2 columns); with the routing `weights` [M,
        top_k], x is [M·top_k, in_features] (a row per pair) and y [M, ...] their weighted sum
        (`bitkern.ops.GroupedMatmul`); `checked`: the caller has checked x's shape and the expert ids, as `Experts`
        does once for both projections."""
        x, output_dtype = self._compute_input(x)
        bias = self._parameters["bias"]
        weight = self.stacked_weight()
        if library.eager(x, bias):
            return library.run_grouped_linear(x, weight, self._stacked_format(), indices, bias, output_dtype,
                                              self.num_experts, self._activation_quant, checked, epilogue, weights)
        tensors, weight_format = library.op_arguments(weight)
        return torch.ops.bitkern.grouped_linear(x, tensors, weight_format, indices, bias, output_dtype,
                                                self.num_experts, self._activation_quant, epilogue, weights)

    def stacked_weight(self):
        """The experts' weights as one [E·N, K] `bitkern.PackedWeight` (views of the buffers, [E, tiles, ...] seen as
        [E·tiles, ...]): what the grouped kernel reads; the same object while the buffers are the same tensors."""
        buffers = tuple(self._buffers[name] for name in WEIGHT_BUFFERS)
        kept = self.__dict__.get("_stacked")
        if kept is None or kept[1] is not self._format_text or any(a is not b for a, b in zip(kept[0], buffers)):
            tensors = [None if t is None else t.flatten(0, 1) for t in buffers]
            weight = library.weight_of(tensors, WeightFormat.decode(self._stacked_format()))
            kept = self.__dict__["_stacked"] = (buffers, self._format_text, weight)
        return kept[2]

    def _stacked_format(self) -> str:
        return stacked_format(self._format_text, self.num_experts)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self._weight_repr()}")


@functools.lru_cache(maxsize=None)
def stacked_format(format_text: str, experts: int) -> str:
    """The weight format (encoded) of `experts` weights of format `format_text` stacked by rows: [E·N, K]."""
    one = WeightFormat.decode(format_text)
    return dataclasses.replace(one, shape=(experts * one.shape[0], one.shape[1])).encode()


@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result  # a compiled graph asks once, while tracing (it reads the CPU's features)
def _grouped_kernel_serves(stacked_format_text: str, compute: torch.dtype, output: torch.dtype, bias: bool,
                           experts: int, device_type: str, activation_quant: str, epilogue: str,
                           combine: bool) -> bool:
    """Whether this machine's `device_type` ("cpu", "cuda") has a grouped kernel template for experts stacked as
    `stacked_format_text` (x quantized by `activation_quant`, `epilogue` and `combine` in its output stage)."""
    spec = library.grouped_spec_of(stacked_format_text, compute, output, bias, experts, 1, activation_quant, epilogue,
                                   combine)
    rows, k = WeightFormat.decode(stacked_format_text).shape
    return serves_grouped(spec, rows // experts, k, device_type)


@torch.compiler.disable  # run as it is, not traced, under torch.compile
@functools.cache
def _note_path(grouped: bool, fused: tuple[bool, bool] = (False, False)) -> None:
    """Say once per process (and path) which path mixture-of-experts projections take."""
    if grouped:
        steps = [step for step, done in zip(("the SwiGLU", "the weighted top-k sum"), fused) if done]
        log.info("bitkern: mixture-of-experts projections of a few tokens (at most %d token-expert pairs) run the "
                 "grouped kernel: one call per projection, %s", GROUPED_PAIRS,
                 f"{' and '.join(steps)} in its output stage" if steps else "gate and weighted sum in torch")
    else:
        log.info("bitkern: mixture-of-experts projections run one dense matmul kernel call per expert with tokens "
                 "(prompts; or no grouped kernel serves them)")


class Experts(nn.Module):
    """The experts of a mixture-of-experts block, quantized: for each token t and each of its top-k experts e
    (top_k_index [T, k]) with weight w (top_k_weights [T, k]),

        y_t = Σ w · (down_e(gate(gate_up_e(x_t))))

    gate_up [E, 2·intermediate, hidden] and down [E, hidden, intermediate] are `ExpertWeights` (settings as for
    `bitkern.Linear`: dtype, group_size, zero_mode, compute_dtype, scale_dtype, activation_quant, method); gate maps
    the gate/up output [rows, 2·intermediate] to [rows, intermediate] (default `swiglu`: silu of the first half times
    the second).  A new module is initialised at random, then quantized; `from_float` quantizes a transformers
    experts module, whose own gate it keeps.  The routing weights are summed in float32; the output has x's dtype.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 gate: Callable | None = None, dtype="nf4", group_size=None, zero_mode: str | None = None,
                 compute_dtype=None, device=None, scale_dtype=torch.float16, activation_quant: str = "none",
                 method: str = "rtn"):
        super().__init__()
        if gate is not None and not callable(gate):
            raise TypeError(f"gate must be a callable [rows, 2·intermediate] -> [rows, intermediate] or None "
                            f"(SwiGLU), got {type(gate).__name__}")
        settings = dict(dtype=dtype, group_size=group_size, zero_mode=zero_mode, compute_dtype=compute_dtype,
                        device=device, scale_dtype=scale_dtype, activation_quant=activation_quant, method=method)
        self.gate_up = ExpertWeights(num_experts, hidden_size, 2 * check_positive("intermediate_size",
                                                                                   intermediate_size), bias, **settings)
        self.down = ExpertWeights(num_experts, intermediate_size, hidden_size, bias, **settings)
        self.gate = swiglu if gate is None else gate
        self.__dict__["float_template"] = None
        self.__dict__["gate_is_swiglu"] = gate is None

    @property
    def num_experts(self) -> int:
        return self.down.num_experts

    @property
    def projections(self) -> dict[str, ExpertWeights]:
        """{name: projection} in the order they run: "gate_up" (or "up" where the experts have no gate), "down"."""
        return {name: module for name, module in self._modules.items() if isinstance(module, ExpertWeights)}

    @classmethod
    def from_float(cls, module: nn.Module, settings: dict | Callable[[str], dict]) -> "Experts":
        """The quantized experts of a transformers experts module (see `is_float_experts`), each projection quantized
        one expert at a time with `settings` (the constructor's weight settings; or a function of the float
        parameter's name, "gate_up_proj" / "up_proj" / "down_proj", giving them).  The model's gate (its
        `_apply_gate`, or `act_fn` for experts without one) is kept."""
        check_float_experts(module)
        return cls.from_projections(module, {name: ExpertWeights.from_float_weight(
            gemm_weight(module, name), float_bias(module, name), **_settings_of(settings, FLOAT_PARAMETERS[name]))
            for name in float_projections(module)})

    @classmethod
    def empty_like(cls, module: nn.Module, settings: dict | Callable[[str], dict]) -> "Experts":
        """Empty quantized experts (on meta) of a transformers experts module's geometry: what a checkpoint loads."""
        check_float_experts(module)
        projections = {}
        for name in float_projections(module):
            experts, n, k = gemm_shape(module, name)
            projections[name] = ExpertWeights(experts, k, n, float_bias(module, name) is not None, device="meta",
                                              **_settings_of(settings, FLOAT_PARAMETERS[name]))
        return cls.from_projections(module, projections)

    @classmethod
    def from_projections(cls, module: nn.Module, projections: dict[str, ExpertWeights]) -> "Experts":
        """Quantized experts made of `projections` ({"gate_up" or "up": ..., "down": ...}) with the gate of the
        transformers experts module `module`, which stays their float template (without its tensors)."""
        check_float_experts(module)
        if set(projections) != set(float_projections(module)):
            raise ValueError(f"projections must be {float_projections(module)}, got {sorted(projections)}")
        for name, projection in projections.items():
            if tuple(projection.weight_shape) != gemm_shape(module, name):
                raise ValueError(f"projections[{name!r}] has weight shape {projection.weight_shape}; the experts "
                                 f"module's {FLOAT_PARAMETERS[name]} is {gemm_shape(module, name)} as [E, N, K]")
        experts = cls.__new__(cls)
        nn.Module.__init__(experts)
        for name in float_projections(module):
            setattr(experts, name, projections[name])
        template = _template(module)
        experts.__dict__["gate"] = template._apply_gate if module.has_gate else template.act_fn
        experts.__dict__["float_template"] = template
        experts.__dict__["gate_is_swiglu"] = gates_by_swiglu(module)
        return experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """hidden_states [T, hidden], top_k_index [T, k] (expert ids), top_k_weights [T, k] -> [T, hidden]."""
        tokens, top_k = self._check_routing(hidden_states, top_k_index, top_k_weights)
        if self._routes(hidden_states, tokens * top_k):
            return self._decode(hidden_states, top_k_index, top_k_weights)
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        # rows per expert, [E] (bincount's length depends on the ids: a data-dependent shape in a compiled graph)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=expert_ids.device).scatter_add_(
            0, expert_ids.long(), torch.ones_like(expert_ids, dtype=torch.int64))
        rows = hidden_states[order // top_k]
        first, *rest = self.projections.values()
        if not torch.compiler.is_compiling():  # a list, once for every projection (a compiled graph keeps a tensor)
            counts = counts.tolist()
        hidden = self.gate(first(rows, counts))
        for projection in rest:
            hidden = projection(hidden, counts)
        weighted = hidden.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
        unsorted = torch.empty_like(weighted)
        unsorted[order] = weighted
        return unsorted.view(tokens, top_k, hidden.shape[-1]).sum(dim=1).to(hidden_states.dtype)

    def kernel_calls(self, dtype: torch.dtype, top_k: int | None, fused: bool = True) -> list[KernelCall]:
        """The kernels calls with x of `dtype` and `top_k` experts a token run (what `bitkern.prepare` and vLLM's
        MoE method make ready): where the grouped kernels serve, calls of at most GROUPED_PAIRS pairs run the first
        projection's at a row a token (with SwiGLU where `_fusions` says) and the others' at a row a pair (the last
        one's at a token's pairs where it sums them); the rest run each projection's dense kernel at any row count
        up to the tokens (an expert's share).  top_k None (unknown): the dense kernels only.  fused=False: the
        grouped kernels of a device that runs neither step in them (a CUDA GPU's, listed for a prebuild from here)."""
        first, *rest = self.projections.values()
        probe = torch.empty(0, first.in_features, dtype=dtype, device="cuda" if first.qweight.is_cuda else "cpu")
        grouped = top_k is not None and all(projection.routes(probe) for projection in self.projections.values())
        decode = (1, GROUPED_PAIRS // top_k) if grouped else (1, 0)
        calls = [projection.kernel_call(library.spec_of(projection.op_weight(0)[1], projection.compute_dtype or dtype,
                                                        dtype, projection.bias is not None,
                                                        activation_quant=projection.activation_quant),
                                        (decode[1] + 1, ALL_TOKENS[1]), up_to=True)
                 for projection in self.projections.values()]
        if grouped:
            swiglu, combine = self._fusions(probe) if fused else (False, False)
            last = len(self.projections) - 1
            for index, projection in enumerate(self.projections.values()):
                combined = combine and index == last
                routed = top_k if index == 0 or combined else 1
                spec = library.grouped_spec_of(library.op_arguments(projection.stacked_weight())[1],
                                               projection.compute_dtype or dtype, dtype, projection.bias is not None,
                                               projection.num_experts, routed, projection.activation_quant,
                                               "swiglu" if swiglu and index == 0 else "none", combined)
                calls.append(projection.kernel_call(spec, decode, rows_per_token=top_k // routed))
        return calls

    def _fusions(self, x: torch.Tensor, routing_weights: torch.Tensor | None = None) -> tuple[bool, bool]:
        """(SwiGLU in the first projection's grouped kernel, the weighted top-k sum in the last one's) for rows like
        x: where the gate is SwiGLU on [gate; up] halves (`gates_by_swiglu`), the routing weights need no gradient,
        and a grouped kernel serves each (the CPU's; CUDA's compute neither)."""
        first, *_, last = self.projections.values()
        swiglu = self.gate_is_swiglu and first.routes(x, epilogue="swiglu")
        differentiated = routing_weights is not None and torch.is_grad_enabled() and routing_weights.requires_grad
        return swiglu, not differentiated and last.routes(x, combine=True)

    def _routes(self, hidden_states: torch.Tensor, pairs: int) -> bool:
        """Whether a call of `pairs` token-expert pairs runs the grouped kernels (`_decode`): few pairs, nothing to
        differentiate, and a grouped kernel for every projection."""
        return 0 < pairs <= GROUPED_PAIRS and not (torch.is_grad_enabled() and hidden_states.requires_grad) and \
            all(projection.routes(hidden_states) for projection in self.projections.values())

    def _decode(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The forward of a few tokens by one grouped kernel call per projection: the first projection of each token
        for its top-k experts ([T, k, N]), the gate (in that kernel where `_fusions` says), then each further
        projection of each (token, expert) pair's row for its expert (top-1 routing of the T·k rows; the last one
        summing a token's pairs with their routing weights in the kernel where `_fusions` says)."""
        swiglu, combine = self._fusions(hidden_states, top_k_weights)
        if not torch.compiler.is_compiling():  # (a graph break under torch.compile)
            _note_path(True, (swiglu, combine))
        tokens, top_k = top_k_index.shape
        first, *rest, last = self.projections.values()
        if swiglu:
            hidden = first.routed(hidden_states, top_k_index, checked=True, epilogue="swiglu")
        else:
            hidden = self.gate(first.routed(hidden_states, top_k_index, checked=True).view(tokens * top_k, -1))
        hidden = hidden.reshape(tokens * top_k, -1)
        pair_experts = top_k_index.reshape(-1, 1)
        for projection in rest:
            hidden = projection.routed(hidden, pair_experts, checked=True).view(tokens * top_k, -1)
        if combine:
            return last.routed(hidden, top_k_index, checked=True, weights=top_k_weights).to(hidden_states.dtype)
        hidden = last.routed(hidden, pair_experts, checked=True)
        weighted = hidden.float().view(tokens, top_k, -1) * top_k_weights.float().unsqueeze(-1)
        return weighted.sum(dim=1).to(hidden_states.dtype)

    def _check_routing(self, hidden_states, top_k_index, top_k_weights) -> tuple[int, int]:
        """(tokens, k); ValueError/TypeError naming the argument that does not fit."""
        hidden = self.projections[next(iter(self.projections))].in_features
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
            raise ValueError(f"hidden_states must be a [tokens, {hidden}] tensor, got "
                             f"{_describe(hidden_states)}")
        if not isinstance(top_k_index, torch.Tensor) or top_k_index.dtype not in (torch.int32, torch.int64) or \
                top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
            raise TypeError(f"top_k_index must be an int32/int64 tensor [{hidden_states.shape[0]}, k], got "
                            f"{_describe(top_k_index)}")
        if not isinstance(top_k_weights, torch.Tensor) or tuple(top_k_weights.shape) != tuple(top_k_index.shape) \
                or not top_k_weights.is_floating_point():
            raise ValueError(f"top_k_weights must be a float tensor of top_k_index's shape "
                             f"{list(top_k_index.shape)}, got {_describe(top_k_weights)}")
        if top_k_index.numel() and not torch.compiler.is_compiling() and (
                int(top_k_index.min()) < 0 or int(top_k_index.max()) >= self.num_experts):
            raise ValueError(f"top_k_index holds expert ids outside [0, {self.num_experts}) "
                             f"(min {int(top_k_index.min())}, max {int(top_k_index.max())})")
        return top_k_index.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The float experts module (of the class `from_float` took) holding the dequantized weights and the biases."""
        if self.float_template is None:
            raise TypeError("these Experts were not made from a float experts module (from_float), so there is no "
                            "float class to give back; use each projection's dequantize_weight()")
        module = copy.copy(self.float_template)
        module._parameters, module._buffers, module._modules = {}, {}, dict(self.float_template._modules)
        for name, projection in self.projections.items():
            weight = projection.dequantize_weight(dtype)
            setattr(module, FLOAT_PARAMETERS[name],
                    nn.Parameter(weight.transpose(1, 2).contiguous() if module.is_transposed else weight))
            if projection.bias is not None:
                setattr(module, FLOAT_PARAMETERS[name] + "_bias", nn.Parameter(projection.bias.detach().to(dtype)))
        return module

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weights (codes, scales, zeros; biases not included)."""
        return sum(projection.nbytes for projection in self.projections.values())


def gates_by_swiglu(module: nn.Module) -> bool:
    """Whether a transformers experts module's gate is SwiGLU on [gate; up] halves, which the grouped kernels apply in
    their output stage: transformers' default `_apply_gate` (halves, act_fn of the first times the second) with an
    act_fn equal to torch's silu.  Others (gpt-oss's clamped gate, other activations) run as the model defines them."""
    if not getattr(module, "has_gate", False):
        return False
    apply_gate = getattr(type(module), "_apply_gate", None)
    if getattr(apply_gate, "__module__", None) != "transformers.integrations.moe" or \
            getattr(apply_gate, "__name__", None) != "_default_apply_gate":
        return False
    act_fn = getattr(module, "act_fn", None)
    probe = torch.linspace(-12.0, 12.0, 97)
    return callable(act_fn) and torch.equal(act_fn(probe), nn.functional.silu(probe))


def is_float_experts(module: nn.Module) -> bool:
    """Whether `module` is a float experts module as transformers' `use_experts_implementation` makes them: 3-D
    parameters `gate_up_proj` (or `up_proj` where has_gate is false) and `down_proj`, and the flags has_gate,
    is_transposed."""
    if not isinstance(module, nn.Module) or isinstance(module, Experts) or not hasattr(module, "is_transposed") \
            or not hasattr(module, "has_gate"):
        return False
    return all(isinstance(module._parameters.get(FLOAT_PARAMETERS[name]), torch.Tensor)
               and module._parameters[FLOAT_PARAMETERS[name]].dim() == 3 for name in float_projections(module))


def check_float_experts(module: nn.Module) -> None:
    """ValueError naming what keeps `module` from being quantized as experts (nothing: returns)."""
    if not is_float_experts(module):
        raise ValueError(f"module must be a transformers experts module (use_experts_implementation: 3-D gate_up_proj "
                         f"or up_proj and down_proj, has_gate, is_transposed), got {type(module).__name__}")
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{type(module).__name__} normalizes each expert's output (has_post_expert_norm), which "
                         f"bitkern's Experts do not")
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"{type(module).__name__} is sharded by expert parallelism, which bitkern's Experts do not "
                         f"support")


def float_projections(module: nn.Module) -> list[str]:
    """The projections of a float experts module, as bitkern names them ("gate_up" or "up", then "down")."""
    return ["gate_up" if getattr(module, "has_gate", True) else "up", "down"]


def gemm_weight(module: nn.Module, name: str) -> torch.Tensor:
    """The float experts module's weight of projection `name` as [E, N, K] (transposed where it stores [E, K, N])."""
    weight = getattr(module, FLOAT_PARAMETERS[name])
    return weight.transpose(1, 2) if module.is_transposed else weight


def gemm_shape(module: nn.Module, name: str) -> tuple[int, int, int]:
    """(E, N, K) of the float experts module's projection `name`."""
    return tuple(gemm_weight(module, name).shape)


def float_bias(module: nn.Module, name: str) -> torch.Tensor | None:
    """The float experts module's bias [E, N] of projection `name`, or None."""
    return module._parameters.get(FLOAT_PARAMETERS[name] + "_bias") if getattr(module, "has_bias", False) else None


def _template(module: nn.Module) -> nn.Module:
    """A copy of the float experts module without its tensors: its gate and class, for the forward and `dequantize`."""
    template = copy.copy(module)
    template._parameters, template._buffers = {}, {}
    template._modules = {name: child for name, child in module._modules.items()
                         if not any(True for _ in child.parameters())}
    return template


def _settings_of(settings, parameter: str) -> dict:
    return dict(settings(parameter) if callable(settings) else settings)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


def experts_targets(model: nn.Module, skipped: Callable) -> list[tuple[str, nn.Module]]:
    """(name, module) of the float experts modules of `model` to quantize (`skipped(name, module)`: the caller's
    choice); one that bitkern cannot compute stays float, logged as a warning with the reason."""
    targets = []
    for name, module in model.named_modules():
        if not is_float_experts(module) or skipped(name, module):
            continue
        try:
            check_float_experts(module)
        except ValueError as error:
            log.warning("bitkern: %s stays float: %s", name or "(model)", error)
            continue
        targets.append((name, module))
    return targets


def experts_in_features(name: str, module: nn.Module) -> list[tuple[str, int]]:
    """(parameter name, reduction length K) of each projection of a float experts module called `name`: what a
    group size must divide."""
    prefix = f"{name}." if name else ""
    return [(prefix + FLOAT_PARAMETERS[projection], gemm_shape(module, projection)[2])
            for projection in float_projections(module)]
