"""bitkern's type system (LADDER tType): every low-precision element type, its packing and quantization.

Entry points: `get(name)`, `names()`, `register(ttype)`; the factories `integer`, `floating`, `codebook`,
`block_scaled` for user-defined types; `pack`/`unpack`; `quantize` -> `QuantizedWeight`.
"""

from .packing import code_dtype, codes_per_word, pack, packed_length, tvm_unpack, unpack
from .quantize import ZERO_MODES, QuantizedWeight, quantize
from .registry import get, names, register
from .types import COMPUTE_DTYPES, KINDS, FloatFormat, TType, block_scaled, codebook, floating, integer

__all__ = [
    "COMPUTE_DTYPES", "KINDS", "ZERO_MODES", "FloatFormat", "QuantizedWeight", "TType", "block_scaled",
    "code_dtype", "codebook", "codes_per_word", "floating", "get", "integer", "names", "pack",
    "packed_length", "quantize", "register", "tvm_unpack", "unpack",
]
