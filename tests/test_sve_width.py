"""benchmarks/sve_width.py: products counted in 128-bit units (a 256-bit SVE product counts two NEON ones), and a
missing llvm-mca named with where to get it."""

import pytest

from tests.helpers import benchmark

LOOP = ["ldr q0, [x1], #16", "fmla v1.4s, v0.4s, v2.4s", "fmla z3.s, p0/m, z4.s, z5.s", "fmad z6.s, p0/m, z7.s, z8.s",
        "sdot v9.4s, v10.16b, v11.16b", "smmla v12.4s, v13.16b, v14.16b", "fadd v15.4s, v15.4s, v16.4s",
        "subs x2, x2, #1", "b.ne .LBB0_1"]


def test_products_count_in_128_bit_units():
    assert benchmark("sve_width").products_128(LOOP) == 1 + 2 + 2 + 1 + 1


def test_a_missing_llvm_mca_is_named_with_the_package_that_brings_it():
    with pytest.raises(SystemExit, match=r"no llvm-mca with the Neoverse V1 model: tried \['llvm-mca-0'\] \(Debian: "
                                         r"apt install llvm-19\)"):
        benchmark("sve_width").find_mca("llvm-mca-0")
