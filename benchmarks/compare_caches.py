"""Time the stored kernels of two kernel caches for one (weight type, activation, M) at N x K, in one process,
interleaved round by round: a same-run comparison of two versions of the code (each prebuilt its kernels into
its own cache; a process can import one bitkern, but it can load any number of stored kernel libraries).

    git archive BASE | tar -x -C /tmp/base
    for tree in /tmp/base $PWD; do (cd /tmp && PYTHONPATH=$tree BITKERN_TUNING=model python -m bitkern prebuild \\
        --shapes 4096:4096 --dtype int4 --activation bfloat16 --m 1,16,128 --cache-dir $tree.cache); done
    python benchmarks/compare_caches.py int4 bfloat16 1 /tmp/base.cache $PWD.cache

Prints each kernel's template and median time (raw launches, no Python wrapper) and the ratio B/A.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import bitkern
from bitkern.cache.private import load_library
from bitkern.codegen.cpu.layout import aligned
from bitkern.tuner import m_bucket


def stored_kernel(cache: Path, weight: str, activation: str, m: int, n: int, k: int):
    """(function, constants, template, config) of the entry serving the case, from any version directory."""
    from safetensors.torch import load

    for manifest_path in sorted(cache.glob("*/*/*/manifest.json")):
        manifest = json.loads(manifest_path.read_text())
        key = manifest["key"]
        if (key["spec"]["weight_dtype"], key["spec"]["activation_dtype"], tuple(key["bucket"]), key["n"], key["k"],
                key["spec"]["bias"]) == (weight, activation, m_bucket(m), n, k, False):
            files = {path.name: path.read_bytes() for path in manifest_path.parent.iterdir()}
            tables = load(files["constants.safetensors"]) if "constants.safetensors" in files else {}
            constants = [aligned(tables[f"c{i}"]) for i in range(len(tables))]
            return load_library(files["kernel.so"]), constants, manifest["template"], manifest["config"]
    raise SystemExit(f"{cache} has no kernel for {weight} x {activation} activations, M={m}, {n}x{k}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weight")
    parser.add_argument("activation")
    parser.add_argument("m", type=int)
    parser.add_argument("cache_a", type=Path)
    parser.add_argument("cache_b", type=Path)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    packed = bitkern.pack(bitkern.quantize(torch.randn(args.n, args.k), args.weight))
    x = torch.randn(args.m, args.k).to(getattr(torch, args.activation))
    y = torch.empty(args.m, args.n, dtype=x.dtype)
    kernels = [stored_kernel(cache, args.weight, args.activation, args.m, args.n, args.k)
               for cache in (args.cache_a, args.cache_b)]
    calls = max(3, int(0.05 / (1e-4 * args.m)))  # ~50 ms of work per round at ~100 us per row
    times: list[list[float]] = [[], []]
    for round_ in range(args.rounds + 1):
        for index, (function, constants, _, _) in enumerate(kernels):
            start = time.perf_counter()
            for _ in range(calls):
                function(x, *packed.kernel_arguments(), *constants, y)
            if round_:  # the first round warms up
                times[index].append((time.perf_counter() - start) / calls * 1e6)
    a, b = (statistics.median(t) for t in times)
    print(f"{args.weight} x {args.activation} M={args.m} {args.n}x{args.k}: A {kernels[0][2]} {a:.0f} us, "
          f"B {kernels[1][2]} {b:.0f} us, B/A {b / a:.3f}   A {kernels[0][3]}   B {kernels[1][3]}")


if __name__ == "__main__":
    main()
