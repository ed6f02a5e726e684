"""The kit's check of itself, without a GPU: every kernel it lists is in its store and loads without TVM, and every
launch, its arguments packed from host tensors as a call on the device packs them, matches the kernel's cubin (the
kernel's name, its parameters' offsets and sizes, the launch limits).  `OUT/run --dry-run` checks every
architecture of the kit; the device run checks the GPU's before it starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache import DiskStore, KernelKey, KernelNotFound
from ..cache.dispatch import rehearsal
from ..codegen.cuda.launcher import check_launches, cubin_kernels
from ..ttype import torch_dtype
from ..tuner import TUNED_M, choose, cuda_device
from ..tuner.profile import random_packed

PINNED_ROWS = (1, 129)  # rows a pinned kernel's launches are checked for (one block, several)


@dataclass
class CheckReport:
    """What the check found: kernels loaded, launches packed and checked, and every problem (none: the kit is
    whole)."""

    kernels: int = 0
    launches: int = 0
    problems: list[str] = field(default_factory=list)


def check(kit: dict, store: DiskStore, archs, kit_dir: Path) -> CheckReport:
    """Check the kernels of `kit` (its kit.json) for `archs` in `store` (the kit's bundle imported), and the decode
    cubins in `kit_dir`."""
    report = CheckReport()
    generator = torch.Generator().manual_seed(0)
    failed = {_canonical(item["key"]): item for item in kit.get("failed", [])}  # kernels the build could not make
    for item in kit["kernels"]:
        key = KernelKey.from_dict(item["key"])
        if key.target.split("-", 1)[1] not in archs:
            continue
        if _canonical(item["key"]) in failed:
            report.problems.append(f"{key.describe()}: did not build ({failed.pop(_canonical(item['key']))['error']})")
            continue
        try:
            kernels, launches = _check_item(item, key, cuda_device(key.target.split("-", 1)[1]), store, generator)
            report.kernels += kernels
            report.launches += launches
        except Exception as error:  # every kind of damage is reported, with the kernel it hit
            report.problems.append(f"{key.describe()}: {type(error).__name__}: {error}")
    report.problems += [f"{KernelKey.from_dict(item['key']).describe()}: did not build ({item['error']})"
                        for item in failed.values() if item["key"]["target"].split("-", 1)[1] in archs]
    for arch in archs:
        path = kit_dir / kit["decode"][arch]
        try:
            if not [name for name in cubin_kernels(path.read_bytes()) if name.startswith("run_")]:
                report.problems.append(f"{path} holds no decode kernels")
        except (OSError, ValueError) as error:
            report.problems.append(f"decode cubin {path}: {error}")
    return report


def _canonical(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


def _check_item(item: dict, key: KernelKey, device, store: DiskStore, generator) -> tuple[int, int]:
    """(kernels loaded, launches checked) of one listed kernel: a pinned one, a tuned one (through the dispatch's
    rehearsal: the lookup a call on the device makes) or a set of tuning candidates (which the tuner can rank)."""
    if item["kind"] in ("tuned", "pinned"):
        kernel = store.load(key)
        if kernel is None:
            raise KernelNotFound("not in the kit's bundle")
        if item["kind"] == "tuned":  # the call a GPU test makes, through the dispatch
            x, weight, bias, extra = _inputs(key, TUNED_M.get(key.bucket, key.bucket[0]), generator)
            with rehearsal(device, store) as launches:
                if key.spec.experts:
                    key.spec(x, weight, extra["indices"], bias)
                else:
                    key.spec(x, weight, bias, extra.get("residual"))
            return 1, len(launches)
        return 1, sum(_check_plan(kernel, _inputs(key, m, generator), device) for m in PINNED_ROWS)
    kernels = [kernel for _, kernel in store.pinned(key)]
    if len(kernels) < item["candidates"]:
        raise KernelNotFound(f"{len(kernels)} tuning candidates in the kit's bundle, {item['candidates']} listed")
    inputs = _inputs(key, TUNED_M.get(key.bucket, key.bucket[0]), generator)
    launches = sum(_check_plan(kernel, inputs, device) for kernel in kernels)
    choose(key.spec, key.n, key.k, key.bucket, key.layout, device, kernels, profile=False)
    return len(kernels), launches


def _check_plan(kernel, inputs, device) -> int:
    x, weight, bias, extra = inputs
    _, calls = kernel.plan(x, weight, bias, **extra)
    check_launches(kernel.binary.cubin, calls, device.shared_bytes_per_block)
    return len(calls)


def _inputs(key: KernelKey, m: int, generator):
    """Host tensors of a call with M rows: x, a weight in the key's layout with random codes (a grouped spec's
    experts stacked), the bias, and {"residual": ...} for a residual spec or {"indices": ...} (each row to top_k
    experts) for a grouped one."""
    spec = key.spec
    experts = spec.experts or 1
    x = torch.randn(m, key.k, generator=generator)
    x = x.mul(16).round().clamp(-127, 127).to(torch.int8) if spec.activation_dtype == "int8" else \
        x.to(torch_dtype(spec.activation_dtype))
    bias = torch.randn(*([spec.experts] if spec.experts else []), key.n, generator=generator) if spec.bias else None
    extra = {}
    if spec.residual:
        extra["residual"] = torch.randn(m, spec.out_features(key.n), generator=generator).to(
            torch_dtype(spec.output_dtype))
    if spec.experts:
        extra["indices"] = torch.randint(0, spec.experts, (m, spec.top_k), generator=generator)
    return x, random_packed(spec, experts * key.n, key.k, key.layout, generator), bias, extra
