"""Grouped VNNI template: a mixture-of-experts projection for decode with int8 activations (activation_quant="int8"),
y[m, j] = x̂[m] · dequant(W[indices[m, j]])ᵀ (`ops.GroupedMatmul`) in one launch, each selected expert's weights read
once per call; its code comes from `emit.grouped_vnni`, the VNNI kernel's prologue and row blocks run over (selected
expert, tile block) tasks.  It serves what the VNNI template serves (int and uint codes of 1, 2, 4 and 8 bits, 4-bit
code books and floats through their int8 code book) but types with a tensor scale, at every level with a byte dot
product (vpmaddubsw from AVX2 up, vpdpbusd, sdot, smmla)."""

from __future__ import annotations

import dataclasses
import math

from ...ops.grouped import GroupedMatmul
from .grouped import Grouped
from .kernel import operand_bytes
from .vnni import VnniConfig, VnniTemplate


class GroupedVnniTemplate(Grouped, VnniTemplate):
    """The VNNI template's checks, configurations and codes for grouped specs: each expert's rows in blocks, every
    block one over all of K, work counted per selected expert."""

    name = "grouped_vnni"
    title = "grouped VNNI"

    def small_m(self, bucket: tuple[int, int]) -> bool:
        return True  # one task per (expert, column block) for all its rows

    def one_row_block(self, rows: int, bucket: tuple[int, int]) -> bool:
        return True  # each block of an expert's rows runs over all of K

    def work(self, spec: GroupedMatmul, n: int, k: int, m: int, config: VnniConfig, device):
        """Per call, with the M·top_k pairs on as many distinct experts as they can be: the VNNI kernel's work on the
        selected experts' weights (as one weight of their rows) at the pairs an expert takes, each weight read from
        DRAM once; every chunk quantizes x's M rows."""
        pairs = m * spec.top_k
        selected = min(spec.experts, pairs)
        work = super().work(spec, selected * n, k, -(-pairs // selected), config, device)
        rows = pairs if spec.combine else m  # x's rows, each quantized by every chunk
        operations = dict(work.operations, vnni_quantize_element=rows * k * device.cores)
        dram = selected * operand_bytes(spec, n, k, 0) + rows * k * 4 + math.prod(spec.output_shape(m, n)) * 4
        return dataclasses.replace(work, operations=operations, dram_bytes=dram)

    def program(self, spec: GroupedMatmul, n: int, k: int, config: VnniConfig, layout, bucket, device):
        """The PrimFunc for any rows (`emit.grouped_vnni.build`) and, for code books, their int8 values."""
        from .emit.grouped_vnni import build

        self.check_program(spec, n, k, config, bucket, device)
        return build(spec, n, k, config, device.cores, device.level), self.constants(spec, device)


TEMPLATE = GroupedVnniTemplate()
