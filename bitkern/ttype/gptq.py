"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
2022): a [N, K] weight quantized one input column at a time, each column's rounding error fed forward into the
columns not yet quantized so that the layer's output on calibration inputs X changes least.  With H = Σ x·xᵀ
over X's rows (`Hessian`), the error of column j is spread by the row j of the upper Cholesky factor U of H⁻¹
(U[j, j:] / U[j, j]); columns are processed in blocks: a column takes the errors of its block's earlier columns
when it is reached (one matrix-vector product), the columns after a block take the block's errors at once.

Scales and zeros: per group of `group_size` columns, chosen by `bitkern.quantize`'s rules (`group_method`:
"hqq"'s search, by default for zero points; "rtn"'s range, by default for symmetric types other than the integers)
or, by default for the symmetric integer types, by the group's signed range ("range": the code −8 of int4 taken
by a negative extreme) from the group's columns as they stand when its first column is reached (GPTQ's dynamic
groups) or, with `static_groups`, from the original weight before any column moves.
`act_order` processes the columns by decreasing H[j, j] (the inputs with the most energy first, while there is
the most freedom left to compensate).  Stored as `bitkern.QuantizedWeight` with groups of consecutive columns:
with act-order and dynamic groups, the groups run in the processing order, so the weight keeps its columns in
that order and `gptq` returns the permutation (`bitkern.Linear.from_quantized(..., input_order=)`, as the GPTQ
importer holds act-order checkpoints); with static groups the columns go back to their own order and no
permutation is needed.

Entry point: `gptq(weight, hessian, ...)` -> (QuantizedWeight, input_order or None); `Hessian` accumulates H.
"""

from __future__ import annotations

import torch

from .packing import pack
from .quantize import (CALIBRATED_METHODS, CAST_TYPES, METHODS, Grid, QuantizedWeight, _group_range, _nonzero,
                       _Rounding, _store_scale, group_grid, resolve_arguments)
from .types import INT

_BLOCK = 128  # columns per block of lazy updates (a multiple of the group size where groups are chosen on the way)
# how a group's scale and zero are chosen: `bitkern.quantize`'s methods, or "range" (symmetric integer types only):
# the scale that maps the group's signed range onto the codes, max(max(w) / 7, min(w) / −8) for int4, so that a
# group whose largest magnitude is negative takes the code −8 and steps 8/7 finer than the absmax rule's
GROUP_METHODS = tuple(m for m in METHODS if m not in CALIBRATED_METHODS) + ("range",)


class Hessian:
    """H = Σ x·xᵀ over the rows x of every batch `add`ed (float32 [K, K]), and how many rows went in."""

    def __init__(self, in_features: int, device=None):
        self.matrix = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Add the rows of x [..., K] (any float dtype)."""
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        self.matrix.addmm_(rows.T, rows)
        self.rows += rows.shape[0]


def gptq(weight: torch.Tensor, hessian: torch.Tensor, dtype="int4", group_size: int | None = None,
         zero_mode: str | None = None, scale_dtype: torch.dtype = torch.float16, act_order: bool = False,
         static_groups: bool = False, damp: float = 0.01, group_method: str | None = None
         ) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """Quantize a float [N, K] weight by GPTQ against `hessian` (Σ x·xᵀ of the calibration inputs, [K, K]).

    dtype, group_size, zero_mode, scale_dtype: as for `bitkern.quantize` (any type it quantizes; bfloat16, which
    is cast, is refused).  act_order: quantize the columns by decreasing H[j, j].  static_groups: choose every
    group's scale and zero from the original weight first (with act_order, the stored weight then keeps its
    column order).  damp: added to H's diagonal, as a fraction of its mean, so that H is positive definite.
    group_method: how a group's scale and zero are chosen (`bitkern.quantize`'s methods: "hqq" or "rtn", GPTQ's
    own min/max rule; or "range", the signed range rule of the symmetric integer types, see `GROUP_METHODS`);
    None: "hqq" for zero points, "range" for the symmetric integer types, "rtn" for the other types of zero_mode
    "none" (a symmetric scale searched below the absmax clips the group's largest weight, whose error GPTQ then
    spreads: MiniLM int4 g128's worst cosine 0.948 with "rtn" against 0.902 with "hqq"; "range" never clips and
    uses the code −8: 0.975 against "rtn"'s 0.971 calibrated on 64 varied sentences with act_order and damp 0.1;
    uint4's is 0.967 with "hqq" against 0.958).
    Returns the weight and the permutation of its stored columns (None where they keep their order): the layer
    computes x[..., input_order] · dequant(weight)ᵀ.
    """
    ttype, group_size, zero_mode = resolve_arguments(weight, dtype, group_size, zero_mode, scale_dtype)
    if ttype.name in CAST_TYPES:
        raise ValueError(f"dtype={ttype.name!r} is cast, not quantized: GPTQ has no rounding to correct; "
                         f"accepted: the types of at most 8 bits")
    signed_integer = zero_mode == "none" and ttype.kind == INT and ttype.bits > 1
    if group_method is None:
        group_method = "hqq" if zero_mode != "none" else "range" if signed_integer else "rtn"
    if group_method not in GROUP_METHODS:
        raise ValueError(f"group_method={group_method!r} is not known; accepted: {list(GROUP_METHODS)}")
    if group_method == "range" and not signed_integer:
        raise ValueError(f"group_method='range' is for the signed integer types with zero_mode='none' (int2 to "
                         f"int8), got dtype={ttype.name!r}, zero_mode={zero_mode!r}")
    n, k = weight.shape
    if not isinstance(hessian, torch.Tensor) or tuple(hessian.shape) != (k, k):
        got = tuple(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian).__name__
        raise ValueError(f"hessian must be a [{k}, {k}] tensor (Σ x·xᵀ over inputs of in_features={k}), got {got}")
    if not 0 <= damp < 1:
        raise ValueError(f"damp={damp!r} must be in [0, 1): the fraction of H's mean diagonal added to it")
    w = weight.detach().float().clone()
    h = hessian.detach().to(torch.float64, copy=True)
    dead = h.diagonal() == 0  # inputs never active: independent of the others (their error goes nowhere)
    h.diagonal()[dead] = 1
    order = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    tensor_scale = group_grid(w, ttype, group_size, zero_mode, scale_dtype, "rtn").tensor_scale \
        if ttype.tensor_scale else None  # one per tensor, from the whole weight, whatever group is chosen
    static = _grid(w, ttype, group_size, zero_mode, scale_dtype, group_method) if static_groups else None
    if order is not None:
        w, h = w[:, order], h[order][:, order]
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    factor = _inverse_factor(h).float()
    rows = w.T.contiguous()  # [K, N]: a column of the weight is a contiguous row here
    codes = torch.empty(k, n, dtype=torch.uint8, device=w.device)
    grids = []
    block = _BLOCK if static is not None or group_size == k else group_size * max(1, _BLOCK // group_size)
    for start in range(0, k, block):
        end = min(start + block, k)
        errors = torch.zeros(end - start, n, dtype=torch.float32, device=w.device)  # scaled errors, one per column
        for j in range(start, end):
            done = j - start  # the block's columns quantized so far: their errors reach column j only now
            if static is not None:
                grid, group = static, int(j if order is None else order[j]) // group_size
            elif j % group_size == 0:
                current = rows[j:j + group_size] - factor[start:j, j:j + group_size].T @ errors[:done]
                grids.append(_grid(current.T.contiguous(), ttype, group_size, zero_mode, scale_dtype, group_method,
                                   tensor_scale))
                grid, group = grids[-1], 0
            column = rows[j] - errors[:done].T.mv(factor[start:j, j])
            codes[j] = grid.codes(column, group)
            errors[done] = (column - grid.values(codes[j], group)) / factor[j, j]
        rows[end:].addmm_(factor[start:end, end:].T, errors, alpha=-1)
    codes = codes.T
    if static is not None:
        if order is not None:
            codes = codes[:, torch.argsort(order)]
        scales, zeros, tensor_scale, order = static.scales, static.zeros, static.tensor_scale, None
    else:
        scales = torch.cat([grid.scales for grid in grids], 1)
        zeros = None if grids[0].zeros is None else torch.cat([grid.zeros for grid in grids], 1)
    quantized = QuantizedWeight(ttype, (n, k), group_size, zero_mode, pack(codes.contiguous(), ttype.bits), scales,
                                zeros, tensor_scale)
    return quantized, order


def _grid(weight: torch.Tensor, ttype, group_size: int, zero_mode: str, scale_dtype: torch.dtype, group_method: str,
          tensor_scale: torch.Tensor | None = None) -> Grid:
    """The `Grid` of the groups of a float32 [N, K] weight: `group_grid`'s, or for "range" the signed range rule
    (scale max(max(w) / largest value, min(w) / smallest value), stored in scale_dtype, codes the nearest)."""
    if group_method != "range":
        return group_grid(weight, ttype, group_size, zero_mode, scale_dtype, group_method, tensor_scale)
    low, high = _group_range(weight, group_size)
    scale = _store_scale(torch.maximum(high / float(ttype.values.max()), low / float(ttype.values.min())),
                         scale_dtype)
    return Grid(ttype, scale, None, None, _Rounding(ttype, _nonzero(scale.float())))


def _inverse_factor(h: torch.Tensor) -> torch.Tensor:
    """The upper triangular U with H⁻¹ = Uᵀ·U, in float64, from one Cholesky factorization and one triangular
    inverse: with J the order reversal and J·H·J = M·Mᵀ (M lower), H = R·Rᵀ for the upper R = J·M·J, so U = R⁻¹ =
    J·M⁻¹·J.  H is damped further if it is not positive definite (a calibration set with fewer independent rows
    than inputs)."""
    mean = float(h.diagonal().mean())
    identity = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for extra in (0.0, 0.01, 0.1, 1.0):
        lower, info = torch.linalg.cholesky_ex((h + extra * mean * identity).flip(0, 1))
        if int(info) == 0:
            return torch.linalg.solve_triangular(lower, identity, upper=False).flip(0, 1)
    raise ValueError("the calibration Hessian is not positive definite even damped by its mean diagonal; the "
                     "calibration inputs hold NaN or infinity")
