"""Instruction-set levels: each CPU template builds for every level that has the features it declares, runs there
where this machine can (against the float64 reference, lower levels forced), and compiles to the instructions its
inner loop is made of above it (checked in the disassembly); it is never offered or built for a level without its
features, and no 256-bit level gets 512-bit code."""

import os
import re
import subprocess
import sys

import pytest
import torch

from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu import TEMPLATES, isa
from bitkern.codegen.cpu.fma import TEMPLATE as FMA
from bitkern.codegen.cpu.kernel import disassembly
from bitkern.ops import GroupedMatmul, Matmul
from bitkern.tuner import device_for, host_cpu
from bitkern.tuner.space import enumerate_candidates, usable_templates
from tests.helpers import assert_matches_reference, matmul_case

# /proc/cpuinfo flags of CPUs bitkern meets (the part of them the levels read) and the level each runs
V3 = {"sse2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
SKYLAKE_SP = V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
CPUS = {"Zen 3": (V3, "x86-64-v3"), "Alder Lake": (V3 | {"avx_vnni"}, "avx-vnni"),
        "Skylake-SP": (SKYLAKE_SP, "avx512"), "Cascade Lake": (SKYLAKE_SP | {"avx512_vnni"}, "avx512-vnni"),
        "Zen 4": (SKYLAKE_SP | {"avx512_vnni", "avx512_bf16"}, "avx512-bf16"),
        "Zen 5": (SKYLAKE_SP | {"avx512_vnni", "avx512_bf16", "avx_vnni"}, "avx512-bf16"),
        "Sapphire Rapids": (SKYLAKE_SP | {"avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16",
                                          "amx_int8"}, "amx"),
        "old x86-64": ({"sse2", "sse4_2"}, "x86-64")}

# (template, spec, rows): a kernel of each template
KERNELS = {"amx": (Matmul("int4", "bfloat16", group_size=64), (1, 16)),
           "dot": (Matmul("int4", "bfloat16", group_size=64), (1, 16)),
           "lut": (Matmul("nf4", "bfloat16", group_size=64), (1, 4)),
           "fma": (Matmul("int4", "bfloat16", group_size=64), (1, 4)),
           "vnni": (Matmul("int4", "bfloat16", group_size=64, activation_quant="int8"), (1, 16)),
           "generic": (Matmul("int4", "float32", group_size=64), (1, 16)),
           "grouped_fma": (GroupedMatmul("int4", "bfloat16", group_size=64, experts=1, top_k=1), (1, 16)),
           "grouped_vnni": (GroupedMatmul("int4", "bfloat16", group_size=64, experts=1, top_k=1,
                                          activation_quant="int8"), (1, 16))}
# the instructions a template's inner loop is made of, per level name or vector width of the level
VNNI_LOOP = {"x86-64-v3": ["vpmaddubsw", "vpaddw", "vpmaddwd"], "avx-vnni": [r"\{vex\} vpdpbusd"],
             "avx512": ["vpmaddubsw", "vpaddw", "vpmaddwd"], 64: ["vpdpbusd"]}
INNER_LOOP = {"amx": ["tdpbf16ps", "tileloadd"], "dot": ["vdpbf16ps"], "vnni": VNNI_LOOP, "grouped_vnni": VNNI_LOOP,
              "lut": {32: ["vperm(ps|d)", "vblendvps"], 64: ["vperm(ps|d)"]},
              "fma": [r"vfmadd\w*ps", "vcvtdq2ps", "vpsrad"], "grouped_fma": [r"vfmadd\w*ps", "vcvtdq2ps", "vpsrad"],
              "generic": {16: ["mulps"], 32: [r"vfmadd\w*ps"], 64: [r"vfmadd\w*ps"]}}
N, K = 64, 256


@pytest.mark.parametrize("cpu", CPUS)
def test_a_cpu_runs_the_highest_level_its_features_allow(cpu):
    flags, expected = CPUS[cpu]
    assert isa.best_level(flags).name == expected
    assert all(level.runs_on(flags) for level in isa.LEVELS[:[lv.name for lv in isa.LEVELS].index(expected)]
               if level.features <= isa.level(expected).features)


def test_unknown_levels_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"cpu level 'avx3' is not known; accepted: \['x86-64', 'x86-64-v3'"):
        isa.level("avx3")


def _levels():
    return [pytest.param(level.name, id=level.name) for level in isa.LEVELS]


@pytest.mark.parametrize("template", [template.name for template in TEMPLATES])
@pytest.mark.parametrize("level", _levels())
def test_every_template_at_every_level(template, level):
    """Offered and built where the level has the template's features: run against the reference where this CPU
    runs the level, else compiled only; the disassembly holds the inner loop's instructions and, for levels of
    256-bit vectors or less, no zmm register.  Refused before any compiling elsewhere."""
    device = host_cpu().at_level(level)
    spec, rows = KERNELS[template]
    template_object = next(t for t in TEMPLATES if t.name == template)
    _, unused = usable_templates(spec, N, K, rows, "tile16", device)
    missing = template_object.missing_features(device)
    if template == "dot" and device.has_amx_bf16:
        assert "this CPU has AMX" in unused["dot"]
        return
    if missing:
        assert unused[template] == missing and level in missing
        with pytest.raises(ValueError, match=f"cannot build for the {level} level"):
            build_kernel(spec, N, K, template, template_object.config_type(), "tile16", rows, device)
        return
    assert template not in unused
    _, candidates = enumerate_candidates(spec, N, K, rows, "tile16", device)
    config = next(c.config for c in candidates if c.template == template)
    kernel = build_kernel(spec, N, K, template, config, "tile16", rows, device)
    code = disassembly(kernel.library)
    expected = INNER_LOOP[template]
    if isinstance(expected, dict):
        expected = expected.get(level, expected.get(device.vector_bytes))
    assert all(re.search(rf"(?<!\w){instruction}(?!\w)", code) for instruction in expected), (expected, level)
    if template in ("vnni", "grouped_vnni") and "vpmaddwd" in expected:  # int4's products widen once per block of 8 (sums_pairs)
        assert 4 * len(re.findall(r"\bvpmaddwd\b", code)) <= len(re.findall(r"\bvpmaddubsw\b", code))
    if device.vector_bytes < 64:
        assert "zmm" not in code
    if device.vector_bytes < 32:
        assert "ymm" not in code
    if not device.runs_here():
        return
    _, qweight, x, _ = matmul_case(spec.weight_dtype, N, K, rows[1], spec.activation_dtype, group=64, seed=3)
    if spec.experts:  # one expert that every row picks: the dense product
        y = kernel(x, pack(qweight), None, indices=torch.zeros(x.shape[0], 1, dtype=torch.long))[:, 0]
        spec = spec.matmul
    else:
        y = kernel(x, pack(qweight))
    if spec.activation_quant != "none":
        spec = Matmul.for_weight(qweight, spec.activation_dtype, activation_quant=spec.activation_quant)
    if spec.activation_quant == "none":
        assert_matches_reference(spec, qweight, x, None, y)
    else:  # int8 activations: the definition's own rounding of x, then the exact product
        torch.testing.assert_close(y, spec.reference(x, qweight), rtol=1e-4, atol=1e-3)


# the code-book VNNI kernel's inner loop per level: a vpshufb of the int8 code book before the level's byte products
CODE_BOOK_LOOP = {"x86-64-v3": ["vpshufb", "vpsignb", "vpmaddubsw"], "avx-vnni": ["vpshufb", r"\{vex\} vpdpbusd"],
                  "avx512": ["vpshufb", "vpmaddubsw"], "avx512-vnni": ["vpshufb", "vpdpbusd"]}


@pytest.mark.parametrize("level", CODE_BOOK_LOOP)
def test_code_books_with_int8_activations_look_up_bytes_at_every_level(level):
    """nf4 with activation_quant="int8" at every level the VNNI template serves: compiled (run against the
    reference where this CPU runs the level), its inner loop a byte lookup and the level's products."""
    device = host_cpu().at_level(level)
    spec = Matmul("nf4", "bfloat16", group_size=64, activation_quant="int8")
    _, candidates = enumerate_candidates(spec, N, K, (1, 16), "tile16", device)
    config = next(c.config for c in candidates if c.template == "vnni")
    kernel = build_kernel(spec, N, K, "vnni", config, "tile16", (1, 16), device)
    code = disassembly(kernel.library)
    assert all(re.search(rf"(?<!\w){instruction}(?!\w)", code) for instruction in CODE_BOOK_LOOP[level])
    assert device.vector_bytes == 64 or "zmm" not in code
    if device.runs_here():
        _, qweight, x, _ = matmul_case("nf4", N, K, 3, "bfloat16", group=64, seed=5)
        spec = Matmul.for_weight(qweight, "bfloat16", activation_quant="int8")
        torch.testing.assert_close(kernel(x, pack(qweight)), spec.reference(x, qweight), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("level", [level.name for level in isa.LEVELS if FMA.runs_at(level)])
def test_bfloat16_weights_take_the_fma_template_at_every_level(level):
    """bfloat16 weights (lm_heads kept in bf16) at every level from AVX2 up: each code moved into float32's top half
    (vpslld, vpand) and multiplied in by FMA, nothing converted; run against the reference where this CPU runs the
    level."""
    device = host_cpu().at_level(level)
    spec = Matmul("bfloat16", "bfloat16", group_size=-1)
    assert "fma" not in usable_templates(spec, N, K, (1, 1), "tile16", device)[1]
    _, candidates = enumerate_candidates(spec, N, K, (1, 1), "tile16", device)
    config = next(c.config for c in candidates if c.template == "fma")
    kernel = build_kernel(spec, N, K, "fma", config, "tile16", (1, 1), device)
    code = disassembly(kernel.library)
    assert all(re.search(rf"(?<!\w){instruction}(?!\w)", code) for instruction in ("vpslld", r"vpand\w*",
                                                                                    r"vfmadd\w*ps"))
    assert "vcvtdq2ps" not in code and (device.vector_bytes == 64 or "zmm" not in code)
    if device.runs_here():
        _, qweight, x, _ = matmul_case("bfloat16", N, K, 1, "bfloat16", group=-1, seed=6)
        assert_matches_reference(Matmul.for_weight(qweight, "bfloat16"), qweight, x, None, kernel(x, pack(qweight)))


def test_forcing_a_lower_level_in_a_fresh_process():
    """$BITKERN_CPU_LEVEL lowers the level of every kernel the process builds (and keys its cache by it); a level
    above this CPU is refused, naming what the CPU lacks."""
    script = ("import torch, bitkern; from bitkern.tuner import host_cpu; "
              "l = bitkern.Linear(256, 64, dtype='int4', group_size=64); x = torch.randn(1, 256).bfloat16(); "
              "w = l.dequantize_weight().float(); "
              "print(host_cpu().key, bool((l(x).float() - x.float() @ w.T).abs().max() < 0.2))")
    forced = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "BITKERN_CPU_LEVEL": "x86-64-v3"})
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert forced.stdout.split() == [f"cpu-x86-64-v3-{host_cpu().cores}c", "True"]
    above = [level.name for level in isa.LEVELS if not level.runs_on(open("/proc/cpuinfo").read().split())]
    if not above:
        pytest.skip("this CPU runs every level")
    refused = subprocess.run([sys.executable, "-c", "from bitkern.tuner import host_cpu; host_cpu()"],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "BITKERN_CPU_LEVEL": above[-1]})
    assert refused.returncode != 0
    assert f"BITKERN_CPU_LEVEL='{above[-1]}': this CPU" in refused.stderr and "it runs the levels" in refused.stderr


def test_a_named_level_is_a_prebuild_target():
    device = device_for("cpu:x86-64-v3")
    assert device.level.name == "x86-64-v3" and device.key == f"cpu-x86-64-v3-{host_cpu().cores}c"
    assert device.runs_here() == isa.level("x86-64-v3").runs_on(open("/proc/cpuinfo").read().split())
    with pytest.raises(ValueError, match="cpu level 'avx1024' is not known"):
        device_for("cpu:avx1024")



def test_a_cache_of_a_level_above_this_cpu_is_never_run_here(tmp_path, caplog):
    """Prebuilt for the highest level this CPU lacks (compiled, not timed), exported and imported into another
    cache: the import says those kernels never run here, and this CPU's call builds its own kernel."""
    from bitkern.cache import DiskStore, forget, kernel_for
    from bitkern.cache.prebuild import LinearShape, prebuild

    above = [level.name for level in isa.LEVELS if not host_cpu().at_level(level.name).runs_here()]
    if not above:
        pytest.skip("this CPU runs every level")
    built = DiskStore(tmp_path / "fleet")
    report = prebuild([LinearShape(64, 256, ("proj",))], "int4", 64, f"cpu:{above[-1]}", rows=[1], store=built,
                      progress=False)
    assert report.built == 1 and {entry["key"]["target"] for entry in built.entries()} == {
        f"cpu-{above[-1]}-{host_cpu().cores}c"}
    built.export(tmp_path / "fleet.tar.gz")
    here = DiskStore(tmp_path / "here")
    with caplog.at_level("WARNING", logger="bitkern"):
        assert here.import_(tmp_path / "fleet.tar.gz") == 1
    assert f"the cpu-{above[-1]}-{host_cpu().cores}c kernels of" in caplog.text and "never run here" in caplog.text
    forget()
    spec = Matmul("int4", "bfloat16", group_size=64)
    kernel = kernel_for(spec, 64, 256, 1, "tile16", store=here)
    assert not isinstance(kernel.record, dict)  # built in this process, not loaded from the imported entry
    assert {entry["key"]["target"] for entry in here.entries()} == {f"cpu-{above[-1]}-{host_cpu().cores}c",
                                                                   host_cpu().key}
