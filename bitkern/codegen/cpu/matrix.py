"""What the two bf16 matrix templates (AMX and AVX512-BF16) share: the specs they serve, their decodes and
activation planes, and the base class both derive from.  Their code comes from one emitter base
(`emit.tile16.Tile16Builder`): the same prologue, decode and per-group epilogue, around AMX tile products or
a vdpbf16ps micro-kernel."""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass

import torch

from ...ops.matmul import EPILOGUES, NORMS, Matmul
from ...ttype import effective_group_size, get
from ...ttype.types import INT, UINT
from .kernel import CpuTemplate, bfloat16_codes, check_prefetch
from .layout import AMX_STEP_K, TILE16_BITS

PLANES = {"bfloat16": 1, "float16": 2, "float32": 3}  # bf16 planes that sum to an activation of each type
MATRIX_BITS = (*TILE16_BITS, 8, 16)
DECODES = ("affine", "lut", "convert", "raw")
TILE_BYTES = 16 * 64  # a decoded bf16 B tile (16 k pairs x 16 columns), a float32 C tile (16 x 16)


def decode_strategies(spec: Matmul) -> tuple[str, ...]:
    """Decode strategies that apply to the spec.  "affine" folds a 128 offset out of float32 sums, which
    costs up to ~2^-16 relative accuracy: below bf16 activations' own rounding, so it is offered for them
    only; 8-bit codes have no table decode, and convert (exact) serves every activation type.  "lut" decodes
    into bf16, exact for types whose values bf16 holds (integers, e2m1).  Others (nf4) it does not serve with
    float32 activations, their lossless compute type: the lookup and generic templates decode them exactly, so
    a float32 row's result does not depend on its M bucket (measured on Zen 4, 4096x4096, against the table
    decode: 1.1x the time at M=1, 2.0x at M=16, 1.7x at M=64).  float16, no lossless compute type for nf4,
    keeps the bf16 table (excluding it cost 1.7x at M=1, 3.3x at M=16).  bfloat16 codes are B-tile elements as
    they are (raw)."""
    ttype = get(spec.weight_dtype)
    if ttype.bits == 16:
        return ("raw",)
    affine = ttype.kind in (INT, UINT) and spec.activation_dtype == "bfloat16"
    if ttype.bits == 8:
        return ("affine", "convert") if affine else ("convert",)
    table = ("lut",) if spec.activation_dtype != "float32" or _exact_in_bf16(ttype) else ()
    return ("affine", *table) if affine else table


@functools.lru_cache(maxsize=None)
def _exact_in_bf16(ttype) -> bool:
    """Whether bf16 holds every value of the type (its bf16 decode table is then exact)."""
    return bool(torch.equal(ttype.lut("bfloat16").float(), ttype.values))


def nibbles(spec: Matmul, decode: str) -> int:
    """B tiles per 16 weight columns and 32-deep step: the affine decode multiplies 8-bit codes as two 4-bit
    nibbles."""
    return 2 if get(spec.weight_dtype).bits == 8 and decode == "affine" else 1


def step_depth(group: int, k: int) -> int | None:
    """k's per decoded step: 32 (an AMX step), 16 for groups of 16, None where the group fits neither."""
    if group % AMX_STEP_K == 0:
        return AMX_STEP_K
    if group == 16:
        return 16
    if group == k:  # per-channel: K is padded to the step and the whole padded K is one group
        return AMX_STEP_K
    return None


def lut_words(spec: Matmul) -> torch.Tensor:
    """The table decode's `lut` argument: the type's bf16 values, repeated to 32 entries, as 16 int32 words."""
    values = get(spec.weight_dtype).lut("bfloat16").view(torch.int16)
    return values.repeat(32 // values.numel()).view(torch.int32).contiguous()


def check_decode(decode: str) -> None:
    """Raise unless `decode` names a decode strategy."""
    if decode not in DECODES:
        raise ValueError(f"decode={decode!r} is not known; accepted: {list(DECODES)}")


@dataclass(frozen=True)
class MatrixConfig:
    """Fields the AMX and AVX512-BF16 configurations share (their defaults are the AMX template's).

    n_tiles: 16-column tiles per task; small_m: one block of all M <= 16 rows; m_chunk: rows per task (large M);
    stage_steps: 32-deep k-steps decoded per pipeline stage; prefetch: words ahead (0: none); decode: strategy;
    chunk_prologue (large M): each task builds its row chunk's activation planes itself and runs every column
    block over them while they sit in L2, instead of one pass over all rows before the main loop (whose planes
    outgrow the caches at large M and are re-read once per column block).
    """

    n_tiles: int = 4
    small_m: bool = True
    m_chunk: int = 256
    stage_steps: int = 4
    prefetch: int = 16
    decode: str = "affine"
    chunk_prologue: bool = False

    def __post_init__(self):
        check_decode(self.decode)
        check_prefetch(self.prefetch)


class MatrixTemplate(CpuTemplate):
    """Base of the AMX and AVX512-BF16 templates.  Their emitter (`builder`, imported when a kernel is built) is
    an `emit.tile16.Tile16Builder`; both take the table of the lut decode after the weight's tensors."""

    shape_fields = ("n_tiles", "m_tiles", "rows", "prefetch", "decode", "chunk_prologue")
    epilogues = EPILOGUES  # the tile16 builder's output stage (`Tile16Builder._store_output`)
    residual_add = True
    norms = NORMS  # the tile16 builder's prologue (`Tile16Builder._x_at`)

    @staticmethod
    def for_epilogue(spec: Matmul, configs: list) -> list:
        """The configurations whose tasks can apply the spec's epilogue: SwiGLU needs whole (gate, up) tile pairs
        per task, i.e. an even n_tiles."""
        return [c for c in configs if c.n_tiles % 2 == 0] if spec.epilogue == "swiglu" else configs

    def unsupported_spec(self, spec: Matmul, k: int) -> str | None:
        """Why neither matrix template can run `spec` with reduction length k, or None if they can."""
        ttype = get(spec.weight_dtype)
        group = effective_group_size(spec.group_size, k)
        if ttype.bits not in MATRIX_BITS:
            return f"{ttype.bits}-bit codes (it decodes {MATRIX_BITS}-bit codes)"
        if ttype.bits == 8 and ttype.kind not in (INT, UINT):
            return f"8-bit {ttype.kind} codes (8-bit codes decode as integers)"
        if ttype.bits == 16 and not bfloat16_codes(ttype):
            return f"16-bit {ttype.name} codes (16-bit codes are read as bfloat16)"
        if spec.activation_dtype not in PLANES:
            return f"activation_dtype={spec.activation_dtype} (AMX bf16 takes {sorted(PLANES)})"
        depth = step_depth(group, k)
        if depth is None:
            return f"group_size={group} with in_features={k} (it needs a multiple of 32, 16, or per-channel)"
        if depth * ttype.bits < 32:
            return f"group_size={group}, shorter than one 32-bit word of {ttype.bits}-bit codes"
        if not decode_strategies(spec):
            return f"{ttype.name} with {spec.activation_dtype} activations (bf16 holds its values inexactly; the " \
                   f"other templates decode them exactly)"
        return None

    @abc.abstractmethod
    def builder(self):
        """The emitter class of the template's kernels (an `emit.tile16.Tile16Builder`)."""

    def program(self, spec: Matmul, n: int, k: int, config, layout, bucket, device):
        """The PrimFunc computing `spec` for a [N, K] weight in the tile16 layout, for any number of rows M
        (at most 16 with small_m).  Arguments, in order: x [M, K], qweight, scales, zeros (zero modes),
        tensor_scale (nvfp4), lut (lut decode), bias [N] float32 (bias specs), residual (residual specs), y [M,
        out_features]."""
        self.check_config(config)
        reason = self.unsupported_spec(spec, k)
        if reason:
            raise ValueError(f"the {self.title} template does not support {reason}")
        if config.decode not in decode_strategies(spec):
            raise ValueError(f"decode={config.decode!r} does not apply to {spec.weight_dtype}; "
                             f"accepted: {list(decode_strategies(spec))}")
        if not self.for_epilogue(spec, [config]):
            raise ValueError(f"n_tiles={config.n_tiles}: epilogue='swiglu' needs an even n_tiles (gate and up tiles "
                             f"in pairs)")
        func = self.builder()(spec, n, k, config).build("main")
        return func, [lut_words(spec)] if config.decode == "lut" else []
