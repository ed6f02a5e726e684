"""Modelled speed of bitkern's aarch64 kernels on named ARM cores (Neoverse N1/V1/V2, Apple M1/M4, Cortex-A76), from
their generated assembly: measured only where run on such a machine (--native).

Each kernel is cross-compiled here for the core's target (TVM's LLVM, the build's pass settings) and its
hot inner loops are read from the assembly: the innermost loops holding the products (`fmla` for the FMA and generic
templates, the four-register `tbl` for the lookup template, `sdot` for the VNNI template serving int8 activations,
`smmla` for its row pairs) and,
for the generic template, the one decoding a weight tile into memory.  Each loop's instructions are sorted into
classes (`bitkern.tuner.arm_cores.CLASSES`) and priced by the core's per-class throughputs (`ArmCore.cycles`: the
busiest pipe group, or the issue width); each loop covers a known number of weights per iteration (4 per `fmla` of 4
float32 lanes and row, 16/bits per `tbl` lane of the lookup, 4 per 16-byte store of decoded floats, 16 per `sdot` of
4 int32 lanes and row, 16 per `smmla` of 2 columns' 8 k's and a row pair), and runs once per weight (decode) or once per
row or block of rows (products).
Cycles per weight byte at M=1, at the core's clock, give one core's decode rate; with every core streaming, each gets
its share of the machine's DRAM peak, so the predicted M=1 fraction of DRAM is min(1, decode rate / share).  At M=16
and M=512 the predicted time is the larger of the compute time (cycles over all cores) and the weights' DRAM time.
Not modelled: loop overheads outside the inner loops (group scales, the prologue widening x, the epilogue), cache
misses beyond the DRAM stream, frequency changes under load.

Run: python benchmarks/arm_model.py [--cores neoverse-v1 ...] [--out benchmarks/results/arm_model.md]
     python benchmarks/arm_model.py --native [--native-core apple-m1] [--native-rows 1 16 512]
         (on an aarch64 machine: also measures, benchmarks/cpu_levels.py's way, and prints both side by side)
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import re
from collections import Counter
from dataclasses import dataclass

from bitkern.ops import Matmul
from bitkern.tuner.arm_cores import ARM_CORES, CLASSES, ArmCore

TYPES = ("int4", "nf4", "int8", "mxfp4", "int2")
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
TEMPLATES = ("fma", "lut", "generic")  # the dense templates serving aarch64 with float activations
# the activations each template set serves: float (activation_quant="none") and int8 per 32-k block (the VNNI
# template's sdot, or smmla for row pairs, activation_quant="int8")
ACTIVATIONS = {"none": TEMPLATES, "int8": ("vnni",)}
ROWS = (1, 16, 512)
GROUP = 128
GROUPS = {"mxfp4": 32}  # as benchmarks/cpu_levels.py
TARGET_FRACTION = 0.85

_BRANCH = re.compile(r"(b\.\w+|b|cbn?z|tbn?z)\s+.*?([.\w$]+)$")
_VECTOR = re.compile(r"\b[vz]\d+\.|\b[qdshb]\d+\b")
_SIMPLE = {"fp": ("fmla", "fmls", "fmul", "fmulx", "fadd", "fsub", "fmax", "fmin", "fmaxnm", "fminnm", "fneg", "fabs",
                  "faddp", "fdiv", "fmadd", "fmsub", "bfmlalb", "bfmlalt"),
           "convert": ("scvtf", "ucvtf", "fcvtl", "fcvtl2", "fcvtn", "fcvtn2", "bfcvtn", "bfcvtn2", "bfcvt", "fcvt",
                       "fcvtzs", "fcvtzu", "fcvtas", "fcvtns"),
           "shift": ("ushr", "sshr", "shl", "ushl", "sshl", "ushll", "ushll2", "sshll", "sshll2", "shll", "shll2",
                     "shrn", "shrn2", "xtn", "xtn2", "sli", "sri", "usra", "ssra", "uxtl", "uxtl2", "sxtl", "sxtl2"),
           "imul": ("mul", "mla", "mls", "umull", "umull2", "smull", "smull2", "umlal", "umlal2", "smlal", "smlal2",
                    "sqdmulh"),
           "dot": ("sdot", "udot", "usdot", "sudot", "bfdot"),
           "mmla": ("smmla", "ummla", "usmmla", "bfmmla"),
           "prefetch": ("prfm", "prfum"),
           "load_broadcast": ("ld1r",)}
_CLASS_OF = {mnemonic: name for name, mnemonics in _SIMPLE.items() for mnemonic in mnemonics}


def classify(instruction: str) -> list[tuple[str, int]]:
    """The classes (and how many of each) of one aarch64 instruction as LLVM prints it ("fmla v0.4s, v1.4s, v2.4s"):
    a load or store pair counts twice, a `tbl` by its table registers, a vector move from a general register as
    `dup_gpr`, other vector instructions not listed (logic, compares, integer add, moves, permutes) as `logic`."""
    mnemonic, _, operands = instruction.partition(" ")
    operands = operands.strip()
    if _BRANCH.match(instruction) or mnemonic in ("ret", "bl", "blr", "br"):
        return [("branch", 1)]
    if mnemonic in _CLASS_OF and (_VECTOR.search(operands) or _CLASS_OF[mnemonic] in ("prefetch", "load_broadcast")):
        return [(_CLASS_OF[mnemonic], 1)]
    if mnemonic in ("tbl", "tbx"):
        return [(f"tbl{operands.split('{')[1].split('}')[0].count(',') + 1}", 1)]
    if mnemonic.startswith(("ld", "st")):
        registers = operands.split("}")[0].count(",") + 1 if operands.startswith("{") else \
            (2 if mnemonic[2:3] in ("p", "n") else 1)
        return [("load" if mnemonic.startswith("ld") else "store", registers)]
    if mnemonic in ("dup", "mov", "ins", "fmov") and re.search(r",\s*[wx](\d+|zr)$", operands) and \
            _VECTOR.search(operands):
        return [("dup_gpr", 1)]
    return [("logic" if _VECTOR.search(operands) else "scalar", 1)]


def instructions(assembly: str) -> tuple[list[str], dict[str, int]]:
    """(the instructions of an assembly listing, in order; {label: index of the instruction it precedes})."""
    found, labels = [], {}
    for line in assembly.splitlines():
        text = line.split("//")[0].strip()
        if text.endswith(":"):
            labels[text[:-1]] = len(found)
        elif text and not text.startswith("."):
            found.append(re.sub(r"\s+", " ", text))
    return found, labels


def innermost_loops(assembly: str) -> list[list[str]]:
    """The bodies of the innermost loops (a backward branch to a label, enclosing no other such branch)."""
    code, labels = instructions(assembly)
    loops = []
    for end, instruction in enumerate(code):
        match = _BRANCH.match(instruction)
        if match and labels.get(match[2], end + 1) <= end:
            loops.append((labels[match[2]], end))
    return [code[start:end + 1] for start, end in loops
            if not any(start <= a and b <= end and (a, b) != (start, end) for a, b in loops)]


def counts(body: list[str]) -> dict[str, int]:
    """{class: instructions} of a loop body."""
    found = Counter()
    for instruction in body:
        for name, number in classify(instruction):
            found[name] += number
    return dict(found)


@dataclass(frozen=True)
class Loop:
    """One hot inner loop: its instruction counts per iteration, the weights an iteration covers, and how many times
    each weight passes through it for M rows (a function of M)."""

    mix: dict
    weights: float
    passes: object

    def cycles_per_weight(self, core: ArmCore, m: int) -> float:
        return core.cycles(self.mix) / self.weights * self.passes(m)


def hot_loops(assembly: str, template: str, bits: int, block_rows: int, pairs: bool = False) -> list[Loop]:
    """The loops a weight passes through, read from the assembly of `template`'s kernel (see the module's model):
    the product loop with the most `fmla` (or, for the lookup template, `tbl`; for the VNNI template `sdot`, or
    `smmla` where its rows go in `pairs`), and for the generic template its decode loop (the most stores of decoded
    floats among the others)."""
    loops = [(body, counts(body)) for body in innermost_loops(assembly)]
    if template == "vnni":  # one sdot: 4 lanes x 4 k's of one row; one smmla: 2 columns x 8 k's of a row pair; a row
        # block decodes its words once
        products, rows_each = ("mmla", 2) if pairs else ("dot", 1)
        body, mix = max(loops, key=lambda loop: loop[1].get(products, 0))
        return [Loop(mix, 16 * rows_each * mix.get(products, 0) / block_rows, lambda m: -(-m // block_rows))]
    if template == "lut":
        body, mix = max(loops, key=lambda loop: loop[1].get("tbl4", 0))
        return [Loop(mix, mix.get("tbl4", 0) * 4 * 4 / bits, lambda m: 1)]
    body, mix = max(loops, key=lambda loop: _fmla(loop[0]))
    if template == "fma":
        return [Loop(mix, 4 * _fmla(body) / block_rows, lambda m: -(-m // block_rows))]
    product = Loop(mix, 4 * _fmla(body), lambda m: m)
    decode_body, decode_mix = max((loop for loop in loops if loop[0] is not body and _tile_stores(loop[0])),
                                  key=lambda loop: loop[1].get("convert", 0) + loop[1].get("fp", 0))
    return [Loop(decode_mix, 4 * _tile_stores(decode_body), lambda m: 1), product]


def _fmla(body: list[str]) -> int:
    return sum(1 for instruction in body if re.match(r"fmla v\d+\.4s", instruction))


def _tile_stores(body: list[str]) -> int:
    """16-byte vector registers a loop stores outside the stack (spills go to sp): a decoded tile's floats."""
    return sum(operands.count("q") if mnemonic in ("str", "stp", "stur") else operands.split("}")[0].count("v")
               for mnemonic, _, operands in (instruction.partition(" ") for instruction in body)
               if mnemonic in ("str", "stp", "stur", "st1") and "[sp" not in operands and
               (mnemonic == "st1" or re.match(r"q\d+", operands)))


def assembly(spec: Matmul, n: int, k: int, template: str, config, bucket: tuple[int, int], device) -> str:
    """The code of `template` with `config` for `device`, as TVM's LLVM writes it (no cross tools needed; the pass
    settings are the build's, `codegen.cpu.kernel.compile_function`)."""
    import tvm

    from bitkern.codegen.cpu import TEMPLATES as CPU_TEMPLATES

    found = next(t for t in CPU_TEMPLATES if t.name == template)
    func, _ = found.program(spec, n, k, config, "tile16", bucket, device)
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        library = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(
            device.level.target_dict(device.cores)))
    return library.mod.inspect_source("asm")


def configs(spec: Matmul, n: int, k: int, template: str, bucket: tuple[int, int], device) -> list:
    """The configurations of `template` for `device` that differ in more than the prefetch depth (each with the depth
    the tuner's cost model prefers for it); empty where the template cannot serve the kernel.  The tuner profiles
    such a shortlist on the machine; here the assembly model stands in for the profile."""
    from bitkern.tuner.buckets import TUNED_M
    from bitkern.tuner.cost import estimate
    from bitkern.tuner.space import enumerate_candidates

    _, candidates = enumerate_candidates(spec, n, k, bucket, "tile16", device)
    m = TUNED_M.get(bucket, bucket[0])
    best = {}
    for config in (c.config for c in candidates if c.template == template):
        shape = dataclasses.replace(config, prefetch=0) if hasattr(config, "prefetch") else config
        seconds = estimate(template, config, spec, n, k, m, device).seconds
        if shape not in best or seconds < best[shape][0]:
            best[shape] = (seconds, config)
    return [config for _, config in best.values()]


@dataclass(frozen=True)
class Prediction:
    """A template's modelled figures for one core, type and row count."""

    template: str
    cycles_per_byte: float
    limit: str
    mix_per_byte: dict
    config: object

    def decode_bytes_per_s(self, clock_hz: float) -> float:
        return clock_hz / self.cycles_per_byte

    @property
    def label(self) -> str:
        """The template, and "smmla" where its rows go in pairs by i8mm's smmla."""
        return self.template + (" smmla" if getattr(self.config, "pairs", False) else "")


def predict(core_name: str, dtype: str, m: int, template: str, activation: str = "none") -> Prediction | None:
    """The model's cycles per weight byte of `template` for `dtype` at M rows on the core with `activation`
    ("none": float; "int8": quantized per 32-k block), or None where the template does not serve it."""
    from bitkern.ttype import get
    from bitkern.tuner.buckets import m_bucket
    from bitkern.tuner.device import named_cpu

    device = named_cpu(core_name)
    n, k = SHAPES[0]
    spec = Matmul(dtype, "bfloat16", group_size=GROUPS.get(dtype, GROUP), activation_quant=activation)
    bucket = m_bucket(m)
    core = ARM_CORES[core_name]
    bits = get(dtype).bits
    found = []
    for config in configs(spec, n, k, template, bucket, device):
        loops = hot_loops(assembly(spec, n, k, template, config, bucket, device), template, bits,
                          getattr(config, "rows", 0) or 1, getattr(config, "pairs", False))
        cycles = sum(loop.cycles_per_weight(core, m) for loop in loops) * 8 / bits
        mix = Counter()
        for loop in loops:
            for name, count in loop.mix.items():
                mix[name] += count / loop.weights * loop.passes(m) * 8 / bits
        slowest = max(loops, key=lambda loop: loop.cycles_per_weight(core, m))
        found.append(Prediction(template, cycles, core.limiting(slowest.mix), dict(mix), config))
    return min(found, key=lambda p: p.cycles_per_byte, default=None)


def fraction_of_dram(prediction: Prediction, core_name: str) -> float:
    """min(1, one core's decode rate / its share of the DRAM peak)."""
    from bitkern.tuner.device import CPU_TARGETS

    core = ARM_CORES[core_name]
    return min(1.0, prediction.decode_bytes_per_s(CPU_TARGETS[core_name].clock_hz) / core.share_bytes_per_s)


def rate_gflops(prediction: Prediction, core_name: str, n: int, k: int, m: int, weight_bytes: float,
                cores: int | None = None) -> float:
    """Predicted GFLOP/s (2·M·N·K over the larger of the compute time and the weights' DRAM time) on `cores` cores
    (default: all of the machine's), each with its share of the DRAM peak."""
    from bitkern.tuner.device import CPU_TARGETS

    core = ARM_CORES[core_name]
    cores = cores or core.cores
    compute = weight_bytes * prediction.cycles_per_byte / (cores * CPU_TARGETS[core_name].clock_hz)
    return 2 * m * n * k / max(compute, weight_bytes / (core.share_bytes_per_s * cores)) / 1e9


def weight_bytes(dtype: str, n: int, k: int) -> float:
    """Bytes of a packed [N, K] weight of `dtype`: codes and per-group scales (float16)."""
    from bitkern.ttype import get

    return n * k * get(dtype).bits / 8 + n * k / GROUPS.get(dtype, GROUP) * 2


def model_text() -> str:
    """The model in words: the second paragraph of this module's docstring."""
    return __doc__.split("\n\n")[1].replace("\n", " ")


def tables(core_names: list[str]) -> tuple[list[str], list[str]]:
    """(the modelled table: per core, type, activation and shape the best template's M=1 fraction of DRAM and M=16/512
    rates; the counts: per core, template, type and activation, instructions per weight byte by class at M=1)."""
    table = ["| core | type | activation | N x K | M=1 template | cycles / weight byte | limited by | predicted M=1 "
             "fraction of DRAM | M=1 ms | M=16 template | M=16 GFLOP/s | M=512 template | M=512 GFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    count_lines = ["| core | template | type | activation | M | " + " | ".join(CLASSES) + " | cycles / byte | "
                   "limited by |", "|---|---|---|---|---|" + "---|" * len(CLASSES) + "---|---|"]
    for core_name in core_names:
        for dtype in TYPES:
            for activation, templates in ACTIVATIONS.items():
                best = {}
                for m in ROWS:
                    found = [p for p in (predict(core_name, dtype, m, t, activation) for t in templates)
                             if p is not None]
                    best[m] = min(found, key=lambda p: p.cycles_per_byte)
                    if m == 1:
                        for p in found:
                            count_lines.append(f"| {core_name} | {p.template} | {dtype} | {activation} | 1 | " +
                                               " | ".join(f"{p.mix_per_byte.get(c, 0):.2f}" for c in CLASSES) +
                                               f" | {p.cycles_per_byte:.2f} | {p.limit} |")
                for n, k in SHAPES:
                    size = weight_bytes(dtype, n, k)
                    one = best[1]
                    fraction = fraction_of_dram(one, core_name)
                    ms = size / (fraction * ARM_CORES[core_name].dram_bytes_per_s) * 1e3
                    table.append(f"| {core_name} | {dtype} | {activation} | {n}x{k} | {one.template} | "
                                 f"{one.cycles_per_byte:.2f} | {one.limit} | {fraction:.2f} | {ms:.3f} | "
                                 f"{best[16].label} | {rate_gflops(best[16], core_name, n, k, 16, size):.0f} | "
                                 f"{best[512].label} | {rate_gflops(best[512], core_name, n, k, 512, size):.0f} |")
                    print(table[-1], flush=True)
    return table, count_lines


def verdict(table: list[str]) -> list[str]:
    """Per core and type, the best activation's M=1 fraction of DRAM (the bar is judged on it), the activation it
    needs, and whether it reaches TARGET_FRACTION; below it, the class that limits it."""
    cells = [[cell.strip() for cell in row.split("|")[1:-1]] for row in table[2:]]
    best = {}
    for core, dtype, activation, _, _, _, limit, fraction, *_ in cells:
        if (core, dtype) not in best or float(fraction) > float(best[core, dtype][1]):
            best[core, dtype] = (activation, fraction, limit)
    lines = ["| core | type | best activation | predicted M=1 fraction of DRAM | meets the bar | limited by |",
             "|---|---|---|---|---|---|"]
    for (core, dtype), (activation, fraction, limit) in best.items():
        meets = float(fraction) >= TARGET_FRACTION
        lines.append(f"| {core} | {dtype} | {activation} | {fraction} | {'yes' if meets else 'no'} | "
                     f"{'' if meets else limit} |")
    return lines


def cores_text(core_names: list[str]) -> list[str]:
    """One line per core: clock, DRAM peak, cores sharing it and each one's share, and the source of its numbers."""
    from bitkern.tuner.device import CPU_TARGETS

    return [f"- {core.title}: {CPU_TARGETS[name].clock_hz / 1e9:.1f} GHz, DRAM peak {core.dram_bytes_per_s / 1e9:.1f}"
            f" GB/s over {core.cores} cores ({core.share_bytes_per_s / 1e9:.2f} GB/s each); {core.source}"
            for name, core in ((name, ARM_CORES[name]) for name in core_names)]


def native(core_name: str, rounds: int, rows: list[int]) -> list[str]:
    """On an aarch64 machine: benchmarks/cpu_levels.py's measurement of this CPU beside the model of `core_name` (the
    core this machine has) with this machine's cores: at M=1 the fraction of DRAM (measured: of the probe; modelled:
    of the peak), above it GFLOP/s."""
    from conftest import read_probes
    from cpu_levels import measure

    from bitkern.tuner import host_cpu

    device = host_cpu()
    probes, probe_bytes = read_probes()
    lines = ["| type | N x K | M | measured kernel | measured | modelled template | modelled |",
             "|---|---|---|---|---|---|---|"]
    for m in rows:
        for dtype in TYPES:
            model = min((p for p in (predict(core_name, dtype, m, t) for t in TEMPLATES) if p is not None),
                        key=lambda p: p.cycles_per_byte)
            for n, k in SHAPES:
                measured = measure(dtype, n, k, m, GROUP, "none", device, probes, probe_bytes, rounds)
                if m == 1:
                    figures = measured["fraction"], fraction_of_dram(model, core_name)
                else:
                    figures = (2 * m * n * k / measured["ms"] / 1e6,
                               rate_gflops(model, core_name, n, k, m, weight_bytes(dtype, n, k), device.cores))
                lines.append(f"| {dtype} | {n}x{k} | {m} | {measured['template']} | {figures[0]:.2f} | "
                             f"{model.template} | {figures[1]:.2f} |")
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    from provenance import header, publish

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", nargs="+", default=list(ARM_CORES), choices=list(ARM_CORES))
    parser.add_argument("--native", action="store_true",
                        help="on an aarch64 machine: also measure this CPU (benchmarks/cpu_levels.py's way)")
    parser.add_argument("--native-core", default=None, help="the core this machine has (default: detected)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--native-rows", type=int, nargs="+", default=list(ROWS), help="rows M measured by --native")
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = parser.parse_args()
    lines = [header(), "", "# bitkern's aarch64 kernels: modelled, not measured", "",
             f"The model, not a measurement: {model_text()}", "", "Cores:", *cores_text(args.cores), ""]
    table, count_lines = tables(args.cores)
    lines += ["## Predicted fraction of DRAM at M=1, rates at M=16 and M=512 (best template per row)", "",
              "activation: none = float activations (FMA, lookup, generic templates); int8 = activations quantized "
              "per 32-k block (activation_quant=\"int8\", the VNNI template's sdot, or smmla for rows in pairs: "
              "\"vnni smmla\").", "", *table, "",
              f"## The bar: M=1 fraction of DRAM >= {TARGET_FRACTION} per core and type, on the best activation "
              "(largest fraction; the first listed on ties)", "", *verdict(table), "",
              "## Instructions per weight byte in the inner loops, by class (M=1)", "", *count_lines, ""]
    if args.native:
        if platform.machine() not in ("aarch64", "arm64"):
            parser.error("--native measures, on an aarch64 machine; this one is " + platform.machine())
        from bitkern.tuner import host_cpu

        core_name = args.native_core or host_cpu().level.llvm_cpu
        if core_name not in ARM_CORES:
            parser.error(f"this CPU's core ({host_cpu().name}) is not modelled; name one with --native-core")
        lines += [f"## Measured here ({host_cpu().name}, {host_cpu().cores} threads) beside the model of {core_name}",
                  "", "M=1: fraction of DRAM (measured: of the probe; modelled: of the peak); M > 1: GFLOP/s.", "",
                  *native(core_name, args.rounds, args.native_rows), ""]
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
