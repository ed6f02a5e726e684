"""The aarch64 cores' throughputs in the tuner: the port-pressure bound they give, and the cost model pricing a named
ARM target's operations (and its DRAM) with that core's numbers instead of the x86 ones."""

import pytest

from bitkern.codegen import template
from bitkern.codegen.cpu.fma import FmaConfig
from bitkern.codegen.cpu.vnni import VnniConfig
from bitkern.ops import Matmul
from bitkern.tuner import device_for
from bitkern.tuner.arm_cores import ARM_CORES, CLASSES, arm_core
from bitkern.tuner.cost import ARM_MIXES, CPU_CYCLES, estimate, operation_cycles
from bitkern.tuner.device import CPU_TARGETS

N, K = 4096, 4096


def test_every_named_arm_part_has_a_core_pricing_every_class():
    assert set(ARM_CORES) == set(CPU_TARGETS)
    for core in ARM_CORES.values():
        assert set(core.classes) == set(CLASSES) and core.source
        assert all(group in core.pipes for _, group in core.classes.values())
    assert arm_core("generic") is ARM_CORES["neoverse-n1"]


def test_the_bound_is_the_busiest_pipe_group_or_the_issue_width():
    v1 = ARM_CORES["neoverse-v1"]
    # 32 converts: 2 micro-ops each on V0/V2 (32 cycles); with 64 logic ops all four V pipes carry 128 (32 cycles)
    assert v1.cycles({"convert": 32}) == 32 and v1.cycles({"convert": 32, "logic": 64}) == 32
    assert v1.cycles({"convert": 32, "logic": 68}) == 33 and v1.limiting({"convert": 32, "logic": 68}) == "logic"
    assert v1.cycles({"scalar": 80}) == 20  # four integer pipes; the issue width (8) allows 10
    assert v1.limiting({"tbl4": 8, "fp": 4}) == "tbl4"  # 24 micro-ops on V0/V1
    assert ARM_CORES["apple-m1"].cycles({"tbl4": 8, "fp": 4}) == 5  # 2 micro-ops each on any of 4 pipes
    assert ARM_CORES["neoverse-n1"].cycles({"fp": 8, "branch": 8}) == 8  # 1 branch unit, issue width 4


@pytest.mark.parametrize("part", sorted(CPU_TARGETS))
def test_the_cost_model_prices_a_named_arm_target_with_its_cores_numbers(part):
    device = device_for(f"cpu:{part}")
    core = ARM_CORES[part]
    spec = Matmul("int4", "bfloat16", group_size=128)
    config = FmaConfig(1, 16)
    work = template("fma").work(spec, N, K, 1, config, device)
    parts = estimate("fma", config, spec, N, K, 1, device).parts
    for op in ("convert_code_vector", "fma_code_row"):
        assert parts[op] == pytest.approx(work.operations[op] * core.cycles(ARM_MIXES[op]))
    assert parts["dram_s"] == pytest.approx(work.dram_bytes / (core.share_bytes_per_s * device.cores))
    x86 = estimate("fma", config, spec, N, K, 1, device_for("cpu:x86-64-v3")).parts
    assert parts["convert_code_vector"] != work.operations["convert_code_vector"] * CPU_CYCLES["convert_code_vector"]
    assert x86["convert_code_vector"] != parts["convert_code_vector"]


def test_cores_differ_where_their_pipes_do():
    """Neoverse V1 converts on two of its four vector pipes, N1 on one of two, M1 on all four."""
    cost = {part: arm_core(part).cycles(ARM_MIXES["convert_code_vector"]) for part in ("neoverse-n1", "neoverse-v1",
                                                                                       "apple-m1")}
    assert cost["neoverse-n1"] > cost["neoverse-v1"] > cost["apple-m1"]


@pytest.mark.parametrize("part", ["neoverse-n1", "neoverse-v1", "apple-m1"])
def test_the_cost_model_prices_the_vnni_templates_sdot_work_with_the_cores_numbers(part):
    """The int8-activation (sdot) kernel's byte products, the bound the work counts give, and its unpacking are priced
    by the core's dot and vector pipes, not x86's vpdpbusd figures."""
    device = device_for(f"cpu:{part}")
    core = ARM_CORES[part]
    spec = Matmul("int4", "bfloat16", group_size=128, activation_quant="int8")
    config = VnniConfig(n_tiles=1, rows=1)
    work = template("vnni").work(spec, N, K, 1, config, device)
    parts = estimate("vnni", config, spec, N, K, 1, device).parts
    for op in ("vnni_block_row", "vnni_broadcast"):
        assert parts[op] == pytest.approx(work.operations[op] * core.cycles(ARM_MIXES[op]))
    [bound] = work.bounds
    cycles = operation_cycles(device)
    assert all(cycles[op] == core.cycles(ARM_MIXES[op]) for op in bound)
    assert cycles["byte_dot"] == core.cycles({"dot": 2})
