"""Offline prebuild: compile every kernel a model needs before it runs, for a target that need not be here.

The distinct Linear shapes come from a Hugging Face config.json (hidden size, intermediate size, heads,
key/value heads, head dim) or an explicit list; repeated layers share their shapes, so a 32-layer model
costs what one layer costs (Welder's subgraph-signature cache).  Each shape is built for the M buckets of
the rows the caller expects.  Underneath, `prebuild_requests` builds any list of `Request`s (the tuner's choice,
a pinned configuration, or the tuner's shortlist as candidates for tuning where the device is), in parallel
worker processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from ..codegen import layout_for
from ..ops.matmul import Matmul
from ..ttype import get
from ..tuner.buckets import m_bucket
from ..tuner.device import device_for
from .disk import DiskStore
from .lookup import kernel_for, pinned_kernel

DEFAULT_ROWS = (1, 16, 128)


@dataclass(frozen=True)
class LinearShape:
    """A Linear layer's weight shape [out_features, in_features] and the projections that have it."""

    out_features: int
    in_features: int
    names: tuple[str, ...]


def shapes_from_config(path: str | os.PathLike) -> list[LinearShape]:
    """The distinct Linear shapes of a decoder-only transformer described by a Hugging Face config.json
    (Llama, Mistral, Qwen2 and the like: attention q/k/v/o and a gated MLP)."""
    with open(path) as file:
        config = json.load(file)
    required = ("hidden_size", "intermediate_size", "num_attention_heads")
    missing = [name for name in required if name not in config]
    if missing:
        raise ValueError(f"config {path} lacks {missing}; prebuild reads {list(required)} (and optionally "
                         f"num_key_value_heads, head_dim)")
    hidden, intermediate, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    projections = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
                   "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
                   "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                   "down_proj": (hidden, intermediate)}
    grouped: dict[tuple[int, int], list[str]] = {}
    for name, shape in projections.items():
        grouped.setdefault(shape, []).append(name)
    return [LinearShape(n, k, tuple(names)) for (n, k), names in grouped.items()]


def parse_shapes(text: str) -> list[LinearShape]:
    """Shapes from "N:K,N:K" (out_features:in_features)."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            n, k = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"shape {item!r} must be out_features:in_features, e.g. 4096:11008") from None
        shapes.append(LinearShape(n, k, (item,)))
    return shapes


@dataclass
class PrebuildReport:
    kernels: int
    built: int
    seconds: float
    target: str
    failed: list = field(default_factory=list)  # (request, error) of kernels that did not build (keep_going)


@dataclass(frozen=True)
class Request:
    """One kernel to prebuild for `target` (see `device_for`): the tuner's choice for rows in `bucket`; pinned to
    `template` with `config`; or, with `candidates` > 0, that many configurations of the tuner's shortlist stored
    pinned, for the device to time (`lookup` keeps the fastest as the tuned entry)."""

    spec: Matmul
    n: int
    k: int
    bucket: tuple[int, int]
    target: str
    template: str | None = None
    config: object = None
    candidates: int = 0


def prebuild(shapes: list[LinearShape], dtype: str = "int4", group_size: int = 128, target: str = "cpu",
             rows=DEFAULT_ROWS, activation_dtype: str = "bfloat16", zero_mode: str | None = None,
             scale_dtype: str = "float16", store: DiskStore | None = None, progress: bool = True) -> PrebuildReport:
    """Compile (or find in the store) the kernel of every shape for every M bucket of `rows`."""
    from ..ttype.quantize import default_zero_mode

    ttype = get(dtype)
    zero_mode = default_zero_mode(ttype) if zero_mode is None else zero_mode
    group = ttype.block_size if ttype.block_size > 1 else group_size
    spec = Matmul(ttype.name, activation_dtype, group_size=group, zero_mode=zero_mode, scale_dtype=scale_dtype)
    requests = kernel_requests([(spec, shape.out_features, shape.in_features) for shape in shapes], rows, target)
    return prebuild_requests(requests, store, progress=progress, description=f"prebuild {dtype} for {target}")


def kernel_requests(kernels, rows, target: str) -> list[Request]:
    """The requests of the kernels (Matmul spec, N, K) for every M bucket of `rows` on `target`; ValueError naming
    what does not fit (an unknown target, a type its kernels lack, a shape the spec cannot have) before anything
    is built."""
    if device_for(target).kind == "cuda":
        from ..codegen.cuda.layout import check_type

        for spec, _, _ in kernels:
            check_type(get(spec.weight_dtype))
    for spec, n, k in kernels:
        spec.check_shape(n, k)
    buckets = sorted({m_bucket(m) for m in rows})
    return [Request(spec, n, k, bucket, target) for spec, n, k in kernels for bucket in buckets]


def prebuild_requests(requests: list[Request], store: DiskStore | None = None, workers: int = 1,
                      progress: bool = True, description: str = "prebuild", keep_going: bool = False) -> PrebuildReport:
    """Compile (or find in the store) every requested kernel, in `workers` processes (TVM holds the interpreter
    while it lowers; nvcc runs beside it).  A kernel that fails to build raises, or with `keep_going` is listed in
    the report's `failed` and the others are built.  The report's target names the requests' targets."""
    store = store or DiskStore()
    problem = store.problem() or store.unwritable()
    if problem:  # kernels would be built in memory only: nothing prebuilt
        raise ValueError(f"the kernel cache {store.root} {problem}; prebuild stores kernels there (choose another "
                         f"with --cache-dir or BITKERN_CACHE_DIR)")
    start = time.perf_counter()
    jobs = [job for request in requests for job in _jobs(request)]
    before = {entry["directory"] for entry in store.entries()}
    if workers > 1 and len(jobs) > 1:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked TVM or torch threads
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            done = pool.map(_build, jobs, [store] * len(jobs), [keep_going] * len(jobs), chunksize=1)
            errors = list(tqdm(done, total=len(jobs), desc=description, disable=not progress))
    else:
        errors = [_build(job, store, keep_going) for job in tqdm(jobs, desc=description, disable=not progress)]
    built = len({entry["directory"] for entry in store.entries()} - before)
    targets = ",".join(dict.fromkeys(request.target for request in requests))
    failed = [(job, error) for job, error in zip(jobs, errors) if error is not None]
    return PrebuildReport(len(jobs), built, time.perf_counter() - start, targets, failed)


def _jobs(request: Request) -> list[Request]:
    """The kernels a request stands for: itself, or its shortlist's configurations, pinned."""
    if not request.candidates:
        return [request]
    from ..tuner import shortlist

    device = device_for(request.target)
    layout = layout_for(get(request.spec.weight_dtype), device.kind)
    return [Request(request.spec, request.n, request.k, request.bucket, request.target, candidate.template,
                    candidate.config)
            for candidate in shortlist(request.spec, request.n, request.k, request.bucket, layout, device,
                                       top_k=request.candidates)]


def _build(job: Request, store: DiskStore, keep_going: bool = False) -> str | None:
    """Find or build the kernel of a job (a request without candidates) in `store`; None, or with `keep_going` the
    error that stopped the build."""
    device = device_for(job.target)
    layout = layout_for(get(job.spec.weight_dtype), device.kind)
    try:
        if job.template is None:
            kernel_for(job.spec, job.n, job.k, job.bucket[0], layout, device, store)
        else:
            pinned_kernel(job.spec, job.n, job.k, job.bucket, layout, device, job.template, job.config, store)
    except Exception as error:  # any failure of the compiler stack is the job's: reported, the others go on
        if not keep_going:
            raise
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:500]
    return None
