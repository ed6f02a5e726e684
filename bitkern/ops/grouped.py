"""The grouped (mixture-of-experts) matmul for routed rows: each row of x goes to its top-k experts,

    y[m, j, :] = f(x[m] · dequant(W[indices[m, j]])ᵀ (+ bias[indices[m, j]]))

with the experts' [N, K] weights stacked by rows into one [E·N, K] weight (expert e's rows e·N .. (e+1)·N: the
stack of E weights quantized one at a time, as `bitkern.Experts` stores them) and the routing `indices` [M, top_k]
(int32 or int64 expert ids).  A kernel reads each selected expert's weight once per call, however many rows pick it.

Two steps of a mixture-of-experts block can run in the kernel's output stage:
  epilogue="swiglu"  f = SwiGLU on each expert's [gate; up] rows (its first N/2 rows the gate, the last N/2 the up
                     projection, as transformers' `gate_up_proj` stacks them): y[m, j, i] = silu(z_i) · z_{N/2+i}.
  combine=True       the down projection's weighted top-k sum: x holds a row per (m, j) pair (M·top_k rows, pair
                     m·top_k + j) and y[m, :] = Σ_j weights[m, j] · f(x[m·top_k + j] · dequant(W[indices[m, j]])ᵀ
                     (+ bias)) is [M, N], summed in float32; `weights` [M, top_k] are the router's.

`GroupedMatmul` is the hashable spec (a Matmul spec plus the number of experts and top_k, which its kernels are
compiled for); `GroupedMatmul.reference` the float64 definition every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..ttype import StoredWeight, torch_dtype
from . import execution
from .matmul import BIAS_DTYPES, Matmul, quantize_activations

INDEX_DTYPES = (torch.int32, torch.int64)
GROUPED_EPILOGUES = ("none", "swiglu")  # SwiGLU on each expert's [gate; up] halves (not `swiglu_rows`' order)
ROUTING_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STACK_ROWS = 16  # each expert's N is a multiple of this: the stack's tile16 tiles then never straddle two experts


@dataclass(frozen=True, kw_only=True)
class GroupedMatmul(Matmul):
    """Spec of the routed matmul: a Matmul spec (weight type, activation, output, group size, zero mode, scale
    dtype, bias: a per-expert bias [E, N], activation_quant: x quantized per row as `Matmul` does) over `experts`
    stacked [N, K] weights, each row of x going to `top_k` of them; epilogue "none" or "swiglu" (on [gate; up] halves,
    see the module docstring), `combine` the weighted top-k sum.  No residual or norm (the per-expert Matmul calls
    serve those)."""

    experts: int = field(default=0)
    top_k: int = field(default=1)
    combine: bool = field(default=False)

    def __post_init__(self):
        for name, value in (("experts", self.experts), ("top_k", self.top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not isinstance(self.combine, bool):
            raise TypeError(f"combine={self.combine!r} must be a bool")
        super().__post_init__()
        if self.epilogue not in GROUPED_EPILOGUES or self.residual or self.norm != "none":
            raise ValueError(f"epilogue={self.epilogue!r}, residual={self.residual}, norm={self.norm!r}: a grouped "
                             f"matmul has none of them; accepted: epilogue in {list(GROUPED_EPILOGUES)}, "
                             f"residual=False, norm='none'")
        object.__setattr__(self, "_hash", hash((self._hash, self.experts, self.top_k, self.combine)))
        object.__setattr__(self, "_unbiased", replace(self.matmul, bias=False))  # checks x against the weight

    def __hash__(self) -> int:
        return self._hash

    @property
    def matmul(self) -> Matmul:
        """One expert's spec: the same fields as a plain Matmul (bias of one expert), without the SwiGLU (which reads
        the expert's rows as halves, not as the dense epilogue's `swiglu_rows`): its z."""
        fields = {name: getattr(self, name) for name in Matmul.__dataclass_fields__}
        return Matmul(**dict(fields, epilogue="none"))

    def check_shape(self, n: int, k: int) -> None:
        """Raise unless each expert's weight can be [N, K] (see `Matmul.check_shape`), N a multiple of STACK_ROWS."""
        super().check_shape(n, k)
        if n % STACK_ROWS:
            raise ValueError(f"out_features={n}: a grouped matmul's experts have a multiple of {STACK_ROWS} rows each")

    def stacked_rows(self, n: int) -> int:
        """Rows of the stacked weight of experts of N rows each."""
        return self.experts * n

    def input_shape(self, m: int, k: int) -> tuple:
        """x of M tokens: a row per token, or per (token, expert) pair where the kernel combines them."""
        return (m * self.top_k if self.combine else m), k

    def output_shape(self, m: int, n: int) -> tuple:
        """y of M tokens on experts of N rows: [M, top_k, N'] per pair, or [M, N'] combined (N' of `out_features`)."""
        return (m, self.out_features(n)) if self.combine else (m, self.top_k, self.out_features(n))

    def fits(self, x, weight, bias, residual=None, norm_weight=None, norm_bias=None) -> bool:
        return False  # the routing is checked in full on every call (`check_routed`)

    def __call__(self, x: torch.Tensor, weight, indices: torch.Tensor, bias: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        """y (`output_shape`) of x [M, K] ([M·top_k, K] combined) by a compiled kernel; weight: the `bitkern.pack`ed
        [E·N, K] stack, indices [M, top_k], bias [E, N] or None, weights [M, top_k] (combine only; see the module
        docstring).  Goes to the dispatch layer (`bitkern.cache.dispatch`), which checks the inputs with
        `check_routed`."""
        return execution.run_grouped(self, x, weight, indices, bias, weights)

    def check_routed(self, x: torch.Tensor, weight, indices: torch.Tensor, bias: torch.Tensor | None = None,
                     weights: torch.Tensor | None = None) -> None:
        """Raise naming the argument if x [M, K] ([M·top_k, K] combined), the stacked weight [E·N, K], indices [M,
        top_k] (expert ids in [0, E)), bias [E, N] or weights ([M, top_k] floats, combine only) do not fit this
        spec."""
        if not isinstance(weight, StoredWeight):
            raise TypeError(f"weight must be a bitkern QuantizedWeight (the experts' stacked weights), got "
                            f"{type(weight).__name__}")
        if weight.ttype.tensor_scale:
            raise ValueError(f"weight_dtype={weight.ttype.name!r} has one scale per tensor, which a stack of experts "
                             f"does not share; a grouped matmul takes types without a tensor scale")
        rows, k = weight.shape
        if rows % self.experts:
            raise ValueError(f"weight has {rows} rows, not a stack of experts={self.experts} weights of equal rows")
        n = rows // self.experts
        self.check_shape(n, k)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"x must be a [rows, {k}] tensor, got {_describe(x)}")
        self._unbiased.check_inputs(x, weight)  # the weight's format, x's dtype, K and device
        tokens = x.shape[0] // self.top_k if self.combine else x.shape[0]
        if self.combine and x.shape[0] % self.top_k:
            raise ValueError(f"x has {x.shape[0]} rows; combine=True takes a row per (token, expert) pair: a multiple "
                             f"of top_k={self.top_k}")
        if not isinstance(indices, torch.Tensor) or indices.dtype not in INDEX_DTYPES or \
                tuple(indices.shape) != (tokens, self.top_k):
            raise ValueError(f"indices must be an int32 or int64 tensor [{tokens}, top_k={self.top_k}] (x's "
                             f"{'rows / top_k' if self.combine else 'rows'}), got {_describe(indices)}")
        if self.combine != (weights is not None):
            raise ValueError(f"weights {'are required' if self.combine else 'must be None'}: the spec has "
                             f"combine={self.combine}")
        if weights is not None and (not isinstance(weights, torch.Tensor) or weights.dtype not in
                                    ROUTING_WEIGHT_DTYPES or weights.shape != indices.shape or
                                    weights.device != x.device):
            raise ValueError(f"weights must be a float32, float16 or bfloat16 tensor [{tokens}, {self.top_k}] on "
                             f"{x.device}, got {_describe(weights)}")
        if indices.device != x.device:
            raise ValueError(f"indices is on {indices.device} but x is on {x.device}")
        self.check_expert_ids(indices)
        if self.bias != (bias is not None):
            raise ValueError(f"bias {'is required' if self.bias else 'must be None'}: the spec has bias={self.bias}")
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.experts, n)
                                 or bias.dtype not in BIAS_DTYPES or bias.device != x.device):
            raise ValueError(f"bias must be a float32, float16 or bfloat16 tensor [{self.experts}, {n}] on "
                             f"{x.device}, got {_describe(bias)}")

    def check_expert_ids(self, indices: torch.Tensor) -> None:
        """Raise unless every id of `indices` names one of the experts: in [0, experts)."""
        if indices.numel():
            low, high = (int(bound) for bound in torch.aminmax(indices))
            if low < 0 or high >= self.experts:
                raise ValueError(f"indices holds expert ids outside [0, {self.experts}) (min {low}, max {high})")

    def reference(self, x: torch.Tensor, weight, indices: torch.Tensor, bias: torch.Tensor | None = None,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
        """The reference result: `exact` cast to the output type."""
        return self.exact(x, weight, indices, bias, weights).to(torch_dtype(self.output_dtype))

    def exact(self, x: torch.Tensor, weight, indices: torch.Tensor, bias: torch.Tensor | None = None,
              weights: torch.Tensor | None = None) -> torch.Tensor:
        """y (`output_shape`) in float64 before output rounding: each (row, expert) pair's float64 sums of x (as
        activation_quant quantizes it) with the dequantized expert weight (and its bias), SwiGLU on its halves,
        summed with the routing weights where combined."""
        self.check_routed(x, weight, indices, bias, weights)
        values = self.weight_values(weight)
        values = values.view(self.experts, -1, values.shape[1])
        picked = values[indices.long()]  # [M, top_k, N, K]
        x = quantize_activations(x) if self.activation_quant == "int8" else x.double()
        if self.combine:
            y = torch.einsum("mjk,mjnk->mjn", x.view(indices.shape[0], self.top_k, -1), picked)
        else:
            y = torch.einsum("mk,mjnk->mjn", x, picked)
        if bias is not None:
            y = y + bias.double()[indices.long()]
        if self.epilogue == "swiglu":
            y = swiglu_halves(y)
        return (y * weights.double().unsqueeze(-1)).sum(dim=1) if self.combine else y


def swiglu_halves(z: torch.Tensor) -> torch.Tensor:
    """silu of the first half of z's last dimension times the second: SwiGLU on [gate; up] (epilogue="swiglu")."""
    gate, up = z.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)} on {value.device}"
    return type(value).__name__
