"""Why bitkern's M=1 int4 kernels trail llama.cpp's Q4_0 in generation on this machine: the inner loop's compute
ceiling per core (benchmarks/decode_ceiling.c: weights in L1, no memory stalls) against each core's share of the
DRAM read bandwidth.  A kernel overlaps its loads with its arithmetic only when the arithmetic alone runs well
above the bytes' arrival rate; at a ceiling near it, the kernel pays for both.

Variants (see the C file): bitkern's bf16 dot (vdpbf16ps on decoded nibbles), llama.cpp's int8 VNNI (activations
quantized to int8 per 32 k; vpdpbusd), and VNNI on two int8 parts of the activations (~15 bits per block).  Beside
them, bitkern's whole tuned M=1 kernel (the Llama MLP's gate/up shape, 11264x2048 int4 g128, all threads), with bf16
activations and with int8 ones (activation_quant="int8", the VNNI template), its weight resident in the last-level
cache (hot: its own compute rate) and rotating through DRAM (cold), interleaved with the DRAM probes, per core.

Run: python benchmarks/decode_ceiling.py [--rounds 7] (needs a C compiler; cc -O2 -march=native).  Prints the
table and writes benchmarks/results/decode_ceiling.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from conftest import best_read_gbs, interleaved, read_probes, rotation
from provenance import header

SOURCE = Path(__file__).with_suffix(".c")
RESULTS = Path(__file__).parent / "results" / "decode_ceiling.md"
SHAPE = (11264, 2048)  # N x K: the gate/up GEMM of benchmarks/llama_cpp.py's model
VARIANTS = {"bf16_dot": "bf16 dot (bitkern's direct kernel)", "int8_vnni": "int8 VNNI (llama.cpp Q4_0 x Q8_0)",
            "int8x2_vnni": "int8 VNNI, two activation parts"}


def ceilings(rounds: int) -> dict[str, list[float]]:
    """int4 weights per second of each variant, per round (one process, one thread)."""
    compiler = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as directory:
        binary = Path(directory) / "decode_ceiling"
        subprocess.run([compiler, "-O2", "-march=native", "-o", str(binary), str(SOURCE)], check=True)
        lines = subprocess.run([str(binary), "20000", str(rounds)], check=True, capture_output=True,
                               text=True).stdout.splitlines()
    records = [json.loads(line) for line in lines]
    return {name: [record[name] for record in records] for name in VARIANTS}


def kernel_rates(rounds: int, activation_quant: str) -> dict[str, float]:
    """GB/s per core of bitkern's tuned M=1 int4 kernel on SHAPE (activations quantized by `activation_quant`), hot
    (one weight, cache-resident) and cold (weights rotating through DRAM), and of the faster DRAM probe, medians of
    interleaved rounds; and the template the tuner picked."""
    import copy

    import bitkern
    from bitkern.cache import kernel_for

    n, k = SHAPE
    layer = bitkern.Linear(k, n, bias=False, dtype="int4", group_size=128, compute_dtype=torch.bfloat16,
                           activation_quant=activation_quant)
    x = torch.randn(1, k, dtype=torch.bfloat16)
    probes, nbytes = read_probes()
    with torch.inference_mode():
        layer(x)  # tuned (or loaded) before timing
        copies = rotation(lambda: copy.deepcopy(layer), layer.nbytes)
        medians = interleaved({"hot": lambda: layer(x), "cold": lambda: copies()(x), **probes}, rounds=rounds)
    cores = torch.get_num_threads()
    probe = [min(values) for values in zip(*(medians[name] for name in probes))]
    spec = bitkern.ops.Matmul.for_weight(layer.quantized_weight(), "bfloat16", activation_quant=activation_quant)
    return {"hot": layer.nbytes / statistics.median(medians["hot"]) / 1e9 / cores,
            "cold": layer.nbytes / statistics.median(medians["cold"]) / 1e9 / cores,
            "dram": nbytes / statistics.median(probe) / 1e9 / cores,
            "template": kernel_for(spec, n, k, 1, "tile16").template}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    probes, nbytes = read_probes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    one_core = best_read_gbs(probes, nbytes)
    torch.set_num_threads(threads)
    all_cores = best_read_gbs(probes, nbytes)
    share = all_cores / threads
    speeds = ceilings(args.rounds)
    kernels = {quant: kernel_rates(args.rounds, quant) for quant in ("none", "int8")}
    rows = []
    for name, title in VARIANTS.items():
        weights = statistics.median(speeds[name])
        gbs = weights / 2 / 1e9  # int4: two weights per byte
        rows.append(f"| {title} | {weights / 1e9:.1f} | {gbs:.1f} | {gbs / share:.2f} | {gbs / one_core:.2f} |")
    text = "\n".join([
        header(),
        "",
        f"{threads} threads; DRAM read, best "
        f"of the streaming probes: {all_cores:.1f} GB/s with all threads ({share:.1f} GB/s per core), "
        f"{one_core:.1f} GB/s with one.",
        "",
        "| inner loop (one core, weights in L1) | G int4 weights/s | GB/s of int4 | / per-core DRAM share | "
        "/ one core's DRAM read |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"bitkern's tuned M=1 kernel, {SHAPE[0]}x{SHAPE[1]} int4 g128, {threads} threads, interleaved with the "
        f"probes (GB/s per core; hot: its weight cache-resident, its compute rate; cold: from DRAM):",
        "",
        "| activations | template | hot | cold | probe | cold / probe | hot / probe |",
        "|---|---|---|---|---|---|---|",
        *[f"| {'bf16' if quant == 'none' else 'int8 (activation_quant)'} | {k['template']} | {k['hot']:.1f} | "
          f"{k['cold']:.1f} | {k['dram']:.1f} | {k['cold'] / k['dram']:.2f} | {k['hot'] / k['dram']:.2f} |"
          for quant, k in kernels.items()],
        "",
    ])
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
