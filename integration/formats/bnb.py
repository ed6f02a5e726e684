"""bitsandbytes 4-bit checkpoints (quant_method "bitsandbytes", load_in_4bit; nf4 and fp4) as bitkern weights.

Per linear layer [N, K]: `weight` uint8 [N·K/2, 1], two codes per byte, the first element in the high nibble;
`weight.absmax` one float32 scale per block of `blocksize` consecutive elements of the row-major weight,
or, with double quantization, uint8 codes of `weight.nested_quant_map` (256 float32 values) scaled by
`weight.nested_absmax` (float32, one per `nested_blocksize` blocks) plus `nested_offset`; `weight.quant_map`
the 16 values of the codes; `weight.quant_state.bitsandbytes__<type>` JSON (type, blocksize, dtype, shape,
nested settings).  Dequantized in float32: quant_map[q] · absmax (then cast to the state's dtype).
bitkern holds such a layer as nf4 (bitsandbytes' nf4 table) or bnb_fp4 (its fp4 table, which is not OCP
e2m1) with float32 scales and no zeros, one group per block (a block spanning whole rows gives those rows
a per-channel scale each), bit for bit.
"""

from __future__ import annotations

import json

import torch

from bitkern import ttype
from bitkern.ttype import QuantizedWeight, pack

from .imported import FormatError, ImportedLinear, bias, expect_shape, setting, tensor

QUANT_METHOD = "bitsandbytes"
TYPES = {"nf4": "nf4", "fp4": "bnb_fp4"}
# bnb_4bit_quant_storage: the packed bytes may be stored as any of these (a view of the same bytes)
STORAGE_DTYPES = (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int32)
STATE = "weight.quant_state.bitsandbytes__"
TENSORS = ("weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
           *(STATE + quant_type for quant_type in TYPES))
OWNED = ("weight", *TENSORS)  # the tensors of a module that the import consumes (with its bias)


def read_config(config: dict) -> dict:
    if config.get("load_in_8bit") or config.get("_load_in_8bit"):
        raise FormatError("quantization_config load_in_8bit=True: bitsandbytes 8-bit (LLM.int8) checkpoints are not "
                          "supported; accepted: load_in_4bit with bnb_4bit_quant_type 'nf4' or 'fp4'")
    setting(config, "load_in_4bit", (True,), config.get("_load_in_4bit"))
    setting(config, "bnb_4bit_quant_type", tuple(TYPES), "fp4")
    return {}


def _state(tensors: dict, prefix: str) -> tuple[str, dict]:
    names = [prefix + STATE + quant_type for quant_type in TYPES if prefix + STATE + quant_type in tensors]
    if len(names) != 1:
        raise FormatError(f"tensor {prefix + STATE + 'nf4'!r} (or ...fp4) is missing from the checkpoint"
                          if not names else f"module {prefix[:-1]!r} has two quant states: {names}")
    name = names[0]
    raw = tensor(tensors, name, (torch.uint8,), 1)
    try:
        state = json.loads(bytes(raw.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FormatError(f"tensor {name!r} is not the JSON quant state bitsandbytes writes: {error}") from None
    if not isinstance(state, dict):
        raise FormatError(f"tensor {name!r} holds {type(state).__name__} JSON, not bitsandbytes' quant state object")
    return name, state


def _absmax(tensors: dict, prefix: str, state: dict, state_name: str, blocks: int) -> torch.Tensor:
    """float32 absmax per block, double quantization decoded as bitsandbytes does (float32 product, then sum)."""
    name = prefix + "weight.absmax"
    nested = "nested_blocksize" in state or prefix + "weight.nested_absmax" in tensors
    if not nested:
        absmax = tensor(tensors, name, (torch.float32,), 1)
        expect_shape(name, absmax, (blocks,))
        return absmax
    codes = tensor(tensors, name, (torch.uint8,), 1)
    expect_shape(name, codes, (blocks,))
    nested_blocksize = state.get("nested_blocksize")
    offset = state.get("nested_offset")
    if not isinstance(nested_blocksize, int) or nested_blocksize < 1 or not isinstance(offset, (int, float)):
        raise FormatError(f"tensor {state_name!r} lacks a valid nested_blocksize / nested_offset for its double "
                          f"quantization (got {nested_blocksize!r}, {offset!r})")
    quant_map = tensor(tensors, prefix + "weight.nested_quant_map", (torch.float32,), 1)
    expect_shape(prefix + "weight.nested_quant_map", quant_map, (256,))
    nested_absmax = tensor(tensors, prefix + "weight.nested_absmax", (torch.float32,), 1)
    expect_shape(prefix + "weight.nested_absmax", nested_absmax, (-(-blocks // nested_blocksize),))
    scale = nested_absmax.repeat_interleave(nested_blocksize)[:blocks]
    return quant_map[codes.long()] * scale + torch.tensor(float(offset), dtype=torch.float32)


def convert(tensors: dict, prefix: str, settings: dict) -> ImportedLinear:
    state_name, state = _state(tensors, prefix)
    quant_type = setting(state, "quant_type", tuple(TYPES))
    shape = state.get("shape")
    blocksize = state.get("blocksize")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)):
        raise FormatError(f"tensor {state_name!r} gives shape={shape!r}; a linear layer's is [out, in]")
    if not isinstance(blocksize, int) or blocksize < 1:
        raise FormatError(f"tensor {state_name!r} gives blocksize={blocksize!r}; expected a positive int")
    n, k = shape
    if (n * k) % 2 or (k % blocksize and blocksize % k) or (n * k) % blocksize:
        raise FormatError(f"tensor {state_name!r}: blocks of {blocksize} elements over a [{n}, {k}] weight do not "
                          f"fall on whole rows or within rows; bitkern holds groups along rows only")
    packed = tensor(tensors, prefix + "weight", STORAGE_DTYPES, 2)
    expect_shape(prefix + "weight", packed, (n * k // 2 // packed.element_size(), 1))
    bitkern_type = ttype.get(TYPES[quant_type])
    quant_map = tensor(tensors, prefix + "weight.quant_map", (torch.float32,), 1)
    if quant_map.shape != (16,) or not torch.equal(quant_map.view(torch.int32), bitkern_type.values.view(torch.int32)):
        raise FormatError(f"tensor {prefix + 'weight.quant_map'!r} is not bitsandbytes' {quant_type} table "
                          f"(bitkern type {bitkern_type.name}); custom 4-bit tables are not supported")
    absmax = _absmax(tensors, prefix, state, state_name, n * k // blocksize)
    flat = packed.contiguous().view(torch.uint8).reshape(-1)  # bnb_4bit_quant_storage: the same bytes
    codes = torch.stack((flat >> 4, flat & 15), 1).reshape(n, k)
    if k % blocksize == 0:
        group_size, scales = blocksize, absmax.reshape(n, k // blocksize)
    else:  # a block holds blocksize // k whole rows
        group_size, scales = k, absmax.repeat_interleave(blocksize // k).reshape(n, 1)
    weight = QuantizedWeight(bitkern_type, (n, k), group_size, "none", pack(codes, 4), scales.contiguous())
    return ImportedLinear(weight, None, bias(tensors, prefix, n))
