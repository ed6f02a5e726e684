"""VNNI template: y = x̂ · dequant(W)ᵀ for activation_quant="int8" specs, integer weight codes (or, for 4-bit code
books and floats, their int8 code book looked up by vpshufb or NEON's tbl, `TType.int8_values`) times int8 activations
in exact int32 byte dot products, for any number of rows, with each level's byte dot product (`dot_instruction`):
vpdpbusd with AVX512-VNNI (Intel since Cascade Lake, AMD Zen 4 and later) and AVX-VNNI (Alder Lake and later, Zen 5),
vpmaddubsw and vpmaddwd with AVX2, and sdot with aarch64's dot product: Neoverse N1 and later, Cortex-A76, Apple M1
(`emit.vnni.dot_bytes`); blocks of rows in pairs by the level's byte matrix product where it has one (`pair_instruction`:
i8mm's smmla, Neoverse V1 and later, Apple M2 and later).  Its code comes from `emit.vnni` (see there for the kernel's
structure)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ...ops.matmul import ACTIVATION_BLOCK, ACTIVATION_QUANTS, EPILOGUES, NORMS, Matmul
from ...ttype import effective_group_size, get
from ...ttype.types import INT, UINT
from ..template import Work
from . import isa
from .kernel import (PREFETCH_WORDS, SMALL_M, CpuTemplate, Footprint, check_prefetch, doublings, norm_prologue,
                     operand_bytes)
from .layout import AMX_TILE_ROWS, padded_k
from .matrix import PLANES, MatrixTemplate

BITS = (1, 2, 4, 8)  # code widths whose tile16 words split into bytes of whole codes
PRODUCTS = ACTIVATION_BLOCK // 4  # vpdpbusd per row, tile and activation block (4 k's per lane each)
# vpdpbusd a kernel's bodies hold over all their row counts and tiles, per activation block: bounds LLVM's compile
# time (the bodies are unrolled; 1 + 2 + 3 + 4 rows x 4 tiles x 8 products = 320)
BODY = 320
# Weight streams a task reads at once cost DRAM time: per doubling of them, the memory time grows by this.  Measured
# by the tuner on Zen 4 at x86-64-v3 (int4, M=1, weights rotating through DRAM, 2 threads): one stream (one tile, or two
# in turn) against two at once took 0.347-0.359 ms against 0.416-0.473 for 11264x2048 and 0.064-0.066 against
# 0.070-0.078 for 3072x2048; the SwiGLU gate/up 11264x2048 0.43 against 0.46-0.49 ms (interleaved, 9 rounds)
STREAM_PENALTY = 0.08
# 16-lane registers a row block may hold: y and an int32 sum per (row, tile); per tile its word and two group factors
REGISTERS = 30  # of 32 zmm
# with 256-bit vectors (two of AVX2's 16 ymm each) or 128-bit ones (four of aarch64's 32 v each), 512 bytes of registers
# either way: a few spill, the byte products bound the time
REGISTERS_NARROW = 12


def looks_up_bytes(spec: Matmul) -> bool:
    """Whether the kernel looks each code's byte up in the type's int8 code book (vpshufb or tbl, `byte_table`)
    instead of multiplying the code itself: types that are neither int nor uint."""
    return get(spec.weight_dtype).kind not in (INT, UINT)


def byte_bits(spec: Matmul) -> int:
    """Bits of the bytes the kernel multiplies: 8 for looked-up code books, else the codes' own."""
    return 8 if looks_up_bytes(spec) else get(spec.weight_dtype).bits


def byte_bias(spec: Matmul, level) -> int:
    """What the kernel adds to a looked-up code book's values t (`byte_table`): 0 where it reads signed bytes
    (`reads_signed_bytes`), else -min(t), which makes them unsigned with the least offset to fold back."""
    values, _ = get(spec.weight_dtype).int8_values
    return 0 if reads_signed_bytes(level, 8) else max(0, -int(values.min()))


def byte_table(spec: Matmul, level) -> torch.Tensor:
    """The `lut` argument of a looked-up type: its int8 code book t as bytes t + `byte_bias`, 16 of them repeated per
    128-bit lane as vpshufb reads them (tbl reads the first 16), as 16 int32."""
    values, _ = get(spec.weight_dtype).int8_values
    codes = values.to(torch.int16) + byte_bias(spec, level)
    table = torch.zeros(16, dtype=torch.int16)
    table[:len(codes)] = codes
    return (table & 0xFF).to(torch.uint8).repeat(4).view(torch.int32)


def dot_instruction(level) -> str:
    """The byte dot product of a level's kernels: "sdot" (aarch64's dot-product extension, signed bytes times signed
    bytes), "vpdpbusd" (AVX512-VNNI on 512-bit vectors, AVX-VNNI on 256-bit ones; unsigned times signed bytes) or
    "vpmaddubsw" (x86 without VNNI: unsigned times signed byte pairs into saturating int16, then vpmaddwd)."""
    if level.arch == "aarch64":
        return "sdot"
    vnni = "avx512_vnni" if level.vector_bytes >= 64 else "avx_vnni"
    return "vpdpbusd" if vnni in level.features else "vpmaddubsw"


def pair_instruction(level) -> str | None:
    """The byte matrix product of a level's kernels, which multiplies two rows at once, or None: "smmla" (aarch64's
    i8mm, signed bytes: a 2x8 block of two rows' activations by an 8x2 block of two columns' codes into their 2x2
    int32 sums, twice sdot's products per instruction)."""
    return "smmla" if level.arch == "aarch64" and "i8mm" in level.features else None


def reads_signed_bytes(level, bits: int) -> bool:
    """Whether the kernel reads `bits`-bit codes as signed bytes: 8-bit codes with sdot, and with AVX2's vpmaddubsw
    by the sign trick (|s| times q with the sign of s: pairs of products stay within int16, `dot_bytes`); else as
    unsigned (which sdot reads as signed bytes of the same values: below 2^bits <= 16)."""
    if bits != 8:
        return False
    instruction = dot_instruction(level)
    return instruction == "sdot" or (instruction == "vpmaddubsw" and level.vector_bytes == 32)


def steps_words(level, rows: int) -> bool:
    """Whether a block of `rows` rows runs a quantization group's products as one loop over its words (one sum per
    cell, `emit.vnni`) instead of unrolled activation blocks: on x86 levels of 16 vector registers (AVX2, AVX-VNNI)
    for blocks of 2 or more rows.  LLVM scheduled an unrolled block's products cell by cell there and spilled the
    decoded codes; a loop of one word's products keeps them in registers (AMD Zen 3, int8 activations, int4
    4096x14336 at M=512: 333 -> 231 ms; int8 4096x4096 116 -> 97 ms; M=16 1.13x).  One row (decode) keeps the
    unrolled blocks: the stepped loop measured 1-2% slower there."""
    return level.arch == "x86_64" and level.vector_bytes < 64 and rows > 1


def dot_cost(level, bits: int, looked_up: bool = False) -> float:
    """Instructions per 64 bytes of byte dot products at a level (`emit.vnni.dot_bytes`), relative to one 512-bit
    vpdpbusd: two 256-bit ones with AVX-VNNI; four sdot (and tbl of a looked-up code book) at two per cycle on aarch64;
    without VNNI a vpmaddubsw and a vpaddw (on two ports) per vector (two vectors with AVX2) and per block of 8 a
    vpmaddwd and an add (`emit.vnni.sums_pairs`); 8-bit codes widen per vector, with AVX2 with a vpsignb more (the
    sign trick; the codes' vpabsb is the row block's, `shared_dot_cost`), with AVX-512 twice over (two nibbles); a
    looked-up code book (`looks_up_bytes`, bits 8) a vpshufb more per vector (without VNNI once per row block)."""
    lookup = int(looked_up)
    instruction = dot_instruction(level)
    if instruction == "vpdpbusd":
        return (1 + lookup / 2) * (64 / level.vector_bytes)  # vpshufb on another port than vpdpbusd
    if instruction == "sdot":
        return (1 + lookup) * (64 / level.vector_bytes) / 2
    operations = 2.25 if bits <= 4 else 4 if reads_signed_bytes(level, bits) else 6
    return operations * (64 / level.vector_bytes) / 2


def shared_dot_cost(level, bits: int, looked_up: bool = False) -> float:
    """Instructions per 64 bytes of codes that a row block's rows share, in `dot_cost`'s units: without VNNI the
    code book's vpshufb and AVX2's vpabsb of 8-bit codes (the sign trick's magnitudes), once per word and byte
    position whatever the rows (`emit.vnni`)."""
    if dot_instruction(level) != "vpmaddubsw":
        return 0.0
    return (int(looked_up) + int(reads_signed_bytes(level, bits))) * (64 / level.vector_bytes) / 2


def registers(rows: int, n_tiles: int) -> int:
    """zmm registers a block of `rows` rows and `n_tiles` tiles holds (see REGISTERS)."""
    return 2 * rows * n_tiles + 3 * n_tiles


@dataclass(frozen=True)
class VnniConfig:
    """Tile configuration of the VNNI template (chosen by the tuner): n_tiles 16-column tiles per task, rows per
    register block (each row block decodes the task's words again), small_m: one task per column block for all M
    <= 16 rows, m_chunk: rows per task otherwise, prefetch: words ahead (0: none), in_turn: the task's tiles one
    after another over all of K, for calls of one row block (one weight stream at a time and one tile's registers:
    n_tiles then sets only the task's width, as SwiGLU's gate and up pairs need), pairs: a block's rows multiplied two
    at a time by the level's byte matrix product (`pair_instruction`; an even number of rows, a block's odd last row
    paired with itself)."""

    n_tiles: int = 4
    small_m: bool = True
    m_chunk: int = SMALL_M
    rows: int = 1
    prefetch: int = 32
    in_turn: bool = False
    pairs: bool = False
    # the tile16 builder's options this template keeps fixed: one prologue pass over all rows, nothing staged
    chunk_prologue = False
    stage_steps = 1

    def __post_init__(self):
        check_prefetch(self.prefetch)
        for name in ("n_tiles", "m_chunk", "rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        for name in ("in_turn", "pairs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.pairs and self.rows % 2:
            raise ValueError(f"pairs=True multiplies rows two at a time: rows={self.rows} must be even")
        if registers(self.rows, 1 if self.in_turn else self.n_tiles) > REGISTERS:
            held = f"rows={self.rows}" + (", one tile at a time," if self.in_turn else f" x n_tiles={self.n_tiles}")
            raise ValueError(f"{held} needs more than {REGISTERS} vector registers")
        if self.m_chunk % self.rows or (self.small_m and self.m_chunk != SMALL_M):
            raise ValueError(f"m_chunk={self.m_chunk} must be a multiple of rows={self.rows} ({SMALL_M} for small_m)")


class VnniTemplate(CpuTemplate):
    name = "vnni"
    title = "VNNI"
    config_type = VnniConfig
    shape_fields = ("n_tiles", "rows", "prefetch", "in_turn", "pairs")
    # vpmaddubsw at least, or sdot (`dot_instruction`)
    requires = (isa.level("x86-64-v3").features, isa.level("armv8.2-a").features)
    epilogues = EPILOGUES  # the tile16 builder's output stage
    residual_add = True
    norms = NORMS  # the tile16 builder's prologue
    activation_quants = tuple(quant for quant in ACTIVATION_QUANTS if quant != "none")

    def unsupported(self, spec: Matmul, n: int, k: int, device) -> str | None:
        ttype = get(spec.weight_dtype)
        if spec.activation_quant == "none":
            return "activation_quant='none' (it multiplies int8 activations)"
        if ttype.bits not in BITS or (ttype.kind not in (INT, UINT) and ttype.int8_values is None):
            return f"{ttype.name} codes (it reads int and uint codes of {list(BITS)} bits, and code books and floats " \
                   f"of up to 4 bits through their int8 code book)"
        if spec.activation_dtype not in PLANES:
            return f"activation_dtype={spec.activation_dtype}"
        if spec.geometry is not None:
            return "a convolution"
        return None

    def resources(self, spec: Matmul, k: int, config: VnniConfig) -> Footprint:
        """L2: the task's weight words, which every row block reads again."""
        return Footprint(l2_bytes=config.n_tiles * padded_k(k, get(spec.weight_dtype).bits) * 2)

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[VnniConfig]:
        """Row blocks up to the bucket's rows (at most 4) and tiles that fit the registers and the body bound,
        the task's words within half of L2, every prefetch depth; row chunks of 32 to 128 rows beyond 16; where one
        row block holds the bucket's rows, 2 and 4 tiles also in turn; blocks of 2 and 4 rows also in pairs where the
        level has a byte matrix product (`pair_instruction`)."""
        small = self.small_m(bucket)
        budget = REGISTERS if device.vector_bytes >= 64 else REGISTERS_NARROW
        found = []
        for rows in doublings(1, min(4, bucket[1])):
            shapes = []
            for n_tiles in range(1, 9):
                if registers(rows, n_tiles) > budget or rows * (rows + 1) // 2 * n_tiles * PRODUCTS > BODY:
                    break
                shapes.append((n_tiles, False))
            if self.one_row_block(rows, bucket) and registers(rows, 1) <= budget:
                shapes += [(n_tiles, True) for n_tiles in (2, 4)]
            chunks = [SMALL_M] if small else [c for c in doublings(32, 128)]
            pairs = (False, True) if rows >= 2 and pair_instruction(device.level) else (False,)
            for (n_tiles, in_turn), chunk, prefetch, paired in itertools.product(shapes, chunks, PREFETCH_WORDS,
                                                                                 pairs):
                config = VnniConfig(n_tiles, small, chunk, rows, prefetch, in_turn, paired)
                if self.resources(spec, k, config).l2_bytes <= device.l2_bytes // 2:
                    found.append(config)
        return MatrixTemplate.for_epilogue(spec, found)

    def small_m(self, bucket: tuple[int, int]) -> bool:
        """Whether the bucket's calls run one task per column block for all their rows (VnniConfig.small_m)."""
        return bucket[1] <= SMALL_M

    def one_row_block(self, rows: int, bucket: tuple[int, int]) -> bool:
        """Whether one block of `rows` rows holds every call's rows in the bucket (VnniConfig.in_turn needs it)."""
        return bucket[1] <= rows

    def work(self, spec: Matmul, n: int, k: int, m: int, config: VnniConfig, device) -> Work:
        """Per call: byte dot products per row, tile and product (`dot_cost` per level, and per row block what its
        rows share, `shared_dot_cost`; in pairs smmla, eight per row pair, tile and two products, an odd block's last
        row counted as a pair, and per 16 bytes of codes and row block a zip, and a tbl for a code book, both once per
        block, not per row); each row block's word decodes (a mask and a shift per byte position) beside them; per
        row, tile and activation block the conversion and scaling of C; per group the offset term; the serial
        prologue of few rows (the other cores wait for it)."""
        bits = get(spec.weight_dtype).bits
        tiles_n = -(-n // AMX_TILE_ROWS)
        blocks = padded_k(k, bits) // ACTIVATION_BLOCK
        groups = padded_k(k, bits) // min(effective_group_size(spec.group_size, k), padded_k(k, bits))
        row_blocks = -(-m // config.rows)
        chunks = 1 if config.small_m else -(-m // config.m_chunk)
        column_blocks = -(-tiles_n // config.n_tiles)
        streams = 1 if config.in_turn else config.n_tiles  # tiles whose words a task reads at once
        copies = device.cores if config.small_m else 1
        operations = {"vnni_block_row": tiles_n * blocks * m, "vnni_group_row": tiles_n * groups * m,
                      "vnni_broadcast": column_blocks * config.n_tiles // streams * blocks * PRODUCTS * m,
                      "vnni_quantize_element": m * k * copies, **norm_prologue(spec, m, k, copies)}
        widths = 64 // device.vector_bytes
        unpacked = tiles_n * blocks * PRODUCTS * row_blocks * widths  # 16-byte vectors of codes decoded
        bound = {"vnni_unpack": unpacked}
        if config.pairs:
            paired_rows = m // config.rows * config.rows + -(-(m % config.rows) // 2) * 2
            bound["pair_dot"] = tiles_n * blocks * PRODUCTS * paired_rows * 2
            operations["vnni_zip"] = unpacked
            if looks_up_bytes(spec):
                operations["vnni_table"] = unpacked
        else:
            costs = (device.level, byte_bits(spec), looks_up_bytes(spec))
            bound["byte_dot"] = tiles_n * blocks * PRODUCTS * (m * dot_cost(*costs) +
                                                               row_blocks * shared_dot_cost(*costs))
        return Work(column_blocks * chunks, operand_bytes(spec, n, k, m), operations, (bound,),
                    streams=streams, prefetch=config.prefetch, stream_penalty=STREAM_PENALTY)

    def program(self, spec: Matmul, n: int, k: int, config: VnniConfig, layout, bucket, device):
        """The PrimFunc for rows M in `bucket` (at most 16 with small_m); arguments as the tile16 templates', the
        constant `lut` the int8 code book of a looked-up type (`byte_table`)."""
        from .emit.vnni import VnniBuilder

        self.check_program(spec, n, k, config, bucket, device)
        return VnniBuilder(spec, n, k, config, device.level, bucket[1]).build("main"), self.constants(spec, device)

    def check_program(self, spec: Matmul, n: int, k: int, config: VnniConfig, bucket, device) -> None:
        """Raise naming the field unless the template builds `config` for the spec, the bucket and the device."""
        self.check_config(config)
        reason = self.unsupported(spec, n, k, device) or self.unsupported_epilogue(spec)
        if reason:
            raise ValueError(f"the {self.title} template does not support {reason}")
        if config.small_m != self.small_m(bucket):
            raise ValueError(f"small_m={config.small_m} does not fit rows {bucket}")
        if config.pairs and not pair_instruction(device.level):
            raise ValueError(f"pairs=True needs a byte matrix product (aarch64's i8mm, smmla); the "
                             f"{device.level.name} level has none")
        if config.in_turn and not self.one_row_block(config.rows, bucket):
            raise ValueError(f"in_turn=True needs one row block for every call: rows={config.rows} is fewer than "
                             f"the bucket's {bucket}")
        if not MatrixTemplate.for_epilogue(spec, [config]):
            raise ValueError(f"n_tiles={config.n_tiles}: epilogue='swiglu' needs an even n_tiles (gate and up tiles "
                             f"in pairs)")

    def constants(self, spec: Matmul, device) -> list:
        """The kernel's constant arguments: the int8 code book of a looked-up type (`byte_table`), or the bits that
        flip codes to unsigned bytes (`emit.vnni.flip_words`)."""
        if looks_up_bytes(spec):
            return [byte_table(spec, device.level)]
        from .emit.vnni import flip_words

        return flip_words(spec, device.level)


TEMPLATE = VnniTemplate()
