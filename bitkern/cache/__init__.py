"""Compiled kernels keyed by operator spec, shape and target; offline prebuilds (not built yet)."""
