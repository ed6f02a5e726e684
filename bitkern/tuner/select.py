"""Tune one kernel: enumerate hint-aligned candidates, rank them by the cost model, build the top-k in
parallel, time them on the device, keep the fastest (or the model's best where the device is absent).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

from ..codegen import KernelBuildError
from ..codegen import template as template_named
from ..ops.matmul import Matmul
from .buckets import TUNED_M
from .cost import estimate
from .hints import device_hint
from .profile import SAMPLERS, build_all, describe, inputs, stage_inputs, time_kernels
from .record import Trial, TuningRecord
from .space import Candidate, enumerate_candidates, usable_templates

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
    start = time.perf_counter()
    record, candidates, order = _considered(spec, n, k, bucket, layout, device, top_k)
    if profile and is_present(device):
        built = _build(record, _shortlist(record.trials, order, top_k), candidates, spec, n, k, layout, bucket, device)
        if not built:  # the model's next candidates, one at a time, until one builds
            built = [_first_that_builds(record, order, candidates, spec, n, k, layout, bucket, device)]
        kernel = _fastest(record, [i for i, _ in built], [kernel for _, kernel in built], spec, n, k, layout, device)
    else:
        record.chosen, kernel = _first_that_builds(record, order, candidates, spec, n, k, layout, bucket, device)
        record.notes.append(_model_note(device))
        record.trials[record.chosen].build_s = getattr(kernel, "build_seconds", None)
    return _done(kernel, record, start)


def _first_that_builds(record: TuningRecord, order: list[int], candidates: list, spec: Matmul, n: int, k: int,
                       layout: str, bucket: tuple[int, int], device) -> tuple[int, object]:
    """(index, kernel) of the best modeled candidate that builds (the failures logged and noted); KernelBuildError
    naming the kernel and every reason where none does."""
    for index in order:
        if record.trials[index].failed is None:
            built = _build(record, [index], candidates, spec, n, k, layout, bucket, device)
            if built:
                return built[0]
    reasons = "; ".join(f"{trial.template} {trial.config}: {trial.failed}" for trial in record.trials if trial.failed)
    raise KernelBuildError(f"no candidate of {describe(spec, n, k, bucket, device)} built: {reasons}")


def _build(record: TuningRecord, indices: list[int], candidates: list, spec: Matmul, n: int, k: int, layout: str,
           bucket: tuple[int, int], device) -> list[tuple[int, object]]:
    """[(index, kernel)] of the candidates at `indices` that built; each failure's reason goes into its trial."""
    built = []
    for index, result in zip(indices, build_all([candidates[i] for i in indices], spec, n, k, layout, bucket, device)):
        if isinstance(result, KernelBuildError):
            record.trials[index].failed = str(result)
        else:
            built.append((index, result))
    return built


def shortlist(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str, device,
              top_k: int = TOP_K) -> list[Candidate]:
    """The candidates `tune` builds and times for this kernel on `device` (best modeled first): what a kit
    prebuilds for tuning on a device that cannot build."""
    record, candidates, order = _considered(spec, n, k, bucket, layout, device, top_k)
    return [candidates[i] for i in _shortlist(record.trials, order, top_k)]


def choose(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str, device, kernels: list,
           profile: bool = True) -> Tuned:
    """The fastest of compiled kernels for one spec and shape (e.g. prebuilt candidates) timed on the present
    device, or the cost model's pick among them where the device is absent or profiling is off."""
    start = time.perf_counter()
    if not kernels:
        raise ValueError("kernels must hold at least one compiled kernel to choose from")
    record = _record(spec, n, k, bucket, device)
    record.trials = [Trial(kernel.template, kernel.config,
                           estimate(kernel.template, kernel.config, spec, n, k, record.tuned_m, device).seconds)
                     for kernel in kernels]
    record.notes.append(f"chosen among {len(kernels)} prebuilt candidates")
    if profile and is_present(device):
        kernel = _fastest(record, list(range(len(kernels))), kernels, spec, n, k, layout, device)
    else:
        record.chosen = _ranked(record.trials)[0]
        record.notes.append(_model_note(device))
        kernel = kernels[record.chosen]
    return _done(kernel, record, start)


def build_pinned(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str, device, template: str,
                 fields: dict) -> Tuned:
    """The kernel of one configuration of `template` (`fields` as cache keys name it), built without tuning; its
    record holds that one trial."""
    start = time.perf_counter()
    config = template_named(template).config_from_dict(fields)
    record = _record(spec, n, k, bucket, device)
    record.trials = [Trial(template, config, estimate(template, config, spec, n, k, record.tuned_m, device).seconds)]
    record.notes.append("a pinned configuration, not tuned")
    kernel = build_all([Candidate(template, config)], spec, n, k, layout, bucket, device)[0]
    if isinstance(kernel, KernelBuildError):
        raise kernel
    record.trials[0].build_s = getattr(kernel, "build_seconds", None)
    return _done(kernel, record, start)


def _record(spec: Matmul, n: int, k: int, bucket: tuple[int, int], device) -> TuningRecord:
    spec.check_shape(n, k)
    return TuningRecord(spec, n, k, bucket, TUNED_M.get(bucket, bucket[0]), device.key, device_hint(spec, k, device))


def _considered(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str, device, top_k: int):
    """(a record listing every candidate with its modeled time, the candidates, their indices best modeled
    first)."""
    if not 1 <= top_k <= 8:
        raise ValueError(f"top_k={top_k} is out of range; accepted: 1..8")
    record = _record(spec, n, k, bucket, device)
    _, candidates = enumerate_candidates(spec, n, k, bucket, layout, device)
    _, unused = usable_templates(spec, n, k, bucket, layout, device)
    if not candidates:
        reasons = "; ".join(f"{name}: {why}" for name, why in unused.items())
        raise ValueError(f"no kernel configuration builds {spec} for a [{n}, {k}] weight on {device.key} "
                         f"(templates not used: {reasons})")
    record.trials = [Trial(c.template, c.config, estimate(c.template, c.config, spec, n, k, record.tuned_m,
                                                          device).seconds) for c in candidates]
    record.notes += [f"{name} template not used: {reason}" for name, reason in unused.items()]
    return record, candidates, _ranked(record.trials)


def _fastest(record: TuningRecord, indices: list[int], kernels: list, spec: Matmul, n: int, k: int, layout: str,
             device):
    """Time `kernels` (record.trials[indices]) on the device, note each one's time, choose the fastest (times
    within TIE of it are ties, broken by the model) and return its kernel."""
    x, copies, bias = inputs(spec, n, k, record.tuned_m, layout, device)
    extras = stage_inputs(spec, n, k, record.tuned_m, device)
    timed = [functools.partial(kernel, **extras) for kernel in kernels] if extras else kernels
    seconds_each = time_kernels(timed, x, copies, bias, sampler=SAMPLERS[device.kind])
    for i, kernel, seconds in zip(indices, kernels, seconds_each):
        record.trials[i].measured_s = seconds
        record.trials[i].build_s = getattr(kernel, "build_seconds", None)
    fastest = min(record.trials[i].measured_s for i in indices)
    ties = [i for i in indices if record.trials[i].measured_s <= fastest * (1 + TIE)]
    order = _ranked(record.trials)
    record.chosen = min(ties, key=order.index)
    record.profiled = True
    return kernels[indices.index(record.chosen)]


def _model_note(device) -> str:
    return ("chosen by the cost model alone: the target device is not present" if not is_present(device)
            else "chosen by the cost model alone (profiling off)")


def _done(kernel, record: TuningRecord, start: float) -> Tuned:
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
    """The candidate identical to trials[index] but for prefetch=0, if its template has the knob."""
    config = trials[index].config
    if "prefetch" not in {field.name for field in dataclasses.fields(config)} or not config.prefetch:
        return None
    twin = dataclasses.replace(config, prefetch=0)
    return next((i for i, trial in enumerate(trials)
                 if trial.template == trials[index].template and trial.config == twin), None)


def _shape(trial: Trial) -> tuple:
    """What distinguishes candidates beyond the model's ties: the template and its configuration's shape fields
    (tile counts, register rows, prefetch depth, decode, where the activation planes are built)."""
    return (trial.template, *(getattr(trial.config, name) for name in template_named(trial.template).shape_fields))


def is_present(device) -> bool:
    """Whether kernels for `device` can run in this process (so candidates can be timed)."""
    if device.kind == "cpu":
        from .device import host_cpu

        return device.runs_here() and device.cores == host_cpu().cores
    import torch

    if not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return device.arch == f"sm_{props.major}{props.minor}"
