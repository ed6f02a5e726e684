"""Decode GEMV template for few rows: each warp computes a few outputs, its threads split K.

Per thread and k-step: one vectorized load of `words` 32-bit words of codes (words=4: 128 bits), the
LOP3 decode of each word into registers (scale and zero applied), products with x (loaded 16 bytes at a
time for rows=1) accumulated in float32 (int32 for int8 activations) for every row; then a warp-shuffle
reduction across the threads of the warp and the epilogue (per-channel scale, bias, cast).  Rows are
processed `rows` at a time (blockIdx.y covers M / rows blocks), so one kernel serves any M and is
fastest for M <= rows.  Split-K (`split_k` > 1) cuts K into slices computed by different blocks: the
kernel then writes float32 partial sums and `splitk.build_reduce` makes the kernel that sums them and
applies the epilogue.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

from ...ops.matmul import Matmul
from ...ttype import effective_group_size, get, itemsize
from . import splitk
from .decode import library
from .expr import ACCUMULATE, cuda_matmul_expr
from .intrin import decode_intrinsic
from .layout import layout_group, padded_shape, type_unsupported
from ..sched import read_index, vector_lanes
from ..template import Work
from .kernel import (DECODES, MAX_THREADS, PER_COLUMN_EPILOGUES, WARP, CudaTemplate, Resources, check_config,
                     weight_bytes)

log = logging.getLogger("bitkern")

FEW_ROWS = 4  # rows up to which a GEMV competes with the GEMM (it serves any M, in blocks of `rows`)
ACTIVATIONS = ("float16", "bfloat16", "float32", "int8")


@dataclass(frozen=True)
class GemvConfig:
    """Configuration of the GEMV template (chosen by the tuner).

    rows: rows of x per block (the kernel serves any M, in blocks of `rows`); warps: output columns per
    block (one per warp); k_threads: threads of a warp along K (the rest of the warp's 32 lanes take
    further columns); words: 32-bit words each thread loads per step (4 = 128-bit loads); split_k: K
    slices computed by separate blocks (1 = none); decode: "lop3" or "tir" (see `GemmConfig`).
    """

    rows: int = 1
    warps: int = 4
    k_threads: int = WARP  # a warp's lanes all along K
    words: int = 4
    split_k: int = 1
    decode: str = "lop3"

    def __post_init__(self):
        check_config(self, ("rows", "warps", "k_threads", "words", "split_k"))
        if self.k_threads not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"k_threads={self.k_threads} must be a power of two up to {WARP}")
        if self.words not in (1, 2, 4):
            raise ValueError(f"words={self.words} is not supported; accepted: 1, 2, 4 (4 = 128-bit loads)")
        if self.warps * WARP > MAX_THREADS:
            raise ValueError(f"warps={self.warps} exceed {MAX_THREADS} threads per block")

    @property
    def columns_per_warp(self) -> int:
        return WARP // self.k_threads

    @property
    def columns(self) -> int:
        """Output columns (weight rows) one block computes."""
        return self.warps * self.columns_per_warp

    def workspace(self, n: int, k: int, m: int) -> tuple:
        """(names, shape) of the float32 buffers the launches of a call with M rows share: split-K's partial sums."""
        return splitk.workspace(self.split_k, self.rows, n, k, m)


class GemvTemplate(CudaTemplate):
    name = "gemv"
    title = "GEMV"
    config_type = GemvConfig
    shape_fields = ("rows", "decode", "words", "k_threads")
    max_rows = FEW_ROWS
    # its output stage runs per weight row (a lane group's column): SwiGLU's gate and up rows are computed by other
    # lanes, so the GEMM serves SwiGLU at any M
    epilogues = PER_COLUMN_EPILOGUES

    def spec_unsupported(self, spec: Matmul, n: int, k: int, arch: str) -> str | None:
        if (reason := type_unsupported(get(spec.weight_dtype))) is not None:
            return reason
        if spec.activation_dtype not in ACTIVATIONS:
            return f"activation_dtype={spec.activation_dtype} (the GEMV takes {list(ACTIVATIONS)})"
        if spec.accumulate_dtype != ACCUMULATE[spec.activation_dtype]:
            return f"accumulate_dtype={spec.accumulate_dtype} (it accumulates in {ACCUMULATE[spec.activation_dtype]})"
        if spec.activation_dtype == "int8":
            if effective_group_size(spec.group_size, k) != k:
                return f"group_size={spec.group_size} with int8 activations (per-channel scales only, group_size=-1)"
            if spec.zero_mode == "hqq":
                return "zero_mode=hqq with int8 activations"
        return None

    def config_unsupported(self, spec: Matmul, n: int, k: int, config: GemvConfig, arch: str) -> str | None:
        n_pad, k_pad = padded_shape(n, k)
        per_word = 32 // get(spec.weight_dtype).bits
        step = config.k_threads * config.words * per_word * config.split_k
        if k_pad % step:
            return (f"k_threads={config.k_threads} x words={config.words} x {per_word} codes x split_k="
                    f"{config.split_k} = {step} does not divide the padded K={k_pad}")
        if n_pad % config.columns:
            return f"{config.columns} columns per block do not divide the padded N={n_pad}"
        if (reason := splitk.unsupported(spec, config.split_k)) is not None:
            return reason
        if config.decode == "lop3" and layout_group(effective_group_size(spec.group_size, k), k) % per_word:
            return f"decode='lop3' with group_size={spec.group_size} (a word of {per_word} codes needs one scale)"
        return None

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[GemvConfig]:
        """1 to 4 rows per block (no more than the bucket's rows: the rows past M are computed too), 2 to 8 warps, 8
        to 32 threads along K, 64- or 128-bit loads, split-K 1 to 4, both decodes: those that build and fit the
        architecture."""
        rows = [r for r in (1, 2, 4) if r <= max(1, bucket[1])]
        candidates = [GemvConfig(*fields) for fields in itertools.product(rows, (2, 4, 8), (8, 16, 32), (2, 4),
                                                                          (1, 2, 4), DECODES)]
        return self.buildable(spec, n, k, candidates, device)

    def resources(self, spec: Matmul, k: int, config: GemvConfig) -> Resources:
        """Threads, shared memory (none: x is read through the cache, the reduction uses warp shuffles) and a
        register estimate (ptxas' count after the build is in `CudaKernel.binary.registers`)."""
        ttype = get(spec.weight_dtype)
        x_cache = config.words * (32 // ttype.bits) * itemsize(spec.activation_dtype) // 8 if config.rows == 1 else 0
        registers = 32 + 2 * config.rows + 2 * config.words + x_cache
        return Resources(0, config.warps * WARP, registers)

    def work(self, spec: Matmul, n: int, k: int, m: int, config: GemvConfig, device) -> Work:
        """Per call: the weight read (and decoded) once per block of rows, x once, y (and split-K's partial sums);
        the products on the CUDA cores for every row of a block (rows past M are computed too); the loads into
        registers (the weights and, for every column, its rows of x); a thread block per row block, column block
        and K slice."""
        n_pad, k_pad = padded_shape(n, k)
        row_blocks = -(-m // config.rows)
        weights = weight_bytes(spec, n_pad, k_pad)
        dram = weights * row_blocks + m * k_pad * itemsize(spec.activation_dtype) + m * n_pad * 4 * config.split_k
        x_loads = n_pad * k_pad * config.rows * itemsize(spec.activation_dtype)  # every column reads its rows of x
        operations = {"core_flop": 2 * row_blocks * config.rows * n_pad * k_pad,
                      "decoded_weight": n_pad * k_pad * row_blocks, "extra_launch": int(config.split_k > 1),
                      "l1_bytes": (weights + x_loads) * row_blocks}
        return Work(row_blocks * (n_pad // config.columns) * config.split_k, dram, operations,
                    per_block=self.resources(spec, k, config))

    def functions(self, spec: Matmul, n: int, k: int, config: GemvConfig, arch: str, prefix: str = "") -> dict:
        """The scheduled PrimFunc (the decode functions' C source attached with pragma_import_c; arguments as
        `expr.cuda_matmul_expr`); with split_k > 1 its last argument is instead the float32 partial sums
        [split_k, M, N_pad], and the kernel that sums them (`splitk.build_reduce`) follows."""
        from tvm import s_tir, te

        self.checked(spec, n, k, config, arch)
        expr = cuda_matmul_expr(spec, n, k, config.rows)
        output = splitk.partial_sums(expr, config.split_k) if config.split_k > 1 else expr.output
        func = te.create_prim_func([*expr.inputs, output])
        schedule = Schedule(s_tir.Schedule(func.with_attr("global_symbol", "main")), spec, n, k, config, expr)
        schedule.apply()
        funcs = {f"{prefix}gemv": schedule.sch.mod["main"].with_attr("global_symbol", "main")}
        if config.split_k > 1:
            funcs[f"{prefix}gemv_reduce"] = splitk.build_reduce(spec, n, config.split_k, config.rows)
        return funcs


TEMPLATE = GemvTemplate()


class Schedule:
    """The schedule primitives of the template, step by step; metadata_scope: where the decode reads scales and zeros
    (`intrin.decode_intrinsic`)."""

    metadata_scope = "global"

    def __init__(self, sch, spec: Matmul, n: int, k: int, config: GemvConfig, expr):
        self.sch, self.spec, self.n, self.k, self.cfg, self.expr = sch, spec, n, k, config, expr
        self.ttype = get(spec.weight_dtype)
        self.per_word = 32 // self.ttype.bits

    def apply(self) -> None:
        sch, cfg = self.sch, self.cfg
        acc = sch.get_sblock("acc")
        loops = sch.get_loops(acc)
        piece = loops[0] if cfg.split_k > 1 else None
        m, n, k = loops[-3:]
        m_block, m_row = sch.split(m, [None, cfg.rows])
        n_block, n_warp, n_lane = sch.split(n, [None, cfg.warps, cfg.columns_per_warp])
        k_step, k_lane, k_word, k_code = sch.split(k, [None, cfg.k_threads, cfg.words, self.per_word])
        outer = [n_block, m_block] + ([piece] if piece is not None else [])
        order = outer + [n_warp, n_lane, k_lane, k_step, k_word, k_code, m_row]
        sch.reorder(*order)
        partial = sch.rfactor(k_lane, 0)
        loops = sch.get_loops(partial)
        for loop, thread in zip(loops, ["blockIdx.x", "blockIdx.y", "blockIdx.z"][:len(outer)]):
            sch.bind(loop, thread)
        column = loops[len(outer) + 1]
        sch.bind(loops[len(outer)], "threadIdx.z")
        sch.bind(column, "threadIdx.y")
        sch.bind(loops[len(outer) + 2], "threadIdx.x")
        k_step = loops[len(outer) + 3]
        self._per_thread(partial, k_step)
        sch.compute_inline(sch.get_sblock("xk"))
        if cfg.rows == 1:  # with more rows the clamped row index makes the cached region's size symbolic
            self._load_x(partial, k_step)
        sch.reverse_compute_at(acc, column)
        # the write-back block's loops follow its iterators, (k_lane, row); the cross-thread sum over k_lane
        # (warp shuffles) needs it innermost
        reduction = sch.get_loops(acc)[-2 if cfg.rows > 1 else -1]
        if int(sch.get(reduction).extent) != cfg.k_threads:
            raise RuntimeError(f"unexpected loop nest in the GEMV write-back block: {sch.get(acc)}")
        if cfg.rows > 1:
            sch.reorder(sch.get_loops(acc)[-1], reduction)
        sch.bind(reduction, "threadIdx.x")
        sch.set_scope(partial, 0, "local")
        if cfg.split_k == 1:
            sch.reverse_compute_at(sch.get_sblock("y"), column)
            sch.set_scope(acc, 0, "local")

    def _load_x(self, partial, k_step) -> None:
        """The thread's x values of a k-step (rows x words·C consecutive k) into registers, 16 bytes at a time."""
        sch = self.sch
        cache = sch.cache_read(partial, read_index(sch, partial, "x"), "local")
        sch.compute_at(cache, k_step)
        size = itemsize(self.spec.activation_dtype)
        # lanes divide K too, so that every row of x starts on a vector boundary
        lanes = vector_lanes(16 // size, math.gcd(self.cfg.words * self.per_word, self.k))
        _, vector = sch.split(sch.get_loops(cache)[-1], [None, lanes])
        sch.vectorize(vector)

    def _weight_registers(self, wdec, k_step):
        """The block that loads a thread's packed words of a k-step into registers (a local cache of qweight)."""
        register = self.sch.cache_read(wdec, read_index(self.sch, wdec, "qweight"), "local")
        self.sch.compute_at(register, k_step)
        return register

    def _per_thread(self, partial, k_step) -> None:
        """Per k-step of a thread: one vectorized load of the packed words, LOP3 decode of each word."""
        sch, cfg = self.sch, self.cfg
        wdec = sch.get_sblock("wdec")
        sch.compute_at(wdec, k_step)
        sch.set_scope(wdec, 0, "local")
        register = self._weight_registers(wdec, k_step)
        if cfg.words > 1:
            sch.vectorize(sch.get_loops(register)[-1])
        if cfg.decode == "lop3":
            word = sch.get_loops(wdec)[-1]
            _, lanes = sch.split(word, [None, self.per_word])
            sch.tensorize(lanes, decode_intrinsic(self.expr.decoder, self.metadata_scope))
            sch.annotate(k_step, "pragma_import_c", library([self.expr.decoder]))
        else:
            log.info("bitkern: CUDA GEMV decodes %s with plain TIR (decode='tir')", self.ttype.name)
