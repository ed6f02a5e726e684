"""benchmarks/arm_model.py: its instruction counter on a known aarch64 loop, and its model giving the figure the
committed results file documents for three cases (Neoverse V1, int4, FMA template; Apple M1, nf4, int8 activations,
VNNI template; M=1; Neoverse V2, int4, int8 activations, M=16: rows in pairs by smmla)."""

import re

import pytest

from tests.docs_pages import ROOT
from tests.helpers import benchmark

LOOP = """
.LBB0_1:
	mov	x10, #64
.LBB0_2:
	ldp	q0, q1, [x1], #32
	and	v2.16b, v0.16b, v16.16b
	ushr	v3.16b, v0.16b, #4
	ucvtf	v2.4s, v2.4s
	tbl	v4.16b, { v20.16b, v21.16b, v22.16b, v23.16b }, v3.16b
	fmla	v8.4s, v2.4s, v5.s[0]
	ld1r	{ v6.4s }, [x9], #4
	dup	v7.4s, w8
	mla	v9.4s, v3.4s, v17.4s
	prfm	pldl1keep, [x5, x12]
	str	q8, [sp, #16]
	subs	x10, x10, #1
	b.ne	.LBB0_2
	add	x11, x11, #1
	cbnz	x11, .LBB0_1
	ret
"""


def test_the_counter_finds_the_innermost_loop_and_sorts_its_instructions_into_classes():
    model = benchmark("arm_model")
    [loop] = model.innermost_loops(LOOP)
    assert loop[0].startswith("ldp") and loop[-1] == "b.ne .LBB0_2"
    assert model.counts(loop) == {"load": 2, "logic": 1, "shift": 1, "convert": 1, "tbl4": 1, "fp": 1,
                                  "load_broadcast": 1, "dup_gpr": 1, "imul": 1, "prefetch": 1, "store": 1,
                                  "scalar": 1, "branch": 1}


@pytest.mark.parametrize("core, dtype, activation, template", [("neoverse-v1", "int4", "none", "fma"),
                                                               ("apple-m1", "nf4", "int8", "vnni")])
def test_the_model_gives_the_documented_fraction(core, dtype, activation, template):
    """A float-activation kernel (the FMA template's int4) and an int8-activation one (the VNNI template's nf4, by
    sdot and a one-register tbl) compiled here: their cycles per weight byte and M=1 fraction of DRAM are those of
    benchmarks/results/arm_model.md."""
    model = benchmark("arm_model")
    prediction = model.predict(core, dtype, 1, template, activation)
    results = (ROOT / "benchmarks" / "results" / "arm_model.md").read_text()
    row = re.search(rf"^\| {core} \| {dtype} \| {activation} \| 4096x4096 \| (\w+) \| ([\d.]+) \| (\w+) \| ([\d.]+) \|",
                    results, re.MULTILINE)
    assert row[1] == prediction.template == template and row[3] == prediction.limit
    assert f"{prediction.cycles_per_byte:.2f}" == row[2]
    assert f"{model.fraction_of_dram(prediction, core):.2f}" == row[4]


def test_rows_in_pairs_by_smmla_give_the_documented_m16_rate():
    """At M=16 on Neoverse V2 with int8 activations the model's best VNNI kernel multiplies rows in pairs (i8mm's
    smmla, one per two columns' 8 k's of a row pair): its rate is the results file's M=16 figure, labelled as such."""
    model = benchmark("arm_model")
    prediction = model.predict("neoverse-v2", "int4", 16, "vnni", "int8")
    assert prediction.config.pairs and prediction.label == "vnni smmla" and prediction.mix_per_byte["mmla"] > 0
    results = (ROOT / "benchmarks" / "results" / "arm_model.md").read_text()
    row = re.search(r"^\| neoverse-v2 \| int4 \| int8 \| 4096x4096 \|(?: [^|]+ \|){5} ([\w ]+) \| (\d+) \|", results,
                    re.MULTILINE)
    rate = model.rate_gflops(prediction, "neoverse-v2", 4096, 4096, 16, model.weight_bytes("int4", 4096, 4096))
    assert row[1] == "vnni smmla" and row[2] == f"{rate:.0f}"
