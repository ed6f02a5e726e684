"""Fingerprints of what bitkern generates and decides, to show that a refactor changed neither.

For a fixed set of (spec, N, K, template, configuration) cases it prints, as JSON: a sha256 of each CPU kernel's
TIR, of its constants and of the assembly LLVM makes of it; a sha256 of each CUDA kernel's generated .cu source;
and for a fixed set of (spec, N, K, M bucket, device) cases the tuner's ranking by its cost model (the first
eight candidates and their modeled seconds) and the kernel `bitkern.cache.kernel_for` picks with
BITKERN_TUNING=model.  The devices are fixed descriptions (a Zen 4-like and a Sapphire Rapids-like CPU with a
fixed DRAM bandwidth, CUDA sm_80 and sm_90), so the output does not depend on the machine it runs on.

Run: BITKERN_CACHE_DIR=$(mktemp -d) python tools/fingerprints.py > fingerprints.json   (then diff two runs)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ["BITKERN_TUNING"] = "model"

import torch  # noqa: E402

from bitkern.ops import Conv2d, ConvGeometry, Matmul  # noqa: E402
from bitkern.tuner import device as device_module  # noqa: E402
from bitkern.codegen.cpu.isa import level  # noqa: E402
from bitkern.codegen.cpu.kernel import disassembly  # noqa: E402
from bitkern.tuner.device import CpuDevice, cuda_device  # noqa: E402

BANDWIDTH = 30e9  # bytes/s: the fixed devices' DRAM bandwidth (the host's would be measured)
ZEN4 = CpuDevice("fixed Zen 4", level("avx512-bf16"), 2, 32 << 10, 1 << 20, 32 << 20, 3.5e9)
SPR = CpuDevice("fixed Sapphire Rapids", level("amx"), 2, 48 << 10, 2 << 20, 105 << 20, 2.0e9)


# -- what this tree calls to generate, rank and pick (the only part a refactor edits) ------------------------
def cpu_program(spec, n, k, template, config, layout, bucket, device):
    """(TIR PrimFunc, constant tensors) of a CPU kernel."""
    from bitkern.codegen import template as template_named

    return template_named(template).program(spec, n, k, config, layout, bucket, device)


def cpu_kernel(spec, n, k, template, config, layout, bucket, device):
    from bitkern.codegen import build_kernel

    return build_kernel(spec, n, k, template, config, layout, bucket, device)


def cuda_source(spec, n, k, template, config, arch):
    from bitkern.codegen import template as template_named
    from bitkern.codegen.cuda.compile import lower

    return lower(template_named(template).functions(spec, n, k, config, arch), arch)[0]


def ranking(spec, n, k, bucket, layout, device):
    """[(template, config, modeled seconds)] in the tuner's order."""
    from bitkern.tuner.cost import estimate
    from bitkern.tuner.record import Trial
    from bitkern.tuner.select import _ranked
    from bitkern.tuner.space import enumerate_candidates

    tuned_m = {(1, 1): 1, (2, 4): 4, (5, 16): 16, (17, 128): 64}.get(bucket, 256)
    _, candidates = enumerate_candidates(spec, n, k, bucket, layout, device)
    trials = [Trial(c.template, c.config, estimate(c.template, c.config, spec, n, k, tuned_m, device).seconds)
              for c in candidates]
    return [(trials[i].template, trials[i].config, trials[i].modeled_s) for i in _ranked(trials)]


def configs():
    from bitkern.codegen.cpu.amx import AmxConfig
    from bitkern.codegen.cpu.dot import DotConfig
    from bitkern.codegen.cpu.generic import GenericConfig
    from bitkern.codegen.cpu.lut import LutConfig
    from bitkern.codegen.cuda import GemmConfig, GemvConfig

    return AmxConfig, DotConfig, LutConfig, GenericConfig, GemmConfig, GemvConfig


# -- the cases -----------------------------------------------------------------------------------------------
def cpu_cases():
    Amx, Dot, Lut, Generic, _, _ = configs()
    conv = ConvGeometry(64, 14, 14, (3, 3), padding=(1, 1, 1, 1))
    odd_conv = ConvGeometry(5, 9, 7, (2, 3), stride=(2, 1), dilation=(1, 2), padding=(1, 0, 2, 1))
    small, large = (1, 16), (129, 2**31 - 1)
    return {
        "amx int4 bf16 small": (Matmul("int4", "bfloat16"), 256, 512, "amx", Amx(n_tiles=4), small),
        "amx int8 nibbles": (Matmul("int8", "bfloat16", bias=True), 96, 256, "amx", Amx(n_tiles=2), small),
        "amx int8 convert f32": (Matmul("int8", "float32", group_size=64), 96, 256, "amx",
                                 Amx(n_tiles=3, decode="convert"), small),
        "amx nf4 lut large prologue": (Matmul("nf4", "float16", group_size=-1), 160, 384, "amx",
                                       Amx(n_tiles=2, m_tiles=2, small_m=False, m_chunk=64, stage_steps=2,
                                           decode="lut", chunk_prologue=True), large),
        "amx uint2 gptq large": (Matmul("uint2", "bfloat16", zero_mode="gptq", group_size=64), 128, 512, "amx",
                                 Amx(n_tiles=3, small_m=False, m_chunk=32, prefetch=0), large),
        "amx nvfp4 group16": (Matmul("nvfp4", "bfloat16", group_size=16), 64, 256, "amx",
                              Amx(n_tiles=2, decode="lut"), small),
        "amx conv int4": (Conv2d("int4", "bfloat16", group_size=64, geometry=conv), 64, 576, "amx",
                          Amx(n_tiles=2, small_m=False, m_chunk=64), large),
        "dot int4 staged": (Matmul("int4", "bfloat16", bias=True), 88, 384, "dot", Dot(n_tiles=3, rows=4), small),
        "dot int4 direct": (Matmul("int4", "bfloat16"), 256, 512, "dot", Dot(n_tiles=2, rows=2, direct=True), (1, 4)),
        "dot int2 affine shifts": (Matmul("int2", "bfloat16", group_size=64), 96, 384, "dot",
                                   Dot(n_tiles=2, rows=1, stage_steps=1, direct=True), (1, 1)),
        "dot int1 large prologue": (Matmul("int1", "float32"), 96, 512, "dot",
                                    Dot(n_tiles=2, rows=2, small_m=False, m_chunk=32, stage_steps=4, decode="lut",
                                        chunk_prologue=True), large),
        "dot uint8 hqq convert": (Matmul("uint8", "float16", zero_mode="hqq", group_size=-1), 64, 256, "dot",
                                  Dot(n_tiles=2, rows=4, decode="convert"), small),
        "dot mxfp4 lut": (Matmul("mxfp4", "bfloat16", group_size=32), 64, 256, "dot",
                          Dot(n_tiles=1, rows=8, decode="lut"), small),
        "dot conv odd channels": (Conv2d("int4", "bfloat16", group_size=-1, geometry=odd_conv), 24, 30, "dot",
                                  Dot(n_tiles=2, rows=4, small_m=False, m_chunk=32), large),
        "lut int1 one row": (Matmul("int1", "bfloat16"), 256, 512, "lut", Lut(n_tiles=4), (1, 1)),
        "lut uint2 awq rows 2-4": (Matmul("uint2", "float32", zero_mode="awq", group_size=32, bias=True), 88, 384,
                                   "lut", Lut(n_tiles=2, prefetch=0), (2, 4)),
        "lut nf4 per-channel": (Matmul("nf4", "float16", group_size=-1), 48, 200, "lut", Lut(n_tiles=8), (1, 4)),
        "generic int3 tile16": (Matmul("int3", "bfloat16", group_size=64), 80, 256, "generic", Generic(64), small),
        "generic int4 int8": (Matmul("int4", "int8", "int32"), 64, 256, "generic", Generic(), small),
        "generic fp8 rowmajor": (Matmul("float8_e5m2", "float32", bias=True), 48, 128, "generic", Generic(32),
                                 small),
        "generic conv": (Conv2d("uint4", "float32", zero_mode="gptq", group_size=-1, geometry=odd_conv), 16, 30,
                         "generic", Generic(), large),
    }


def cuda_cases():
    _, _, _, _, Gemm, Gemv = configs()
    return {
        "gemm int4 f16": (Matmul("int4", "float16"), 256, 512, "gemm", Gemm(), "sm_80"),
        "gemm uint4 awq bf16": (Matmul("uint4", "bfloat16", zero_mode="awq", scale_dtype="bfloat16"), 256, 512, "gemm",
                                Gemm(block_k=64), "sm_80"),
        "gemm nf4": (Matmul("nf4", "float16", group_size=64), 96, 200, "gemm",
                     Gemm(block_m=32, block_n=32, warp_n=32), "sm_90"),
        "gemm int1 group16 tir": (Matmul("int1", "float16", group_size=16), 128, 256, "gemm",
                                  Gemm(block_n=64, warp_n=32, block_k=64, decode="tir"), "sm_80"),
        "gemm int4 e4m3": (Matmul("int4", "float8_e4m3", group_size=-1, output_dtype="float16", bias=True), 256, 512,
                           "gemm", Gemm(block_k=128), "sm_90"),
        "gemm uint4 int8": (Matmul("uint4", "int8", "int32", group_size=-1, zero_mode="gptq"), 256, 512, "gemm",
                            Gemm(block_k=64), "sm_80"),
        "gemv uint4 gptq": (Matmul("uint4", "float16", zero_mode="gptq"), 4096, 4096, "gemv", Gemv(), "sm_80"),
        "gemv split-k": (Matmul("uint4", "float16", zero_mode="gptq", bias=True), 4096, 4096, "gemv",
                         Gemv(split_k=4, k_threads=8, rows=2), "sm_90"),
        "gemv mxfp4": (Matmul("mxfp4", "bfloat16", group_size=32), 128, 1024, "gemv", Gemv(k_threads=8), "sm_80"),
    }


def pick_cases():
    conv = ConvGeometry(64, 14, 14, (3, 3), padding=(1, 1, 1, 1))
    cases = {}
    for device in (ZEN4, SPR):
        for label, spec, n, k in (("int4", Matmul("int4", "bfloat16"), 4096, 4096),
                                  ("nf4 fp16", Matmul("nf4", "float16"), 11008, 4096),
                                  ("uint4 gptq f32", Matmul("uint4", "float32", zero_mode="gptq"), 4096, 11008),
                                  ("int8", Matmul("int8", "bfloat16"), 4096, 4096),
                                  ("int2", Matmul("int2", "bfloat16", group_size=64), 4096, 4096),
                                  ("int1", Matmul("int1", "bfloat16"), 4096, 4096),
                                  ("int3", Matmul("int3", "bfloat16"), 1024, 1024),
                                  ("fp8 activations", Matmul("int4", "float8_e4m3", group_size=-1, output_dtype="float32"), 512,
                                   512)):
            for bucket in ((1, 1), (2, 4), (5, 16), (17, 128), (129, 2**31 - 1)):
                cases[f"{device.name} {label} {n}x{k} M{bucket[0]}"] = (spec, n, k, bucket, "tile16", device)
        cases[f"{device.name} conv M17"] = (Conv2d("int4", "bfloat16", group_size=64, geometry=conv), 64, 576,
                                           (17, 128), "tile16", device)
        cases[f"{device.name} rowmajor int4 M1"] = (Matmul("int4", "bfloat16"), 1024, 1024, (1, 1), "rowmajor", device)
    for arch in ("sm_80", "sm_90"):
        for label, spec in (("int4 f16", Matmul("int4", "float16")), ("nf4 bf16", Matmul("nf4", "bfloat16")),
                            ("int8 int8", Matmul("int8", "int8", "int32", group_size=-1))):
            for bucket in ((1, 4), (17, 128), (129, 2**31 - 1)):
                cases[f"{arch} {label} M{bucket[0]}"] = (spec, 4096, 4096, bucket, "lop3", cuda_device(arch))
    return cases


# -- fingerprints --------------------------------------------------------------------------------------------
def sha(data) -> str:
    return hashlib.sha256(data if isinstance(data, bytes) else str(data).encode()).hexdigest()[:16]


def tensor_bytes(tensors) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def main() -> None:
    device_module._measured_bandwidth = lambda cores: BANDWIDTH
    out = {"cpu": {}, "cuda": {}, "picks": {}}
    for name, (spec, n, k, template, config, bucket) in cpu_cases().items():
        layout = "rowmajor" if "rowmajor" in name else "tile16"
        device = SPR if template == "amx" else ZEN4
        func, constants = cpu_program(spec, n, k, template, config, layout, bucket, device)
        kernel = cpu_kernel(spec, n, k, template, config, layout, bucket, device)
        out["cpu"][name] = {"tir": sha(func.script()), "constants": sha(tensor_bytes(constants)),
                            "kernel_constants": sha(tensor_bytes(kernel.constants)),
                            "asm": sha(disassembly(kernel.library).split("\n", 2)[2])}
        print(f"cpu {name}: done", file=sys.stderr)
    for name, (spec, n, k, template, config, arch) in cuda_cases().items():
        out["cuda"][name] = sha(cuda_source(spec, n, k, template, config, arch))
        print(f"cuda {name}: done", file=sys.stderr)
    from bitkern.cache import kernel_for

    for name, (spec, n, k, bucket, layout, device) in pick_cases().items():
        ranked = ranking(spec, n, k, bucket, layout, device)
        entry = {"candidates": len(ranked), "ranking": [[t, repr(c), repr(s)] for t, c, s in ranked[:8]]}
        if device.kind == "cpu":
            kernel = kernel_for(spec, n, k, bucket[0], layout, device)
            entry["picked"] = [kernel.template, repr(kernel.config)]
        out["picks"][name] = entry
        print(f"pick {name}: done", file=sys.stderr)
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
