"""Operators as typed tensor expressions: specs (hashable, validated) and their pure-torch references.

Entry points: `Matmul` (y = x · dequant(W)ᵀ + b), `Conv2d` (the same GEMM with x's rows gathered from an NHWC
image: an implicit-GEMM convolution) and `GroupedMatmul` (rows routed to their top-k of stacked experts' weights: a
mixture-of-experts projection), with `.reference` for tests.  ops executes nothing: calling a spec goes to the
dispatch layer that `bitkern.cache` attaches (`execution`).
"""

from .conv import REDUCTION_ORDER, Conv2d, ConvGeometry, spec_from_dict
from .grouped import GroupedMatmul
from .matmul import ACCUMULATE_DTYPES, ACTIVATION_DTYPES, OPERAND_LAYOUTS, OUTPUT_DTYPES, Matmul

__all__ = ["ACCUMULATE_DTYPES", "ACTIVATION_DTYPES", "Conv2d", "ConvGeometry", "GroupedMatmul", "Matmul",
           "OPERAND_LAYOUTS", "OUTPUT_DTYPES", "REDUCTION_ORDER", "spec_from_dict"]
