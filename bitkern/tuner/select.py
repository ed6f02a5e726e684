"""Tune one kernel: enumerate hint-aligned candidates, rank them by the cost model, build the top-k in
parallel, time them on the device, keep the fastest (or the model's best where the device is absent).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from tqdm import tqdm

from ..ops.matmul import Matmul
from .buckets import TUNED_M
from .cost import estimate, estimate_cuda
from .profile import build_all, build_all_cuda, cuda_inputs, inputs, time_cuda_kernel, time_kernels
from .record import Trial, TuningRecord
from .space import enumerate_candidates, enumerate_cuda_candidates, templates_for

log = logging.getLogger("bitkern")

TOP_K = 6
TIE = 0.03  # measured times within 3% of the fastest are a tie, broken by the model: stable choices


@dataclass
class Tuned:
    """The chosen kernel (compiled) and the record of how it was chosen."""

    kernel: object
    record: TuningRecord


def tune(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str, device, top_k: int = TOP_K,
         profile: bool = True) -> Tuned:
    """Choose and compile the kernel for `spec` on a [N, K] weight in `layout`, rows in `bucket`."""
    if not 1 <= top_k <= 8:
        raise ValueError(f"top_k={top_k} is out of range; accepted: 1..8")
    start = time.perf_counter()
    spec.check_shape(n, k)
    backend = _CudaBackend(spec, n, k, bucket, device) if device.kind == "cuda" else \
        _CpuBackend(spec, n, k, bucket, layout, device)
    hint, candidates = backend.enumerate()
    if not candidates:
        raise ValueError(f"no kernel configuration builds {spec} for a [{n}, {k}] weight on {device.key}")
    tuned_m = TUNED_M.get(bucket, bucket[0])
    record = TuningRecord(spec, n, k, bucket, tuned_m, device.key, hint)
    record.trials = [Trial(c.template, c.config, backend.estimate(c, tuned_m).seconds) for c in candidates]
    record.notes += backend.notes()
    order = _ranked(record.trials)
    present = is_present(device)
    if profile and present:
        shortlist = _shortlist(record.trials, order, top_k)
        kernels = backend.build([candidates[i] for i in shortlist])
        x, copies, bias = backend.inputs(tuned_m)
        for i, kernel, seconds in zip(shortlist, kernels, backend.time(kernels, x, copies, bias)):
            record.trials[i].measured_s = seconds
            record.trials[i].build_s = getattr(kernel, "build_seconds", None)
        fastest = min(record.trials[i].measured_s for i in shortlist)
        ties = [i for i in shortlist if record.trials[i].measured_s <= fastest * (1 + TIE)]
        record.chosen = min(ties, key=order.index)
        record.profiled = True
        kernel = kernels[shortlist.index(record.chosen)]
    else:
        record.chosen = order[0]
        record.notes.append("chosen by the cost model alone: the target device is not present"
                            if not present else "chosen by the cost model alone (profiling off)")
        kernel = backend.build([candidates[order[0]]])[0]
        record.trials[order[0]].build_s = getattr(kernel, "build_seconds", None)
    record.seconds = time.perf_counter() - start
    log.info("bitkern: tuned %s", record.summary())
    log.debug("bitkern: tuning record\n%s", record)
    return Tuned(kernel, record)


def _ranked(trials: list[Trial]) -> list[int]:
    """Candidate indices by modeled time; ties broken by template and configuration, so runs agree."""
    return sorted(range(len(trials)), key=lambda i: (trials[i].modeled_s, trials[i].template, repr(trials[i].config)))


CONTENDER = 2.0  # another template's best is worth building if modeled within this factor of the best


def _shortlist(trials: list[Trial], order: list[int], top_k: int) -> list[int]:
    """The best candidate of each template the model rates a contender, and the best's twin without software
    prefetch (which the model cannot rank); then, in model order, candidates that differ in the tile shape or
    prefetch depth from those taken (the model is least sure of these); then the next best, up to top_k."""
    best = trials[order[0]].modeled_s
    chosen: list[int] = []
    for template in dict.fromkeys(trials[i].template for i in order):
        first = next(i for i in order if trials[i].template == template)
        if len(chosen) < top_k and trials[first].modeled_s <= CONTENDER * best:
            chosen.append(first)
    twin = _without_prefetch(trials, order[0])
    if twin is not None and twin not in chosen and len(chosen) < top_k:
        chosen.append(twin)
    for distinct in (True, False):
        for i in order:
            if len(chosen) >= top_k:
                break
            if i not in chosen and (not distinct or _shape(trials[i]) not in {_shape(trials[j]) for j in chosen}):
                chosen.append(i)
    return sorted(chosen, key=order.index)


def _without_prefetch(trials: list[Trial], index: int) -> int | None:
    """The candidate identical to trials[index] but for prefetch=0, if there is one."""
    config = trials[index].config
    if not getattr(config, "prefetch", 0):
        return None
    twin = replace(config, prefetch=0)
    return next((i for i, trial in enumerate(trials)
                 if trial.template == trials[index].template and trial.config == twin), None)


def _shape(trial: Trial) -> tuple:
    """What distinguishes candidates beyond the model's ties: template, tile counts, register rows, prefetch
    depth, decode, where the activation planes are built."""
    config = trial.config
    return (trial.template, getattr(config, "n_tiles", None), getattr(config, "m_tiles", None),
            getattr(config, "rows", None), getattr(config, "prefetch", None), getattr(config, "decode", None),
            getattr(config, "chunk_prologue", None))


def is_present(device) -> bool:
    """Whether kernels for `device` can run in this process (so candidates can be timed)."""
    if device.kind == "cpu":
        from .device import host_cpu

        return device.key == host_cpu().key
    import torch

    if not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return device.arch == f"sm_{props.major}{props.minor}"


class _CpuBackend:
    """Candidates, model, builds and timing on an x86 CPU."""

    def __init__(self, spec, n, k, bucket, layout, device):
        self.spec, self.n, self.k, self.bucket, self.layout, self.device = spec, n, k, bucket, layout, device

    def enumerate(self):
        return enumerate_candidates(self.spec, self.n, self.k, self.bucket, self.layout, self.device)

    def estimate(self, candidate, m):
        return estimate(candidate.template, candidate.config, self.spec, self.n, self.k, m, self.device)

    def notes(self):
        return [f"{template} template not used: {reason}" for template, reason in
                templates_for(self.spec, self.k, self.bucket, self.layout, self.device).items() if reason]

    def build(self, candidates):
        return build_all(candidates, self.spec, self.n, self.k, self.layout, self.bucket, self.device)

    def inputs(self, m):
        return inputs(self.spec, self.n, self.k, m, self.layout, self.device)

    @staticmethod
    def time(kernels, x, copies, bias) -> list[float]:
        return time_kernels(kernels, x, copies, bias)


class _CudaBackend:
    """Candidates, model, nvcc builds and CUDA-event timing for an NVIDIA architecture."""

    def __init__(self, spec, n, k, bucket, device):
        self.spec, self.n, self.k, self.bucket, self.device = spec, n, k, bucket, device

    def enumerate(self):
        return enumerate_cuda_candidates(self.spec, self.n, self.k, self.bucket, self.device)

    def estimate(self, candidate, m):
        return estimate_cuda(candidate.template, candidate.config, self.spec, self.n, self.k, m, self.device)

    def notes(self):
        return []

    def build(self, candidates):
        return build_all_cuda(candidates, self.spec, self.n, self.k, self.bucket, self.device)

    def inputs(self, m):
        return cuda_inputs(self.spec, self.n, self.k, m)

    def time(self, kernels, x, copies, bias) -> list[float]:
        progress = tqdm(kernels, desc=f"tuning {self.spec.weight_dtype} {self.n}x{self.k}", leave=False, disable=None)
        return [time_cuda_kernel(kernel, x, copies, bias) for kernel in progress]
