"""Does SVE's vector length pay on the ARM cores bitkern targets?  Modelled with llvm-mca, not measured.

Of the named parts only Neoverse V1 (Graviton 3) has SVE vectors wider than NEON's 128 bits (256); Neoverse V2
(Graviton 4) has 128-bit SVE, Apple cores, Neoverse N1 and Cortex-A76 none.  For each template and type at M=1 this
compiles the tuner's pick for V1 twice: as bitkern's levels do (the templates' fixed-width vectors to NEON) and with
LLVM told that SVE vectors are 256 bits (`-aarch64-sve-vector-bits-min=256`, TVM's `cl-opt`: the same vectors to
256-bit SVE where LLVM can).  It takes the hot inner loop (the most products: fmla/fmad, sdot, smmla), times one
iteration with llvm-mca's Neoverse V1 model (LLVM's encoding of Arm's optimization guide) and divides by the loop's
products in 128-bit units (a 256-bit SVE fmla counts two), so both columns price the same work.

Run: python benchmarks/sve_width.py [--mca llvm-mca-19] [--out benchmarks/results/sve_width.md]
     (llvm-mca 16 or newer, which has the Neoverse V1 model: Debian's llvm-19 package)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess

from bitkern.ops import Matmul

PART = "neoverse-v1"
N, K = 4096, 4096
GROUP = 128
# (template, type, activation_quant) at M=1: the float-activation templates and the int8 one
CASES = [("fma", "int4", "none"), ("fma", "nf4", "none"), ("fma", "int8", "none"), ("fma", "mxfp4", "none"),
         ("generic", "int4", "none"), ("vnni", "int4", "int8"), ("vnni", "nf4", "int8"), ("vnni", "int8", "int8")]
SVE_256 = {"cl-opt": ["-aarch64-sve-vector-bits-min:uint=256"]}
_PRODUCT = re.compile(r"^(fmla|fmad|sdot|smmla)\s+([vz])\d+\.")
ITERATIONS = 200


def assembly(spec: Matmul, template: str, extra: dict) -> str:
    """The V1 code of the tuner's pick of `template` for `spec` at M=1, with `extra` target settings."""
    import tvm

    from bitkern.codegen.cpu import TEMPLATES
    from bitkern.tuner.device import named_cpu
    from bitkern.tuner.select import shortlist

    device = named_cpu(PART)
    picked = next(c for c in shortlist(spec, N, K, (1, 1), "tile16", device, top_k=8) if c.template == template)
    found = next(t for t in TEMPLATES if t.name == template)
    func, _ = found.program(spec, N, K, picked.config, "tile16", (1, 1), device)
    target = {**device.level.target_dict(device.cores), **extra}
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        library = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(target))
    return library.mod.inspect_source("asm")


def products_128(body: list[str]) -> int:
    """The loop's products in 128-bit units: a NEON one counts one, a 256-bit SVE one two."""
    return sum(1 if match[2] == "v" else 2 for match in map(_PRODUCT.match, body) if match)


def cycles_per_iteration(body: list[str], mca: str) -> float:
    """llvm-mca's Neoverse V1 cycles per iteration of a loop body."""
    completed = subprocess.run([mca, "-mtriple=aarch64", f"-mcpu={PART}", "-mattr=+sve,+i8mm,+bf16",
                                f"-iterations={ITERATIONS}"], input="\n".join(body), capture_output=True, text=True,
                               check=True)
    return int(re.search(r"Total Cycles:\s+(\d+)", completed.stdout)[1]) / ITERATIONS


def row(template: str, dtype: str, activation: str, mca: str) -> str:
    """One table row: NEON's and SVE-256's cycles per 128-bit product and loop lengths, and their ratio."""
    from arm_model import innermost_loops

    spec = Matmul(dtype, "bfloat16", group_size=32 if dtype == "mxfp4" else GROUP, activation_quant=activation)
    cells = []
    for extra in ({}, SVE_256):
        body = max(innermost_loops(assembly(spec, template, extra)), key=products_128)
        cells.append((cycles_per_iteration(body, mca) / products_128(body), len(body)))
    (neon, neon_length), (sve, sve_length) = cells
    return (f"| {template} | {dtype} | {activation} | {neon:.3f} | {neon_length} | {sve:.3f} | {sve_length} | "
            f"{sve / neon:.2f} |")


def find_mca(name: str | None) -> str:
    """llvm-mca with a Neoverse V1 model: `name`, or the newest llvm-mca-NN (NN >= 16) on PATH."""
    candidates = [name] if name else [f"llvm-mca-{version}" for version in range(22, 15, -1)]
    found = next(filter(None, map(shutil.which, candidates)), None)
    if found is None:
        raise SystemExit(f"no llvm-mca with the Neoverse V1 model: tried {candidates} (Debian: apt install llvm-19)")
    return found


def main() -> None:
    from provenance import header, publish

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mca", help="the llvm-mca to run (default: the newest llvm-mca-NN, NN >= 16)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    mca = find_mca(args.mca)
    version = subprocess.run([mca, "--version"], capture_output=True, text=True).stdout.split("version")[1].split()[0]
    lines = [header(), "", f"# SVE's vector length on {PART}: modelled by llvm-mca {version}, not measured", "",
             __doc__.split("\n\n")[1].replace("\n", " "), "", f"M=1, {N}x{K}, group {GROUP} (mxfp4: 32).", "",
             "| template | type | activation | NEON cycles / 128-bit product | NEON loop length | SVE-256 cycles / "
             "128-bit product | SVE-256 loop length | SVE-256 / NEON |", "|---|---|---|---|---|---|---|---|"]
    lines += [row(*case, mca) for case in CASES]
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
