"""Grouped decode GEMV template: a mixture-of-experts projection of a few rows, y[m, j] = x[m] · dequant(W[indices[m,
j]])ᵀ (`ops.GroupedMatmul`), in one launch over the experts' stacked [E·N, K] weight in the "lop3" layout.

Each (row, top-k slot) pair is one row of the GEMV's schedule (`gemv.Schedule` with one row per block): a block
reads its pair's expert id from `indices` and computes that expert's N-tile for the pair, its threads loading,
LOP3-decoding and multiplying the expert's weight words as the dense GEMV does.  Weights are read once per pair: once
per selected expert when the pairs pick distinct experts (a decode step's usual case), and once more for each further
pair on an expert (from L2 when the blocks run together).  It serves what the GEMV serves, but types with a tensor
scale (stacked experts do not share one), and no epilogue, residual or split-K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.grouped import GroupedMatmul
from ...ops.expr import output_value, scale_storage, zero_storage
from ...ttype import codes_per_word, effective_group_size, get, itemsize, tvm_dtype
from ..template import Work
from .expr import ACCUMULATE, CudaExpr, code, decoder_for, dequant
from .gemv import GemvConfig, GemvTemplate, Schedule
from .kernel import DECODES, CudaKernel, weight_bytes
from .layout import layout_group, padded_shape

INDEX_DTYPE = torch.int64  # the expert ids the kernel reads (what torch.topk gives a router)
MAX_INDEX = 2**31  # the kernel indexes the stacked weight and y in int32
MAX_PAIRS = 65535  # a thread block row per (row, expert) pair: CUDA's grid.y limit


def check_pairs(m: int, top_k: int, n: int) -> None:
    """Raise unless a call of M rows to top_k experts of N outputs each fits the kernel's grid and int32 indexing."""
    pairs = m * top_k
    if pairs > MAX_PAIRS or pairs * n >= MAX_INDEX:
        raise ValueError(f"x has {m} rows: {pairs} (row, expert) pairs of {n} outputs; a grouped kernel serves up to "
                         f"{MAX_PAIRS} pairs (a block row each) and {MAX_INDEX - 1} outputs (run larger calls expert "
                         f"by expert, as bitkern.Experts does for prompts)")


@dataclass
class GroupedCudaKernel(CudaKernel):
    """A compiled grouped kernel: called with the routing as well."""

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None, residual: None = None,
                 indices: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, top_k, N] for a contiguous CUDA x [M, K], the experts' stacked weight [E·N, K] in the lop3 layout,
        indices [M, top_k] (expert ids, int32 or int64) and bias [E, N] or None (inputs already validated by the
        caller: `GroupedMatmul.check_routed`)."""
        self._check_call(x, weight)
        self._check_device(x.device)
        return self.launch(x.device, *self.plan(x, weight, bias, residual, indices))

    def plan(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None, residual: None = None,
             indices: torch.Tensor | None = None):
        """(y [M, top_k, N], [LaunchCall]) as `CudaKernel.plan`, with the routing among the arguments."""
        if residual is not None:
            raise ValueError("residual must be None: a grouped kernel adds none")
        if not isinstance(indices, torch.Tensor) or tuple(indices.shape) != (x.shape[0], self.spec.top_k):
            raise ValueError(f"indices must be a [{x.shape[0]}, top_k={self.spec.top_k}] tensor of expert ids, got "
                             f"{tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__}")
        check_pairs(x.shape[0], self.spec.top_k, self.n)
        if indices.dtype != INDEX_DTYPE or not indices.is_contiguous():
            indices = indices.to(INDEX_DTYPE).contiguous()  # expert ids below E: exact
        y, calls = self._plan(x, weight, None if bias is None else bias.reshape(-1), None, {"indices": indices})
        return y.view(x.shape[0], self.spec.top_k, self.n), calls

    def output_rows(self, m: int) -> int:
        return m * self.spec.top_k


@dataclass(frozen=True)
class GroupedGemvConfig(GemvConfig):
    """The GEMV's configuration (`GemvConfig`) with one pair per block: rows=1 and no split-K, the only values."""

    def __post_init__(self):
        super().__post_init__()
        if self.rows != 1 or self.split_k != 1:
            raise ValueError(f"rows={self.rows}, split_k={self.split_k}: a grouped GEMV block computes one (row, "
                             f"expert) pair over all of K; accepted: rows=1, split_k=1")


class GroupedGemvTemplate(GemvTemplate):
    """The GEMV template over routed pairs: its checks and schedule, an expression that gathers each pair's expert."""

    name = "grouped_gemv"
    title = "grouped GEMV"
    config_type = GroupedGemvConfig
    kernel_class = GroupedCudaKernel
    spec_class = GroupedMatmul
    grouped = True
    epilogues = ("none",)
    residual_add = False
    shape_fields = ("decode", "words", "k_threads")

    def spec_unsupported(self, spec: GroupedMatmul, n: int, k: int, arch: str) -> str | None:
        if get(spec.weight_dtype).tensor_scale:
            return f"{spec.weight_dtype} (a scale per tensor, which stacked experts do not share)"
        if spec.combine:
            return "combine=True (its blocks compute one pair each; the weighted top-k sum runs after it)"
        if (reason := super().spec_unsupported(spec, n, k, arch)) is not None:
            return reason
        if spec.experts * n * padded_shape(n, k)[1] // codes_per_word(get(spec.weight_dtype).bits) >= MAX_INDEX:
            return f"experts={spec.experts} of [{n}, {k}] weights (the stack's words must be indexable in int32)"
        return None

    def unsupported_rows(self, bucket: tuple[int, int], device) -> str | None:
        return None  # any rows: a block per (row, expert) pair

    def configs(self, spec: GroupedMatmul, n: int, k: int, bucket: tuple[int, int], device,
                hint) -> list[GroupedGemvConfig]:
        """2 to 8 warps, 8 to 32 threads along K, 64- or 128-bit loads, both decodes: those that build and fit."""
        candidates = [GroupedGemvConfig(warps=warps, k_threads=k_threads, words=words, decode=decode)
                      for warps in (2, 4, 8) for k_threads in (8, 16, 32) for words in (2, 4) for decode in DECODES]
        return self.buildable(spec, n, k, candidates, device)

    def work(self, spec: GroupedMatmul, n: int, k: int, m: int, config: GroupedGemvConfig, device) -> Work:
        """Per call, with the M·top_k pairs on as many distinct experts as they can be: each selected expert's weight
        from DRAM once (a further pair on it reads it from L2), x and y; the products and decodes per pair; a block
        per pair and column block."""
        n_pad, k_pad = padded_shape(n, k)
        pairs = m * spec.top_k
        selected = min(spec.experts, pairs)
        weights = weight_bytes(spec, n_pad, k_pad)
        dram = weights * selected + m * k_pad * itemsize(spec.activation_dtype) + pairs * n_pad * 4
        x_loads = n_pad * k_pad * itemsize(spec.activation_dtype)
        operations = {"core_flop": 2 * pairs * n_pad * k_pad, "decoded_weight": n_pad * k_pad * pairs,
                      "l1_bytes": (weights + x_loads) * pairs}
        return Work(pairs * (n_pad // config.columns), dram, operations, per_block=self.resources(spec, k, config))

    def functions(self, spec: GroupedMatmul, n: int, k: int, config: GroupedGemvConfig, arch: str,
                  prefix: str = "") -> dict:
        """The scheduled PrimFunc (arguments as `grouped_expr`), the GEMV's schedule over the pairs."""
        from tvm import s_tir, te

        self.checked(spec, n, k, config, arch)
        expr = grouped_expr(spec, n, k)
        func = te.create_prim_func([*expr.inputs, expr.output])
        schedule = _GroupedSchedule(s_tir.Schedule(func.with_attr("global_symbol", "main")), spec, n, k, config, expr)
        schedule.apply()
        return {f"{prefix}grouped_gemv": schedule.sch.mod["main"].with_attr("global_symbol", "main")}


TEMPLATE = GroupedGemvTemplate()


def grouped_expr(spec: GroupedMatmul, n: int, k: int) -> CudaExpr:
    """The grouped matmul as the tensor expression the template schedules, over P = M·top_k pairs (pair p = m·top_k +
    j of row m and slot j):

        e[p] = indices[m, j];   words[p, i, w] = qweight[e[p]·N + i, w]  (scales, zeros gathered alike)
        W[p, i, k] = dequant(words[p, i, k / C], scale[p, i, g], zero[p, i, g])    (`expr.dequant`)
        Y[p, i] = cast_out( Σ_k acc(X[m, k]) · acc(W[p, i, k]) [· s[e[p]·N + i]] + bias[e[p], i] )

    The gathers are stages of their own ("expert", "qweight_pair", ...), so that the decode reads what the LOP3
    intrinsic's description reads (a word, its scale and zero).  Arguments, in order: x [M, K], qweight [E·N, K_pad /
    C], scales, zeros (zero modes), indices [M, top_k] (int64), bias [E, N] (bias specs), y [M·top_k, N] (the memory
    of [M, top_k, N])."""
    from tvm import te, tirx

    ttype = get(spec.weight_dtype)
    decoder = decoder_for(spec)
    _, k_pad = padded_shape(n, k)
    rows = spec.experts * n
    group = layout_group(effective_group_size(spec.group_size, k), k)
    columns = -(-k_pad // group)
    m, top_k = te.var("M"), spec.top_k
    pairs = m * top_k
    x = te.placeholder((m, k), tvm_dtype(spec.activation_dtype), name="x")
    qweight = te.placeholder((rows, k_pad // codes_per_word(ttype.bits)), "int32", name="qweight")
    scales = te.placeholder((rows, columns), scale_storage(spec), name="scales")
    zeros = te.placeholder((rows, columns), zero_storage(spec), name="zeros") if spec.zero_mode != "none" else None
    indices = te.placeholder((m, top_k), "int64", name="indices")
    bias = te.placeholder((spec.experts, n), "float32", name="bias") if spec.bias else None
    inputs = [t for t in (x, qweight, scales, zeros, indices, bias) if t is not None]

    def routed(p):
        return indices[p // top_k, p % top_k].astype("int32")

    expert = te.compute((pairs,), routed, name="expert")

    def gather(tensor):
        return te.compute((pairs, n, tensor.shape[1]), lambda p, i, w: tensor[expert[p] * n + i, w],
                          name=f"{tensor.op.name}_pair")

    words = gather(qweight)
    scaled_later = decoder.scale is None
    pair_scales = None if scaled_later else gather(scales)
    pair_zeros = None if zeros is None else gather(zeros)

    def weight(p, i, j):
        g = j // group
        return dequant(decoder, code(_PairView(words, p), i, j, ttype.bits),
                       None if pair_scales is None else pair_scales[p, i, g],
                       None if pair_zeros is None else pair_zeros[p, i, g])

    wdec = te.compute((pairs, n, k_pad), weight, name="wdec")

    def padded_x(p, j):
        value = x[p // top_k, j]
        return tirx.if_then_else(j < k, value, tirx.const(0, x.dtype)) if k_pad > k else value

    xk = te.compute((pairs, k_pad), padded_x, name="xk")
    acc_dtype = ACCUMULATE[spec.activation_dtype]
    reduce_k = te.reduce_axis((0, k_pad), name="k")
    acc = te.compute((pairs, n), lambda p, i: te.sum(
        xk[p, reduce_k].astype(acc_dtype) * wdec[p, i, reduce_k].astype(acc_dtype), axis=reduce_k), name="acc")

    def y(p, i):
        value = acc[p, i].astype("float32")
        if scaled_later:
            value = value * scales[routed(p) * n + i, 0].astype("float32")
        return output_value(spec, value + bias[routed(p), i] if bias is not None else value)

    return CudaExpr(m, inputs, wdec, acc, te.compute((pairs, n), y, name="y"), decoder)


class _PairView:
    """Indexes a pair's gathered words the way `expr.code` indexes qweight ([row, word])."""

    def __init__(self, words, pair):
        self.words, self.pair = words, pair

    def __getitem__(self, index):
        row, word = index
        return self.words[self.pair, row, word]


class _GroupedSchedule(Schedule):
    """The GEMV's schedule with the pair's gathers: the expert id read once per thread, a k-step's words (one vector
    load), scale and zero gathered into registers where the GEMV caches qweight's."""

    metadata_scope = "local"

    def _weight_registers(self, wdec, k_step):
        sch = self.sch
        stages = (["scales_pair"] if self.expr.decoder.scale is not None else []) + \
            (["zeros_pair"] if self.spec.zero_mode != "none" else []) + ["qweight_pair"]
        for name in stages:
            block = sch.get_sblock(name)
            sch.compute_at(block, k_step)
            sch.set_scope(block, 0, "local")
        words = sch.get_sblock("qweight_pair")
        loops = sch.get_loops(words)
        thread = next(i for i, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(k_step))) - 1
        expert = sch.get_sblock("expert")
        sch.compute_at(expert, loops[thread])
        sch.set_scope(expert, 0, "local")
        return words
