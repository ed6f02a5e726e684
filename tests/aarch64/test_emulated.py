"""The aarch64 lane, run by tools/aarch64/test inside an emulated arm64 root (skipped elsewhere): bitkern imports with
nothing set, detects emulated CPU models as their /proc/cpuinfo says, every
template that serves aarch64 computes the references (int8 activations by sdot and smmla, experts' rows by the
grouped template too), and a quantized tiny Llama
generates, saves and loads."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bitkern
from bitkern import ttype
from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu import isa
from bitkern.codegen.cpu.vnni import VnniConfig
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu
from bitkern.tuner.space import enumerate_candidates
from tests.codegen.cpu.test_arm_levels import CPUINFO
from tests.codegen.cpu.test_grouped import E as grouped_experts, K as grouped_k
from tests.codegen.cpu.test_grouped import _build as grouped_build, _case as grouped_case
from tests.codegen.cpu.test_grouped import _check as grouped_check, _distinct as grouped_routing
from tests.helpers import assert_matches_reference, matmul_case
from tests.nn.test_generation import _greedy, _llama

pytestmark = pytest.mark.skipif(platform.machine() != "aarch64",
                                reason="the aarch64 lane: tools/aarch64/test runs it in an emulated arm64 root")

CHECKOUT = Path(__file__).resolve().parents[2]
N, K = 64, 256
BUCKETS = [(1, 4), (1, 16)]  # the lookup template serves up to 4 rows, the others 16 too; each template's first bucket
TYPES = ["int4", "nf4", "int8", "mxfp4", "int2"]
ACTIVATIONS = [(name, activation) for name in TYPES for activation in ("bfloat16", "float32")] + \
              [(name, "int8") for name in TYPES if "int8" in ttype.get(name).compute_types]
# the CI suite's share of the lane (marked lane_ci): import with nothing set, every template on int4 codes with bf16
# and int8 activations, sdot at M=1 and smmla at M=3, the tiny Llama (each test finds the emulated CPU's level: qemu's
# max, sve2)
CI = pytest.mark.lane_ci
CI_ACTIVATIONS = {("int4", "bfloat16"), ("int4", "int8")}
# qemu's -cpu model (QEMU_CPU): (the real core's /proc/cpuinfo sample in test_arm_levels, or None; the level expected)
EMULATED = {"neoverse-v1": ("Neoverse V1 (Graviton 3)", "sve"), "cortex-a76": ("Cortex-A76 (Raspberry Pi 5)",
                                                                                 "armv8.2-a"),
            "max": (None, "sve2")}
# in a fresh process on the emulated model: what bitkern detected and what /proc/cpuinfo says
_DETECT = """
import json
from bitkern.tuner import host_cpu
from bitkern.tuner.device import cpuinfo_features
cpu = host_cpu()
print(json.dumps([cpu.level.name, cpu.runs_here(), sorted(cpuinfo_features(open("/proc/cpuinfo").read()))]))
"""


@CI
def test_bitkern_imports_with_nothing_set_in_the_environment():
    completed = subprocess.run([sys.executable, "-c", "import bitkern, platform; print(platform.machine())"], env={},
                               cwd="/", capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "aarch64"


@pytest.mark.parametrize("model", EMULATED)
def test_emulated_cpu_models_are_detected_as_their_cpuinfo_says(model):
    """The level is the best one the Features line allows, and the real core's sample (test_arm_levels) has that
    level too.  (The name is not compared: qemu adds a "model name" line that arm64 Linux does not print.)"""
    completed = subprocess.run([sys.executable, "-c", _DETECT], cwd=CHECKOUT,
                               env=dict(os.environ, QEMU_CPU=model), capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    level, runs_here, features = json.loads(completed.stdout.splitlines()[-1])
    sample, expected = EMULATED[model]
    assert level == expected == isa.best_level(features, "aarch64").name and runs_here
    assert sample is None or CPUINFO[sample][3] == level


@pytest.mark.parametrize("name, activation", [pytest.param(*case, id="-".join(case),
                                                          marks=[CI] if case in CI_ACTIVATIONS else [])
                                             for case in ACTIVATIONS])
def test_every_template_serving_aarch64_computes_the_reference(name, activation):
    spec, qweight, x, _ = matmul_case(name, N, K, 3, activation,
                                      group=None if ttype.get(name).block_size > 1 else 64)
    packed = pack(qweight)
    first = {}
    for bucket in BUCKETS:
        _, candidates = enumerate_candidates(spec, N, K, bucket, packed.layout, host_cpu())
        for candidate in candidates:
            first.setdefault(candidate.template, (candidate.config, bucket))
    assert "generic" in first and (activation == "int8" or "fma" in first)
    for template, (config, bucket) in first.items():
        kernel = build_kernel(spec, N, K, template, config, packed.layout, bucket, host_cpu())
        assert_matches_reference(spec, qweight, x, None, kernel(x, packed))


@pytest.mark.parametrize("name, m", [pytest.param("int4", 1, marks=CI), ("nf4", 1), pytest.param("int4", 3, marks=CI),
                                     ("nf4", 4), ("int8", 3), ("int2", 4), ("mxfp4", 3)])
def test_int8_activations_by_sdot_and_smmla_compute_the_reference(name, m):
    """activation_quant="int8" on the emulated CPU (qemu 'max': sve2, with sdot and i8mm's smmla): the VNNI template's
    first candidate for the bucket of M rows, and at M >= 2 a block of 4 rows by sdot and blocks of 2 and 4 rows in
    pairs by smmla (3 rows: a block's odd last row paired with itself), against the definition (its own rounding of x,
    then the exact product).  The types cover every byte position count of a word (8-bit codes pair two words)."""
    _, qweight, x, _ = matmul_case(name, N, K, m, "bfloat16", group=None if ttype.get(name).block_size > 1 else 64,
                                   seed=m)
    spec = Matmul.for_weight(qweight, "bfloat16", activation_quant="int8")
    bucket = (1, 4 if m > 1 else 1)
    _, candidates = enumerate_candidates(spec, N, K, bucket, "tile16", host_cpu())
    configs = [next(c.config for c in candidates if c.template == "vnni")]
    if m > 1:
        configs += [VnniConfig(1, True, 16, 4, 32), VnniConfig(1, True, 16, 2, 32, pairs=True),
                    VnniConfig(2, True, 16, 4, 32, pairs=True)]
    for config in configs:
        kernel = build_kernel(spec, N, K, "vnni", config, "tile16", bucket, host_cpu())
        torch.testing.assert_close(kernel(x, pack(qweight)), spec.reference(x, qweight), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype, zero_mode, group", [("int4", None, 64), ("nf4", None, 64), ("uint4", "gptq", 64)])
def test_experts_rows_by_the_grouped_template_compute_the_reference(dtype, zero_mode, group):
    """The grouped FMA template (mixture-of-experts decode) at the emulated CPU's level: rows routed to their top 2
    of 6 experts, 1 to 7 rows, against the float64 reference pair by pair (tests/codegen/cpu/test_grouped's check)."""
    spec, weight, bias = grouped_case(dtype, zero_mode, group, top_k=2, activation="bfloat16")
    kernel = grouped_build(spec, host_cpu().level.name)
    for tokens in (1, 2, 7):
        x = torch.randn(tokens, grouped_k, generator=torch.Generator().manual_seed(tokens)).bfloat16()
        grouped_check(spec, weight, bias, kernel, x, grouped_routing(tokens, 2, grouped_experts, tokens))


@CI
def test_a_quantized_tiny_llama_generates_and_round_trips_through_save_and_load(tmp_path):
    """quantize_model (int4, bitkern.Linear everywhere, the output layer bf16) generates greedily; saved and loaded
    into a fresh float model, it generates the same tokens."""
    model = bitkern.quantize_model(_llama(), "int4", compute_dtype=torch.bfloat16)
    assert isinstance(model.model.layers[0].mlp.up_proj, bitkern.Linear)
    tokens = _greedy(model, tokens=4)
    assert tokens.shape == (2, 10)
    bitkern.save(model, tmp_path / "llama-int4.safetensors")
    loaded = bitkern.load(_llama(), tmp_path / "llama-int4.safetensors")
    assert isinstance(loaded.model.layers[0].mlp.up_proj, bitkern.Linear)
    assert torch.equal(_greedy(loaded, tokens=4), tokens)
