"""The cost model that decides each fusion: a variant (unfused or fused) is its kernel calls, the torch ops
between them and the bytes those ops move; its time is estimated from the tuner's model of each call's kernel
(the kernel the cache would run), a fixed price per call and per torch op, and the bytes at the measured DRAM
bandwidth — and measured, where example inputs are given, by timing both variants interleaved (FusionStitching's
order: a model first, then profiling)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..cache import kernel_for
from ..nn.library import spec_of
from ..tuner import host_cpu
from ..ttype import WeightFormat
from ..tuner.cost import estimate

# Measured on this 2-core Zen 4 (issue 25): each torch op between two bitkern kernels pays a thread wake-up
# ([16, 4096] multiply: 10 µs with spinning threads, 66 µs with OMP_WAIT_POLICY=PASSIVE); a bitkern call's own
# overhead (op dispatch, checks, output allocation) is of the same order.
TORCH_OP_S = 10e-6
CALL_S = 15e-6
MIN_GAIN = 1.02  # a fusion must win by this much (measured, or modeled) to be made: never slower, noise included
ROUNDS = 9


@dataclass(frozen=True)
class Call:
    """One bitkern kernel call: the weight's format string, activation and output dtypes, bias, epilogue, norm
    prologue (priced, with `on_plain_kernel`, on the kernel picked for the call without it: picks made by timing
    differ by more than a prologue costs), activation quantization."""

    weight_format: str
    activation: torch.dtype
    output: torch.dtype
    bias: bool
    epilogue: str = "none"
    residual: bool = False
    norm: str = "none"
    norm_eps: float = 1e-6
    on_plain_kernel: bool = False  # priced on the kernel the cache runs without the norm: its prologue's own cost
    activation_quant: str = "none"

    def seconds(self, m: int) -> float:
        """Modeled time of the kernel the cache runs for M rows (built on first use, as the call itself would)."""
        spec = self.kernel_spec()
        described = WeightFormat.decode(self.weight_format)
        n, k = described.shape
        kernel = kernel_for(self._spec("none") if self.on_plain_kernel else spec, n, k, m, described.layout)
        return estimate(kernel.template, kernel.config, spec, n, k, m, host_cpu()).seconds

    def kernel_spec(self):
        """The Matmul spec this call runs."""
        return self._spec(self.norm)

    def _spec(self, norm: str):
        return spec_of(self.weight_format, self.activation, self.output, self.bias, None, self.epilogue,
                       self.residual, norm, self.norm_eps, self.activation_quant)


@dataclass
class Variant:
    """A way to compute a group: its kernel calls, the torch ops between them and the bytes those ops read and
    write per row of input."""

    calls: list
    torch_ops: int = 0
    bytes_per_row: float = 0.0

    def seconds(self, m: int) -> float:
        kernels = sum(call.seconds(m) for call in self.calls)
        traffic = self.bytes_per_row * m / host_cpu().memory_bandwidth()
        return kernels + CALL_S * len(self.calls) + TORCH_OP_S * self.torch_ops + traffic


@dataclass
class Decision:
    """The verdict on one candidate group: modeled and (where inputs were given) measured seconds per call."""

    estimated: tuple
    measured: tuple | None = None
    notes: list = field(default_factory=list)

    @property
    def gain(self) -> float:
        """unfused / fused time: the measured ratio where there is one, else the modeled."""
        unfused, fused = self.measured or self.estimated
        return unfused / fused

    @property
    def fuse(self) -> bool:
        return self.gain >= MIN_GAIN


def decide(unfused: Variant, fused: Variant, m: int, run_unfused=None, run_fused=None) -> Decision:
    """Model both variants for M rows; time them too where callables running them on example inputs are given."""
    decision = Decision((unfused.seconds(m), fused.seconds(m)))
    if run_unfused is not None:
        decision.measured = interleaved_medians(run_unfused, run_fused)
    return decision


def interleaved_medians(*calls, rounds: int = ROUNDS) -> tuple:
    """Median seconds of each call, timed in alternation (after one warm-up each) so that load drifts hit all."""
    with torch.no_grad():
        for call in calls:
            call()
        times = [[] for _ in calls]
        for _ in range(rounds):
            for call, record in zip(calls, times):
                start = time.perf_counter()
                call()
                record.append(time.perf_counter() - start)
    return tuple(statistics.median(record) for record in times)
