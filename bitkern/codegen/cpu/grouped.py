"""Grouped FMA template: a mixture-of-experts projection for decode, y[m, j] = x[m] · dequant(W[indices[m, j]])ᵀ
(`ops.GroupedMatmul`) in one launch, each selected expert's weights read once per call; its code comes from
`emit.grouped`, the FMA kernel's few-row body (`emit.fma`) run over (selected expert, tile block) tasks.  It serves
what the FMA template serves (integer and zero-point codes of 2, 4 and 8 bits, 4-bit code books, bfloat16) but types
with a tensor scale, at every level from AVX2 up; any number of rows (each expert's rows four at a time), though it is
meant for the few of a decode step (a prompt's many rows are better served expert by expert, blocks of rows)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...ops.grouped import GROUPED_EPILOGUES, GroupedMatmul
from ...ttype import get, torch_dtype
from ..template import Work
from .fma import BODY, FmaConfig, FmaTemplate, fits_registers, looks_up
from .kernel import FEW_ROWS, PREFETCH_WORDS, CpuKernel, doublings, operand_bytes
from .layout import AMX_TILE_ROWS, aligned, padded_k
from .lut import LOOKUP_256, min_tiles, value_table


@dataclass
class GroupedCpuKernel(CpuKernel):
    """A compiled grouped kernel: called with the routing as well."""

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                 indices: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
        """y (`GroupedMatmul.output_shape`) for a contiguous x [M, K] ([M·top_k, K] combined; M in m_range), the
        experts' stacked packed weight [E·N, K], indices [M, top_k] (expert ids, int32 or int64), bias [E, N] or None
        and the routing weights [M, top_k] (combine specs) (inputs already validated by the caller:
        `GroupedMatmul.check_routed`)."""
        self.check_rows(indices.shape[0])
        return self.run(x, (*weight.kernel_arguments(), *self.constants), bias, indices, weights)

    def run(self, x: torch.Tensor, arguments: tuple, bias: torch.Tensor | None = None,
            indices: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The call with the weight's kernel arguments and the constants (`arguments`), inputs as `__call__`
        takes them (or as a bound call's first call had, `bitkern.cache.bound`)."""
        y = torch.empty(self.spec.output_shape(indices.shape[0], self.n), dtype=torch_dtype(self.spec.output_dtype),
                        device=x.device)
        if indices.dtype != torch.int64 or not indices.is_contiguous():
            indices = indices.to(torch.int64).contiguous()  # expert ids below E: exact
        routing = (aligned(indices),) if weights is None else \
            (aligned(indices), aligned(weights.float().contiguous()))
        bias_argument = () if bias is None else (aligned(bias.reshape(-1).float().contiguous()),)
        self.function(aligned(x), *arguments, *routing, *bias_argument, y)
        return y


class Grouped:
    """What a grouped template adds to the dense template it derives from (listed first among its bases): grouped
    specs only, their kernels called with the routing, SwiGLU on each expert's [gate; up] halves and the weighted
    top-k sum (`combine`) in the output stage, no other epilogue, residual or norm, no type with a tensor scale, and
    any rows (each expert's rows a few at a time)."""

    grouped = True
    kernel_class = GroupedCpuKernel
    epilogues = GROUPED_EPILOGUES
    norms = ("none",)
    residual_add = False

    def unsupported(self, spec: GroupedMatmul, n: int, k: int, device) -> str | None:
        if get(spec.weight_dtype).tensor_scale:
            return f"{spec.weight_dtype} (a scale per tensor, which stacked experts do not share)"
        return super().unsupported(spec, n, k, device)

    def unsupported_rows(self, bucket: tuple[int, int], device) -> str | None:
        return None


class GroupedFmaTemplate(Grouped, FmaTemplate):
    """The FMA template's checks and codes for grouped specs: few-row configurations (each expert's rows four at a
    time), work counted per selected expert."""

    name = "grouped_fma"
    title = "grouped FMA"

    def configs(self, spec: GroupedMatmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[FmaConfig]:
        """Tiles per task while four rows' sums stay within BODY or the level's registers (`fits_registers`),
        in (gate, up) pairs for SwiGLU, every prefetch depth."""
        return [FmaConfig(n_tiles, prefetch) for n_tiles in doublings(min_tiles(spec), 8)
                if n_tiles * FEW_ROWS <= BODY or fits_registers(FEW_ROWS, n_tiles, device.level, looks_up(spec))
                for prefetch in PREFETCH_WORDS]

    def work(self, spec: GroupedMatmul, n: int, k: int, m: int, config: FmaConfig, device) -> Work:
        """Per call, with the M·top_k pairs on as many distinct experts as they can be: each selected expert's code
        vectors decoded once per four of its rows and multiplied in per pair, its weight read from DRAM once."""
        pairs = m * spec.top_k
        selected = min(spec.experts, pairs)
        per_expert = -(-pairs // selected)
        vectors = selected * (n // AMX_TILE_ROWS) * padded_k(k, get(spec.weight_dtype).bits)
        widths = 64 // device.vector_bytes
        tasks = selected * -(-(n // AMX_TILE_ROWS) // config.n_tiles)
        decode = LOOKUP_256 if looks_up(spec) and device.vector_bytes < 64 else 1
        operations = {"convert_code_vector": vectors * -(-per_expert // FEW_ROWS) * widths * decode,
                      "fma_code_row": vectors * per_expert * widths,
                      "fma_broadcast_row": vectors * per_expert * widths // config.n_tiles}
        dram = selected * operand_bytes(spec, n, k, 0) + pairs * k * 4 + math.prod(spec.output_shape(m, n)) * 4
        return Work(tasks, dram, operations, streams=config.n_tiles, prefetch=config.prefetch)

    def emit(self, spec: GroupedMatmul, n: int, k: int, config: FmaConfig, bucket, device):
        """The grouped kernel (`emit.grouped.build`) and, for code books, the value table."""
        from .emit.grouped import build

        constants = [value_table(spec)] if looks_up(spec) else []
        return build(spec, n, k, config, device.cores, device.level), constants


TEMPLATE = GroupedFmaTemplate()
