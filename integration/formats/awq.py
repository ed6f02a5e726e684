"""AWQ checkpoints (AutoAWQ "gemm" version, quant_method "awq") as bitkern weights.

Per linear layer (K inputs, N outputs, G groups): `qweight` int32 [K, N/8], eight 4-bit codes per word packed
along N, word position i holding column 8·j + AWQ_ORDER[i]; `qzeros` int32 [G, N/8] the same way, zeros as
they are; `scales` float16 [G, N].  Dequantized: W[n, k] = (q[k, n] − z[k // g, n]) · s[k // g, n].
bitkern holds such a layer as uint4 with zero_mode "awq" and float16 scales, bit for bit.
"""

from __future__ import annotations

import torch

from bitkern.ttype import QuantizedWeight, pack

from .imported import FormatError, ImportedLinear, bias, expect_shape, group_size_setting, setting, tensor

QUANT_METHOD = "awq"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TENSORS = ("qweight", "qzeros", "scales")
OWNED = TENSORS  # the tensors of a module that the import consumes (with its bias)
BITS = 4


def read_config(config: dict) -> dict:
    setting(config, "bits", (BITS,), config.get("w_bit"))
    setting(config, "version", ("gemm", "GEMM"), "gemm")
    setting(config, "zero_point", (True,), True)
    return {"group_size": group_size_setting(config.get("group_size", config.get("q_group_size")))}


def unpack_columns(words: torch.Tensor) -> torch.Tensor:
    """uint8 [R, 8·C] codes of int32 [R, C] words packed along the last axis in AWQ's column order."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)
    fields = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 15  # [R, C, 8]: word position i
    columns = torch.empty_like(fields)
    columns[..., list(AWQ_ORDER)] = fields
    return columns.reshape(words.shape[0], -1).to(torch.uint8)


def convert(tensors: dict, prefix: str, settings: dict) -> ImportedLinear:
    qweight = tensor(tensors, prefix + "qweight", (torch.int32,), 2)
    qzeros = tensor(tensors, prefix + "qzeros", (torch.int32,), 2)
    scales = tensor(tensors, prefix + "scales", (torch.float16, torch.bfloat16, torch.float32), 2)
    k, words = qweight.shape
    n = 8 * words
    group_size = k if settings["group_size"] == -1 else settings["group_size"]
    if k % group_size:
        raise FormatError(f"tensor {prefix + 'qweight'!r} has {k} input rows, which groups of "
                          f"group_size={group_size} do not divide")
    expect_shape(prefix + "scales", scales, (k // group_size, n))
    expect_shape(prefix + "qzeros", qzeros, (k // group_size, words))
    codes = unpack_columns(qweight).T.contiguous()
    zeros = unpack_columns(qzeros).T.contiguous()
    weight = QuantizedWeight("uint4", (n, k), group_size, "awq", pack(codes, BITS), scales.T.contiguous(), zeros)
    return ImportedLinear(weight, None, bias(tensors, prefix, n))
