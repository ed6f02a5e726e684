"""Small helpers the tensor-expression schedule templates share (the generic CPU template, the CUDA ones)."""

from __future__ import annotations


def vector_lanes(wanted: int, extent: int) -> int:
    """The widest vector up to `wanted` lanes that divides `extent`."""
    lanes = wanted
    while lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes


def loops_under(sch, block, anchor) -> list:
    """The loops of `block` nested inside loop `anchor` (a cache block's own loops after compute_at)."""
    loops = sch.get_loops(block)
    position = next(i for i, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(anchor)))
    return loops[position + 1:]


def read_index(sch, block, prefix: str) -> int:
    """Position among `block`'s reads of the buffer whose name starts with `prefix` (caches of a buffer
    keep its name as a prefix)."""
    reads = sch.get(block).reads
    return next(i for i, region in enumerate(reads) if region.source.name.startswith(prefix))
