"""`bitkern.prepare(model, tokens)`: every kernel a forward of `model` over those token counts calls, made ready
before the first call (loaded from the caches, the user's then the system one, or tuned and built), so that no
call tunes; with a progress bar and a summary.

A module whose forward runs bitkern's matmul kernels lists them: `kernel_calls(dtype)` gives a `KernelCall` per
kernel a call with an input of `dtype` runs (`bitkern.Linear`, the fused modules of `bitkern.fusion`); such a
module stands for its submodules.  A forward over t tokens (the tokens of all sequences of a batch together)
multiplies t rows, and each count's M bucket has its kernel (`bitkern.tuner.buckets`); `bitkern.Experts` lists
its grouped kernels and its experts' dense ones with the counts and rows they run at (`kernel_calls(dtype,
top_k)`).  Not listed, so tuned on their first call: convolutions (their rows depend on the image size: logged),
experts' grouped kernels where top_k is unknown (logged), and the kernels of residual adds that torch.compile's
fusion pass folds into a linear.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from ..cache.attention import prepare_attention
from ..cache.dispatch import device_of
from ..cache.lookup import prepare_kernel
from ..ttype import dtype_name
from .experts import Experts
from .kernel_call import KernelCall
from .library import FLOAT_DTYPES
from .storage import QuantizedModule, check_float_dtype

log = logging.getLogger("bitkern")

@dataclass(frozen=True)
class PrepareReport:
    """What `prepare` did: `kernels` made ready, of which `built` were tuned and built, `loaded` came from a cache
    and `ready` were in this process already; in `seconds`; the token counts a warm-up forward ran at (`warmed`, a
    transformers model's: `bitkern.integration.hf.warmup`)."""

    kernels: int
    built: int
    loaded: int
    ready: int
    seconds: float
    tokens: tuple[int, ...]
    warmed: tuple[int, ...] = ()

    def __str__(self) -> str:
        counts = ", ".join(map(str, self.tokens)) if len(self.tokens) <= 8 else \
            f"{self.tokens[0]}..{self.tokens[-1]} ({len(self.tokens)} counts of)"
        return (f"bitkern.prepare: {self.kernels} kernels for {counts} tokens "
                f"({self.built} built, {self.loaded} loaded, {self.ready} already in this process) in "
                f"{self.seconds:.1f} s" + (f"; warmed up at {', '.join(map(str, self.warmed))} tokens"
                                             if self.warmed else ""))


def check_tokens(tokens, argument: str = "tokens") -> tuple[int, ...]:
    """Token counts as a sorted tuple of distinct positive ints, from an int or an iterable of them; ValueError
    naming `argument` otherwise."""
    values = (tokens,) if isinstance(tokens, int) else tokens
    try:
        counts = tuple(values)
    except TypeError:
        counts = ()
    if not counts or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in counts):
        raise ValueError(f"{argument}={tokens!r} must be a positive int or a non-empty sequence of them: the token "
                         f"counts of the forwards to prepare (batch x sequence length, e.g. (1, 512) for decoding "
                         f"one sequence and its prompts of 129 or more tokens)")
    return tuple(sorted(set(counts)))


def input_dtype(model: nn.Module, dtype=None) -> torch.dtype:
    """The dtype of the model's inputs: `dtype`, else the model's own (`model.dtype` of a transformers model, else
    the one floating-point dtype of its parameters and buffers); ValueError naming `dtype` where that is unclear."""
    dtype = check_float_dtype("dtype", dtype, FLOAT_DTYPES, allow_none=True)
    if dtype is not None:
        return dtype
    own = getattr(model, "dtype", None)
    if own in FLOAT_DTYPES:
        return own
    found = {t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()}
    if len(found) != 1:
        raise ValueError(f"dtype=None: the model's floating-point tensors are {sorted(map(dtype_name, found))}, which "
                         f"does not tell the dtype of its inputs; pass it, one of "
                         f"{', '.join(dtype_name(d) for d in FLOAT_DTYPES)}")
    return found.pop()


def kernel_calls(model: nn.Module, dtype: torch.dtype, top_k: int | None = None, fused: bool = True
                 ) -> tuple[list[KernelCall], list[str]]:
    """(the distinct kernels a forward of `model` with inputs of `dtype` and `top_k` experts a token (mixture of
    experts; None: unknown) calls, in the order met; the names of the bitkern modules whose kernels are not listed,
    such as convolutions, and experts layers' grouped kernels where top_k is unknown).  fused: as
    `Experts.kernel_calls` takes it."""
    calls, unlisted = {}, []

    def visit(name: str, module: nn.Module) -> None:
        if isinstance(module, Experts):
            calls.update(dict.fromkeys(module.kernel_calls(dtype, top_k, fused)))
            if top_k is None:
                unlisted.append(f"{name} (grouped kernels: top_k unknown)")
            return
        listing = getattr(module, "kernel_calls", None)
        if callable(listing):
            calls.update(dict.fromkeys(listing(dtype)))
            return
        if isinstance(module, QuantizedModule):
            unlisted.append(name or "(model)")
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return list(calls), unlisted


def prepare(model: nn.Module, tokens, dtype=None, progress: bool = True, attention=(), top_k: int | None = None
            ) -> PrepareReport:
    """Make ready every kernel a forward of `model` over each count of `tokens` calls (see the module docstring):
    loaded from the caches or tuned and built, as the first call of each M bucket would, before any call.

    dtype: the dtype of the model's inputs (default: the model's, see `input_dtype`).  progress: show a progress
    bar.  attention: decode-attention specs (`bitkern.ops.attention.DecodeAttention`) to build too (what
    `bitkern.prepare` finds in a transformers model that runs bitkern's attention).  top_k: the experts a token is
    routed to, for the grouped kernels of `bitkern.Experts` layers (None: those are tuned on their first call,
    logged).  Every argument is checked before any kernel is built."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    counts = check_tokens(tokens)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be a positive int (the experts a token is routed to) or None")
    dtype = input_dtype(model, dtype)
    calls, unlisted = kernel_calls(model, dtype, top_k)
    if not calls:
        raise ValueError("model has no bitkern layers whose kernels can be prepared; quantize it first "
                         "(bitkern.quantize_model, or transformers' from_pretrained with bitkern.BitkernConfig)")
    if unlisted:
        log.info("bitkern.prepare: %d layers are tuned on their first call instead (their kernels depend on more "
                 "than the token count): %s", len(unlisted), ", ".join(unlisted[:8]))
    report = prepare_calls(calls, counts, progress, attention)
    log.info("%s", report)
    return report


def prepare_calls(calls: list[KernelCall], tokens, progress: bool = True, attention=()) -> PrepareReport:
    """`prepare` of the kernels `calls` (from `kernel_calls` methods), for a caller that knows them (vLLM's linear
    method prepares its layer's)."""
    counts = check_tokens(tokens)
    elsewhere = sorted({str(call.device) for call in calls if call.device.type not in ("cpu", "cuda")})
    if elsewhere:
        raise ValueError(f"the model has bitkern layers on {elsewhere}, where no kernels run; load its weights first, "
                         f"or prebuild the kernels of a model directory for a target: python -m bitkern prebuild "
                         f"--model")
    devices = {device: device_of(torch.empty(0, device=device)) for device in {call.device for call in calls}}
    work = [(call, m) for call in calls for m in call.rows(counts)]
    sources = {"built": 0, "loaded": 0, "ready": 0}
    start = time.perf_counter()
    with tqdm(total=len(work) + len(attention), desc="bitkern: preparing kernels", unit="kernel",
              disable=not progress) as bar:
        for call, m in work:
            sources[prepare_kernel(call.spec, call.n, call.k, m, call.layout, devices[call.device])] += 1
            bar.set_postfix(sources, refresh=False)
            bar.update()
        for spec in attention:
            sources[prepare_attention(spec)] += 1
            bar.update()
    return PrepareReport(len(work) + len(attention), sources["built"], sources["loaded"], sources["ready"],
                         time.perf_counter() - start, counts)
