"""TensorCore GEMV for few rows: the weights decoded straight into mma fragments, nothing through shared memory.

The decode GEMV (`gemv.py`) multiplies on the CUDA cores, converting every x and weight to float32 (~150
instructions per 32 codes and thread), and loads x again for every column it computes.  Here each m16n8k16 mma
takes its B operand (16 k x 8 columns) from registers the LOP3 decode has just filled and accumulates in float32
on the tensor cores (~80 instructions per 32 codes), and a warp's x registers serve up to 8 column tiles.  A
k-step of a warp: the 4 threads of a quad read `words` 32-bit words of one weight row each (128-bit loads at
words=4), the 8 quads 8 rows (an mma's columns).  The k order inside an mma is free
(the sum does not depend on it), so each thread feeds the mma the k it loaded itself: per 8 consecutive k of a
thread (an "octet": one 128-bit load of x, four decoded pairs P0..P3) two mmas, one with B = (P0, P2), one with
B = (P1, P3), and A from the matching x pairs.
- block_m = 8 (M <= 8 per block): A's four registers are the octet's x pairs X0..X3 as loaded (no moves); rows
  g of the first mma get X0·P0 + X2·P2, rows g+8 of the second X1·P1 + X3·P3, and the thread adds the two
  halves of its accumulators (both are its own registers).  The other halves hold products of unmatched pairs
  and are dropped.
- block_m = 16·t: rows g and g+8 are rows of x, A interleaves their pairs, every accumulator row is a result.
Without split-K the kernel applies the output stage (bias, epilogue, residual, cast) to its accumulators and writes
y: one launch per call.  With split-K it writes float32 partial sums [split_k, M, N_pad] (blockIdx.z takes a K
slice) and `splitk.build_reduce` makes the kernel that sums them and applies the output stage.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ...ops.expr import apply_epilogue, output_value, scale_storage, zero_storage
from ...ops.matmul import Matmul
from ...ttype import codes_per_word, effective_group_size, get, itemsize, tvm_dtype
from . import splitk
from .decode import library
from .expr import MAX_ROWS, decoder_for
from .layout import layout_group, padded_shape, type_unsupported
from ..sched import vector_lanes
from ..template import Work
from .kernel import MAX_THREADS, PER_COLUMN_EPILOGUES, WARP, CudaTemplate, Resources, check_positive, weight_bytes

ACTIVATIONS = {"float16": "fp16", "bfloat16": "bf16"}  # mma input types, as PTX names them
MMA_N = 8  # columns of an m16n8k16 tile
QUAD = 4  # threads of a quad share an mma column and split its k
OCTET = 8  # consecutive k a thread gives two mmas (one 128-bit load of 16-bit x)
FEW_ROWS = 128  # buckets of up to this many rows try the template
BLOCK_M = (8, 16, 32, 64)
SPLIT_K = (1, 2, 4, 8, 16)
# column tiles per warp: each tile's weight row reuses the warp's x registers.  x's loads hit L1 (every warp reads the
# same x); with one tile they outnumbered the weights' 4 to 1 and bound the kernel (H100 ncu: L1 at 73-85% of its
# throughput, DRAM at 35%)
N_TILES = (1, 2, 4, 8)


@dataclass(frozen=True)
class MmaGemvConfig:
    """Configuration of the TensorCore GEMV (chosen by the tuner).

    block_m: rows of x per block (8: one mma tile's upper rows, see the module docstring; 16 to 64: whole tiles);
    warps: warps per block, each on its own columns; n_tiles: 8-column mma tiles per warp (they share x's
    registers, see `N_TILES`); words: 32-bit words of codes each thread loads per row and step (4 = 128-bit
    loads); split_k: K slices computed by separate blocks.
    """

    block_m: int = 8
    warps: int = 4
    n_tiles: int = 1
    words: int = 4
    split_k: int = 1

    def __post_init__(self):
        check_positive(self, ("block_m", "warps", "n_tiles", "words", "split_k"))
        if self.block_m not in BLOCK_M:
            raise ValueError(f"block_m={self.block_m} is not supported; accepted: {', '.join(map(str, BLOCK_M))}")
        if self.words not in (1, 2, 4):
            raise ValueError(f"words={self.words} is not supported; accepted: 1, 2, 4 (4 = 128-bit loads)")
        if self.split_k not in SPLIT_K:
            raise ValueError(f"split_k={self.split_k} is not supported; accepted: {', '.join(map(str, SPLIT_K))}")
        if self.warps * WARP > MAX_THREADS:
            raise ValueError(f"warps={self.warps} exceed {MAX_THREADS} threads per block")

    @property
    def columns(self) -> int:
        """Output columns (weight rows) one block computes."""
        return self.warps * self.n_tiles * MMA_N

    @property
    def half(self) -> bool:
        """Whether a block takes 8 rows: the upper rows of one mma tile (see the module docstring)."""
        return self.block_m == 8

    @property
    def tiles(self) -> int:
        """16-row mma tiles per block."""
        return 1 if self.half else self.block_m // 16

    @property
    def x_rows(self) -> int:
        """Rows of x a thread loads per step: g, and g + 8 of each whole tile."""
        return 1 if self.half else 2 * self.tiles

    @property
    def c_tiles(self) -> int:
        """Accumulator sets per column tile: one per mma of the octet at block_m=8, else one per row tile."""
        return 2 if self.half else self.tiles

    def workspace(self, n: int, k: int, m: int) -> tuple:
        """(names, shape) of the float32 partial sums the kernel writes and the reduce kernel reads; none without
        split-K."""
        return splitk.workspace(self.split_k, self.block_m, n, k, m)


class MmaGemvTemplate(CudaTemplate):
    name = "mma_gemv"
    title = "TensorCore GEMV"
    config_type = MmaGemvConfig
    shape_fields = ("block_m", "n_tiles", "words", "split_k")
    max_rows = FEW_ROWS
    epilogues = PER_COLUMN_EPILOGUES  # applied per column: by the kernel, or by split-K's reduce kernel

    def spec_unsupported(self, spec: Matmul, n: int, k: int, arch: str) -> str | None:
        if (reason := type_unsupported(get(spec.weight_dtype))) is not None:
            return reason
        if spec.activation_dtype not in ACTIVATIONS:
            return f"activation_dtype={spec.activation_dtype} (the TensorCore GEMV takes {list(ACTIVATIONS)})"
        if spec.accumulate_dtype != "float32":
            return f"accumulate_dtype={spec.accumulate_dtype} (it accumulates in float32)"
        per_word = codes_per_word(get(spec.weight_dtype).bits)
        if layout_group(effective_group_size(spec.group_size, k), k) % per_word:
            return f"group_size={spec.group_size} (a word of {per_word} codes needs one scale)"
        return None

    def config_unsupported(self, spec: Matmul, n: int, k: int, config: MmaGemvConfig, arch: str) -> str | None:
        n_pad, k_pad = padded_shape(n, k)
        per_word = codes_per_word(get(spec.weight_dtype).bits)
        if config.words * per_word < OCTET:
            return f"words={config.words} x {per_word} codes (a thread's k-step must hold {OCTET} codes)"
        step = QUAD * config.words * per_word * config.split_k
        if k_pad % step:
            return (f"{QUAD} threads x words={config.words} x {per_word} codes x split_k={config.split_k} = {step} "
                    f"does not divide the padded K={k_pad}")
        if n_pad % config.columns:
            return f"{config.columns} columns per block do not divide the padded N={n_pad}"
        return None

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[MmaGemvConfig]:
        """8 rows per block for buckets of up to 8 rows, else 16 to 64 (no more than the bucket holds); 2 to 8 warps of
        1 to 8 column tiles; 64- or 128-bit loads; split-K 1 to 16: those that build and fit the architecture."""
        rows = (8,) if bucket[1] <= 8 else tuple(r for r in BLOCK_M[1:] if r <= max(16, bucket[1]))
        candidates = [MmaGemvConfig(*fields) for fields in itertools.product(rows, (2, 4, 8), N_TILES, (2, 4),
                                                                             SPLIT_K)]
        return self.buildable(spec, n, k, candidates, device)

    def buildable(self, spec: Matmul, n: int, k: int, candidates, device) -> list:
        """The candidates that build `spec` and fit the device (one decode: no plain-TIR twins to drop)."""
        return [config for config in candidates if self.config_unsupported(spec, n, k, config, device.arch) is None
                and self.resources(spec, k, config).unfit(device) is None]

    def resources(self, spec: Matmul, k: int, config: MmaGemvConfig) -> Resources:
        """Threads, no shared memory, and a register estimate: accumulators, x's registers, every tile's words and
        one tile's decoded weights (ptxas' count after the build is in `CudaKernel.binary.registers`)."""
        codes = config.words * codes_per_word(get(spec.weight_dtype).bits)
        accumulators = 4 * config.n_tiles * config.c_tiles
        x_registers = codes // 2 * config.x_rows
        registers = 24 + accumulators + x_registers + config.n_tiles * config.words + codes // 2
        return Resources(0, config.warps * WARP, registers)

    def work(self, spec: Matmul, n: int, k: int, m: int, config: MmaGemvConfig, device) -> Work:
        """Per call: the weight read once per row block, x once, y (and split-K's partial sums, written and read
        back); the mma flops of whole 16-row tiles; the weights each row block decodes; the loads into registers (the
        weights, and x once per column tile of a warp); split-K's reduce kernel launch."""
        n_pad, k_pad = padded_shape(n, k)
        row_blocks = -(-m // config.block_m)
        rows = row_blocks * config.block_m
        weights = weight_bytes(spec, n_pad, k_pad)
        partial_sums = rows * n_pad * 4 * config.split_k * 2 if config.split_k > 1 else 0
        dram = weights * row_blocks + m * k_pad * itemsize(spec.activation_dtype) + partial_sums + \
            m * n * itemsize(spec.output_dtype)
        x_loads = n_pad * k_pad * config.x_rows * itemsize(spec.activation_dtype) / config.n_tiles  # per column tile
        operations = {"mma_flop": 2 * row_blocks * max(16, config.block_m) * n_pad * k_pad,
                      "decoded_weight": n_pad * k_pad * row_blocks, "extra_launch": int(config.split_k > 1),
                      "l1_bytes": (weights + x_loads) * row_blocks}
        return Work(row_blocks * (n_pad // config.columns) * config.split_k, dram, operations,
                    per_block=self.resources(spec, k, config))

    def functions(self, spec: Matmul, n: int, k: int, config: MmaGemvConfig, arch: str, prefix: str = "") -> dict:
        """The kernel (arguments: x, qweight, scales, zeros, tensor_scale as the spec has them, then bias, residual
        as it has them and y; with split-K instead the partial sums [split_k, M rounded up to block_m, N_pad] as
        "acc", followed by the reduce kernel)."""
        self.checked(spec, n, k, config, arch)
        functions = {f"{prefix}mma_gemv": _kernel(spec, n, k, config)}
        if config.split_k > 1:
            functions[f"{prefix}mma_gemv_reduce"] = splitk.build_reduce(spec, n, config.split_k, config.block_m)
        return functions


TEMPLATE = MmaGemvTemplate()


def _kernel(spec: Matmul, n: int, k: int, config: MmaGemvConfig):
    """The PrimFunc of y (or of split-K's partial sums), written with TVM's IR builder (threads bound by hand)."""
    from tvm.script.ir_builder import IRBuilder

    with IRBuilder() as builder:
        _Kernel(spec, n, k, config).emit()
    return builder.get().with_attr("global_symbol", "main")


class _Kernel:
    """The kernel's statements, step by step, into the IR builder's current function."""

    def __init__(self, spec: Matmul, n: int, k: int, config: MmaGemvConfig):
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        self.T, self.tirx = T, tirx
        self.spec, self.n, self.k, self.cfg = spec, n, k, config
        self.decoder = decoder_for(spec)
        self.per_word = codes_per_word(get(spec.weight_dtype).bits)
        self.n_pad, self.k_pad = padded_shape(n, k)
        self.group = layout_group(effective_group_size(spec.group_size, k), k)
        self.activation = tvm_dtype(spec.activation_dtype)
        self.codes = config.words * self.per_word  # k a thread covers per row and step
        self.octets = self.codes // OCTET
        self.slice_k = self.k_pad // config.split_k
        self.half, self.tiles, self.x_rows, self.c_tiles = config.half, config.tiles, config.x_rows, config.c_tiles
        self.a_sets = 1 if self.half else 2  # A registers per octet: one set serves both mmas at block_m=8
        self.lanes = vector_lanes(OCTET, math.gcd(OCTET, k))  # x's rows start on a vector boundary

    def emit(self) -> None:
        T, tirx, cfg = self.T, self.tirx, self.cfg
        with T.prim_func():
            T.func_name("main")
            self._arguments()
            with T.launch_thread("blockIdx.x", self.n_pad // cfg.columns) as column_block, \
                    T.launch_thread("blockIdx.y", self.rows // cfg.block_m) as row_block, \
                    T.launch_thread("blockIdx.z", cfg.split_k) as self.piece, \
                    T.launch_thread("threadIdx.x", WARP) as lane, \
                    T.launch_thread("threadIdx.y", cfg.warps) as warp:
                self.quad_row, self.quad_lane = lane // QUAD, lane % QUAD
                self.first_column = (column_block * cfg.warps + warp) * cfg.n_tiles * MMA_N
                self.first_row = row_block * cfg.block_m
                self._registers()
                with T.unroll(0, cfg.n_tiles * self.c_tiles * 4) as i:
                    T.buffer_store(self.c_frag, tirx.const(0, "float32"),
                                   [i // (self.c_tiles * 4), i // 4 % self.c_tiles, i % 4])
                with T.attr(0, "pragma_import_c", library([self.decoder])):
                    with T.serial(0, self.slice_k // (QUAD * self.codes)) as step:
                        k_first = self.piece * self.slice_k + step * (QUAD * self.codes) + self.quad_lane * self.codes
                        self._load(k_first)
                        self._a_fragments()
                        for t in range(cfg.n_tiles):  # decoded registers live for one column tile only
                            self._decode(t, k_first)
                            self._mmas(t)
                self._store()

    def _arguments(self) -> None:
        """x, qweight, scales, zeros and tensor_scale as the spec has them, then bias, residual and y (split-K: the
        partial sums "acc"); M symbolic."""
        from tvm.script.ir_builder import IRBuilder

        T, tirx, spec = self.T, self.tirx, self.spec
        m = self.m = tirx.Var("M", "int32")

        def argument(name, shape, dtype):
            return IRBuilder.name(name, T.match_buffer(T.arg(name, T.handle()), shape, dtype))

        self.x = argument("x", (m, self.k), self.activation)
        self.qweight = argument("qweight", (self.n_pad, self.k_pad // self.per_word), "int32")
        columns = -(-self.k_pad // self.group)
        self.scales = argument("scales", (self.n_pad, columns), scale_storage(spec))
        self.extra = {}  # the decode's further arguments by role
        if spec.zero_mode != "none":
            self.extra["zero"] = argument("zeros", (self.n_pad, columns), zero_storage(spec))
        if "tensor_scale" in self.decoder.arguments():
            self.extra["tensor_scale"] = argument("tensor_scale", (1,), "float32")
        block_m = self.cfg.block_m
        self.rows = (tirx.min(m, MAX_ROWS) + (block_m - 1)) // block_m * block_m
        if self.cfg.split_k > 1:
            self.acc = argument("acc", (self.cfg.split_k, self.rows, self.n_pad), "float32")
            return
        output = tvm_dtype(spec.output_dtype)
        self.bias = argument("bias", (self.n,), "float32") if spec.bias else None
        self.residual = argument("residual", (m, self.n), output) if spec.residual else None
        self.y = argument("y", (m, self.n), output)

    def _registers(self) -> None:
        """A thread's local buffers: the words of codes, their decoded values, B in mma order, x, A, accumulators."""
        T, cfg, activation = self.T, self.cfg, self.activation
        self.words = T.alloc_buffer((cfg.n_tiles, cfg.words), "int32", scope="local")
        self.decoded = T.alloc_buffer((cfg.n_tiles, self.codes), activation, scope="local")
        self.b_frag = T.alloc_buffer((cfg.n_tiles, self.codes), activation, scope="local")
        self.xs = T.alloc_buffer((self.x_rows, self.codes), activation, scope="local")
        self.a_frag = T.alloc_buffer((self.tiles, self.octets, self.a_sets, OCTET), activation, scope="local")
        self.c_frag = T.alloc_buffer((cfg.n_tiles, self.c_tiles, 4), "float32", scope="local")

    def _load(self, k_first) -> None:
        """The step's words of each column tile's row (one vector load) and x's rows (`lanes` at a time; columns
        past K read as zero)."""
        T, tirx, cfg = self.T, self.tirx, self.cfg
        for t in range(cfg.n_tiles):
            with T.vectorized(0, cfg.words) as v:
                T.buffer_store(self.words, self.qweight[self.first_column + t * MMA_N + self.quad_row,
                                                        k_first // self.per_word + v], [t, v])
        for r in range(self.x_rows):
            row = tirx.min(self.first_row + (r // 2) * 16 + (r % 2) * MMA_N + self.quad_row, self.m - 1)
            for chunk in range(self.codes // self.lanes):
                start = k_first + chunk * self.lanes
                if self.k_pad == self.k:
                    self._copy_x(r, row, chunk, start)
                    continue
                with T.If(start < self.k):
                    with T.Then():
                        self._copy_x(r, row, chunk, start)
                    with T.Else():
                        with T.vectorized(0, self.lanes) as v:
                            T.buffer_store(self.xs, tirx.const(0, self.activation), [r, chunk * self.lanes + v])

    def _copy_x(self, r: int, row, chunk: int, start) -> None:
        with self.T.vectorized(0, self.lanes) as v:
            self.T.buffer_store(self.xs, self.x[row, start + v], [r, chunk * self.lanes + v])

    def _decode(self, t: int, k_first) -> None:
        """Column tile t's words through the decode function (its group's scale and zero), then B of each octet's
        two mmas: pairs (P0, P2) and (P1, P3)."""
        T, tirx = self.T, self.tirx
        weight_row = self.first_column + t * MMA_N + self.quad_row
        for j in range(self.cfg.words):
            column = (k_first + j * self.per_word) // self.group
            values = [self.scales[weight_row, column]]
            values += [self.extra["zero"][weight_row, column]] if "zero" in self.extra else []
            values += [self.extra["tensor_scale"][0]] if "tensor_scale" in self.extra else []
            T.evaluate(tirx.call_extern("void", self.decoder.name, tirx.address_of(self.words[t, j]),
                                        tirx.address_of(self.decoded[t, j * self.per_word]), *values))
        for o in range(self.octets):
            for position, pair in enumerate((0, 2, 1, 3)):
                for e in range(2):
                    T.buffer_store(self.b_frag, self.decoded[t, o * OCTET + 2 * pair + e],
                                   [t, o * OCTET + 2 * position + e])

    def _a_fragments(self) -> None:
        """A of each mma, copied from x's registers (TVM stores those as vectors, which mma's operand cannot
        address): at block_m=8 the octet as loaded, else rows g and g + 8 interleaved."""
        T = self.T
        for tile in range(self.tiles):
            for o in range(self.octets):
                if self.half:
                    for e in range(OCTET):
                        T.buffer_store(self.a_frag, self.xs[0, o * OCTET + e], [tile, o, 0, e])
                    continue
                for which, (first, second) in enumerate(((0, 2), (1, 3))):
                    for slot, (r, pair) in enumerate(((0, first), (1, first), (0, second), (1, second))):
                        for e in range(2):
                            T.buffer_store(self.a_frag, self.xs[2 * tile + r, o * OCTET + 2 * pair + e],
                                           [tile, o, which, 2 * slot + e])

    def _mmas(self, t: int) -> None:
        """Column tile t's two m16n8k16 per octet and row tile."""
        from tvm.backend.cuda.op import ptx_legacy_mma

        kind = ACTIVATIONS[self.spec.activation_dtype]
        for o in range(self.octets):
            for which in range(2):
                for tile in range(self.tiles):
                    a_offset = ((tile * self.octets + o) * self.a_sets + (0 if self.half else which)) * OCTET
                    c_offset = (t * self.c_tiles + (which if self.half else tile)) * 4
                    self.T.evaluate(ptx_legacy_mma(
                        "m16n8k16", "row", "col", kind, kind, "fp32", self.a_frag.data, a_offset, self.b_frag.data,
                        t * self.codes + o * OCTET + 4 * which, self.c_frag.data, c_offset, False))

    def _store(self) -> None:
        """The accumulators, two columns per thread and row: at block_m=8 rows g of the first mma plus rows g + 8 of
        the second, else both halves of every row tile; into the partial sums (split-K, one store per pair), else
        through the output stage into y."""
        T = self.T
        for t in range(self.cfg.n_tiles):
            column = self.first_column + t * MMA_N + self.quad_lane * 2
            for tile in range(self.tiles):
                for upper in range(1 if self.half else 2):
                    row = self.first_row + tile * 16 + upper * MMA_N + self.quad_row

                    def value(e):
                        return self.c_frag[t, 0, e] + self.c_frag[t, 1, 2 + e] if self.half else \
                            self.c_frag[t, tile, 2 * upper + e]

                    if self.cfg.split_k == 1:
                        for e in range(2):
                            self._store_output(row, column + e, value(e))
                        continue
                    with T.vectorized(0, 2) as e:
                        T.buffer_store(self.acc, value(e), [self.piece, row, column + e])

    def _store_output(self, row, column, total) -> None:
        """y[row, column] = cast(f(total + bias) (+ residual)), f the spec's epilogue, where y has the row and the
        column (rows past M and columns past N are the padding's)."""
        T, tirx = self.T, self.tirx
        with T.If(tirx.all(row < self.m, column < self.n)):
            with T.Then():
                biased = total + self.bias[column] if self.bias is not None else total
                value = apply_epilogue(self.spec.epilogue, biased)
                residual = None if self.residual is None else self.residual[row, column]
                T.buffer_store(self.y, output_value(self.spec, value, residual), [row, column])
