"""Small TIR helpers for the hand-scheduled CPU templates: vectors, bf16 bit patterns, the few intrinsics that
differ per instruction-set level (x86, aarch64)."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

LANES = 16  # 32-bit lanes of one 512-bit vector


def prim_func(name: str, arguments, body):
    """The PrimFunc `name` written with TVM's IR builder: `arguments()` declares its arguments (which never alias),
    `body()` emits its statements."""
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name(name)
            arguments()
            T.func_attr({"tirx.noalias": True})
            body()
    return builder.get()


def registers(shape: tuple, dtype: str):
    """A buffer of 16-lane vectors (`shape` of them) that LLVM can keep in registers: a stack array.  TVM allocates
    "local" buffers inside parallel tasks from its workspace pool, whose memory LLVM must keep up to date (a vector
    store per update at the end of every loop iteration: measured on a VNNI GEMV, one per product); a default-scope
    buffer under TVM's stack limit (1 KiB) is an alloca that LLVM promotes."""
    return T.alloc_buffer((*shape, LANES), dtype, align=64)


def lanes(expr) -> int:
    """Vector lanes of an expression (1 for scalars)."""
    return expr.ty.dtype.lanes


def load(buffer, *indices):
    """buffer[indices] as an expression (a vector when an index is a ramp)."""
    return tirx.BufferLoad(buffer, list(indices))


def tile_pointer(buffer, indices, rows: int, row_stride: int, access: str):
    """Pointer to a `rows` x `row_stride`-element block of a row-major buffer starting at `indices`, for
    AMX tile loads/stores: the extent tells TVM the whole block is accessed (an address_of a single
    element would let buffer compaction shrink the allocation to that element)."""
    offset = 0
    for index, extent in zip(indices, buffer.shape):
        offset = offset * extent + index
    return buffer.access_ptr(access, offset=offset, extent=rows * row_stride)


def ramp(start, lanes: int = LANES):
    return tirx.Ramp(start, 1, lanes)


def by_parts(width: int, op, *vectors):
    """op applied to each `width` lanes of the 16-lane `vectors` (one Shuffle of those lanes each), the parts joined
    back into 16 lanes: how a 16-lane value meets an instruction of a narrower vector (AVX2's 8 lanes, NEON's 4)."""
    if width == LANES:
        return op(*vectors)
    parts = [op(*(tirx.Shuffle([vector], list(range(start, start + width))) for vector in vectors))
             for start in range(0, LANES, width)]
    return tirx.Shuffle(parts, list(range(LANES)))


def splat(value, dtype: str, count: int = LANES):
    """`count` lanes of a Python number (as `dtype`) or of a scalar expression."""
    return tirx.Broadcast(tirx.const(value, dtype) if isinstance(value, (bool, int, float)) else value, count)


def u32(value: int, count: int = LANES):
    return splat(value, "uint32", count)


def intrinsic(name: str, *args) -> None:
    """Emit a call to an LLVM intrinsic that returns nothing (AMX tile ops, prefetch)."""
    T.evaluate(tirx.call_llvm_intrin("void", name, *args))


def tile(index: int):
    """An AMX tile register number (an i8 immediate)."""
    return tirx.const(index, "int8")


def stride(bytes_: int):
    return tirx.const(bytes_, "int64")


def _typed(dtype: str, lanes: int) -> str:
    return f"{dtype}x{lanes}" if lanes > 1 else dtype


def _u32_like(value: int, lanes: int):
    return u32(value, lanes) if lanes > 1 else tirx.const(value, "uint32")


def bf16_bits(value):
    """uint32 (lanes) holding the round-to-nearest-even bfloat16 pattern of float32 (lanes) in the low
    16 bits."""
    n = lanes(value)
    bits = tirx.reinterpret(_typed("uint32", n), value)
    lsb = tirx.bitwise_and(tirx.shift_right(bits, _u32_like(16, n)), _u32_like(1, n))
    return tirx.shift_right(bits + _u32_like(0x7FFF, n) + lsb, _u32_like(16, n))


def bf16_value(bits):
    """float32 (lanes) of bfloat16 patterns held in the low 16 bits of uint32 (lanes)."""
    n = lanes(bits)
    return tirx.reinterpret(_typed("float32", n), tirx.shift_left(bits, _u32_like(16, n)))


def bf16_to_float(stored):
    """float32 (lanes) of loaded bfloat16 (or int16 bit pattern) lanes, by shifting their bits."""
    n = lanes(stored)
    return bf16_value(tirx.Cast(_typed("uint32", n), tirx.reinterpret(_typed("uint16", n), stored)))


def to_float32(value, dtype: str):
    """Loaded values of `dtype` (bfloat16, float16 or float32; scalar or lanes) as float32."""
    if dtype == "bfloat16":
        return bf16_to_float(value)
    return tirx.Cast(_typed("float32", lanes(value)), value)


def horizontal_sum(values):
    """Sum of the lanes of a vector, as a tree of halves."""
    return _horizontal(values, lambda a, b: a + b)


def horizontal_max(values):
    """Largest lane of a vector, as a tree of halves."""
    return _horizontal(values, tirx.max)


def _horizontal(values, combine):
    while lanes(values) > 1:
        half = lanes(values) // 2
        values = combine(tirx.Shuffle([values], list(range(half))), tirx.Shuffle([values], list(range(half, 2 * half))))
    return values


def lookup16(table, index, level):
    """table[index & 15] per lane: 16 float32 lanes looked up in a 16-entry float32 table (`index` int32x16; bits
    above the low 4 are ignored), with the instruction-set `level`'s instructions.  x86 with 512-bit vectors: one
    vpermps; with 256-bit ones (AVX2), per half of the lanes a vpermps into each half of the table (it reads the low
    3 bits) and a vblendvps choosing by bit 3 (shifted into the sign bit).  aarch64: `tbl` over the table's four
    NEON registers by byte (`_tbl4_lookup16`)."""
    if level.arch == "aarch64":
        return _tbl4_lookup16(table, index)
    if level.vector_bytes >= 64:
        return tirx.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.permvar.sf.512", table, index)
    halves = [tirx.Shuffle([table], list(range(start, start + 8))) for start in (0, 8)]
    picked = []
    for start in (0, 8):
        lanes_index = tirx.Shuffle([index], list(range(start, start + 8)))
        low, high = (tirx.call_llvm_pure_intrin("float32x8", "llvm.x86.avx2.permps", half, lanes_index)
                     for half in halves)
        bit3 = tirx.reinterpret("float32x8", tirx.shift_left(lanes_index, splat(28, "int32", 8)))
        picked.append(tirx.call_llvm_pure_intrin("float32x8", "llvm.x86.avx.blendv.ps.256", low, high, bit3))
    return tirx.Shuffle(picked, list(range(LANES)))


def _tbl4_lookup16(table, index):
    """`lookup16` with NEON's four-register `tbl`: each lane's four byte indices 4·(index & 15) + 0..3 (one multiply
    spreads 4·i into every byte of the lane, one add numbers the bytes), then per 16 bytes (4 lanes) one `tbl` of
    the 64-byte table."""
    offset = tirx.bitwise_and(index, splat(15, "int32")) * splat(4, "int32")
    byte_index = tirx.reinterpret("int8x64", offset * splat(0x01010101, "int32") + splat(0x03020100, "int32"))
    table_bytes = tirx.reinterpret("int8x64", table)
    registers_of_table = [tirx.Shuffle([table_bytes], list(range(16 * r, 16 * r + 16))) for r in range(4)]
    picked = [tirx.call_llvm_pure_intrin("int8x16", "llvm.aarch64.neon.tbl4", *registers_of_table,
                                         tirx.Shuffle([byte_index], list(range(16 * q, 16 * q + 16))))
              for q in range(4)]
    return tirx.reinterpret("float32x16", tirx.Shuffle(picked, list(range(64))))


def lookup_bytes(table, index, level):
    """Per byte, the byte of `table` at the low 4 bits of `index`'s byte (both 16 int32 lanes, bytes of index below
    16), with the instruction-set `level`'s instructions: vpshufb, which looks up within each 128-bit lane, so `table`
    holds its 16 bytes once per lane.  One 512-bit vpshufb with AVX-512, one per 8 lanes with AVX2; aarch64: one
    single-register `tbl` of the table's first 16 bytes per 4 lanes."""
    if level.arch == "aarch64":
        table_bytes = tirx.reinterpret("int8x16", tirx.Shuffle([table], list(range(4))))
        return by_parts(4, lambda part: tirx.reinterpret("uint32x4", tirx.call_llvm_pure_intrin(
            "int8x16", "llvm.aarch64.neon.tbl1", table_bytes, tirx.reinterpret("int8x16", part))), index)
    if level.vector_bytes >= 64:
        picked = tirx.call_llvm_pure_intrin("int8x64", "llvm.x86.avx512.pshuf.b.512",
                                            tirx.reinterpret("int8x64", table), tirx.reinterpret("int8x64", index))
        return tirx.reinterpret("uint32x16", picked)
    return by_parts(8, lambda part_table, part_index: tirx.reinterpret("uint32x8", tirx.call_llvm_pure_intrin(
        "int8x32", "llvm.x86.avx2.pshuf.b", tirx.reinterpret("int8x32", part_table),
        tirx.reinterpret("int8x32", part_index))), table, index)


def prefetch_ahead(buffer, tile_index, index, distance: int, tiles_per_task: int) -> None:
    """Prefetch the line `distance` rows past (tile, index) of a per-tile buffer [tiles, rows, lanes] (tile16
    weight words, or the per-group scales and zeros).  Past a tile's end it reaches the same stream of the
    next task (`tiles_per_task` tiles on; consecutive tasks run on the same thread), so a task starts on
    prefetched lines instead of cold misses.  Distance 0 emits nothing: the hardware prefetchers alone."""
    if distance == 0:
        return
    tiles, rows = buffer.shape[0], buffer.shape[1]
    ahead = index + distance
    tile_ahead = tirx.min(tile_index + tirx.floordiv(ahead, rows) * tiles_per_task, tiles - 1)
    prefetch(load(buffer, tile_ahead, tirx.floormod(ahead, rows), 0))


def prefetch(element, into_l1: bool = True) -> None:
    """Prefetch the cache line holding a buffer element (for reading): into L1 for the next iterations, or
    into L2 only (prefetcht1) for lines needed later than L1 could keep them."""
    intrinsic("llvm.prefetch.p0", tirx.address_of(element), tirx.const(0, "int32"),
              tirx.const(3 if into_l1 else 2, "int32"), tirx.const(1, "int32"))
