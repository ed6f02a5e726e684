"""Bound calls: what the dispatch layer settled for a CPU kernel call (its inputs checked, its kernel found, the
weight's arguments made), kept per weight, so that a later call of the same signature runs the kernel at once.

Through the checks and the lookup, an op call in a compiled graph pays ~40 µs of Python before its kernel starts
(a grouped one ~80; M=1, Zen 3): at a decode step's 30-40 calls, a millisecond or more, on one thread while the
other waits.  A bound call pays a few.  The signature is the key: the weight's tensors (the same objects, at the
same addresses), x's shape, dtype and layout, the other inputs' and every option; each input it fixes passed the
first call's checks, so a call matching it passes them too.  What depends on the data (a grouped call's expert ids)
is still checked every call.  An entry lives as long as its weight's qweight tensor (a weak key), so freeing a model
frees its entries.
"""

from __future__ import annotations

import weakref

import torch

_BOUND: dict[int, tuple] = {}  # id(qweight) -> (a weak reference to qweight, {signature: Bound})


def described(tensor: torch.Tensor | None):
    """A tensor's part of a call signature: its type, shape, dtype, device and whether it is contiguous (None: no
    tensor)."""
    if tensor is None:
        return None
    return type(tensor), tensor.shape, tensor.dtype, tensor.device, tensor.is_contiguous()


class Bound:
    """A kernel with a weight's arguments, for the calls of one signature: `arguments(qweight)` are what the kernel
    takes after x (the weight's tensors, then its constants).  It keeps the weight's tensors but qweight (the entry's
    weak key), and where each one's data starts."""

    __slots__ = ("kernel", "others", "pointers", "fixed")

    def __init__(self, kernel, tensors, weight):
        arguments = weight.kernel_arguments()
        self.kernel, self.others = kernel, tuple(tensors[1:])
        self.pointers = tuple(None if t is None else t.data_ptr() for t in tensors)
        self.fixed = (*arguments[1:], *kernel.constants)

    def arguments(self, qweight: torch.Tensor) -> tuple:
        return (qweight, *self.fixed)

    def holds(self, tensors) -> bool:
        """Whether `tensors` are this call's weight tensors (qweight found by its key), none of them moved."""
        if tensors[0].data_ptr() != self.pointers[0] or len(tensors) != len(self.pointers):
            return False
        return all(a is b and (a is None or a.data_ptr() == p)
                   for a, b, p in zip(tensors[1:], self.others, self.pointers[1:]))


def find(tensors, signature: tuple) -> Bound | None:
    """The bound call of `signature` on the weight `tensors` (qweight first), or None: none yet, or the tensors are
    not those it was bound to."""
    entry = _BOUND.get(id(tensors[0]))
    if entry is None or entry[0]() is not tensors[0]:
        return None
    found = entry[1].get(signature)
    return found if found is not None and found.holds(tensors) else None


def keep(tensors, signature: tuple, kernel, weight) -> None:
    """Bind `kernel` (a CPU kernel, whose checked call of `signature` has just run) to the packed `weight` that
    `tensors` describe."""
    key = id(tensors[0])
    entry = _BOUND.get(key)
    if entry is None or entry[0]() is not tensors[0]:
        entry = _BOUND[key] = (weakref.ref(tensors[0], lambda ref, key=key: _forget(key, ref)), {})
    entry[1][signature] = Bound(kernel, tensors, weight)


def _forget(key: int, ref) -> None:
    """Drop the entry of a qweight that has been freed (its weak reference's callback)."""
    if key in _BOUND and _BOUND[key][0] is ref:
        del _BOUND[key]


def clear() -> None:
    """Drop every bound call (with the process's kernel map, `lookup.forget`)."""
    _BOUND.clear()
