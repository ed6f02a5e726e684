"""bitkern's type system (LADDER tType): every low-precision element type, its packing and quantization.

Entry points: `get(name)`, `names()`, `register(ttype)`; the factories `integer`, `floating`, `codebook`,
`block_scaled` for user-defined types; `pack`/`unpack`; `quantize` -> `QuantizedWeight`, whose `format`
(`WeightFormat`, with its `Layout`) every stored weight shares (`StoredWeight`); the dtype table
(`torch_dtype`, `tvm_dtype`, `itemsize`, `dtype_name`).
"""

from .dtypes import DTYPES, dtype_name, itemsize, torch_dtype, tvm_dtype
from .packing import code_dtype, codes_per_word, pack, packed_length, tvm_unpack, unpack
from .quantize import QuantizedWeight, effective_group_size, quantize
from .registry import get, names, register
from .types import COMPUTE_DTYPES, KINDS, FloatFormat, TType, block_scaled, codebook, floating, integer
from .weight import ZERO_MODES, Layout, StoredWeight, WeightFormat

__all__ = [
    "COMPUTE_DTYPES", "DTYPES", "KINDS", "Layout", "ZERO_MODES", "FloatFormat", "QuantizedWeight", "StoredWeight",
    "TType", "WeightFormat", "block_scaled", "code_dtype", "codebook", "codes_per_word", "dtype_name",
    "effective_group_size", "floating", "get", "integer", "itemsize", "names", "pack", "packed_length", "quantize",
    "register", "torch_dtype", "tvm_dtype", "tvm_unpack", "unpack",
]
