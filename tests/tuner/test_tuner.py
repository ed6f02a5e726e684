"""The tuner: device descriptions, hints, the candidate space, the cost model, and top-k selection."""

import dataclasses

import pytest
import torch

import bitkern
from bitkern.codegen import template as template_named
from bitkern.codegen import to_layout
from bitkern.codegen.cpu.amx import TILE_REGISTERS, AmxConfig
from bitkern.codegen.cpu.dot import REGISTERS as DOT_REGISTERS
from bitkern.codegen.cpu.generic import GenericConfig
from bitkern.codegen.cpu.lut import LutConfig
from bitkern.ops import Matmul
from bitkern.tuner import M_BUCKETS, cuda_device, device_for, host_cpu, m_bucket, tune
from bitkern.tuner.cost import estimate
from bitkern.tuner.hints import device_hint
from bitkern.tuner.record import Trial
from bitkern.tuner.select import _ranked, _shortlist, is_present
from bitkern.tuner.space import enumerate_candidates


def test_host_cpu_is_read_from_the_machine():
    cpu = host_cpu()
    assert cpu.cores >= 1 and cpu.vector_bytes in (16, 32, 64)
    assert cpu.l1_bytes < cpu.l2_bytes <= cpu.llc_bytes or cpu.llc_bytes >= cpu.l2_bytes
    assert cpu.memory_bandwidth() > 1e9
    assert cpu.has_amx_bf16 == ({"amx_tile", "amx_bf16"} <= cpu.flags)
    assert cpu.key.startswith("cpu-") and device_for("cpu") is cpu


@pytest.mark.parametrize("arch, shared, fp8", [("sm_80", 163 << 10, False), ("sm_86", 99 << 10, False),
                                               ("sm_89", 99 << 10, True), ("sm_90", 227 << 10, True)])
def test_cuda_architectures_by_name(arch, shared, fp8):
    gpu = cuda_device(arch)
    assert gpu.arch == arch and gpu.shared_bytes_per_block == shared
    assert gpu.shared_banks == 32 and gpu.shared_bank_bytes == 4 and gpu.global_transaction_bytes == 32
    assert gpu.mma["float16"] == gpu.mma["bfloat16"] and (gpu.mma["float16"].m, gpu.mma["float16"].k) == (16, 16)
    assert gpu.mma["int8"].k == 32
    assert ("float8_e4m3" in gpu.mma) == fp8
    assert device_for(arch) is gpu


def test_unknown_cuda_arch_is_refused():
    with pytest.raises(ValueError, match=r"arch='sm_75' is not a known CUDA target; accepted"):
        cuda_device("sm_75")


def test_a_rocm_torch_and_gpus_before_sm_80_are_refused_naming_why(monkeypatch):
    """A ROCm torch presents its AMD GPU as "cuda"; a pre-Ampere NVIDIA GPU lacks the bf16 TensorCore instructions:
    both are refused when the device is described, before any kernel is built."""
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    with pytest.raises(RuntimeError, match=r"built for ROCm \(HIP 6.2.41133\).*NVIDIA's nvcc.*run the model on the CPU"):
        cuda_device()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: type("Props", (), {"name": "Tesla T4", "major": 7, "minor": 5})())
    with pytest.raises(RuntimeError, match=r"Tesla T4 is sm_75; bitkern's GPU kernels need sm_80 or newer"):
        cuda_device()


def test_hints_are_common_multiples_of_every_level():
    cpu = host_cpu()
    hint = device_hint(Matmul("int4", "bfloat16"), 4096, cpu)
    assert hint.k % 8 == 0 and hint.n % (cpu.vector_bytes // 4) == 0
    amx = cpu.at_level("amx")
    hint = device_hint(Matmul("int4", "bfloat16"), 4096, amx)
    assert (hint.m, hint.n, hint.k) == (16, 16, 32)  # AMX tiles: 16 rows, 16 columns, 32-deep steps
    gpu = device_hint(Matmul("int4", "float16"), 4096, cuda_device("sm_80"))
    assert gpu.m % 16 == 0 and gpu.n % 8 == 0 and gpu.k % 16 == 0
    assert gpu.k % (32 * 8 // 4) == 0  # one 32-byte transaction of 4-bit codes: 64 k
    assert "mma: m16 n8 k16" in gpu.sources


@pytest.mark.parametrize("bucket", M_BUCKETS)
def test_candidates_fit_the_device(bucket):
    cpu = host_cpu()
    hint, candidates = enumerate_candidates(Matmul("int4", "bfloat16"), 4096, 4096, bucket, "tile16", cpu)
    templates = {c.template for c in candidates}
    assert "generic" in templates
    assert ("lut" in templates) == (bucket[1] <= 4)
    assert ("amx" in templates) == cpu.has_amx_bf16
    assert ("dot" in templates) == (not cpu.has_amx_bf16 and "avx512_bf16" in cpu.flags)
    for c in candidates:
        config = c.config
        if c.template == "amx":
            assert config.m_tiles * config.n_tiles + config.m_tiles + 1 <= TILE_REGISTERS
            assert 2 * config.stage_steps * config.n_tiles * 1024 <= cpu.l1_bytes
            assert config.small_m == (bucket[1] <= 16)
        if c.template == "dot":
            assert (config.rows + 1) * config.n_tiles <= DOT_REGISTERS
            assert config.stage_steps * config.n_tiles * 1024 <= cpu.l1_bytes // 2
            assert config.small_m == (bucket[1] <= 16) and config.m_chunk % config.rows == 0
    assert len(candidates) == len(set(candidates))


def test_templates_that_cannot_run_a_spec_are_left_out():
    cpu = host_cpu()
    _, candidates = enumerate_candidates(Matmul("int3", "bfloat16"), 256, 256, (1, 4), "rowmajor", cpu)
    assert {c.template for c in candidates} == {"generic"}
    _, candidates = enumerate_candidates(Matmul("int4", "int8", "int32"), 256, 256, (1, 4), "tile16", cpu)
    assert {c.template for c in candidates} == {"generic"}


def test_cost_model_tracks_traffic_and_parallelism():
    cpu = host_cpu()
    config = AmxConfig(n_tiles=2, prefetch=64)
    int4 = estimate("amx", config, Matmul("int4", "bfloat16"), 4096, 4096, 1, cpu)
    int8_bytes = estimate("generic", GenericConfig(), Matmul("int8", "bfloat16"), 4096, 4096, 1, cpu)
    assert int4.parts["dram_bytes"] < int8_bytes.parts["dram_bytes"]
    one_task = estimate("amx", AmxConfig(n_tiles=2, prefetch=64), Matmul("int4", "bfloat16"), 32, 4096, 1, cpu)
    assert one_task.parts["tasks"] == 1 and (cpu.cores == 1 or one_task.parts["imbalance"] == cpu.cores)
    wider = estimate("amx", config, Matmul("int4", "bfloat16"), 8192, 4096, 1, cpu)
    assert wider.seconds > int4.seconds


def test_shortlist_times_the_best_without_software_prefetch():
    """The model cannot tell whether the hardware prefetchers keep up: it ranks prefetch=0 below the ideal depth,
    and the shortlist always times the best candidate's twin without software prefetch."""
    cpu, spec = host_cpu(), Matmul("int4", "bfloat16")
    configs = [AmxConfig(n_tiles=n, prefetch=p) for n in (1, 2) for p in (0, 16, 32, 64)]
    trials = [Trial("amx", c, estimate("amx", c, spec, 4096, 4096, 1, cpu).seconds) for c in configs]
    order = _ranked(trials)
    assert trials[order[0]].config.prefetch != 0
    shortlist = _shortlist(trials, order, 2)
    assert [trials[i].config for i in shortlist] == [trials[order[0]].config,
                                                     dataclasses.replace(trials[order[0]].config, prefetch=0)]


def test_shortlist_is_deterministic_and_spans_templates():
    trials = [Trial("amx", AmxConfig(n_tiles=n, prefetch=p), 1.0 + 0.01 * n) for n in (1, 2) for p in (16, 32)]
    trials += [Trial("lut", LutConfig(), 1.5), Trial("generic", GenericConfig(), 9.0)]
    order = _ranked(trials)
    assert order == _ranked(list(trials))
    shortlist = _shortlist(trials, order, 4)
    assert [trials[i].template for i in shortlist].count("lut") == 1  # a contender within 2x of the best
    assert all(trials[i].template != "generic" for i in shortlist)  # modeled 9x slower: not built
    assert len(shortlist) == 4 and shortlist == sorted(shortlist, key=order.index)


def test_model_only_tuning_is_deterministic():
    cpu = host_cpu()
    spec = Matmul("uint4", "bfloat16", zero_mode="gptq")
    first = tune(spec, 256, 512, (17, 128), "tile16", cpu, profile=False)
    second = tune(spec, 256, 512, (17, 128), "tile16", cpu, profile=False)
    assert first.record.choice.config == second.record.choice.config
    assert "chosen by the cost model alone" in " ".join(first.record.notes)
    assert all(t.measured_s is None for t in first.record.trials)


def test_cross_compiling_for_an_absent_cpu_picks_by_the_model():
    cpu = host_cpu()
    other = dataclasses.replace(cpu.at_level("avx512-vnni"), cores=4)
    assert not is_present(other)
    tuned = tune(Matmul("int4", "float32"), 64, 256, (1, 4), "tile16", other)
    assert not tuned.record.profiled and tuned.record.choice.template in ("lut", "fma", "generic")
    assert "the target device is not present" in " ".join(tuned.record.notes)


def test_profiled_tuning_builds_the_top_k_and_keeps_the_fastest():
    spec = Matmul("int4", "bfloat16")
    tuned = tune(spec, 512, 512, (1, 4), "tile16", host_cpu(), top_k=3)
    record = tuned.record
    measured = [t for t in record.trials if t.measured_s is not None]
    assert record.profiled and 1 <= len(measured) <= 3
    fastest = min(t.measured_s for t in measured)
    assert record.choice.measured_s <= fastest * 1.03
    x = torch.randn(2, 512).bfloat16()
    q = bitkern.quantize(torch.randn(512, 512), "int4")
    y = tuned.kernel(x, to_layout(q, "tile16"))
    torch.testing.assert_close(y.float(), spec.reference(x, q).float(), rtol=2e-2, atol=0.5)
    text = str(record)
    assert "<= chosen" in text and "hint m" in text and record.summary() in text


def test_profiled_tuning_times_kernels_of_residual_specs_with_their_residual():
    """A residual spec's kernels take the residual as an argument: timing them passes one (they failed before)."""
    spec = Matmul("int4", "bfloat16", output_dtype="float32", epilogue="swiglu", residual=True)
    tuned = tune(spec, 64, 256, (1, 4), "tile16", host_cpu(), top_k=2)
    assert tuned.record.profiled and any(t.measured_s is not None for t in tuned.record.trials)
    q = bitkern.quantize(torch.randn(64, 256), "int4")
    x, r = torch.randn(3, 256).bfloat16(), torch.randn(3, 32)
    y = tuned.kernel(x, to_layout(q, "tile16"), None, r)
    torch.testing.assert_close(y.double(), spec.exact(x, q, None, r), rtol=2e-2, atol=2e-2)


def test_candidates_are_timed_taking_turns():
    """Profiling alternates the candidates call by call (drift in the machine's speed hits them alike) and
    rotates the weight copies; each gets the median of its own calls."""
    import time

    from bitkern.tuner.profile import time_kernels

    calls = []

    def kernel(name, seconds):
        def call(x, weight, bias):
            calls.append((name, weight))
            time.sleep(seconds)
        return call

    fast, slow = time_kernels([kernel("fast", 0.001), kernel("slow", 0.003)], None, ["w0", "w1", "w2"], None,
                              budget_s=0.03)
    assert fast >= 0.001 and slow >= 0.003 and slow - fast > 0.001
    timed = calls[6:]  # after two warm-up calls each and one estimate each
    assert [name for name, _ in timed] == ["fast", "slow"] * (len(timed) // 2) and len(timed) >= 10
    assert {weight for _, weight in timed} == {"w0", "w1", "w2"}


def test_m_buckets_cover_every_m():
    assert m_bucket(1) == (1, 1) and m_bucket(2) == (2, 4) and m_bucket(4) == (2, 4) and m_bucket(5) == (5, 16)
    assert m_bucket(17) == (17, 128) and m_bucket(100000)[0] == 129
    with pytest.raises(ValueError, match="m=0"):
        m_bucket(0)
    with pytest.raises(ValueError, match="top_k=9 is out of range"):
        tune(Matmul("int4"), 64, 64, (1, 4), "tile16", host_cpu(), top_k=9)


CUDA_SPECS = [Matmul("int4", "float16"), Matmul("nf4", "bfloat16"), Matmul("uint4", "float16", zero_mode="gptq"),
              Matmul("int8", "int8", "int32", group_size=-1), Matmul("int2", "bfloat16", group_size=64)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("bucket", [(1, 4), (17, 128), (129, 2**31 - 1)])
def test_cuda_candidates_respect_the_architecture_limits(arch, bucket):
    gpu = cuda_device(arch)
    for spec in CUDA_SPECS:
        _, candidates = enumerate_candidates(spec, 4096, 4096, bucket, "lop3", gpu)
        assert candidates, spec
        assert any(c.template == "gemm" for c in candidates)
        assert any(c.template == "gemv" for c in candidates) == (bucket[1] <= 4)
        for candidate in candidates:
            used = template_named(candidate.template).resources(spec, 4096, candidate.config)
            assert used.shared_bytes <= gpu.shared_bytes_per_block
            assert used.threads <= gpu.max_threads_per_block
            assert used.registers <= gpu.registers_per_thread
            assert used.registers * used.threads <= gpu.registers_per_sm


def test_cuda_cost_model_prices_idle_sms_and_split_k_launches():
    """Few resident warps per SM keep a fraction of the HBM bandwidth busy (the H100's int4 GEMM at M=16 with two
    warps per SM read at 12%), so at M=16 on a 4096-wide layer split-K ranks above the whole K per block; its reduce
    kernel is a further launch, so the GEMV at M=1 on a small layer keeps the whole K."""
    from bitkern.codegen.cuda import GemmConfig, GemvConfig

    gpu, spec = cuda_device("sm_90"), Matmul("int4", "float16")
    tile = GemmConfig(block_m=16, warp_m=16, block_n=32, warp_n=16, block_k=128, stages=2)
    whole, split = (estimate("gemm", dataclasses.replace(tile, split_k=s), spec, 4096, 14336, 16, gpu) for s in (1, 4))
    assert split.parts["blocks"] == 4 * whole.parts["blocks"]
    assert split.seconds < whole.seconds / 2
    small = [estimate("gemv", GemvConfig(k_threads=16, split_k=s), spec, 64, 4096, 1, gpu).seconds for s in (1, 2)]
    assert small[0] < small[1]


def test_cuda_candidates_for_one_row_compute_one_row_and_few_rows_try_split_k():
    """Rows past M are computed too: an M=1 bucket's GEMVs take one row per block; buckets up to 128 rows offer
    GEMM split-K, larger ones do not."""
    gpu, spec = cuda_device("sm_90"), Matmul("int4", "float16")
    one = enumerate_candidates(spec, 4096, 4096, (1, 1), "lop3", gpu)[1]
    assert {c.config.rows for c in one if c.template == "gemv"} == {1}
    for bucket, splits in (((5, 16), {1, 2, 4, 8}), ((129, 2**31 - 1), {1})):
        candidates = enumerate_candidates(spec, 4096, 4096, bucket, "lop3", gpu)[1]
        assert {c.config.split_k for c in candidates if c.template == "gemm"} == splits


def test_cuda_limits_remove_what_a_smaller_architecture_cannot_hold():
    spec = Matmul("int4", "float16")
    big, small = ({c.config for c in enumerate_candidates(spec, 4096, 4096, (129, 2**31 - 1), "lop3", cuda_device(arch))[1]}
                  for arch in ("sm_90", "sm_86"))
    dropped = big - small
    assert dropped and small < big
    gemm = template_named("gemm")
    assert all(gemm.resources(spec, 4096, config).unfit(cuda_device("sm_86")) for config in dropped)


@pytest.mark.requires_nvcc
def test_cross_compiling_for_an_absent_gpu_picks_by_the_model():
    tuned = tune(Matmul("int4", "float16"), 1024, 1024, (1, 4), "lop3", cuda_device("sm_80"))
    record = tuned.record
    assert not record.profiled and "not present" in " ".join(record.notes)
    assert tuned.kernel.arch == "sm_80"
    assert tuned.kernel.template == "gemv" or "mma" in tuned.kernel.binary.ptx
    assert record.choice.template == tuned.kernel.template and record.choice.config == tuned.kernel.config
