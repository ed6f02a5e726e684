"""A compiler failure never ends the caller: CPU kernels compile in a worker process, so LLVM aborting on a kernel
(here a template that emits AVX-512 lookups whatever the level, which LLVM cannot lower for AVX2) raises
KernelBuildError with LLVM's message; the tuner logs and skips such a candidate, and names the kernel where none
builds."""

import logging

import pytest

from bitkern.codegen import KernelBuildError, build_kernel, cpu
from bitkern.codegen.cpu.lut import LutConfig, LutTemplate
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu, tune

SPEC = Matmul("int4", "bfloat16", group_size=64)
N, K = 64, 256


class AbortingTemplate(LutTemplate):
    """The lookup template with its 512-bit lookups emitted for any level: built for x86-64-v3, LLVM aborts."""

    name = "aborts"
    title = "aborting"

    def configs(self, spec, n, k, bucket, device, hint):
        return [LutConfig(4, 16)]  # one small kernel: LLVM gets to its abort in seconds

    def program(self, spec, n, k, config, layout, bucket, device):
        return super().program(spec, n, k, config, layout, bucket, device.at_level("avx512"))


@pytest.fixture
def registry(monkeypatch):
    def install(*names):
        known = {template.name: template for template in cpu.TEMPLATES}
        monkeypatch.setattr(cpu, "TEMPLATES", [AbortingTemplate() if name == "aborts" else known[name]
                                               for name in names])
    return install


AVX2 = host_cpu().at_level("x86-64-v3")


def test_an_llvm_abort_raises_in_the_caller_and_the_next_build_works(registry):
    registry("aborts", "lut", "generic")
    with pytest.raises(KernelBuildError, match=r"the compiling process ended \(signal SIGABRT\): .*LLVM ERROR"):
        build_kernel(SPEC, N, K, "aborts", LutConfig(4, 16), "tile16", (1, 1), AVX2)
    kernel = build_kernel(SPEC, N, K, "lut", LutConfig(4, 16), "tile16", (1, 1), AVX2)
    assert kernel.library and kernel.template == "lut"


@pytest.mark.parametrize("profile", [False, True])
def test_the_tuner_skips_a_candidate_that_fails_to_build(registry, caplog, profile):
    """The failing candidate is the model's best here; it is logged with its reason, noted in the record, and the
    next candidate that builds is chosen (timed or by the model)."""
    registry("aborts", "generic")
    with caplog.at_level(logging.WARNING, logger="bitkern"):
        tuned = tune(SPEC, N, K, (1, 1), "tile16", AVX2, top_k=2, profile=profile)
    assert tuned.kernel.template == "generic" and tuned.record.choice.template == "generic"
    failed = [trial for trial in tuned.record.trials if trial.failed]
    assert failed and all(trial.template == "aborts" and "SIGABRT" in trial.failed for trial in failed)
    assert "skipped the aborts candidate" in caplog.text and "it failed to build" in caplog.text


def test_a_kernel_no_candidate_builds_is_an_error_naming_it(registry):
    registry("aborts")
    with pytest.raises(KernelBuildError, match=r"no candidate of the int4 x bfloat16 kernel of a \[64, 256\] weight "
                                               r"for rows 1\.\.1 on cpu-x86-64-v3-\d+c built: aborts .*SIGABRT"):
        tune(SPEC, N, K, (1, 1), "tile16", AVX2, profile=False)
