"""Operators as typed tensor expressions: specs (hashable, validated) and their pure-torch references.

Entry point: `Matmul` (y = x · dequant(W)ᵀ + b), with `Matmul.reference` for tests.
"""

from .matmul import ACCUMULATE_DTYPES, ACTIVATION_DTYPES, LAYOUTS, OUTPUT_DTYPES, Matmul

__all__ = ["ACCUMULATE_DTYPES", "ACTIVATION_DTYPES", "LAYOUTS", "Matmul", "OUTPUT_DTYPES"]
