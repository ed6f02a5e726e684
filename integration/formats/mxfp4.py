"""gpt-oss's MXFP4 experts (quant_method "mxfp4": the released openai/gpt-oss checkpoints, as transformers' Mxfp4
integration reads them) as bitkern `mxfp4` experts, the bytes carried over as they are.

Per experts module P (e.g. "model.layers.0.mlp.experts") and projection proj (gate_up_proj, down_proj), each of the
E experts' [N, K] weight (N outputs, K inputs; gate_up: [2·intermediate, hidden], its gate and up rows interleaved as
the model's `_apply_gate` reads them; down: [hidden, intermediate]) is stored as
- `P.proj_blocks`: uint8 [E, N, K/32, 16], blocks of 32 elements along K, 16 bytes each; byte j holds element 2j in
  its low nibble and element 2j+1 in its high nibble, each an OCP e2m1 code (sign, 2 exponent bits, 1 mantissa bit);
- `P.proj_scales`: uint8 [E, N, K/32], the block's e8m0 exponent: the block's values are e2m1(code) · 2^(scale−127);
- `P.proj_bias`: float [E, N].
Experts modules that quantization_config's modules_to_not_convert matches (and everything else: attention, routers,
embeddings, lm_head, norms) are stored float in the model's own layout.

bitkern's `mxfp4` type is this format: e2m1 codes packed little-endian along K (so two codes per byte, the first in
the low nibble: the same bytes) with one e8m0 scale code per 32.  So each expert's blocks become its qweight words and
its scales its scale codes unchanged, and the dequantized weights equal transformers' `convert_moe_packed_tensors`
bit for bit.  A scale code of 255 (e8m0's NaN, which transformers would read as 2^128) is refused.
"""

from __future__ import annotations

import re
import sys

import torch

from bitkern.ttype import QuantizedWeight, pack

from .imported import FormatError, ImportedExperts, expect_shape, tensor

QUANT_METHOD = "mxfp4"
BLOCK = 32  # elements per block (and per scale)
PROJECTIONS = {"gate_up": "gate_up_proj", "down": "down_proj"}  # bitkern's projection name -> the checkpoint's
TENSORS = tuple(f"{proj}_{part}" for proj in PROJECTIONS.values() for part in ("blocks", "scales"))
BIASES = tuple(f"{proj}_bias" for proj in PROJECTIONS.values())
OWNED = (*TENSORS, *BIASES)  # the tensors of an experts module that the import consumes
NAN_SCALE = 255
BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def read_config(config: dict) -> dict:
    """{"modules_to_not_convert": [patterns]} of an mxfp4 quantization_config."""
    patterns = config.get("modules_to_not_convert")
    if patterns is None:
        patterns = []
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        raise FormatError(f"quantization_config modules_to_not_convert={patterns!r} must be a list of module names or "
                          f"patterns (e.g. 'model.layers.*.self_attn', 'lm_head')")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as error:
            raise FormatError(f"quantization_config modules_to_not_convert holds {pattern!r}, which is not a valid "
                              f"pattern: {error}") from None
    return {"modules_to_not_convert": patterns}


def not_converted_by(name: str, patterns: list[str]) -> str | None:
    """The pattern of modules_to_not_convert that names module `name`, or None.  As transformers reads the list: a
    pattern names a module if it is the name or a leading part of it ending at a module boundary ("layers.1" names
    "layers.1.mlp", not "layers.11"), if it matches that way as a regular expression ("model.layers.*.self_attn"),
    or if the name ends with it ("lm_head")."""
    for pattern in patterns:
        if name.endswith(pattern) or re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name):
            return pattern
    return None


def _projection(tensors: dict, prefix: str, proj: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks [E, N, G, 16], scales [E, N, G], bias [E, N]) of one projection, checked."""
    blocks_name, scales_name, bias_name = (f"{prefix}{proj}_{part}" for part in ("blocks", "scales", "bias"))
    blocks = tensor(tensors, blocks_name, (torch.uint8,), 4)
    if blocks.shape[-1] != BLOCK // 2 or 0 in blocks.shape:
        raise FormatError(f"tensor {blocks_name!r} has shape {tuple(blocks.shape)}; expected [experts, out_features, "
                          f"in_features / {BLOCK}, {BLOCK // 2}] (16 bytes per block of {BLOCK} e2m1 codes)")
    scales = tensor(tensors, scales_name, (torch.uint8,), 3)
    expect_shape(scales_name, scales, blocks.shape[:3])
    nan = scales == NAN_SCALE
    if bool(nan.any()):
        first = tuple(int(i) for i in nan.nonzero()[0])
        raise FormatError(f"tensor {scales_name!r} holds {int(nan.sum())} scale(s) of 255, e8m0's NaN (the first at "
                          f"{list(first)}): not a valid MXFP4 scale")
    bias = tensor(tensors, bias_name, BIAS_DTYPES, 2)
    expect_shape(bias_name, bias, blocks.shape[:2])
    return blocks, scales, bias


def _words(blocks: torch.Tensor) -> torch.Tensor:
    """One expert's blocks [N, G, 16] as bitkern's packed qweight [N, G·4] (int32 words of the same byte stream)."""
    n = blocks.shape[0]
    stream = blocks.reshape(n, -1).contiguous()
    if sys.byteorder == "little":
        return stream.view(torch.int32)
    codes = torch.stack((stream & 15, stream >> 4), -1).reshape(n, -1)  # element 2j: low nibble of byte j
    return pack(codes, 4)


def convert(tensors: dict, prefix: str, settings: dict) -> ImportedExperts:
    """The experts module stored under `prefix` (e.g. "model.layers.0.mlp.experts.") as bitkern mxfp4 weights."""
    name = prefix[:-1]
    pattern = not_converted_by(name, settings.get("modules_to_not_convert", []))
    if pattern is not None:
        raise FormatError(f"tensor {prefix + TENSORS[0]!r}: the checkpoint holds module {name!r} in MXFP4, but "
                          f"quantization_config modules_to_not_convert lists it ({pattern!r}): the config and the "
                          f"tensors disagree")
    for proj in PROJECTIONS.values():
        if prefix + proj in tensors:
            raise FormatError(f"tensor {prefix + proj!r}: the checkpoint holds module {name!r} both float and in "
                              f"MXFP4 ({prefix + proj}_blocks)")
    stored = {key: _projection(tensors, prefix, proj) for key, proj in PROJECTIONS.items()}
    (gate_up, _, _), (down, _, _) = stored["gate_up"], stored["down"]
    experts, hidden = gate_up.shape[0], gate_up.shape[2] * BLOCK
    intermediate = down.shape[2] * BLOCK
    expected_down = (experts, hidden, intermediate // BLOCK, BLOCK // 2)
    if gate_up.shape[1] != 2 * intermediate or tuple(down.shape) != expected_down:
        raise FormatError(f"tensor {prefix + 'down_proj_blocks'!r} has shape {tuple(down.shape)} and "
                          f"{prefix + 'gate_up_proj_blocks'!r} {tuple(gate_up.shape)}: not the experts of one block "
                          f"(gate_up [E, 2·intermediate, hidden / 32, 16] and down [E, hidden, intermediate / 32, 16])")
    weights, biases = {}, {}
    for key, (blocks, scales, bias) in stored.items():
        n, k = blocks.shape[1], blocks.shape[2] * BLOCK
        weights[key] = [QuantizedWeight("mxfp4", (n, k), BLOCK, "none", _words(blocks[e]), scales[e].contiguous())
                        for e in range(blocks.shape[0])]
        biases[key] = bias
    return ImportedExperts(weights, biases)
