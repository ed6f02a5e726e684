"""aarch64: host detection from real /proc/cpuinfo and macOS sysctl samples, the named parts to cross-compile for, the
x86 templates refused for aarch64 levels with their reason, and the templates serving aarch64 compiled for every
aarch64 level (inner loops of NEON `fmla`, `tbl`, `sdot` on v registers) but never run on this x86-64 machine."""

import platform
import re
import shutil
import subprocess

import pytest

from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu import TEMPLATES, isa
from bitkern.codegen.cpu.runtime import library_arch
from bitkern.codegen.cpu.vnni import TEMPLATE as VNNI, VnniConfig
from bitkern.ops import GroupedMatmul, Matmul
from bitkern.tuner import device_for, host_cpu
from bitkern.tuner.device import (CPU_TARGETS, cpuinfo_features, cpuinfo_model, named_cpu, parse_sysctl,
                                  sysctl_caches, sysctl_features, unrunnable)
from bitkern.tuner.select import shortlist
from bitkern.tuner.space import enumerate_candidates, usable_templates
from tests.helpers import benchmark, matmul_case

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="checks cross-compiling from x86-64")

_COMMON = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm"
# /proc/cpuinfo of one core of each (the Features line as Linux prints it) and the level and name bitkern reads
CPUINFO = {
    "Neoverse N1 (Ampere Altra)": (f"{_COMMON} lrcpc dcpop asimddp ssbs", "0x3", "0xd0c", "armv8.2-a", "Neoverse N1"),
    "Neoverse V1 (Graviton 3)": ((f"{_COMMON} jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit "
                                  "uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng"), "0x1",
                                 "0xd40", "sve", "Neoverse V1"),
    "Neoverse V2 (Graviton 4)": ((f"{_COMMON} jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit "
                                  "uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 "
                                  "svesm4 flagm2 frint svei8mm svebf16 i8mm bf16 dgh rng bti"), "0x0", "0xd4f", "sve2",
                                 "Neoverse V2"),
    "Cortex-A76 (Raspberry Pi 5)": (f"{_COMMON} lrcpc dcpop asimddp", "0x4", "0xd0b", "armv8.2-a", "Cortex-A76"),
}
# `sysctl hw machdep.cpu.brand_string` on macOS (the lines bitkern reads) and the level each runs
SYSCTL = {
    "Apple M1": ("""machdep.cpu.brand_string: Apple M1
hw.ncpu: 8
hw.l1dcachesize: 65536
hw.l2cachesize: 4194304
hw.perflevel0.physicalcpu: 4
hw.perflevel0.l1dcachesize: 131072
hw.perflevel0.l2cachesize: 12582912
hw.optional.floatingpoint: 1
hw.optional.AdvSIMD: 1
hw.optional.arm.FEAT_FP16: 1
hw.optional.arm.FEAT_DotProd: 1
hw.optional.arm.FEAT_I8MM: 0
hw.optional.arm.FEAT_BF16: 0
hw.optional.arm.FEAT_SME: 0
hw.optional.arm64: 1""", "armv8.2-a", 12 << 20),
    "Apple M4": ("""machdep.cpu.brand_string: Apple M4
hw.ncpu: 10
hw.perflevel0.physicalcpu: 4
hw.perflevel0.l1dcachesize: 131072
hw.perflevel0.l2cachesize: 16777216
hw.optional.floatingpoint: 1
hw.optional.AdvSIMD: 1
hw.optional.arm.FEAT_DotProd: 1
hw.optional.arm.FEAT_I8MM: 1
hw.optional.arm.FEAT_BF16: 1
hw.optional.arm.FEAT_SME: 1
hw.optional.arm.FEAT_SME2: 1
hw.optional.arm64: 1""", "armv8.6-a", 16 << 20),
}
ARM_LEVELS = [level.name for level in isa.ARM_LEVELS]
DOTPROD_LEVELS = [level.name for level in isa.ARM_LEVELS if "asimddp" in level.features]
I8MM_LEVELS = [level.name for level in isa.ARM_LEVELS if "i8mm" in level.features]
N, K = 64, 256


def _cpuinfo(features: str, variant: str, part: str) -> str:
    core = (f"BogoMIPS\t: 50.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
            f"CPU variant\t: {variant}\nCPU part\t: {part}\nCPU revision\t: 1\n")
    return "".join(f"processor\t: {i}\n{core}\n" for i in range(2))


@pytest.mark.parametrize("cpu", CPUINFO)
def test_linux_aarch64_cpus_are_detected_from_cpuinfo(cpu):
    features, variant, part, level, name = CPUINFO[cpu]
    text = _cpuinfo(features, variant, part)
    assert isa.best_level(cpuinfo_features(text), "aarch64").name == level
    assert cpuinfo_model(text) == name


@pytest.mark.parametrize("cpu", SYSCTL)
def test_macos_arm64_cpus_are_detected_from_sysctl(cpu):
    text, level, l2 = SYSCTL[cpu]
    values = parse_sysctl(text)
    features = sysctl_features(values)
    assert isa.best_level(features, "aarch64").name == level
    assert ("sme" in features) == (cpu == "Apple M4") and "sve" not in features
    assert sysctl_caches(values) == (128 << 10, l2, l2)  # the performance cores'


def test_an_aarch64_linux_host_runs_its_level(monkeypatch):
    """host_cpu() on a Graviton 3 (its /proc/cpuinfo; sysfs caches as read here): level sve tuned for its core (so it
    finds kernels prebuilt for cpu:neoverse-v1), its code runnable there, the x86 levels not; $BITKERN_CPU_LEVEL
    forces a lower aarch64 level."""
    from bitkern.tuner import device

    features, variant, part, _, _ = CPUINFO["Neoverse V1 (Graviton 3)"]
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(device, "_cpuinfo_text", lambda: _cpuinfo(features, variant, part))
    monkeypatch.setattr(device, "_cpu_flags", lambda: cpuinfo_features(_cpuinfo(features, variant, part)))
    monkeypatch.delenv(device.LEVEL_VARIABLE, raising=False)
    graviton = device.host_cpu.__wrapped__()  # past its cache: the process's own answer was read on x86-64
    assert (graviton.name, graviton.level.name, graviton.runs_here()) == ("Neoverse V1", "sve", True)
    assert graviton.key == device_for("cpu:neoverse-v1").key
    assert not graviton.at_level("x86-64").runs_here() and graviton.at_level("armv8.2-a").runs_here()
    monkeypatch.setenv(device.LEVEL_VARIABLE, "sve2")
    with pytest.raises(ValueError, match=r"lacks sve2; it runs the levels \['armv8-a', 'armv8.2-a', 'armv8.6-a', "
                                         r"'sve'\]"):
        device.host_cpu.__wrapped__()


def test_x86_cpuinfo_still_reads_flags_and_other_architectures_are_refused(monkeypatch):
    assert cpuinfo_features("processor\t: 0\nflags\t\t: fpu sse2 avx2\n") == {"fpu", "sse2", "avx2"}
    with pytest.raises(ValueError, match=r"arch='riscv64' is not accepted; bitkern's CPU kernels know \['aarch64'"):
        isa.best_level({"rv64"}, "riscv64")
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    with pytest.raises(RuntimeError, match="bitkern's CPU kernels need an x86-64 or aarch64 CPU; this machine is "
                                           "riscv64"):
        host_cpu.__wrapped__()


@pytest.mark.parametrize("name", CPU_TARGETS)
def test_named_parts_are_targets_with_their_llvm_cpu(name):
    device = device_for(f"cpu:{name}")
    part = CPU_TARGETS[name]
    assert device.level.name == part.level and device.level.arch == "aarch64" and device.vector_bytes == 16
    target = device.level.target_dict(device.cores)
    assert target["mtriple"] == "aarch64-linux-gnu" and target["mcpu"] == part.llvm_cpu
    assert device.key == f"cpu-{part.level}+{part.llvm_cpu}-{host_cpu().cores}c"
    assert not device.runs_here()
    assert unrunnable(device.key) == "they are aarch64 code and this machine is x86_64"
    with pytest.raises(ValueError, match=r"cpu target 'graviton9' is not known; accepted: \['apple-m1'"):
        named_cpu("graviton9")


def test_every_aarch64_level_is_a_tvm_target():
    import tvm

    for level in isa.ARM_LEVELS:
        target = tvm.target.Target(level.target_dict(2))
        assert target.attrs["mtriple"] == "aarch64-linux-gnu"
    assert "+sve2" in isa.level("sve2").llvm_attributes and "+dotprod" in isa.level("armv8.2-a").llvm_attributes


@pytest.mark.parametrize("level", ARM_LEVELS)
def test_templates_of_x86_only_are_refused_for_aarch64_levels(level):
    """The FMA templates (dense and grouped) and the lookup template serve aarch64 (their few level-specific
    instructions have NEON forms), the VNNI templates (dense and grouped) the levels with the dot-product extension
    (sdot); the others are x86 code, refused naming it."""
    device = host_cpu().at_level(level)
    spec = Matmul("int4", "bfloat16", group_size=64)
    usable, unused = usable_templates(spec, N, K, (1, 16), "tile16", device)
    assert [template.name for template in usable] == ["fma", "generic"]
    assert "lookup template serves at most" in unused["lut"]
    for template in TEMPLATES:
        vnni = template.name in ("vnni", "grouped_vnni")
        serves = template.name in ("generic", "fma", "lut", "grouped_fma") or (vnni and level in DOTPROD_LEVELS)
        assert template.runs_at(isa.level(level)) == serves
        if not serves and not vnni:
            assert unused[template.name] == (f"the {level} level (aarch64; the {template.title} template is x86_64 "
                                             f"code)")
            with pytest.raises(ValueError, match=f"cannot build for the {level} level"):
                build_kernel(spec, N, K, template.name, template.config_type(), "tile16", (1, 16), device)


def _assembly(spec: Matmul, device, name: str = "generic", bucket: tuple[int, int] = (1, 16), config=None) -> str:
    """The code of template `name`'s `config` (default: its first candidate) for `device`, as TVM's LLVM writes it (no
    cross tools needed; benchmarks/arm_model.py's `assembly`, the build's pass settings)."""
    if config is None:
        _, candidates = enumerate_candidates(spec, N, K, bucket, "tile16", device)
        config = next(c.config for c in candidates if c.template == name)
    return benchmark("arm_model").assembly(spec, N, K, name, config, bucket, device)


def _neon_only(code: str) -> bool:
    """No SVE arithmetic (the templates' fixed-width vectors map to NEON; at the SVE levels LLVM may set a constant
    with SVE's mov of an immediate or index of a start and step, which write the same register) and no x86
    registers."""
    sve = [line for line in code.splitlines() if re.search(r"\bz\d+\.[bhsd]\b", line)]
    immediate = r"#-?(0x[0-9a-f]+|\d+)"
    return all(re.fullmatch(rf"\s*(mov\s+z\d+\.[bhsd], {immediate}|index\s+z\d+\.[bhsd], {immediate}, {immediate})",
                            line) for line in sve) and \
        "xmm" not in code and "ymm" not in code


@pytest.mark.parametrize("level", ARM_LEVELS)
def test_the_generic_template_compiles_to_neon_at_every_aarch64_level(level):
    """float32 activations: the multiply-adds are NEON fmla on 4-lane v registers.  The SVE levels get the same
    NEON code: the template's vectors have a fixed width, which LLVM maps to NEON without a minimum SVE length."""
    code = _assembly(Matmul("int4", "float32", group_size=64), host_cpu().at_level(level))
    assert len(re.findall(r"\bfmla\s+v\d+\.4s", code)) >= 4 and _neon_only(code)


@pytest.mark.parametrize("level", ARM_LEVELS)
def test_the_fma_and_lookup_templates_compile_to_fmla_and_tbl_at_every_aarch64_level(level):
    """The FMA template: integer codes converted in vector registers (ucvtf/scvtf .4s) and multiplied in by fmla;
    code books (nf4) looked up by tbl over the 64-byte value table's four registers, no scalar loads per code.
    The lookup template: its partial-sum tables read by the same tbl."""
    device = host_cpu().at_level(level)
    converted = _assembly(Matmul("int4", "bfloat16", group_size=64), device, "fma")
    assert len(re.findall(r"\bfmla\s+v\d+\.4s", converted)) >= 32
    assert len(re.findall(r"\b[us]cvtf\s+v\d+\.4s", converted)) >= 16 and _neon_only(converted)
    looked_up = _assembly(Matmul("nf4", "bfloat16", group_size=64), device, "fma")
    tables = re.findall(r"\btbl\s+v\d+\.16b, \{ v\d+\.16b, v\d+\.16b, v\d+\.16b, v\d+\.16b \}", looked_up)
    assert len(tables) >= 16 and len(re.findall(r"\bfmla\s+v\d+\.4s", looked_up)) >= 32 and _neon_only(looked_up)
    lookup = _assembly(Matmul("int4", "float32", group_size=64), device, "lut", (1, 4))
    assert len(re.findall(r"\btbl\s+v\d+\.16b, \{ v\d+\.16b, v\d+\.16b, v\d+\.16b, v\d+\.16b \}",
                          lookup)) >= 8 and _neon_only(lookup)


def _inner_loop(code: str, instruction: str) -> list[str]:
    """The lines of the innermost loop (a label to a backward branch to it, holding no other such loop) with the most
    `instruction`s: the body of the most rows, where a kernel has one per row count."""
    lines = code.splitlines()
    labels = {line.rstrip(":"): i for i, line in enumerate(lines) if re.fullmatch(r"\.?L\w+:", line)}
    spans = []
    for i, line in enumerate(lines):
        branch = re.fullmatch(r"\s+(?:b(?:\.\w+)?|cbn?z\s+\w+,|tbn?z\s+\w+,\s*#\d+,)\s+(\.?L\w+)", line)
        if branch and labels.get(branch.group(1), i) < i:
            spans.append((labels[branch.group(1)], i))
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return max((lines[a:b + 1] for a, b in innermost),
               key=lambda loop: sum(bool(re.search(rf"\b{instruction}\b", line)) for line in loop))


# what a scalar fallback of byte products would show: byte loads, lanes moved to general registers, integer multiplies
_SCALAR = re.compile(r"\b(ldrs?b|umov|smov|sxtb|uxtb|mul|madd|msub|smull|umull|smaddl|umaddl)\b")
VNNI_TYPES = {"int4": 64, "int8": 64, "nf4": 64, "int2": 64, "mxfp4": 32}  # and their group sizes


@pytest.mark.parametrize("level", DOTPROD_LEVELS)
@pytest.mark.parametrize("name", VNNI_TYPES)
@pytest.mark.parametrize("rows", [1, 4])
def test_the_vnni_template_compiles_to_sdot_at_every_aarch64_level_with_dotprod(level, name, rows):
    """int8 activations: the inner loop (an activation block of 32 k's) holds one sdot per 4 columns, row and 4 k's
    (8 per 16-column tile and row, times 4 registers), of broadcast activation quads (ld1r), the codes masked per byte
    position; code books and floats looked up first, a single-register tbl per 4 columns and 4 k's (mxfp4's loop, its
    group, also decodes the group's scales); no scalar byte products and no x86 registers.  M=1 takes the first
    candidate; M=4 a block of 4 rows (the codes looked up once, multiplied per row)."""
    spec = Matmul(name, "bfloat16", group_size=VNNI_TYPES[name], activation_quant="int8")
    device = host_cpu().at_level(level)
    assert "vnni" not in usable_templates(spec, N, K, (1, rows), "tile16", device)[1]
    config = VnniConfig(1, True, 16, 4, 32) if rows == 4 else None
    code = _assembly(spec, device, "vnni", (1, rows), config)
    loop = "\n".join(_inner_loop(code, "sdot"))
    sdot = re.findall(r"\bsdot\s+v\d+\.4s, v\d+\.16b, v\d+\.(16b|4b\[\d\])", loop)
    assert len(sdot) == 32 * rows and len(re.findall(r"\bld1r\s+\{ v\d+\.4s \}", loop)) >= 8 * rows
    tables = re.findall(r"\btbl\s+v\d+\.16b, \{ v\d+\.16b \}, v\d+\.16b", loop)
    assert len(tables) >= 32 * (name in ("nf4", "mxfp4")) and (tables == []) == (name not in ("nf4", "mxfp4"))
    assert not _SCALAR.search(loop) and _neon_only(code), loop


@pytest.mark.parametrize("level", I8MM_LEVELS)
@pytest.mark.parametrize("name", VNNI_TYPES)
@pytest.mark.parametrize("rows", [2, 4])
def test_the_vnni_template_multiplies_row_pairs_by_smmla_at_every_aarch64_level_with_i8mm(level, name, rows):
    """int8 activations in row pairs (i8mm): the tuner offers them for blocks of 2 and 4 rows, and the inner loop (an
    activation block) holds per tile and row pair 32 smmla (2 rows x 2 columns x 8 k's each: half sdot's count per
    row) and no sdot, their column operands zipped from two products' codes (32 zips per tile, shared by the row
    pairs), a code book looked up once per row block (32 tbl; mxfp4's loop, its group, also decodes the group's
    scales), no scalar byte products and no x86 registers."""
    spec = Matmul(name, "bfloat16", group_size=VNNI_TYPES[name], activation_quant="int8")
    device = host_cpu().at_level(level)
    config = VnniConfig(1, True, 16, rows, 32, pairs=True)
    assert config in VNNI.configs(spec, N, K, (1, 4), device, None)
    loop = "\n".join(_inner_loop(_assembly(spec, device, "vnni", (1, 4), config), "smmla"))
    smmla = len(re.findall(r"\bsmmla\s+v\d+\.4s, v\d+\.16b, v\d+\.16b", loop))
    blocks = smmla // (16 * rows)  # activation blocks in the loop (LLVM may unroll mxfp4's one-block groups)
    assert blocks >= 1 and smmla == 16 * rows * blocks and not re.search(r"\bsdot\b", loop)
    assert len(re.findall(r"\bzip[12]\s+v\d+\.4s", loop)) >= 32 * blocks
    tables = re.findall(r"\btbl\s+v\d+\.16b, \{ v\d+\.16b \}, v\d+\.16b", loop)
    assert len(tables) >= 32 * blocks * (name in ("nf4", "mxfp4")) and (tables == []) == (name not in ("nf4", "mxfp4"))
    assert not _SCALAR.search(loop), loop


def test_row_pairs_are_refused_at_levels_without_i8mm():
    """armv8.2-a (Neoverse N1, Cortex-A76) and x86 have no byte matrix product: the tuner never offers row pairs
    there, and building them is refused naming it, before any code is made; at armv8.6-a single rows (M=1) get none
    either (a row paired with itself does twice the work)."""
    spec = Matmul("int4", "bfloat16", group_size=64, activation_quant="int8")
    vnni = VNNI
    for device in (host_cpu().at_level("armv8.2-a"), host_cpu()):
        assert not any(config.pairs for config in vnni.configs(spec, N, K, (1, 4), device, None))
    assert not any(config.pairs for config in vnni.configs(spec, N, K, (1, 1), host_cpu().at_level("armv8.6-a"),
                                                           None))
    with pytest.raises(ValueError, match=r"pairs=True needs a byte matrix product \(aarch64's i8mm, smmla\); the "
                                         r"armv8.2-a level has none"):
        build_kernel(spec, N, K, "vnni", VnniConfig(1, True, 16, 2, 32, pairs=True), "tile16", (1, 4),
                     host_cpu().at_level("armv8.2-a"))
    with pytest.raises(ValueError, match=r"pairs=True multiplies rows two at a time: rows=1 must be even"):
        VnniConfig(rows=1, pairs=True)


def test_the_vnni_template_is_refused_at_aarch64_levels_without_dotprod():
    """armv8-a (Cortex-A72) has no sdot: the VNNI template, the only one of int8 activations, is refused naming the
    feature it lacks."""
    device = host_cpu().at_level("armv8-a")
    spec = Matmul("int4", "bfloat16", group_size=64, activation_quant="int8")
    usable, unused = usable_templates(spec, N, K, (1, 16), "tile16", device)
    assert usable == [] and unused["vnni"] == "the armv8-a level (it needs asimddp)"
    with pytest.raises(ValueError, match=r"cannot build for the armv8-a level \(it needs asimddp\)"):
        build_kernel(spec, N, K, "vnni", VnniConfig(), "tile16", (1, 16), device)
    with pytest.raises(ValueError, match=r"no kernel configuration builds .* vnni: the armv8-a level \(it needs "
                                         r"asimddp\)"):
        shortlist(spec, N, K, (1, 16), "tile16", device)  # what the tuner tells the caller


_LINKER = shutil.which("aarch64-linux-gnu-ld") or shutil.which("ld.lld")
_OBJDUMP = shutil.which("aarch64-linux-gnu-objdump") or shutil.which("llvm-objdump")


@pytest.mark.skipif(_LINKER is None or _OBJDUMP is None,
                    reason="an aarch64 linker and disassembler (Debian: binutils-aarch64-linux-gnu) are not here")
def test_a_kernel_built_for_an_aarch64_part_is_kept_but_never_run_here():
    """Built through the build path (linked by the aarch64 linker), its library aarch64 code holding fmla on v
    registers; calling it is refused, naming the architectures."""
    device = device_for("cpu:neoverse-v1")
    spec, qweight, x, _ = matmul_case("int4", N, K, 2, "float32", group=64, seed=1)
    _, candidates = enumerate_candidates(spec, N, K, (1, 16), "tile16", device)
    config = next(c.config for c in candidates if c.template == "generic")
    kernel = build_kernel(spec, N, K, "generic", config, "tile16", (1, 16), device)
    assert library_arch(kernel.library) == "aarch64"
    code = subprocess.run([_OBJDUMP, "-d", "--no-show-raw-insn", kernel.library], check=True, capture_output=True,
                          text=True).stdout
    assert re.search(r"\bfmla\s+v\d+\.4s", code)
    with pytest.raises(RuntimeError, match="this kernel is aarch64 code .* this machine is x86_64: it was built for "
                                           "another machine and is never run here"):
        kernel(x, pack(qweight))


@pytest.mark.skipif(_LINKER is None, reason="an aarch64 linker (Debian: binutils-aarch64-linux-gnu) is not here")
def test_a_prebuilt_cache_for_an_aarch64_part_is_kept_but_never_run_here(tmp_path, caplog):
    """`prebuild --target cpu:cortex-a76` stores the generic kernel under the part's key; imported into another
    cache, it is kept and said never to run here."""
    from bitkern.cache import DiskStore
    from bitkern.cache.prebuild import LinearShape, prebuild

    built = DiskStore(tmp_path / "pi5")
    report = prebuild([LinearShape(N, K, ("proj",))], "int4", 64, "cpu:cortex-a76", rows=[1], store=built,
                      progress=False)
    key = device_for("cpu:cortex-a76").key
    assert report.built == 1 and [entry["key"]["target"] for entry in built.entries()] == [key]
    built.export(tmp_path / "pi5.tar.gz")
    with caplog.at_level("WARNING", logger="bitkern"):
        assert DiskStore(tmp_path / "here").import_(tmp_path / "pi5.tar.gz") == 1
    assert f"the {key} kernels of" in caplog.text and "never run here: they are aarch64 code" in caplog.text


@pytest.mark.parametrize("level", DOTPROD_LEVELS)
@pytest.mark.parametrize("name", ["int4", "nf4"])
def test_the_grouped_vnni_template_compiles_to_sdot_or_smmla_at_every_aarch64_level_with_dotprod(level, name):
    """Experts' rows with int8 activations (the grouped VNNI template): one sdot per 4 columns, row and 4 k's in the
    inner loop (8 per 16-column tile and row, times 4 registers), nf4's code book looked up by tbl; where the level has i8mm, blocks of
    rows in pairs by smmla too.  No x86 or SVE arithmetic."""
    spec = GroupedMatmul(name, "bfloat16", group_size=64, experts=4, top_k=2, activation_quant="int8")
    device = host_cpu().at_level(level)
    loop = "\n".join(_inner_loop(_assembly(spec, device, "grouped_vnni", (1, 1), VnniConfig(1, prefetch=32)),
                                 "sdot"))
    assert len(re.findall(r"\bsdot\s+v\d+\.4s", loop)) == 32 and _neon_only(loop)
    assert (len(re.findall(r"\btbl\s+v\d+\.16b", loop)) >= 32) == (name == "nf4")
    if level in I8MM_LEVELS:
        paired = _assembly(spec, device, "grouped_vnni", (1, 4), VnniConfig(2, rows=2, pairs=True))
        assert re.search(r"\bsmmla\s+v\d+\.4s", paired) and _neon_only(paired)


@pytest.mark.parametrize("level", ARM_LEVELS)
@pytest.mark.parametrize("name", ["int4", "nf4"])
def test_the_grouped_template_compiles_to_neon_at_every_aarch64_level(level, name):
    """Experts' rows (`GroupedMatmul`, the grouped FMA template) on aarch64: NEON fmla, and nf4's code book looked up
    by tbl; no x86 or SVE arithmetic (computed under emulation: tests/aarch64)."""
    spec = GroupedMatmul(name, "bfloat16", group_size=64, experts=4, top_k=2)
    code = _assembly(spec, host_cpu().at_level(level), "grouped_fma", (1, 1))
    tables = re.findall(r"\btbl\s+v\d+\.16b", code)
    assert len(re.findall(r"\bfmla\s+v\d+\.4s", code)) >= 16 and (len(tables) >= 8) == (name == "nf4")
    assert _neon_only(code)


@pytest.mark.parametrize("level", ARM_LEVELS)
def test_the_grouped_templates_with_swiglu_and_the_weighted_sum_compile_to_neon_at_every_aarch64_level(level):
    """The output stage of experts' decode (SwiGLU on each expert's [gate; up] halves, the weighted top-k sum) on
    aarch64: the grouped FMA kernel's fmla, and where the level has the dot product the grouped VNNI kernel's sdot; no
    x86 or SVE arithmetic."""
    device = host_cpu().at_level(level)
    spec = GroupedMatmul("int4", "bfloat16", group_size=64, experts=4, top_k=2, epilogue="swiglu", combine=True)
    code = _assembly(spec, device, "grouped_fma", (1, 1))
    assert len(re.findall(r"\bfmla\s+v\d+\.4s", code)) >= 16 and _neon_only(code)
    if level in DOTPROD_LEVELS:
        quantized = GroupedMatmul("int4", "bfloat16", group_size=64, experts=4, top_k=2, epilogue="swiglu",
                                  combine=True, activation_quant="int8")
        code = _assembly(quantized, device, "grouped_vnni", (1, 1), VnniConfig(2, prefetch=32))
        assert re.search(r"\bsdot\s+v\d+\.4s", code) and _neon_only(code)
