"""bitkern's CPU kernels at one instruction-set level against the machine's DRAM limit and torch, in one run.

For each weight type and shape the tuner picks (by timing) the kernel for rows M at the level given, the way a
process with BITKERN_CPU_LEVEL set would; weights rotate through >= 1 GiB of copies so every call reads them from
DRAM.  Cases take turns round by round with the DRAM probes (torch.sum and a streaming TVM reader) and torch's bf16
matmul; each figure is a median over rounds, each ratio the median of per-round ratios.  On a CPU above the level
(an AVX-512 machine measuring its AVX2 kernels) the figures are those of the lower level's code on this CPU.

With --level the process restarts held to that level (benchmarks/torch_level.py), torch's bf16 baseline included:
the figures an AVX2-only CPU's torch would give, not this CPU's AVX512-BF16 ones.  With --llama-cpp the same case
also runs on llama.cpp's CPU backend built for the level (benchmarks/ggml_mul_mat.c; its nearest ggml type in
LLAMA_CPP_TYPES, weights repacked where ggml repacks them), in a process of its own that runs one call per request,
so that its calls take turns with bitkern's within every round: its ratio is the median of per-round ratios, as
torch's (this VM's compute speed moved 2.7x within a minute).

Run: python benchmarks/cpu_levels.py --level x86-64-v3 [--rows 1] [--activation-quant int8] [--types int4 nf4 ...]
     [--shapes 4096x4096 14336x4096 4096x14336] [--llama-cpp] [--out benchmarks/results/cpu_levels_x86-64-v3.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import subprocess
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
if __name__ == "__main__":
    from torch_level import run_at

    _early = argparse.ArgumentParser(add_help=False)
    _early.add_argument("--level")
    run_at(_early.parse_known_args()[0].level)

import torch  # noqa: E402

os.environ.setdefault("BITKERN_TUNING", "profile")

import bitkern  # noqa: E402
from bitkern.cache import kernel_for  # noqa: E402
from bitkern.ops import Matmul  # noqa: E402
from bitkern.codegen.cpu import isa  # noqa: E402
from bitkern.tuner import host_cpu  # noqa: E402
from conftest import ReportedSeconds, interleaved, read_probes, rotation, round_ratio  # noqa: E402
from provenance import header, publish  # noqa: E402

GROUPS = {"mxfp4": 32}  # block-scaled types have their own block; the others use --group
# bitkern type -> the ggml type llama.cpp users pick for it (block 32 int4 with scale, 4-bit non-linear code book,
# int8, OCP MXFP4, 2-bit k-quant)
LLAMA_CPP_TYPES = {"int4": "q4_0", "nf4": "iq4_nl", "int8": "q8_0", "mxfp4": "mxfp4", "int2": "q2_K"}


def _case(dtype: str, n: int, k: int, m: int, group: int, activation_quant: str, device):
    """(call, call on one weight copy (in cache after the first call), weight bytes per call, template chosen) of a
    bitkern kernel with rotating weights."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    quantized = bitkern.quantize(weight, dtype, group_size=GROUPS.get(dtype, group))
    packed = bitkern.pack(quantized)
    spec = Matmul.for_weight(quantized, "bfloat16", activation_quant=activation_quant)
    kernel = kernel_for(spec, n, k, m, packed.layout, device)
    next_weight = rotation(lambda: packed.from_format(packed.format, *(None if t is None else t.clone()
                                                                       for t in packed.tensors())), packed.nbytes)
    x = torch.randn(m, k).bfloat16()
    return (lambda: kernel(x, next_weight())), (lambda: kernel(x, packed)), packed.nbytes, kernel.template


def _torch_bf16(n: int, k: int, m: int):
    next_weight = rotation(lambda: torch.randn(n, k).bfloat16(), n * k * 2)
    x = torch.randn(m, k).bfloat16()
    return lambda: x @ next_weight().T


class LlamaCppMatmul:
    """llama.cpp's MUL_MAT for the ggml type of `dtype`, served one call at a time by benchmarks/ggml_mul_mat.c in
    a process of its own (ROUNDS 0): each call returns the seconds the harness measured, so `interleaved` counts
    them and the call takes its turn beside bitkern's.  The weights sit in the repacking buffer where ggml has a
    layout for the type and three calls there are faster, else in a plain one."""

    PAUSE_S = 0.005  # before each call: the calling process's OpenMP threads stop spinning and leave the cores

    def __init__(self, harness: Path, dtype: str, n: int, k: int, m: int, threads: int):
        servers, errors = {}, []
        for repack in (1, 0):
            command = [str(value) for value in (harness, LLAMA_CPP_TYPES[dtype], n, k, m, threads, 0, repack)]
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
            if process.stdout.readline().strip() == "ready":
                servers[repack] = process
            else:
                errors.append(process.communicate()[1][-300:])
        if not servers:
            raise RuntimeError(f"{harness} failed for {LLAMA_CPP_TYPES[dtype]}: {errors}")
        speeds = {repack: statistics.median(self._call(process) for _ in range(3))
                  for repack, process in servers.items()}
        fastest = min(speeds, key=speeds.get)
        for repack, process in servers.items():
            if repack != fastest:
                self._close(process)
        self.process = servers[fastest]

    def __call__(self) -> ReportedSeconds:
        return self._call(self.process)

    def close(self) -> None:
        self._close(self.process)

    def _call(self, process) -> ReportedSeconds:
        time.sleep(self.PAUSE_S)
        process.stdin.write("\n")
        process.stdin.flush()
        return ReportedSeconds(float(process.stdout.readline()) / 1e3)

    @staticmethod
    def _close(process) -> None:
        process.stdin.close()
        process.wait()


def measure(dtype: str, n: int, k: int, rows: int, group: int, activation_quant: str, device, probes: dict,
            probe_bytes: int, rounds: int, torch_call=None, llama_cpp=None) -> dict:
    """One case of the table: bitkern's kernel for `dtype` and [n, k] at `rows`, timed round by round with the DRAM
    probes (and `torch_call`, torch's bf16 matmul, and `llama_cpp`, a `LlamaCppMatmul`, where given; llama.cpp's
    calls right after bitkern's): {"template", "ms", "gbs", "fraction" (of the DRAM probe), "cached_ms", "times"
    (each call's seconds per round), "torch_ms", "torch_ratio" with torch, "llama_cpp_ms", "llama_cpp_ratio"
    (median of per-round ratios) with llama.cpp}."""
    call, cached, nbytes, template = _case(dtype, n, k, rows, group, activation_quant, device)
    calls = {"bitkern": call, **({"llama.cpp": llama_cpp} if llama_cpp else {}), "bitkern in cache": cached,
             **({"torch": torch_call} if torch_call else {}),
             **{f"probe {name}": probe for name, probe in probes.items()}}
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, values in interleaved(calls, rounds=1).items():
            times[name] += values
    probe_s = [min(values) for values in zip(*(times[f"probe {name}"] for name in probes))]
    ms = statistics.median(times["bitkern"]) * 1e3
    case = {"template": template, "ms": ms, "gbs": nbytes / ms / 1e6,
            "fraction": statistics.median((nbytes / b) / (probe_bytes / p) for p, b in zip(probe_s, times["bitkern"])),
            "cached_ms": statistics.median(times["bitkern in cache"]) * 1e3, "times": times}
    for name, key in (("torch", "torch"), ("llama.cpp", "llama_cpp")):
        if name in times:
            case.update({f"{key}_ms": statistics.median(times[name]) * 1e3,
                         f"{key}_ratio": round_ratio(times[name], times["bitkern"])})
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", default=None, help="an instruction-set level (default: the host's)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--types", nargs="+", default=["int4", "nf4", "int8", "mxfp4", "int2"])
    parser.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096", "4096x14336"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--activation-quant", default="none", help="none (bf16 activations) or int8 (W4A8, W8A8)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also time llama.cpp's MUL_MAT built for the level (its types: LLAMA_CPP_TYPES)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "bitkern-llamacpp",
                        help="where benchmarks/llama_cpp.py keeps llama.cpp's source and builds")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    harness = None
    if args.llama_cpp:
        from llama_cpp import matmul_harness

        harness = matmul_harness(args.cache_dir.expanduser(), args.level)

    device = host_cpu() if args.level is None else host_cpu().at_level(args.level)
    if not device.runs_here():
        parser.error(f"--level {args.level}: this CPU cannot run it")
    probes, probe_bytes = read_probes()
    host_level = isa.best_level(Path("/proc/cpuinfo").read_text().split()).name
    lines = [header(), "",
             f"# bitkern CPU kernels at {device.level.name}, M={args.rows}, activation_quant={args.activation_quant}",
             "",
             f"{host_cpu().name} ({platform.machine()}, host level {host_level}), "
             f"{device.cores} threads, torch {torch.__version__} (held to the level: "
             f"{'ONEDNN_MAX_CPU_ISA=' + os.environ['ONEDNN_MAX_CPU_ISA'] if args.level else 'no'})",
             "",
             "| type | N x K | kernel | ms | GB/s | of DRAM probe | ms, weights in cache | torch bf16 ms | "
             "torch bf16 / bitkern |" + (" llama.cpp type | llama.cpp ms | llama.cpp / bitkern |" if harness else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if harness else "")]
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        torch_call = _torch_bf16(n, k, args.rows)
        for dtype in args.types:
            llama_cpp = LlamaCppMatmul(harness, dtype, n, k, args.rows, device.cores) \
                if harness and dtype in LLAMA_CPP_TYPES else None
            case = measure(dtype, n, k, args.rows, args.group, args.activation_quant, device, probes, probe_bytes,
                           args.rounds, torch_call, llama_cpp)
            if llama_cpp:
                llama_cpp.close()
            lines.append(f"| {dtype} | {n}x{k} | {case['template']} | {case['ms']:.3f} | {case['gbs']:.1f} | "
                         f"{case['fraction']:.2f} | {case['cached_ms']:.3f} | {case['torch_ms']:.3f} | "
                         f"{case['torch_ratio']:.2f} |")
            if llama_cpp:
                lines[-1] += (f" {LLAMA_CPP_TYPES[dtype]} | {case['llama_cpp_ms']:.3f} | "
                              f"{case['llama_cpp_ratio']:.2f} |")
            elif harness:
                lines[-1] += " - | - | - |"
            print(lines[-1], flush=True)
            times = case["times"]
    probe_gbs = probe_bytes / min(min(times[f"probe {name}"]) for name in probes) / 1e9
    lines += ["", f"DRAM probe (last case's best round): {probe_gbs:.1f} GB/s; `of DRAM probe` is the median over "
                  f"rounds of (weight bytes / kernel time) / (probe bytes / probe time) in the same round.  `ms, "
                  f"weights in cache`: the same kernel on one weight copy, which stays in the last-level cache where it "
                  f"fits ({host_cpu().llc_bytes >> 20} MiB): the speed its instructions allow; a kernel whose time "
                  f"from DRAM is no longer than that is bound by instruction throughput, not memory."]
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
