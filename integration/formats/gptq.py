"""GPTQ checkpoints (AutoGPTQ / GPTQModel, quant_method "gptq") as bitkern weights, and bitkern weights as GPTQ.

Per linear layer (K inputs, N outputs, G groups): `qweight` int32 [K·bits/32, N], codes packed along K as one
bit stream (3-bit codes straddle words); `qzeros` int32 [G, N·bits/32], zero points packed the same way along
N; `scales` float16 [G, N]; `g_idx` int32 [K], the group of each input column (non-monotonic with act-order).
Dequantized: W[n, k] = (q[k, n] − z[g_idx[k], n]) · s[g_idx[k], n].  Checkpoint format "gptq" (v1) stores
each zero minus one; gptqmodel restores it by adding 1 to every field as whole-word arithmetic (a borrow
taken when a zero of 0 was stored runs back as a carry) for 2-, 4- and 8-bit zeros, per field modulo 2**bits
for 3-bit ones; "gptq_v2" stores the zeros as they are.

bitkern holds such a layer as uint{bits} with zero_mode "gptq" and float16 scales, bit for bit; act-order
layers get their input columns sorted by group once (weights and scales), and the layer gathers x's
columns in that order per call.
"""

from __future__ import annotations

import torch

from bitkern.ttype import QuantizedWeight, pack

from .bitstream import add_to_fields, block_codes, pack_stream, stream_length, unpack_stream
from .imported import FormatError, ImportedLinear, bias, expect_shape, group_size_setting, setting, tensor

QUANT_METHOD = "gptq"
BITS = (2, 3, 4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
TENSORS = ("qweight", "qzeros", "scales", "g_idx")
OWNED = TENSORS  # the tensors of a module that the import consumes (with its bias)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def read_config(config: dict) -> dict:
    """The settings of a GPTQ quantization_config that the tensors need: bits, group_size, checkpoint_format."""
    bits = setting(config, "bits", BITS)
    group_size = group_size_setting(config.get("group_size", -1))
    checkpoint_format = config.get("checkpoint_format", config.get("format", "gptq"))
    setting({"checkpoint_format": checkpoint_format}, "checkpoint_format", CHECKPOINT_FORMATS)
    setting(config, "pack_dtype", ("int32",), "int32")
    return {"bits": bits, "group_size": group_size, "checkpoint_format": checkpoint_format}


def convert(tensors: dict, prefix: str, settings: dict) -> ImportedLinear:
    """The GPTQ layer stored under `prefix` in `tensors` as an ImportedLinear (its dequantized weight identical
    to the format's)."""
    bits, checkpoint_format = settings["bits"], settings["checkpoint_format"]
    qweight = tensor(tensors, prefix + "qweight", (torch.int32,), 2)
    qzeros = tensor(tensors, prefix + "qzeros", (torch.int32,), 2)
    scales = tensor(tensors, prefix + "scales", SCALE_DTYPES, 2)
    words, n = qweight.shape
    if words % stream_length(block_codes(bits), bits):
        raise FormatError(f"tensor {prefix + 'qweight'!r} has {words} rows; {bits}-bit streams come in blocks of "
                          f"{stream_length(block_codes(bits), bits)} words")
    k = words * 32 // bits
    group_size = settings["group_size"] if settings["group_size"] != -1 else k
    if k % group_size:
        raise FormatError(f"tensor {prefix + 'qweight'!r} holds {k} inputs, which groups of "
                          f"group_size={group_size} do not divide")
    groups = k // group_size
    expect_shape(prefix + "scales", scales, (groups, n))
    if n % block_codes(bits):
        raise FormatError(f"tensor {prefix + 'scales'!r}: {n} outputs do not fill whole words of {bits}-bit zeros")
    expect_shape(prefix + "qzeros", qzeros, (groups, stream_length(n, bits)))
    g_idx = _group_index(tensors, prefix, k, group_size)
    codes = unpack_stream(qweight, bits, 0).T  # [N, K]
    zeros = unpack_stream(qzeros if checkpoint_format == "gptq_v2" or bits == 3
                          else add_to_fields(qzeros, bits, 1), bits, 1)
    if checkpoint_format == "gptq" and bits == 3:
        zeros = (zeros + 1) & 7
    order = None
    if not torch.equal(g_idx, torch.arange(k, dtype=torch.long) // group_size):
        order = torch.argsort(g_idx, stable=True)
        codes = codes[:, order]
    weight = QuantizedWeight(f"uint{bits}", (n, k), group_size, "gptq", pack(codes.contiguous(), bits),
                             scales.T.contiguous(), zeros.T.contiguous())
    return ImportedLinear(weight, order, bias(tensors, prefix, n))


def _group_index(tensors: dict, prefix: str, k: int, group_size: int) -> torch.Tensor:
    """g_idx as int64, checked to give every group exactly group_size columns (else the groups cannot be
    made contiguous); a checkpoint without g_idx has consecutive groups."""
    name = prefix + "g_idx"
    if name not in tensors:
        return torch.arange(k, dtype=torch.long) // group_size
    g_idx = tensor(tensors, name, (torch.int32, torch.int64), 1)
    expect_shape(name, g_idx, (k,))
    g_idx = g_idx.long()
    groups = k // group_size
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise FormatError(f"tensor {name!r} holds groups in [{int(g_idx.min())}, {int(g_idx.max())}]; the layer "
                          f"has {groups} groups (0..{groups - 1})")
    counts = torch.bincount(g_idx, minlength=groups)
    if bool((counts != group_size).any()):
        group = int((counts != group_size).nonzero()[0])
        raise FormatError(f"tensor {name!r} is inconsistent: group {group} has {int(counts[group])} input columns, "
                          f"every group must have group_size={group_size}")
    return g_idx


# -- export ------------------------------------------------------------------------------------------------

def export(imported: ImportedLinear, checkpoint_format: str = "gptq") -> dict:
    """GPTQ tensors {qweight, qzeros, scales, g_idx[, bias]} of a bitkern layer that GPTQ can hold exactly:
    uint2/3/4/8 with integer zeros ("gptq"/"awq" zero mode) or int2/3/4/8 without zeros (stored as the
    symmetric uint type with zero 2**(bits-1)), float16 scales."""
    setting({"checkpoint_format": checkpoint_format}, "checkpoint_format", CHECKPOINT_FORMATS)
    weight = imported.weight
    bits, kind = weight.ttype.bits, weight.ttype.kind
    codes = weight.codes().long()
    n, k = weight.shape
    groups = k // weight.group_size
    if kind == "uint" and weight.zero_mode in ("gptq", "awq") and bits in BITS:
        zeros = weight.zeros.long()
    elif kind == "int" and weight.zero_mode == "none" and bits in BITS and weight.ttype.block_size == 1:
        codes = codes ^ (1 << (bits - 1))  # two's complement v -> v + 2**(bits-1)
        zeros = torch.full((n, groups), 1 << (bits - 1), dtype=torch.long)
    else:
        raise FormatError(f"a {weight.ttype.name} weight with zero_mode={weight.zero_mode!r} has no exact GPTQ form; "
                          f"accepted: uint2/3/4/8 with zero_mode 'gptq' or 'awq', int2/3/4/8 with zero_mode 'none'")
    if weight.scales.dtype != torch.float16:
        raise FormatError(f"GPTQ stores float16 scales; this weight has {weight.scales.dtype} scales")
    if k % block_codes(bits) or n % block_codes(bits):
        raise FormatError(f"a [{n}, {k}] weight does not fill whole {bits}-bit GPTQ words along both axes")
    g_idx = torch.arange(k, dtype=torch.int32) // weight.group_size
    if imported.input_order is not None:
        inverse = torch.argsort(imported.input_order)
        codes = codes[:, inverse]
        g_idx = g_idx[inverse]
    stored_zeros = zeros.T
    if checkpoint_format == "gptq" and bits == 3:
        stored_zeros = (stored_zeros - 1) & 7
    qzeros = pack_stream(stored_zeros, bits, 1)
    if checkpoint_format == "gptq" and bits != 3:
        qzeros = add_to_fields(qzeros, bits, -1)
    out = {"qweight": pack_stream(codes.T, bits, 0), "qzeros": qzeros, "scales": weight.scales.T.contiguous(),
           "g_idx": g_idx.contiguous()}
    if imported.bias is not None:
        out["bias"] = imported.bias
    return out
