"""Offline prebuild: compile every kernel a model needs before it runs, for a target that need not be here.

The distinct Linear shapes come from a Hugging Face config.json (hidden size, intermediate size, heads,
key/value heads, head dim) or an explicit list; repeated layers share their shapes, so a 32-layer model
costs what one layer costs (Welder's subgraph-signature cache).  Each shape is built for the M buckets of
the rows the caller expects.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from tqdm import tqdm

from ..codegen import layout_for
from ..ops.matmul import Matmul
from ..ttype import get
from ..tuner.buckets import m_bucket
from ..tuner.device import device_for
from .disk import DiskStore
from .lookup import kernel_for

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


def prebuild(shapes: list[LinearShape], dtype: str = "int4", group_size: int = 128, target: str = "cpu",
             rows=DEFAULT_ROWS, activation_dtype: str = "bfloat16", zero_mode: str | None = None,
             scale_dtype: str = "float16", store: DiskStore | None = None, progress: bool = True) -> PrebuildReport:
    """Compile (or find in the store) the kernel of every shape for every M bucket of `rows`."""
    from ..ttype.quantize import default_zero_mode

    ttype = get(dtype)
    device = device_for(target)
    if device.kind == "cuda":
        from ..codegen.cuda.layout import check_type

        check_type(ttype)
    layout = layout_for(ttype, device.kind)
    store = store or DiskStore()
    problem = store.problem()
    if problem:  # kernels would be built in memory only: nothing prebuilt
        raise ValueError(f"the kernel cache {store.root} {problem}; prebuild stores kernels there (choose another "
                         f"with --cache-dir or BITKERN_CACHE_DIR)")
    zero_mode = default_zero_mode(ttype) if zero_mode is None else zero_mode
    group = ttype.block_size if ttype.block_size > 1 else group_size
    buckets = sorted({m_bucket(m) for m in rows})
    jobs = [(shape, bucket) for shape in shapes for bucket in buckets]
    before = {entry["directory"] for entry in store.entries()}
    start = time.perf_counter()
    for shape, bucket in tqdm(jobs, desc=f"prebuild {dtype} for {target}", disable=not progress):
        spec = Matmul(ttype.name, activation_dtype, group_size=group, zero_mode=zero_mode, scale_dtype=scale_dtype)
        spec.check_shape(shape.out_features, shape.in_features)
        kernel_for(spec, shape.out_features, shape.in_features, bucket[0], layout, device, store)
    built = len({entry["directory"] for entry in store.entries()} - before)
    return PrebuildReport(len(jobs), built, time.perf_counter() - start, target)
