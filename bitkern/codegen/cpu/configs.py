"""Tile configurations of the CPU templates: what the tuner chooses and the cache stores (no TVM needed)."""

from __future__ import annotations

from dataclasses import dataclass

from .layout import AMX_TILE_ROWS

TILE_REGISTERS = 8  # AMX tile registers
AMX_DECODES = ("affine", "lut", "convert")


def _check_decode(decode: str) -> None:
    if decode not in AMX_DECODES:
        raise ValueError(f"decode={decode!r} is not known; accepted: {list(AMX_DECODES)}")


def _check_prefetch(prefetch: int) -> None:
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r} is not accepted: weight words ahead, an int >= 0 (0: no software "
                         f"prefetch, the hardware prefetchers alone)")


@dataclass(frozen=True)
class AmxConfig:
    """Tile configuration of the AMX template (chosen by the tuner).

    n_tiles: 16-column C tiles per task; m_tiles: 16-row A tiles per m-block (large M); small_m: one
    block of all M <= 16 rows (tile rows = M) instead of 16-row tiles; m_chunk: rows per task (large M);
    stage_steps: 32-deep k-steps decoded per pipeline stage; prefetch: words ahead (0: none); decode: strategy;
    chunk_prologue (large M): each task builds its row chunk's activation planes itself and runs every
    column block over them while they sit in L2, instead of one pass over all rows before the main loop
    (whose planes outgrow the caches at large M and are re-read once per column block).
    """

    n_tiles: int = 4
    m_tiles: int = 1
    small_m: bool = True
    m_chunk: int = 256
    stage_steps: int = 4
    prefetch: int = 16
    decode: str = "affine"
    chunk_prologue: bool = False

    def __post_init__(self):
        _check_decode(self.decode)
        _check_prefetch(self.prefetch)
        if self.small_m and (self.m_tiles != 1 or self.chunk_prologue):
            raise ValueError("small_m kernels use m_tiles=1 and build their planes in one pass")
        if self.m_tiles * self.n_tiles + self.m_tiles + 1 > TILE_REGISTERS:
            raise ValueError(f"m_tiles={self.m_tiles} x n_tiles={self.n_tiles} needs more than "
                             f"{TILE_REGISTERS} AMX tile registers")
        if self.m_chunk % (AMX_TILE_ROWS * self.m_tiles):
            raise ValueError(f"m_chunk={self.m_chunk} must be a multiple of {AMX_TILE_ROWS * self.m_tiles}")


# zmm registers a register block may hold (C rows and the task's decoded weight rows, of 32): measured on
# AMD Zen 4, 3 rows x 7 tiles (28) ran at half the speed of 4 x 5 (25)
DOT_REGISTERS = 27


@dataclass(frozen=True)
class DotConfig:
    """Tile configuration of the AVX512-BF16 template (chosen by the tuner).

    n_tiles: 16-column weight tiles per task; rows: activation rows per register block (C rows held in
    registers: rows x n_tiles, x2 for 8-bit codes); small_m: one chunk of all M <= 16 rows; m_chunk: rows
    per task (large M); stage_steps, prefetch, decode, chunk_prologue: as in AmxConfig; direct (few rows):
    decoded weight rows go from registers straight into the products of a block of up to `rows` rows, one
    body per row count, instead of through a decoded stage in L1 that serves every row block.
    """

    n_tiles: int = 2
    rows: int = 8
    small_m: bool = True
    m_chunk: int = 64
    stage_steps: int = 2
    prefetch: int = 16
    decode: str = "affine"
    chunk_prologue: bool = False
    direct: bool = False

    def __post_init__(self):
        _check_decode(self.decode)
        _check_prefetch(self.prefetch)
        if self.direct and not self.small_m:
            raise ValueError("direct kernels serve few rows: they need small_m")
        if self.small_m and (self.chunk_prologue or AMX_TILE_ROWS % self.rows):
            raise ValueError(f"small_m kernels take a divisor of {AMX_TILE_ROWS} rows per block and build their "
                             f"planes in one pass")
        if (self.rows + 1) * self.n_tiles > DOT_REGISTERS:
            raise ValueError(f"rows={self.rows} x n_tiles={self.n_tiles} needs more than {DOT_REGISTERS} "
                             f"vector registers")
        if self.m_chunk % self.rows:
            raise ValueError(f"m_chunk={self.m_chunk} must be a multiple of rows={self.rows}")


@dataclass(frozen=True)
class LutConfig:
    """Tile configuration of the lookup template: `n_tiles` 16-row weight tiles per task (they share each
    group's tables while those sit in L1), `prefetch` words ahead (0: none)."""

    n_tiles: int = 8
    prefetch: int = 32

    def __post_init__(self):
        _check_prefetch(self.prefetch)


@dataclass(frozen=True)
class GenericConfig:
    """Tile configuration of the generic template: `k_block` k's decoded per tile (a divisor of K)."""

    k_block: int = 128



CONFIGS = {"amx": AmxConfig, "dot": DotConfig, "lut": LutConfig, "generic": GenericConfig}


def config_from_dict(template: str, fields: dict):
    """A template's configuration from its fields (as the cache's manifests store them)."""
    if template not in CONFIGS:
        raise ValueError(f"template={template!r} is not known; accepted: {sorted(CONFIGS)}")
    return CONFIGS[template](**fields)
