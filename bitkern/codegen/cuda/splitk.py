"""Split-K for the CUDA templates: the float32 partial sums a kernel writes per K slice, and the kernel that sums
them and applies the output stage (bias, epilogue, residual, cast).

Few rows leave most of a GPU idle when each thread block computes a whole K: cutting K into `split_k` slices
computed by separate blocks multiplies the blocks, at the cost of a second launch and the partial sums' traffic.
"""

from __future__ import annotations

from ...ops.expr import output_stage
from ...ops.matmul import Matmul
from .decode import FLOAT_OUTPUTS
from .expr import MAX_ROWS
from .layout import padded_shape

REDUCE_THREADS = 256


def unsupported(spec: Matmul, split_k: int) -> str | None:
    """Why `split_k` slices cannot serve `spec`, or None: int8 / fp8 activations scale the whole sum after it, and
    SwiGLU pairs columns the reduce kernel does not see."""
    if split_k == 1:
        return None
    if spec.activation_dtype not in FLOAT_OUTPUTS:
        return f"split_k with {spec.activation_dtype} activations (their scales apply after the whole sum)"
    if spec.epilogue == "swiglu":
        return "split_k with epilogue='swiglu' (the reduce kernel applies the output stage per column)"
    return None


def workspace(split_k: int, row_block: int, n: int, k: int, m: int) -> tuple:
    """(names, shape) of the partial sums of a call with M rows: [split_k, M rounded up to row_block, N_pad], written
    by the matmul as "acc" and read by the reduce kernel as "partial"; none without split-K."""
    if split_k == 1:
        return ()
    rows = -(-m // row_block) * row_block
    return ((("acc", "partial"), (split_k, rows, padded_shape(n, k)[0])),)


def partial_sums(expr, split_k: int):
    """acc[s, m, n] = Σ_{k in slice s} x[m, k] · W[n, k] in float32, from a `cuda_matmul_expr`."""
    from tvm import te

    if expr.decoder.scale is None:
        raise ValueError(f"split-K sums decoded weights: {expr.decoder} applies its scale after the sum")
    xk = expr.acc.op.input_tensors[0]
    wdec = expr.wdec
    m_pad, k_pad = xk.shape
    n_pad = wdec.shape[0]
    piece = int(k_pad) // split_k
    kk = te.reduce_axis((0, piece), name="k")
    return te.compute((split_k, m_pad, n_pad), lambda s, r, i: te.sum(
        xk[r, s * piece + kk].astype("float32") * wdec[i, s * piece + kk].astype("float32"), axis=kk), name="acc")


def build_reduce(spec: Matmul, n: int, split_k: int, row_block: int, name: str = "reduce"):
    """The kernel summing the partial sums [split_k, M rounded up to row_block, N_pad] into y [M, out_features] with
    the output stage; arguments: partial, bias (bias specs), residual (residual specs), y."""
    from tvm import s_tir, te, tirx

    n_pad, _ = padded_shape(n, 1)
    m = te.var("M")
    rows = (tirx.min(m, MAX_ROWS) + (row_block - 1)) // row_block * row_block
    partial = te.placeholder((split_k, rows, n_pad), "float32", name="partial")
    bias = te.placeholder((n,), "float32", name="bias") if spec.bias else None
    s = te.reduce_axis((0, split_k), name="s")
    total = te.compute((m, n), lambda r, i: te.sum(partial[s, r, i], axis=s), name="total")
    inputs = [partial] + ([bias] if bias is not None else [])
    y = output_stage(spec, m, n, lambda r, i: total(r, i) + bias(i) if bias is not None else total(r, i), inputs)
    sch = s_tir.Schedule(te.create_prim_func([*inputs, y]).with_attr("global_symbol", name))
    rows, cols = sch.get_loops(sch.get_sblock("y"))
    sch.compute_at(sch.get_sblock("total"), cols)
    sch.set_scope(sch.get_sblock("total"), 0, "local")
    fused = sch.fuse(rows, cols)
    block, thread = sch.split(fused, [None, REDUCE_THREADS])
    sch.bind(block, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    return sch.mod["main"].with_attr("global_symbol", name)
