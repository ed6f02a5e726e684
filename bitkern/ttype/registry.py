"""The one registry of type names: the built-in types, and the ones users register."""

from __future__ import annotations

import threading

from .dtypes import dtype_name
from .types import TType, block_scaled, codebook, floating, integer

# QLoRA's NormalFloat4 (Dettmers et al. 2023, appendix E), as bitsandbytes stores it.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)

# bitsandbytes' "fp4" (its own 4-bit float, not OCP e2m1: the smallest magnitude is 1/192, not 1/12), as its
# kernels decode it, normalised to a largest magnitude of 1 like nf4; both zeros are +0.
BNB_FP4_VALUES = (
    0.0, 1 / 192, 2 / 3, 1.0, 1 / 3, 0.5, 1 / 6, 0.25,
    0.0, -1 / 192, -2 / 3, -1.0, -1 / 3, -0.5, -1 / 6, -0.25,
)


def _builtins() -> list[TType]:
    e4m3 = floating("float8_e4m3", 4, 3, specials="fn", description="OCP FP8 E4M3 (finite, NaN only)")
    e2m1 = floating("fp4_e2m1", 2, 1, description="OCP FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives")
    return [
        floating("float32", 8, 23, specials="ieee"),
        floating("float16", 5, 10, specials="ieee"),
        floating("bfloat16", 8, 7, specials="ieee"),
        e4m3,
        floating("float8_e5m2", 5, 2, specials="ieee", description="OCP FP8 E5M2"),
        floating("float8_e8m0", 8, 0, bias=127, signed=False, specials="nan_max", subnormals=False,
                 description="OCP MX shared scale: 2**(code - 127), code 255 is NaN"),
        integer("int8", 8), integer("uint8", 8, signed=False),
        integer("int4", 4), integer("uint4", 4, signed=False),
        integer("int3", 3), integer("uint3", 3, signed=False),
        integer("int2", 2), integer("uint2", 2, signed=False),
        integer("int1", 1, description="binary weights: code 0 is -1, code 1 is +1"),
        integer("uint1", 1, signed=False),
        codebook("nf4", NF4_VALUES, description="QLoRA NormalFloat4"),
        codebook("bnb_fp4", BNB_FP4_VALUES, description="bitsandbytes' 4-bit float (not OCP e2m1)"),
        e2m1,
        block_scaled("mxfp8", e4m3, 32, "float8_e8m0", description="OCP MXFP8: e4m3 elements, e8m0 scale per 32"),
        block_scaled("mxfp4", e2m1, 32, "float8_e8m0", description="OCP MXFP4: e2m1 elements, e8m0 scale per 32"),
        block_scaled("nvfp4", e2m1, 16, "float8_e4m3", tensor_scale=True,
                     description="NVFP4: e2m1 elements, e4m3 scale per 16, float32 scale per tensor"),
    ]


_lock = threading.Lock()
_registry: dict[str, TType] = {t.name: t for t in _builtins()}


def names() -> list[str]:
    """All registered type names, built-ins first, in registration order."""
    return list(_registry)


def get(name) -> TType:
    """The TType for a name (or a TType, or a torch dtype with a bitkern type)."""
    if isinstance(name, TType):
        return name
    key = dtype_name(name)
    if isinstance(key, str) and key in _registry:
        return _registry[key]
    raise ValueError(f"unknown type {name!r}; known types: {', '.join(names())}")


def register(ttype: TType) -> TType:
    """Register a user-defined type under its name; re-registering an identical definition is a no-op."""
    if not isinstance(ttype, TType):
        raise TypeError(f"ttype must be a TType (see bitkern.ttype.integer/floating/codebook), "
                        f"got {type(ttype).__name__}")
    if ttype.block_scale is not None and ttype.block_scale not in _registry:
        raise ValueError(f"block_scale={ttype.block_scale!r} of {ttype.name!r} is not a registered type; "
                         f"known types: {', '.join(names())}")
    with _lock:
        existing = _registry.get(ttype.name)
        if existing is not None and existing != ttype:
            raise ValueError(f"a different type is already registered as {ttype.name!r}: {existing!r}")
        _registry[ttype.name] = ttype
    return ttype
