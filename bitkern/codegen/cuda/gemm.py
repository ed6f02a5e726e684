"""TensorCore GEMM template: mma.sync with the weights decoded between shared memory and registers.

Per thread block (block_m x block_n outputs, warps of warp_m x warp_n), per k-step of block_k:
  cp.async   x tile and packed-weight tile, global -> shared, `stages`-deep pipeline;
  decode     each thread loads one word of codes from shared into a register, the LOP3 decode function
             turns it into C = 32/bits weights (scale and zero applied), stored to a padded shared tile
             (static shared memory: its barriers are then not shared with the pipeline's dynamic
             buffers, so the decode loop runs without any);
  ldmatrix   shared -> registers for x and the decoded weights (rows padded by 16 bytes: conflict-free);
  mma.sync   m16n8k16 (float16 / bfloat16) or m16n8k32 (int8, float8_e4m3), float32 / int32 accumulators;
  epilogue   accumulators -> shared -> global with the per-channel scale (int8 / fp8), bias and the cast.
M is symbolic (rounded up to block_m inside the kernel, extra rows read row M - 1 and are not stored);
N and K come padded by the "lop3" layout, x's columns past K are zero-filled by the copy.
Split-K (`split_k` > 1, float activations): blockIdx.z takes a K slice, the epilogue stores the float32 partial
sums and `splitk.build_reduce` makes the kernel that sums them and applies the output stage; few rows then fill
the GPU (at M=16 a 4096-wide layer has 128 blocks of two warps: 12% of the HBM bandwidth on an H100).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from ...ops.matmul import SWIGLU_BLOCK, Matmul
from ...ttype import effective_group_size, get, itemsize
from . import splitk
from .decode import FLOAT_OUTPUTS, library
from .expr import cuda_matmul_expr
from .intrin import MMA_DTYPES, decode_intrinsic, mma_intrinsics, mma_k
from .layout import K_GRAIN, layout_group, padded_shape, type_unsupported
from ..sched import loops_under, read_index, vector_lanes
from ..template import Work
from .kernel import DECODES, MAX_THREADS, WARP, CudaTemplate, Resources, check_config, weight_bytes

log = logging.getLogger("bitkern")

STATIC_SHARED_LIMIT = 48 * 1024
_FP8_ARCHS = ("sm_89", "sm_90", "sm_90a")
SPLIT_K = (1, 2, 4, 8)
SPLIT_K_ROWS = 128  # buckets of up to this many rows try split-K (more rows fill the GPU with row blocks)
MIN_N = 16  # out_features below this fail to schedule (TIR fuse of a 1-wide axis, symbolic shared tiles)


@dataclass(frozen=True)
class GemmConfig:
    """Tile configuration of the TensorCore GEMM (chosen by the tuner).

    block_m / block_n / block_k: the thread block's tile; warp_m / warp_n: one warp's tile (multiples of
    16); stages: depth of the cp.async pipeline (1 = no pipelining); decode: "lop3" (the decode functions)
    or "tir" (the same formula as plain TIR, for group sizes the one-word decode cannot serve); split_k: K slices
    computed by separate blocks (1 = none).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 32
    warp_m: int = 32
    warp_n: int = 64
    stages: int = 3
    decode: str = "lop3"
    split_k: int = 1

    def __post_init__(self):
        check_config(self, ("block_m", "block_n", "block_k", "warp_m", "warp_n", "stages", "split_k"))
        for field in ("warp_m", "warp_n"):
            if getattr(self, field) % 16:
                raise ValueError(f"{field}={getattr(self, field)} must be a multiple of 16 (the mma tile)")
        if self.block_m % self.warp_m or self.block_n % self.warp_n:
            raise ValueError(f"block {self.block_m}x{self.block_n} must be a whole number of warp tiles "
                             f"{self.warp_m}x{self.warp_n}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"{self.warps} warps ({self.threads} threads) exceed {MAX_THREADS} threads per block")
        if self.block_k not in (32, 64, 128):
            raise ValueError(f"block_k={self.block_k} is not supported; accepted: 32, 64, 128")
        if self.split_k not in SPLIT_K:
            raise ValueError(f"split_k={self.split_k} is not supported; accepted: {', '.join(map(str, SPLIT_K))}")

    @property
    def warps(self) -> int:
        return (self.block_m // self.warp_m) * (self.block_n // self.warp_n)

    def workspace(self, n: int, k: int, m: int) -> tuple:
        """(names, shape) of the float32 buffers the launches of a call with M rows share: split-K's partial sums."""
        return splitk.workspace(self.split_k, self.block_m, n, k, m)

    @property
    def threads(self) -> int:
        return self.warps * WARP


class GemmTemplate(CudaTemplate):
    name = "gemm"
    title = "TensorCore GEMM"
    config_type = GemmConfig
    shape_fields = ("decode", "split_k", "block_m", "block_n")

    def spec_unsupported(self, spec: Matmul, n: int, k: int, arch: str) -> str | None:
        ttype = get(spec.weight_dtype)
        if (reason := type_unsupported(ttype)) is not None:
            return reason
        if n < MIN_N:
            return (f"out_features={n} (the TensorCore template needs N >= {MIN_N}: its schedule fails below one "
                    f"mma tile of output columns; the GEMV template serves such layers at few rows)")
        activation = spec.activation_dtype
        if activation not in MMA_DTYPES:
            return f"activation_dtype={activation} (mma takes {list(MMA_DTYPES)})"
        if activation == "float8_e4m3" and arch not in _FP8_ARCHS:
            return f"float8_e4m3 mma on {arch} (it needs one of {list(_FP8_ARCHS)})"
        if spec.accumulate_dtype not in ("float32", "int32"):
            return f"accumulate_dtype={spec.accumulate_dtype} (mma accumulates in float32 / int32 here)"
        if activation not in FLOAT_OUTPUTS:
            if effective_group_size(spec.group_size, k) != k:
                return (f"group_size={spec.group_size} with {activation} activations (the scale is applied after "
                        f"the product: per-channel scales only, group_size=-1)")
            if activation not in ttype.compute_types:
                return f"{ttype.name} weights with {activation} activations (values not exact in {activation})"
            if spec.zero_mode == "hqq" or (activation == "float8_e4m3" and spec.zero_mode != "none"):
                return f"zero_mode={spec.zero_mode} with {activation} activations"
        if activation == "int8" and k != padded_shape(n, k)[1]:
            return (f"in_features={k} with int8 activations (K must be a multiple of {K_GRAIN}: TVM zero-fills only "
                    f"float copies asynchronously)")
        return None

    def config_unsupported(self, spec: Matmul, n: int, k: int, config: GemmConfig, arch: str) -> str | None:
        n_pad, k_pad = padded_shape(n, k)
        activation = spec.activation_dtype
        if n_pad % config.block_n:
            return f"block_n={config.block_n} does not divide the padded N={n_pad}"
        if k_pad % (config.block_k * config.split_k):
            return (f"block_k={config.block_k} x split_k={config.split_k} does not divide the padded K={k_pad}"
                    if config.split_k > 1 else f"block_k={config.block_k} does not divide the padded K={k_pad}")
        if (reason := splitk.unsupported(spec, config.split_k)) is not None:
            return reason
        if config.block_k % mma_k(activation):
            return f"block_k={config.block_k} is not a multiple of the mma's k={mma_k(activation)}"
        per_word = 32 // get(spec.weight_dtype).bits
        if config.block_k < per_word or WARP % (config.block_k // per_word):
            return f"block_k={config.block_k} with {per_word} codes per word (one word per thread per row)"
        size = itemsize(activation)
        decoded_tile = config.block_n * (config.block_k + 16 // size) * size
        if decoded_tile > STATIC_SHARED_LIMIT:
            return (f"block_n={config.block_n} x block_k={config.block_k}: the decoded tile ({decoded_tile} bytes) is "
                    f"static shared memory, at most {STATIC_SHARED_LIMIT} bytes")
        words = config.block_n * (config.block_k // per_word)
        if words % config.threads:
            return (f"block_n={config.block_n} x block_k={config.block_k} holds {words} words of codes, not a "
                    f"multiple of the {config.threads} threads that decode one word each")
        if spec.epilogue == "swiglu" and config.warp_n % (2 * SWIGLU_BLOCK):
            return (f"warp_n={config.warp_n} with epilogue='swiglu' (a warp's tile must hold whole (gate, up) pairs "
                    f"of {SWIGLU_BLOCK} columns each)")
        if config.decode == "lop3":
            group = layout_group(effective_group_size(spec.group_size, k), k)
            if group % per_word:
                return f"decode='lop3' with group_size={group} (a word of {per_word} codes needs one scale); use 'tir'"
        return None

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[GemmConfig]:
        """Warp tiles of 16 to 64 in grids of up to 4 x 2 warps, block_k 64 or 128 (32 lost to both in every H100
        measurement, at small M and large), 2 to 4 stages, both decodes, split-K up to 8 for buckets of up to
        SPLIT_K_ROWS rows: those whose block tile is a multiple of the hint's m and n, that build, and fit the
        architecture."""
        candidates = []
        split = SPLIT_K if bucket[1] <= SPLIT_K_ROWS else (1,)
        for warp_m, warp_n, (rows_of_warps, cols_of_warps), block_k, stages, decode, split_k in itertools.product(
                (16, 32, 64), (16, 32, 64), ((1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2)), (64, 128),
                (2, 3, 4), DECODES, split):
            try:
                config = GemmConfig(warp_m * rows_of_warps, warp_n * cols_of_warps, block_k, warp_m, warp_n, stages,
                                    decode, split_k)
            except ValueError:
                continue
            if config.block_m % hint.m == 0 and config.block_n % hint.n == 0:
                candidates.append(config)
        return self.buildable(spec, n, k, candidates, device)

    def resources(self, spec: Matmul, k: int, config: GemmConfig) -> Resources:
        """Shared memory, threads and an estimate of the registers per thread of the kernel for `config`.

        Shared memory (an upper bound, static and dynamic together): the pipeline (x tile and packed weight
        tile per stage), the decoded weight tile (rows of both padded by 16 bytes) and the epilogue's float32
        accumulator tile, which TVM places in the pipeline's memory when one of its buffers is large enough.
        Registers: the accumulators, two sets of ldmatrix fragments and the decode's temporaries; ptxas' count
        after the build is in `CudaKernel.binary.registers`."""
        ttype = get(spec.weight_dtype)
        activation = itemsize(spec.activation_dtype)
        k_pad = padded_shape(1, k)[1]
        pad = 16 // activation
        x_tile = config.block_m * (config.block_k + pad) * activation
        packed_tile = config.block_n * config.block_k * ttype.bits // 8
        decoded_tile = config.block_n * (config.block_k + pad) * activation
        stages = max(1, min(config.stages, k_pad // config.block_k))
        pipeline = stages * (x_tile + packed_tile) + decoded_tile
        epilogue = config.block_m * config.block_n * 4
        accumulators = config.warp_m * config.warp_n // WARP
        fragments = 2 * (config.warp_m + config.warp_n) // 16 * 4
        registers = accumulators + fragments + 32 // ttype.bits + 24
        return Resources(pipeline + epilogue, config.threads, registers)

    def work(self, spec: Matmul, n: int, k: int, m: int, config: GemmConfig, device) -> Work:
        """Per call: the weight read once per row block unless L2 holds it, x's tiles once per column block
        (mostly from L2 when it holds x), y (split-K: its partial sums written and read back); the mma flops of
        the padded rows and the weights each row block decodes, which go through shared memory (L1's SRAM) and back;
        a thread block per output tile and K slice."""
        n_pad, k_pad = padded_shape(n, k)
        activation = itemsize(spec.activation_dtype)
        weights = weight_bytes(spec, n_pad, k_pad)
        m_blocks = -(-m // config.block_m)
        dram = weights * min(m_blocks, 1 + (weights > device.l2_bytes) * (m_blocks - 1)) + \
            m * k_pad * activation * (n_pad // config.block_n) / max(1, (device.l2_bytes > m * k_pad * 2) * 8) + \
            m * n_pad * 4 * (1 + 2 * config.split_k * (config.split_k > 1))
        operations = {"mma_flop": 2 * m_blocks * config.block_m * n_pad * k_pad,  # padded rows are computed too
                      "decoded_weight": n_pad * k_pad * m_blocks, "extra_launch": int(config.split_k > 1),
                      "l1_bytes": 2 * n_pad * k_pad * activation * m_blocks}  # the decoded tile: stored, ldmatrix'd
        return Work(m_blocks * (n_pad // config.block_n) * config.split_k, dram, operations,
                    per_block=self.resources(spec, k, config))

    def functions(self, spec: Matmul, n: int, k: int, config: GemmConfig, arch: str, prefix: str = "") -> dict:
        """The scheduled PrimFunc (arguments as `expr.cuda_matmul_expr`; the decode functions' C source is
        attached with pragma_import_c); with split_k > 1 its last argument is instead the float32 partial sums
        [split_k, M, N_pad], and the kernel that sums them (`splitk.build_reduce`) follows."""
        from tvm import s_tir, te

        self.checked(spec, n, k, config, arch)
        expr = cuda_matmul_expr(spec, n, k, config.block_m)
        output = splitk.partial_sums(expr, config.split_k) if config.split_k > 1 else expr.output
        func = te.create_prim_func([*expr.inputs, output]).with_attr("global_symbol", "main")
        schedule = _Schedule(s_tir.Schedule(func), spec, n, k, config, expr)
        schedule.apply()
        funcs = {f"{prefix}gemm": schedule.sch.mod["main"].with_attr("global_symbol", "main")}
        if config.split_k > 1:
            funcs[f"{prefix}gemm_reduce"] = splitk.build_reduce(spec, n, config.split_k, config.block_m)
        return funcs


TEMPLATE = GemmTemplate()


class _Schedule:
    """The schedule primitives of the template, step by step."""

    def __init__(self, sch, spec: Matmul, n: int, k: int, config: GemmConfig, expr):
        self.sch, self.spec, self.n, self.k, self.cfg, self.expr = sch, spec, n, k, config, expr
        self.ttype = get(spec.weight_dtype)
        self.mma = mma_intrinsics(spec.activation_dtype)
        self.stages = min(config.stages, padded_shape(n, k)[1] // (config.block_k * config.split_k))

    def apply(self) -> None:
        sch = self.sch
        self._tile(sch.get_sblock("acc"))
        self._fetch_x()
        self._decode_weights()
        self._fragments()
        self._epilogue()
        if self.stages > 1:
            sch.annotate(self.k0, "software_pipeline_stage", [0, 0, self.stages - 1, self.stages - 1])
            sch.annotate(self.k0, "software_pipeline_order", [0, 1, 2, 3])
            sch.annotate(self.k0, "software_pipeline_async_stages", [0])

    def _tile(self, acc) -> None:
        sch, cfg, step = self.sch, self.cfg, self.mma.k_step
        *piece, m, n, k = sch.get_loops(acc)
        m, m_tile = sch.split(m, [None, 16])
        n, n_tile = sch.split(n, [None, 16])
        k, k_tile = sch.split(k, [None, step])
        sch.reorder(m, n, k, m_tile, n_tile, k_tile)
        self.outer, self.inner = sch.blockize(m_tile), acc
        m0, m1, m2 = sch.split(m, [None, cfg.block_m // cfg.warp_m, cfg.warp_m // 16])
        n0, n1, n2 = sch.split(n, [None, cfg.block_n // cfg.warp_n, cfg.warp_n // 16])
        k0, k1 = sch.split(k, [None, cfg.block_k // step])
        sch.reorder(n0, m0, m1, n1, k0, k1, m2, n2)
        sch.bind(n0, "blockIdx.x")
        sch.bind(m0, "blockIdx.y")
        if piece:
            sch.reorder(*piece, n0)
            sch.bind(piece[0], "blockIdx.z")
        self.warp = sch.fuse(m1, n1)
        sch.bind(self.warp, "threadIdx.y")
        self.k0, self.k1 = k0, k1

    def _fetch_x(self) -> None:
        """x tile -> shared (cp.async); the K padding stays a predicate inside the copy (zero fill)."""
        sch, cfg = self.sch, self.cfg
        size = itemsize(self.spec.activation_dtype)
        vector = vector_lanes(16 // size, self.k)
        fetch = sch.cache_read(self.outer, 0, "shared.dyn")
        sch.compute_at(fetch, self.k0)
        sch.compute_inline(sch.get_sblock("xk"))
        fused = sch.fuse(*loops_under(sch, fetch, self.k0))
        _, warp, lane, vec = sch.split(fused, [None, cfg.warps, WARP, vector])
        sch.bind(lane, "threadIdx.x")
        sch.bind(warp, "threadIdx.y")
        sch.vectorize(vec)
        sch.storage_align(fetch, 0, axis=-2, factor=32, offset=16 // size)

    def _decode_weights(self) -> None:
        """packed tile -> shared (cp.async), then per thread: one word -> registers -> decode -> shared."""
        sch, cfg, spec = self.sch, self.cfg, self.spec
        per_word = 32 // self.ttype.bits
        size = itemsize(spec.activation_dtype)
        tile = sch.cache_read(self.outer, 1, "shared")  # static: its barriers then ignore the dynamic buffers
        sch.compute_at(tile, self.k0)
        rows, cols = sch.get_loops(tile)[-2:]
        word, lanes = sch.split(cols, [None, per_word])
        words_per_row = cfg.block_k // per_word
        row_outer, row_warp, row_lane = sch.split(rows, [None, cfg.warps, WARP // words_per_row])
        sch.reorder(row_outer, row_warp, row_lane, word, lanes)
        thread = sch.fuse(row_lane, word)
        sch.bind(thread, "threadIdx.x")
        sch.bind(row_warp, "threadIdx.y")
        _, store_vector = sch.split(lanes, [None, vector_lanes(16 // size, per_word)])
        sch.vectorize(store_vector)
        sch.storage_align(tile, 0, axis=-2, factor=32, offset=16 // size)
        wdec = sch.get_sblock("wdec")
        sch.compute_at(wdec, thread)
        sch.set_scope(wdec, 0, "local")
        packed = sch.cache_read(wdec, read_index(sch, wdec, "qweight"), "shared.dyn")
        sch.compute_at(packed, self.k0)
        fused = sch.fuse(*loops_under(sch, packed, self.k0))
        _, warp, lane, vec = sch.split(fused, [None, cfg.warps, WARP, vector_lanes(4, words_per_row)])
        sch.bind(lane, "threadIdx.x")
        sch.bind(warp, "threadIdx.y")
        sch.vectorize(vec)
        register = sch.cache_read(wdec, read_index(sch, wdec, "qweight"), "local")
        sch.compute_at(register, thread)
        if cfg.decode == "lop3":
            decoder = self.expr.decoder
            sch.tensorize(sch.get_loops(wdec)[-1], decode_intrinsic(decoder))
            sch.annotate(self.warp, "pragma_import_c", library([decoder]))
        else:
            log.info("bitkern: CUDA GEMM decodes %s with plain TIR (decode='tir')", self.ttype.name)

    def _fragments(self) -> None:
        """ldmatrix / mma / fill tensorization on 16x16 (x 16 or 32) tiles."""
        sch, step = self.sch, self.mma.k_step
        from tvm.s_tir.tensor_intrin import cuda

        a_warp = sch.cache_read(self.outer, 0, "warp")
        b_warp = sch.cache_read(self.outer, 1, "warp")
        sch.compute_at(a_warp, self.k1)
        sch.compute_at(b_warp, self.k1)
        self.c_shared = sch.cache_write(self.outer, 0, "shared.dyn")
        self.c_warp = sch.cache_write(self.outer, 0, "warp")
        if self.spec.epilogue == "swiglu":  # the tile as [16-column tile, row, 16]: see `_epilogue`
            sch.transform_layout(self.c_shared, ("read", 0), lambda i, j: (j // SWIGLU_BLOCK, i, j % SWIGLU_BLOCK))
        sch.reverse_compute_at(self.c_warp, self.warp)
        if self.cfg.split_k > 1:  # the copy to the partial sums, placed before tensorize (it cannot be after)
            sch.reverse_compute_at(self.c_shared, self.warp)
        rows, cols = sch.get_loops(self.c_warp)[-2:]
        row_tile, rows = sch.split(rows, [None, 16])
        col_tile, cols = sch.split(cols, [None, 16])
        sch.reorder(row_tile, col_tile, rows, cols)
        init = sch.decompose_reduction(self.outer, self.k0)
        init_inner = sch.get_child_blocks(init)[0]
        load_a = _fragment_tile(sch, a_warp, 16, step)
        load_b = _fragment_tile(sch, b_warp, 16, step)
        if step == 16:
            layout_a = layout_b = cuda.shared_16x16_to_ldmatrix_32x8_layout
        else:
            layout_a = layout_b = cuda.shared_16x32_to_ldmatrix_32x16_layout
        sch.transform_layout(a_warp, ("write", 0), _tiled(layout_a, 16, step))
        sch.transform_layout(b_warp, ("write", 0), _tiled(layout_b, 16, step))
        sch.transform_layout(self.c_warp, ("read", 0), _tiled(cuda.shared_16x16_to_ldmatrix_32x8_layout, 16, 16))
        sch.tensorize(load_a, self.mma.load_a)
        sch.tensorize(load_b, self.mma.load_b)
        sch.tensorize(sch.get_loops(self.inner)[-3], self.mma.compute)
        sch.tensorize(sch.get_loops(init_inner)[-2], self.mma.init)
        sch.tensorize(sch.get_loops(self.c_warp)[-2], self.mma.store)

    def _epilogue(self) -> None:
        """Inline the output chain into the copy from the shared accumulator tile to y, per warp (split-K: the
        copy stores the float32 partial sums).  SwiGLU: the tile is laid out [16-column tile, row, 16], so that
        y[r, j // 16, j % 16] reads tiles 2·(j // 16) (gate) and the next (up) at its own row and lane (what
        compute-at can place)."""
        sch = self.sch
        if self.cfg.split_k > 1:  # the copy to the partial sums (under the warp since `_fragments`; fetched anew,
            store = sch.get_sblock("acc_shared.dyn")  # as tensorize replaced the blocks around it)
            lanes = vector_lanes(4, padded_shape(self.n, self.k)[0])
        else:
            sch.compute_inline(self.c_shared)
            store = sch.get_sblock("y")
            if self.spec.epilogue == "swiglu":
                _simplify_indices(sch, store)
            sch.reverse_compute_at(store, self.warp)
            lanes = vector_lanes(16 // itemsize(self.spec.output_dtype), self.spec.out_features(self.n))
            if self.spec.epilogue != "none":  # TVM writes the epilogues' float32x8 constants as an invalid
                lanes = min(lanes, 4)  # make_ulonglong4 of 8 floats; float32x4 constants are make_float4
        fused = sch.fuse(*loops_under(sch, store, self.warp))
        _, lane, vec = sch.split(fused, [None, WARP, lanes])
        sch.bind(lane, "threadIdx.x")
        sch.vectorize(vec)


def _simplify_indices(sch, block) -> None:
    """Rewrite a block's indices and read regions with its iteration ranges known: the inlined [tile, row, 16]
    layout leaves floordiv / floormod of y's indices that compute-at cannot invert (they vanish within the
    ranges)."""
    from tvm import ir, sym, tirx

    stmt = sch.get(block)
    analyzer = sym.Analyzer()
    for iter_var in stmt.iter_vars:
        analyzer.bind(iter_var.var, iter_var.dom)
    store = stmt.body
    body = tirx.BufferStore(store.buffer, analyzer.simplify(store.value), [analyzer.simplify(i) for i in store.indices])
    reads = [type(read)(read.source, [ir.Range.from_min_extent(analyzer.simplify(r.min), analyzer.simplify(r.extent))
                                      for r in read.region], read.ty) for read in stmt.reads]
    simplified = type(stmt)(stmt.iter_vars, reads, stmt.writes, stmt.name_hint, body, stmt.init, stmt.alloc_buffers,
                            stmt.match_buffers, stmt.annotations)
    sch.state.replace(sch.get_sref(block), simplified, {stmt: simplified})


def _fragment_tile(sch, block, rows: int, cols: int):
    """Split a warp-cache block's last two loops into rows x cols tiles; return the tile's first loop."""
    i, j = sch.get_loops(block)[-2:]
    i0, i1 = sch.split(i, [None, rows])
    j0, j1 = sch.split(j, [None, cols])
    sch.reorder(i0, j0, i1, j1)
    return i1


def _tiled(layout, rows: int, cols: int):
    """Index map (..., i, j) -> (..., tile row, tile col, thread, local) for a fragment layout of rows x cols tiles
    (leading indices, such as split-K's slice, kept)."""
    def index_map(*indices):
        *lead, i, j = indices
        return (*lead, i // rows, j // cols, *layout(i % rows, j % cols))

    return index_map
