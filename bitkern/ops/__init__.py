"""Operators as typed tensor expressions: specs (hashable, validated) and their pure-torch references.

Entry points: `Matmul` (y = x · dequant(W)ᵀ + b) and `Conv2d` (the same GEMM with x's rows gathered from
an NHWC image: an implicit-GEMM convolution), with `.reference` for tests.  ops executes nothing: calling a
spec goes to the dispatch layer that `bitkern.cache` attaches (`execution`).
"""

from .conv import REDUCTION_ORDER, Conv2d, ConvGeometry, spec_from_dict
from .matmul import ACCUMULATE_DTYPES, ACTIVATION_DTYPES, OPERAND_LAYOUTS, OUTPUT_DTYPES, Matmul

__all__ = ["ACCUMULATE_DTYPES", "ACTIVATION_DTYPES", "Conv2d", "ConvGeometry", "Matmul", "OPERAND_LAYOUTS",
           "OUTPUT_DTYPES", "REDUCTION_ORDER", "spec_from_dict"]
