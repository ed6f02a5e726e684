"""The CUDA kernels a GPU kit carries: every kernel the GPU tests and the GPU benchmark ask for, per architecture.

Three kinds, each a prebuild `Request` (`bitkern.cache.prebuild`):
- pinned: the correctness matrix (`correctness_cases`), each case one template configuration (the GEMM and the
  GEMV on every weight type x activation type x zero mode, output types, split-K, the plain-TIR decode, fuzzed
  shapes fixed by a seed, edge shapes, the fusion epilogues; the grouped mixture-of-experts GEMV on every type, top_k
  and routing, `grouped_cases`): tests/codegen/cuda/test_gpu.py runs each case;
- tuned: the kernels the GPU tests reach through torch ops and modules (`DISPATCH`, `DISPATCH_EXPERTS`:
  tests/cache/test_dispatch_gpu.py, tests/nn/test_compile.py), the tuner's choice built by its model;
- candidates: the benchmark's Llama-3-8B/70B layer shapes (`BENCH_SHAPES` x `BENCH_ROWS` for int4 g128, nf4 / int8
  / int2 at M=1), each shipped as the tuner's shortlist, so that the device times them and keeps the fastest.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass

import torch

from ..cache.prebuild import Request
from ..ops.grouped import GroupedMatmul
from ..ops.matmul import Matmul
from ..ttype import get, torch_dtype
from ..tuner.buckets import m_bucket

ANY_ROWS = (1, 1 << 30)  # the rows a correctness kernel serves (M is symbolic in every CUDA kernel)
TUNING_CANDIDATES = 8  # configurations per benchmark kernel, timed on the device (the tuner allows up to 8)

BENCH_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192))  # (N, K): Llama-3 8B/70B
BENCH_ROWS = (1, 16, 64, 256, 4096)
BENCH_TYPE = "int4"
BENCH_M1_TYPES = ("nf4", "int8", "int2")
BENCH_GROUP = 128
BENCH_ACTIVATION = "float16"
# (type, N, K, M): the benchmark kernels the kit's ncu step profiles (the GEMV and the GEMM at both ends of the shapes)
NCU_KERNELS = (("int4", 28672, 8192, 1), ("int4", 4096, 4096, 1), ("int4", 4096, 14336, 16),
               ("int4", 14336, 4096, 64), ("int4", 28672, 8192, 4096), ("nf4", 28672, 8192, 1),
               ("int2", 28672, 8192, 1))

# (weight, group_size, zero_mode, activation, output, bias, N, K, M): the tuned kernels the GPU tests reach through
# torch ops and modules; keep in step with tests/cache/test_dispatch_gpu.py and the CUDA tests of tests/nn/test_compile.py
DISPATCH = (
    *((name, 128, zero, activation, "float32", False, 256, 512, m)  # test_matmul_on_cuda_tensors
      for name, zero, activation in (("int4", "none", "float16"), ("nf4", "none", "bfloat16"),
                                     ("uint4", "gptq", "float16")) for m in (1, 33)),
    ("int4", 128, "none", "float16", "float32", True, 256, 512, 4),  # test_linear_moved_to_cuda_relays_its_weight
    ("uint4", 32, "gptq", "float32", "float32", True, 48, 128, 2),  # test_cuda_move_runs_the_same_layer
    *(("int4", 64, "none", activation, activation, False, n, k, m)  # the TransformerBlock(128, 4, 256) tests
      for activation, m in (("float32", 4), ("float16", 12)) for n, k in ((128, 128), (256, 128), (128, 256))),
)
# (epilogue, residual, M): the fused kernels of tests/cache/test_dispatch_gpu.py's test_fused_matmul_on_cuda_tensors
# (int4 g128 256 x 512, float16 activations, float32 output, bias)
DISPATCH_EPILOGUES = tuple((epilogue, residual, m) for epilogue, residual in (("swiglu", True), ("gelu", False))
                           for m in (1, 33))
# (dtype, group_size, activation, experts, hidden, intermediate, tokens, top_k): the `bitkern.Experts` modules moved to
# CUDA in tests/cache/test_dispatch_gpu.py's test_experts_on_cuda_run_the_grouped_kernel, whose decode calls run the
# grouped kernel of each projection (gate/up: each token to its top_k experts; down: each pair's row to its expert)
DISPATCH_EXPERTS = (("int4", 32, "float16", 8, 256, 128, 2, 2), ("nf4", 64, "bfloat16", 8, 256, 128, 3, 4))


@dataclass(frozen=True)
class Case:
    """One correctness case: template `template` on a random [N, K] `weight` matrix and M rows (inputs from `seed`)."""

    group: str
    template: str
    weight: str
    n: int
    k: int
    m: int
    activation: str
    zero_mode: str = "none"
    group_size: int = 128
    bias: bool = True
    seed: int = 0
    output: str | None = None
    prefer: object = None  # a configuration tried before the template's list
    epilogue: str = "none"  # the spec's epilogue ("swiglu": the weight is a stacked [gate; up] of N rows)
    residual: bool = False
    experts: int = 0  # a grouped case (`ops.GroupedMatmul`): E experts of [N, K] weights stacked, x's rows routed
    top_k: int = 1  # to top_k of them
    routing: str = "spread"  # how its rows are routed (`ROUTINGS`)

    def __str__(self) -> str:
        return (f"{self.group}-{self.template}-{self.weight}-{self.zero_mode}-{self.activation}-"
                f"{self.n}x{self.k}x{self.m}-g{self.group_size}" + (f"-{self.output}" if self.output else "") +
                ("" if self.epilogue == "none" else f"-{self.epilogue}") + ("-residual" if self.residual else "") +
                (f"-e{self.experts}top{self.top_k}-{self.routing}" if self.experts else "") +
                (f"-s{self.seed}" if self.seed else "") + ("" if self.prefer is None else f"-{_short(self.prefer)}"))

    def supported_on(self, arch: str) -> bool:
        """Whether the case's template serves its spec, epilogue and shape on `arch` (as the template itself says)."""
        from ..codegen.cuda import TEMPLATES

        template = next(template for template in TEMPLATES if template.name == self.template)
        spec = self.spec()
        return template.spec_unsupported(spec, self.n, self.k, arch) is None and \
            template.unsupported_epilogue(spec) is None

    def inputs(self):
        """(spec, quantized weight, x, bias, residual) on the host, the same on every machine (a grouped case: its
        experts' stacked [E·N, K] weight and [E, N] bias; its routing is `indices`)."""
        generator = torch.Generator().manual_seed(self.seed)
        block = get(self.weight).block_size > 1
        scale = torch.bfloat16 if self.activation == "bfloat16" else torch.float16
        from ..ttype import quantize

        q = quantize(torch.randn(max(1, self.experts) * self.n, self.k, generator=generator), self.weight,
                     group_size=None if block else self.group_size, zero_mode=self.zero_mode, scale_dtype=scale)
        options = {"accumulate_dtype": "int32"} if self.activation == "int8" else {}
        if self.experts:
            spec = GroupedMatmul.for_weight(q, self.activation, bias=self.bias, output_dtype=self.output,
                                            experts=self.experts, top_k=self.top_k, **options)
        else:
            spec = Matmul.for_weight(q, self.activation, bias=self.bias, output_dtype=self.output,
                                     epilogue=self.epilogue, residual=self.residual, **options)
        x = torch.randn(self.m, self.k, generator=generator)
        x = x.mul(20).round().clamp(-127, 127).to(torch.int8) if self.activation == "int8" else \
            x.to(torch_dtype(self.activation))
        b = torch.randn(*([self.experts] if self.experts else []), self.n, generator=generator) if self.bias else None
        r = torch.randn(self.m, spec.out_features(self.n), generator=generator).to(torch_dtype(spec.output_dtype)) \
            if self.residual else None
        return spec, q, x, b, r

    def indices(self) -> torch.Tensor:
        """A grouped case's routing [M, top_k] (int64 expert ids, the same on every machine): "spread" sends row m's
        slot j to expert (m·top_k + j) mod E; "empty" draws distinct experts from 1..E-1, so expert 0 has no token;
        "one" sends every pair to expert E // 2; "fuzz" draws any experts, repeats within a row included."""
        if not self.experts:
            raise ValueError(f"case {self} is not grouped (experts=0): it has no routing")
        generator = torch.Generator().manual_seed(self.seed + 1)
        m, e, top_k = self.m, self.experts, self.top_k
        if self.routing == "spread":
            return torch.arange(m * top_k).view(m, top_k) % e
        if self.routing == "empty":
            return torch.stack([torch.randperm(e - 1, generator=generator)[:top_k] + 1 for _ in range(m)])
        if self.routing == "one":
            return torch.full((m, top_k), e // 2, dtype=torch.int64)
        if self.routing == "fuzz":
            return torch.randint(0, e, (m, top_k), generator=generator)
        raise ValueError(f"routing={self.routing!r} is not known; accepted: {list(ROUTINGS)}")

    def config(self, spec: Matmul, arch: str):
        """The first configuration of the template that builds the case (LOP3 decode first, the plain-TIR one for
        group sizes it cannot serve), or None."""
        from ..codegen import template

        chosen = template(self.template)
        configs = ([self.prefer] if self.prefer else []) + list(_CONFIGS[self.template]())
        for config in configs + [dataclasses.replace(c, decode="tir") for c in configs if hasattr(c, "decode")]:
            if chosen.reason(spec, self.n, self.k, config, arch) is None:
                return config
        return None

    def spec(self) -> Matmul:
        return _spec(self)

    def request(self, arch: str) -> Request | None:
        spec = self.spec()
        config = self.config(spec, arch)
        return None if config is None else Request(spec, self.n, self.k, ANY_ROWS, arch, self.template, config)


@functools.lru_cache(maxsize=None)
def _spec(case: Case) -> Matmul:
    return case.inputs()[0]


def _gemm_configs():
    from ..codegen.cuda import GemmConfig

    return (GemmConfig(), GemmConfig(block_k=64), GemmConfig(block_m=32, warp_m=16, block_n=64, warp_n=32),
            GemmConfig(block_m=16, warp_m=16, block_n=32, warp_n=16, block_k=64, stages=2),
            GemmConfig(block_m=16, warp_m=16, block_n=16, warp_n=16, block_k=128, stages=2))


def _gemv_configs():
    from ..codegen.cuda import GemvConfig

    return (GemvConfig(), GemvConfig(rows=4, k_threads=16, words=2), GemvConfig(k_threads=8, words=1),
            GemvConfig(k_threads=4, words=1, warps=2), GemvConfig(k_threads=1, words=1, warps=1))


def _mma_gemv_configs():
    from ..codegen.cuda import MmaGemvConfig

    return (MmaGemvConfig(), MmaGemvConfig(block_m=16, n_tiles=2, words=2), MmaGemvConfig(warps=2, words=2),
            MmaGemvConfig(warps=1, words=1), MmaGemvConfig(block_m=32, warps=2))


def _grouped_configs():
    from ..codegen.cuda import GroupedGemvConfig

    return (GroupedGemvConfig(), GroupedGemvConfig(k_threads=16, words=2), GroupedGemvConfig(k_threads=8, words=1),
            GroupedGemvConfig(k_threads=4, words=1, warps=2), GroupedGemvConfig(k_threads=1, words=1, warps=1))


_CONFIGS = {"gemm": _gemm_configs, "gemv": _gemv_configs, "mma_gemv": _mma_gemv_configs,
            "grouped_gemv": _grouped_configs}
ROUTINGS = ("spread", "empty", "one", "fuzz")


def _short(config) -> str:
    return "-".join(f"{name}{value}" for name, value in dataclasses.asdict(config).items())


FLOAT_WEIGHTS = (*((name, "none") for name in ("int4", "int2", "int1", "int8", "nf4", "fp4_e2m1", "float8_e4m3",
                                               "float8_e5m2", "mxfp4", "mxfp8", "nvfp4")),
                 *((name, zero) for name in ("uint4", "uint2", "uint1", "uint8") for zero in ("gptq", "awq", "hqq")))
INT8_WEIGHTS = (("int4", "none"), ("uint4", "gptq"), ("uint4", "awq"), ("int2", "none"), ("uint2", "gptq"),
                ("int1", "none"), ("int8", "none"))
EDGE_SHAPES = ((1, 8, 1), (17, 40, 3), (16, 128, 65), (130, 136, 129))  # (N, K, M): smallest and ragged
# (epilogue, residual): the fusion epilogues, each on int4 and int8 weights (float16 activations, group 128) and
# int4 with int8 activations, on the GEMM at 67 rows and the GEMV (which leaves SwiGLU to the GEMM) at 3 rows
EPILOGUES = (("relu", False), ("silu", True), ("gelu", False), ("swiglu", False), ("swiglu", True), ("none", True))
EPILOGUE_TYPES = (("int4", "float16", 128, None), ("int8", "float16", 128, None), ("int4", "int8", -1, "float32"))
FUZZ_SEED, FUZZ_CASES = 2026, 12
MMA_FUZZ_SEED = 2027


def correctness_cases() -> list[Case]:
    """Every correctness case of the GPU tests, in a fixed order."""
    from ..codegen.cuda import GemmConfig, GemvConfig

    cases = [Case("types", template, name, 256, 512, m, activation, zero)
             for template, m in (("gemm", 67), ("gemv", 3)) for activation in ("float16", "bfloat16")
             for name, zero in FLOAT_WEIGHTS]
    cases += [Case("int8", template, name, 256, 512, m, "int8", zero, group_size=-1, output="float16")
              for template, m in (("gemm", 40), ("gemv", 2)) for name, zero in INT8_WEIGHTS]
    cases += [Case("fp8", "gemm", name, 256, 512, 33, "float8_e4m3", group_size=-1, output="bfloat16")
              for name in ("fp4_e2m1", "int4", "uint4", "float8_e4m3")]
    cases += [Case("tir", template, "int1", 128, 256, 5, "float16", group_size=16) for template in ("gemm", "gemv")]
    cases += [Case("f32", "gemv", "uint4", 128, 512, 3, "float32", "gptq", output="float32")]
    cases += [Case("splitk", "gemv", "uint4", 512, 4096, m, "float16", "gptq",
                   prefer=GemvConfig(rows=rows, split_k=4, k_threads=8)) for rows, m in ((1, 1), (2, 5), (4, 4))]
    split = GemmConfig(block_m=16, warp_m=16, block_n=64, warp_n=32, block_k=64, stages=2, split_k=4)
    cases += [Case("splitk", "gemm", name, 256, 1024, m, activation, zero, prefer=split)
              for name, activation, zero, m in (("int4", "float16", "none", 1), ("int4", "float16", "none", 16),
                                                ("nf4", "bfloat16", "none", 67), ("uint4", "float16", "hqq", 16),
                                                ("int2", "bfloat16", "none", 5))]
    cases += [Case("splitk", "gemm", "int4", 64, 40, 130, "float16", group_size=-1,  # ragged K, K/2 per slice
                   prefer=GemmConfig(block_m=32, warp_m=16, block_n=64, warp_n=32, block_k=32, split_k=2)),
              Case("splitk", "gemm", "uint4", 256, 2048, 20, "float16", "gptq", epilogue="gelu", residual=True,
                   prefer=dataclasses.replace(split, split_k=8))]
    cases += [Case("outputs", template, "int4", 128, 256, 9, "float16", output=output)
              for template in ("gemm", "gemv") for output in ("float32", "float16", "bfloat16")]
    fuzz = random.Random(FUZZ_SEED)
    for _ in range(FUZZ_CASES):
        name = fuzz.choice(("int4", "uint4", "nf4", "int2", "fp4_e2m1"))
        n, k, m = fuzz.randint(1, 200), 8 * fuzz.randint(1, 40), fuzz.randint(1, 150)  # any K that words fill
        template, seed = fuzz.choice(("gemm", "gemv")), fuzz.randint(0, 1000)
        cases.append(Case("fuzz", template, name, n, k, m, "float16", "gptq" if name == "uint4" else "none",
                          group_size=-1, bias=seed % 2 == 0, seed=seed))
    cases += [Case("edge", template, "int4", n, k, m, "float16", group_size=-1)
              for template in ("gemm", "gemv") for n, k, m in EDGE_SHAPES]
    cases += [Case("epilogue", template, name, 256, 512, m, activation, group_size=group, output=output,
                   epilogue=epilogue, residual=residual)
              for template, m in (("gemm", 67), ("gemv", 3)) for name, activation, group, output in EPILOGUE_TYPES
              for epilogue, residual in EPILOGUES]
    cases += [Case("epilogue", "gemv", "uint4", 512, 4096, 5, "float16", "gptq", epilogue="gelu", residual=True,
                   prefer=GemvConfig(rows=2, split_k=4, k_threads=8)),  # split-K's reduce kernel; ragged K and M:
              Case("epilogue", "gemm", "uint4", 64, 40, 130, "bfloat16", "gptq", group_size=-1, epilogue="swiglu",
                   residual=True, prefer=GemmConfig(block_m=32, warp_m=16, block_n=64, warp_n=32, block_k=64))]
    cases += _mma_gemv_cases()
    cases += grouped_cases()
    return cases


GROUPED_EXPERTS = 10
GROUPED_FUZZ_SEED = 2028


def grouped_cases() -> list[Case]:
    """The grouped (mixture-of-experts) GEMV's cases, 10 experts of [128, 512] weights: every weight type it serves x
    float16 / bfloat16 activations at top_k 2 (3 rows), int8 activations, top_k 1 and 8 on the common types, each
    routing (`Case.indices`: spread, an expert without tokens, one expert taking every pair, fuzzed) at top_k 1, 2
    and 8, output types, float32 activations, a ragged K and fuzzed shapes."""
    grouped = functools.partial(Case, template="grouped_gemv", experts=GROUPED_EXPERTS)
    cases = [grouped(group="moe-types", weight=name, n=128, k=512, m=3, activation=activation, zero_mode=zero,
                     top_k=2)
             for activation in ("float16", "bfloat16") for name, zero in FLOAT_WEIGHTS if name != "nvfp4"]
    cases += [grouped(group="moe-int8", weight=name, n=128, k=512, m=2, activation="int8", zero_mode=zero,
                      group_size=-1, output="float16", top_k=2) for name, zero in INT8_WEIGHTS]
    cases += [grouped(group="moe-topk", weight=name, n=128, k=512, m=m, activation=activation, zero_mode=zero,
                      top_k=top_k)
              for name, zero in (("int4", "none"), ("uint4", "gptq"), ("nf4", "none"))
              for activation in ("float16", "bfloat16") for top_k, m in ((1, 4), (8, 4))]
    cases += [grouped(group="moe-routing", weight="int4", n=128, k=512, m=m, activation="float16", top_k=top_k,
                      routing=routing, seed=seed)
              for routing in ROUTINGS for top_k, m, seed in ((1, 5, 1), (2, 4, 2), (8, 3, 3))]
    cases += [grouped(group="moe-outputs", weight="uint4", n=128, k=512, m=3, activation="float16", zero_mode="gptq",
                      output=output, top_k=2) for output in ("float32", "bfloat16")]
    cases += [grouped(group="moe-f32", weight="int4", n=64, k=512, m=2, activation="float32", output="float32",
                      top_k=2)]
    cases += [grouped(group="edge", weight="int4", n=16, k=40, m=m, activation="float16", group_size=-1, top_k=top_k,
                      routing="fuzz") for m, top_k in ((1, 8), (65, 2))]
    fuzz = random.Random(GROUPED_FUZZ_SEED)
    for _ in range(6):
        name = fuzz.choice(("int4", "uint4", "nf4", "int2", "fp4_e2m1", "int8"))
        top_k = fuzz.choice((1, 2, 4, 8))
        cases.append(grouped(group="moe-fuzz", weight=name, n=16 * fuzz.randint(1, 12), k=8 * fuzz.randint(1, 64),
                             m=fuzz.randint(1, 8), activation="float16", zero_mode="gptq" if name == "uint4" else "none",
                             group_size=-1, top_k=top_k, routing="fuzz", seed=fuzz.randint(0, 1000)))
    return cases


def _mma_gemv_cases() -> list[Case]:
    """The TensorCore GEMV's cases: every type at 8 rows per block (3 rows) and the common ones at 16 and 32 rows
    per block, split-K, output types, epilogues, edge shapes and fuzzed shapes."""
    from ..codegen.cuda import MmaGemvConfig

    cases = [Case("types", "mma_gemv", name, 256, 512, 3, activation, zero)
             for activation in ("float16", "bfloat16") for name, zero in FLOAT_WEIGHTS]
    cases += [Case("rows", "mma_gemv", name, 256, 512, m, activation, zero, prefer=MmaGemvConfig(block_m=block_m))
              for name, zero in (("int4", "none"), ("uint4", "gptq"), ("nf4", "none"), ("int8", "none"),
                                 ("int2", "none"), ("uint4", "hqq"))
              for activation in ("float16", "bfloat16") for block_m, m in ((16, 20), (32, 45))]
    cases += [Case("splitk", "mma_gemv", "uint4", 512, 4096, m, "float16", "gptq",
                   prefer=MmaGemvConfig(block_m=block_m, split_k=split_k, words=2))
              for block_m, m, split_k in ((8, 1, 4), (8, 7, 16), (16, 16, 2), (32, 33, 8))]
    cases += [Case("outputs", "mma_gemv", "int4", 128, 256, 9, "float16", output=output)
              for output in ("float32", "float16", "bfloat16")]
    cases += [Case("epilogue", "mma_gemv", name, 256, 512, 3, activation, group_size=group, output=output,
                   epilogue=epilogue, residual=residual)
              for name, activation, group, output in EPILOGUE_TYPES if activation != "int8"
              for epilogue, residual in EPILOGUES if epilogue != "swiglu"]
    cases += [Case("edge", "mma_gemv", "int4", n, k, m, "float16", group_size=-1) for n, k, m in EDGE_SHAPES]
    fuzz = random.Random(MMA_FUZZ_SEED)
    for _ in range(FUZZ_CASES):
        name = fuzz.choice(("int4", "uint4", "nf4", "int2", "fp4_e2m1"))
        n, k, m = fuzz.randint(1, 200), 8 * fuzz.randint(1, 40), fuzz.randint(1, 64)
        cases.append(Case("fuzz", "mma_gemv", name, n, k, m, "float16", "gptq" if name == "uint4" else "none",
                          group_size=-1, bias=m % 2 == 0, seed=fuzz.randint(0, 1000)))
    return cases


def bench_specs() -> list[tuple[Matmul, tuple[int, ...]]]:
    """(spec, rows) of the benchmark: int4 g128 at every M, the other types at M=1 (float16 activations and
    output, float16 scales)."""
    def spec(name):
        return Matmul(name, BENCH_ACTIVATION, group_size=BENCH_GROUP, zero_mode="none", scale_dtype="float16")

    return [(spec(BENCH_TYPE), BENCH_ROWS)] + [(spec(name), (1,)) for name in BENCH_M1_TYPES]


def dispatch_specs() -> list[tuple[Matmul, int, int, int]]:
    """(spec, N, K, M) of `DISPATCH`, `DISPATCH_EPILOGUES` and the grouped kernels of `DISPATCH_EXPERTS`."""
    return [(Matmul(name, activation, group_size=group, zero_mode=zero, bias=bias, output_dtype=output,
                    scale_dtype="float16"), n, k, m)
            for name, group, zero, activation, output, bias, n, k, m in DISPATCH] + \
        [(Matmul("int4", "float16", output_dtype="float32", bias=True, epilogue=epilogue, residual=residual), 256, 512, m)
         for epilogue, residual, m in DISPATCH_EPILOGUES] + [kernel for entry in DISPATCH_EXPERTS
                                                             for kernel in experts_kernels(*entry)]


def experts_kernels(dtype: str, group_size: int, activation: str, experts: int, hidden: int, intermediate: int,
                    tokens: int, top_k: int) -> list[tuple[GroupedMatmul, int, int, int]]:
    """(spec, N, K, M) of the grouped kernels a decode call of `tokens` tokens runs in a `bitkern.Experts` (SwiGLU,
    no bias, output in x's dtype): gate/up [2·intermediate, hidden] at a row a token for its top_k experts, then down
    [hidden, intermediate] at a row a pair for its one expert."""
    def spec(routed):
        return GroupedMatmul(dtype, activation, group_size=group_size, output_dtype=activation, experts=experts,
                             top_k=routed)

    return [(spec(top_k), 2 * intermediate, hidden, tokens), (spec(1), hidden, intermediate, tokens * top_k)]


def requests(arch: str, smoke: bool = False) -> list[Request]:
    """Every kernel the kit ships for `arch` (`smoke`: a few, one of each kind, for a dry check in CI)."""
    cases = [case for case in correctness_cases() if case.supported_on(arch)]
    pinned = [request for request in (case.request(arch) for case in (cases[:1] + cases[-1:] if smoke else cases))
              if request is not None]
    tuned = [Request(spec, n, k, m_bucket(m), arch) for spec, n, k, m in dispatch_specs()[:1 if smoke else None]]
    benchmark = []
    for spec, rows in bench_specs()[:1 if smoke else None]:
        for n, k in BENCH_SHAPES[:1 if smoke else None]:
            for bucket in dict.fromkeys(m_bucket(m) for m in rows[:1 if smoke else None]):
                benchmark.append(Request(spec, n, k, bucket, arch, candidates=2 if smoke else TUNING_CANDIDATES))
    return _distinct(pinned) + _distinct(tuned) + benchmark


def _distinct(items: list) -> list:
    return list(dict.fromkeys(items))
