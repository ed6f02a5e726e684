"""The GPU benchmark of the kit (`OUT/run` runs it after tuning the kernels on the device): bitkern's int4 g128
kernels on the Llama-3-8B/70B layer shapes (`bitkern.gpukit.matrix.BENCH_SHAPES`) at M in {1, 16, 64, 256, 4096}
against cuBLAS fp16 and bf16 (torch.matmul on the dequantized weight), torch's int4 tinygemm
(torch._weight_int4pack_mm, bf16) and gemlite (A16W4, fp16); nf4, int8 and int2 at M=1.  Every system's call is
captured in a CUDA graph and timed as the graph's replay: medians of triton.testing.do_bench (CUDA events, the L2
cache flushed before each run, so weights come from HBM), so the times are the GPU's and not the host's Python
dispatch (the first H100 run timed eager calls and measured bitkern's and gemlite's dispatch at small shapes);
bitkern's eager call is timed too ("eager ms": what a call outside a graph costs).  The report gives each peer's
speed-up over cuBLAS fp16 and bitkern's fraction of the HBM bandwidth that a device-to-device copy reaches in the
same run.  Writes bench.json and bench.md.

Standalone, on a GPU machine with the kit's cache imported: python benchmarks/bench_gpu.py RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import bitkern
from bitkern.gpukit.matrix import BENCH_GROUP, BENCH_SHAPES, BENCH_TYPE, bench_specs

sys.path.insert(0, str(Path(__file__).parent))  # the kit loads this file by its path; provenance.py is beside it
from provenance import header  # noqa: E402

WARMUP_MS, REP_MS = 10, 50
COPY_BYTES = 1 << 30
PEERS = ("cublas_fp16", "cublas_bf16", "tinygemm", "gemlite")


def median_seconds(call) -> float:
    from triton.testing import do_bench

    return do_bench(call, warmup=WARMUP_MS, rep=REP_MS, return_mode="median") / 1e3


def graph_seconds(call, errors: dict, name: str) -> float:
    """Median seconds of `call` captured in a CUDA graph and replayed (after one eager warm-up call); where
    capture fails, the eager call's time, the failure noted under `name`."""
    call()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
    except Exception as error:  # a system that cannot be captured is timed eagerly, and the report says so
        errors.setdefault(f"{name} (timed eagerly)", repr(error)[:300])
        torch.cuda.synchronize()
        return median_seconds(call)
    seconds = median_seconds(graph.replay)
    del graph
    return seconds


def copy_bandwidth() -> float:
    """Bytes per second a device-to-device copy moves (read plus written)."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * COPY_BYTES / median_seconds(lambda: target.copy_(source))


def _bitkern(spec, weight: torch.Tensor):
    """(packed weight, the weight bitkern computes with as fp16) of a float [N, K] CUDA weight."""
    quantized = bitkern.quantize(weight, spec.weight_dtype, group_size=spec.group_size, zero_mode=spec.zero_mode,
                                 scale_dtype=torch.float16)
    return bitkern.pack(quantized), quantized.dequantize(torch.float16)


def _peers(weight16: torch.Tensor, errors: dict, every: bool) -> dict:
    """{peer: call(x16, x_bf16)} for one [N, K] weight: cuBLAS fp16, and with `every` cuBLAS bf16, tinygemm and
    gemlite (random 4-bit codes for these two: their times do not depend on the values); a peer that cannot be set
    up is left out, its error noted once."""
    n, k = weight16.shape
    peers = {"cublas_fp16": lambda x16, xbf: torch.matmul(x16, weight16.t())}
    if not every:
        return peers
    weight_bf16 = weight16.bfloat16()
    peers["cublas_bf16"] = lambda x16, xbf: torch.matmul(xbf, weight_bf16.t())
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    try:
        packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(), 8)
        scale_zero = torch.zeros(k // BENCH_GROUP, n, 2, dtype=torch.bfloat16, device="cuda")
        scale_zero[..., 0] = 0.01
        peers["tinygemm"] = lambda x16, xbf: torch._weight_int4pack_mm(xbf, packed, BENCH_GROUP, scale_zero)
    except Exception as error:  # a torch build without it: noted, the benchmark goes on
        errors.setdefault("tinygemm (not measured)", repr(error)[:300])
    try:
        from gemlite.helper import A16Wn

        scales = torch.full((n, k // BENCH_GROUP), 0.01, dtype=torch.float16, device="cuda")
        layer = A16Wn(device="cuda", dtype=torch.float16).from_weights(codes, scales, torch.full_like(scales, 8), 4,
                                                                        BENCH_GROUP)
        peers["gemlite"] = lambda x16, xbf: layer(x16)
    except Exception as error:  # gemlite missing or failing on this machine: noted
        errors.setdefault("gemlite (not measured)", repr(error)[:300])
    return peers


def run(results: Path, budget_s: float = 150.0) -> tuple[str, str]:
    """Run the benchmark within about `budget_s` seconds; write bench.json and bench.md into `results`; return
    (status, one line)."""
    deadline = time.monotonic() + budget_s
    bandwidth = copy_bandwidth()
    rows, errors, left = [], {}, []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for spec, m_values in bench_specs():
        for n, k in BENCH_SHAPES:
            if time.monotonic() > deadline:
                left.append(f"{spec.weight_dtype} {n}x{k}")
                continue
            weight16 = (torch.randn(n, k, device="cuda", generator=generator) * 0.02).half()
            packed, dequantized = _bitkern(spec, weight16.float())
            peers = _peers(weight16, errors, every=spec.weight_dtype == BENCH_TYPE)
            for m in m_values:
                x16 = torch.randn(m, k, device="cuda", generator=generator).half()
                xbf = x16.bfloat16()
                row = {"type": spec.weight_dtype, "n": n, "k": k, "m": m,
                       "bitkern_s": graph_seconds(lambda: spec(x16, packed), errors, "bitkern"),
                       "bitkern_eager_s": median_seconds(lambda: spec(x16, packed)),
                       "bytes": _bytes(packed, m, n, k), "error": _error(spec(x16, packed), x16, dequantized)}
                for peer, call in peers.items():
                    row[f"{peer}_s"] = graph_seconds(lambda: call(x16, xbf), errors, peer)
                rows.append(row)
            del weight16, packed, dequantized, peers
    for row in rows:
        row["hbm_fraction"] = row["bytes"] / row["bitkern_s"] / bandwidth
        for peer in PEERS:
            if f"{peer}_s" in row:
                row[f"speedup_vs_{peer}"] = row[f"{peer}_s"] / row["bitkern_s"]
    report = {"header": header(), "device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_per_s": bandwidth,
              "rows": rows, "peer_errors": errors, "left_out_of_time": left}
    (results / "bench.json").write_text(json.dumps(report, indent=1))
    (results / "bench.md").write_text(_markdown(report))
    worst = max((row["error"] for row in rows), default=0.0)
    status = "passed" if rows and not left and worst < 1e-2 else "failed"
    return status, (f"{len(rows)} rows, copy bandwidth {bandwidth / 1e12:.2f} TB/s, largest relative error "
                    f"{worst:.1e}" + (f"; left out of time: {', '.join(left)}" if left else "") +
                    "".join(f"; {peer}: {error}" for peer, error in errors.items()))


def _bytes(packed, m: int, n: int, k: int) -> int:
    """The fewest bytes a call moves: the packed weight's tensors, x and y (fp16)."""
    return sum(t.nbytes for t in packed.tensors() if t is not None) + 2 * m * k + 2 * m * n


def _error(y: torch.Tensor, x16: torch.Tensor, dequantized: torch.Tensor) -> float:
    """‖y − x·Wᵀ‖ / ‖x·Wᵀ‖ against float32 math on the same dequantized weight."""
    reference = x16.float() @ dequantized.float().t()
    return float((y.float() - reference).norm() / reference.norm())


def _markdown(report: dict) -> str:
    bandwidth = report["copy_bandwidth_bytes_per_s"]
    lines = [report["header"], "", f"## Benchmark on {report['device']}", "",
             f"Device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written). Times: medians of CUDA-graph "
             f"replays of one call, L2 flushed per run; eager ms: bitkern's call outside a graph. Speed-up: the "
             f"peer's time over bitkern's (>1: bitkern faster).", "",
             "| type | N x K | M | bitkern ms | eager ms | HBM fraction | vs cuBLAS fp16 | vs cuBLAS bf16 | "
             "vs tinygemm | vs gemlite | cuBLAS fp16 ms | rel. error |", "|---" * 12 + "|"]
    for row in report["rows"]:
        ratios = [f"{row[f'speedup_vs_{peer}']:.2f}x" if f"speedup_vs_{peer}" in row else "-" for peer in PEERS]
        lines.append(f"| {row['type']} | {row['n']}x{row['k']} | {row['m']} | {row['bitkern_s'] * 1e3:.4f} | "
                     f"{row['bitkern_eager_s'] * 1e3:.4f} | {row['hbm_fraction']:.2f} | {' | '.join(ratios)} | "
                     f"{row['cublas_fp16_s'] * 1e3:.4f} | {row['error']:.1e} |")
    for peer, error in report["peer_errors"].items():
        lines.append(f"\n{peer}: {error}")
    if report["left_out_of_time"]:
        lines.append(f"\nLeft out of time: {', '.join(report['left_out_of_time'])}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    directory.mkdir(parents=True, exist_ok=True)
    print(run(directory))
