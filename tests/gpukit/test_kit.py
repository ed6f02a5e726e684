"""The GPU kit, built and checked here without a GPU: a smoke kit (a few kernels) built by the command line; its dry
run with TVM installed (and never imported) and in a Python without TVM; `import bitkern` and kernel lookups where
TVM is missing (a clear error naming the kernel); a saved model's calls rehearsed up to the driver call there."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import bitkern
from bitkern.cache import DiskStore
from bitkern.cache.dispatch import rehearsal
from bitkern.gpukit.build import SIZE_BUDGET
from bitkern.tuner import cuda_device

pytestmark = pytest.mark.requires_nvcc

REPOSITORY = Path(__file__).resolve().parents[2]
TVM_NAMES = ("tvm", "tvm_ffi", "apache_tvm")  # TVM's packages and distributions (dist-info directories)


@pytest.fixture(scope="module")
def smoke_kit(tmp_path_factory) -> Path:
    """A kit of a few kernels for sm_90, built by `python -m bitkern gpu-kit` (no gemlite wheel)."""
    out = tmp_path_factory.mktemp("gpukit") / "kit"
    result = subprocess.run([sys.executable, "-m", "bitkern", "gpu-kit", "--arch", "sm_90", "--smoke", "--gemlite",
                             "none", str(out)], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gpu-kit:" in result.stdout
    return out


@pytest.fixture(scope="module")
def python_without_tvm(tmp_path_factory) -> str:
    """A virtual environment holding every package of this Python but TVM's: there `import tvm` fails and no TVM
    distribution is installed (as on a GPU machine with only torch)."""
    root = tmp_path_factory.mktemp("no-tvm") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    packages = [Path(path) for path in sys.path if path.endswith("site-packages") and Path(path).is_dir()]
    for entry in (entry for directory in packages for entry in directory.iterdir()):  # a venv's, then the system's
        if not entry.name.lower().startswith(TVM_NAMES) and not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)
    probe = subprocess.run([str(python), "-c", "import torch, importlib.util, importlib.metadata as m\n"
                            "assert importlib.util.find_spec('tvm') is None\ntry:\n m.version('apache-tvm')\n"
                            " raise SystemExit('apache-tvm is installed')\nexcept m.PackageNotFoundError:\n pass"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    return str(python)


def _run(command, pythonpath, cache=None, timeout=600):
    """Run `command` with only `pythonpath` before the Python's own packages (from the filesystem root, so that
    `python -c` does not put this checkout first)."""
    environment = {**os.environ, "PYTHONPATH": str(pythonpath)}
    environment.pop("BITKERN_KIT_DIR", None)
    if cache is not None:
        environment["BITKERN_CACHE_DIR"] = str(cache)
    return subprocess.run([str(part) for part in command], capture_output=True, text=True, env=environment,
                          timeout=timeout, cwd="/")


def test_smoke_kit_holds_what_it_lists(smoke_kit):
    kit = json.loads((smoke_kit / "kit.json").read_text())
    assert kit["archs"] == ["sm_90"] and kit["profile"] == "smoke"
    assert sorted({item["kind"] for item in kit["kernels"]}) == ["candidates", "pinned", "tuned"]
    assert all(item["candidates"] >= 2 for item in kit["kernels"] if item["kind"] == "candidates")
    for name in ("run", "kernels.tar.gz", "decode-sm_90.cubin", "bitkern/cache/built_with.json", *kit["tests"],
                 kit["benchmark"]):
        assert (smoke_kit / name).is_file(), name
    assert os.access(smoke_kit / "run", os.X_OK)
    integration = smoke_kit / "bitkern" / "integration"  # `import bitkern` registers its transformers method
    assert integration.is_dir() and not integration.is_symlink() and (integration / "hf" / "registration.py").is_file()
    assert sum(path.stat().st_size for path in smoke_kit.rglob("*") if path.is_file()) < SIZE_BUDGET


def test_dry_run_finds_every_kernel_and_imports_no_tvm(smoke_kit):
    """The dry run in this Python, where TVM is installed: every kernel comes from the bundle, and no TVM module
    is ever imported."""
    script = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom bitkern.gpukit.run import main\n"
              "status = main(sys.argv[1], ['--dry-run'])\n"
              "assert 'tvm' not in sys.modules and 'tvm_ffi' not in sys.modules, sorted(sys.modules)\n"
              "assert sys.modules['bitkern'].__file__.startswith(sys.argv[1])\nsys.exit(status)")
    result = _run([sys.executable, "-c", script, smoke_kit], smoke_kit)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    kit = json.loads((smoke_kit / "kit.json").read_text())
    listed = sum(item.get("candidates", 1) for item in kit["kernels"])
    assert f"dry run: {listed} kernels found" in result.stdout and "dry run: OK" in result.stdout


def test_dry_run_in_a_python_without_tvm(smoke_kit, python_without_tvm):
    result = _run([python_without_tvm, smoke_kit / "run", "--dry-run"], "")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "dry run: OK" in result.stdout


def test_dry_run_names_a_kernel_the_bundle_lacks(smoke_kit, tmp_path, python_without_tvm):
    kit_dir = tmp_path / "kit"
    shutil.copytree(smoke_kit, kit_dir, symlinks=True)
    kit = json.loads((kit_dir / "kit.json").read_text())
    pinned = next(item for item in kit["kernels"] if item["kind"] == "pinned")
    kit["kernels"].append({"kind": "pinned", "key": {**pinned["key"], "n": pinned["key"]["n"] + 16}})
    (kit_dir / "kit.json").write_text(json.dumps(kit))
    result = _run([python_without_tvm, kit_dir / "run", "--dry-run"], "")
    assert result.returncode == 1
    assert f"N={pinned['key']['n'] + 16}, K={pinned['key']['k']}" in result.stdout
    assert "not in the kit's bundle" in result.stdout and "dry run: FAILED" in result.stdout


def test_import_without_tvm_and_missing_kernels_are_named(python_without_tvm, tmp_path):
    """Without TVM, `import bitkern` works; a kernel the cache lacks (CUDA, or a CPU layer's) is a KernelNotFound
    naming it and what is missing, raised before anything imports TVM."""
    script = """
import sys, torch, bitkern
from bitkern.cache import KernelNotFound, kernel_for
from bitkern.ops import Matmul
from bitkern.tuner import cuda_device
try:
    kernel_for(Matmul("int4", "float16"), 4096, 4096, 1, "lop3", cuda_device("sm_90"))
    raise SystemExit("no error for a missing CUDA kernel")
except KernelNotFound as error:
    print("CUDA:", error)
layer = bitkern.Linear(64, 32, dtype="int4", group_size=32)
try:
    layer(torch.randn(2, 64))
    raise SystemExit("no error for a missing CPU kernel")
except KernelNotFound as error:
    print("CPU:", error)
assert not [name for name in sys.modules if name.split(".")[0] in ("tvm", "tvm_ffi")], sorted(sys.modules)
"""
    result = _run([python_without_tvm, "-c", script], REPOSITORY, cache=tmp_path / "cache")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cuda, cpu = result.stdout.strip().splitlines()
    assert "int4 weights x float16 activations" in cuda and "N=4096, K=4096, M=1..1" in cuda
    assert "target cuda-sm_90" in cuda and "TVM (apache-tvm) not found" in cuda
    assert "N=32, K=64" in cpu and "target cpu-" in cpu and "TVM (apache-tvm) not found" in cpu


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64, bias=False))


def test_saved_model_runs_up_to_the_driver_call_without_tvm(smoke_kit, python_without_tvm, tmp_path):
    """A model quantized and saved here, its CUDA kernels prebuilt (by rehearsing its call for sm_90), loads in a
    Python without TVM and runs on the kernel cache up to the driver call: lookups, arguments, cubin checks."""
    torch.manual_seed(0)
    model = bitkern.quantize_model(_model(), "int4", group_size=64, compute_dtype=torch.float16)
    bitkern.save(model, tmp_path / "model.safetensors")
    cache = tmp_path / "cache"
    with rehearsal(cuda_device("sm_90"), DiskStore(cache)) as launches:  # builds the kernels it does not find
        model(torch.randn(3, 256))
    assert len(launches) == 2
    script = f"""
import sys, torch, bitkern
from torch import nn
from bitkern.cache.dispatch import rehearsal
from bitkern.tuner import cuda_device
model = bitkern.load(nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64, bias=False)),
                     {str(tmp_path / "model.safetensors")!r})
assert bitkern.__file__.startswith({str(smoke_kit)!r}), bitkern.__file__
assert isinstance(model[0], bitkern.Linear) and model[0].weight_dtype == "int4"
with rehearsal(cuda_device("sm_90")) as launches:
    y = model(torch.randn(3, 256))
assert y.shape == (3, 64) and y.dtype == torch.float32, (y.shape, y.dtype)
print(len(launches), sorted({{call.name for call in launches}}))
assert not [name for name in sys.modules if name.split(".")[0] in ("tvm", "tvm_ffi")], sorted(sys.modules)
"""
    result = _run([python_without_tvm, "-c", script], smoke_kit, cache=cache)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.startswith("2 ")


def test_ncu_step_profiles_kernels_the_kit_ships_as_benchmark_candidates():
    """The ncu step calls its kernels with the tuning off: each must be a benchmark kernel whose candidates the kit
    holds (tuned on the device by then), or its lookup would need TVM and nvcc there."""
    from bitkern.gpukit.matrix import NCU_KERNELS, requests
    from bitkern.tuner.buckets import m_bucket

    shipped = {(r.spec.weight_dtype, r.n, r.k, tuple(r.bucket)) for r in requests("sm_90") if r.candidates}
    assert [kernel for kernel in NCU_KERNELS if (*kernel[:3], m_bucket(kernel[3])) not in shipped] == []


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_case_gets_the_configuration_it_prefers(arch):
    """A correctness case that names a configuration (split-K, rows per block, a ragged K slice) tests that one: if its
    template refused it, `Case.config` would fall back to another and the case would test something else unnoticed."""
    from bitkern.gpukit.matrix import correctness_cases

    preferring = [case for case in correctness_cases() if case.prefer is not None and case.supported_on(arch)]
    assert len(preferring) >= 20
    refused = [str(case) for case in preferring if case.config(case.spec(), arch) != case.prefer]
    assert not refused, refused


def test_matrix_holds_grouped_cases_for_every_type_top_k_and_routing():
    """The kit's correctness matrix carries the grouped (mixture-of-experts) GEMV: every weight type it serves x float16
    / bfloat16 activations, int8 activations, top_k 1, 2 and 8, an expert left without tokens and one expert taking
    every pair; every such case has a configuration on sm_80 and sm_90, so the kit builds its kernel."""
    from bitkern.codegen import template
    from bitkern.gpukit.matrix import FLOAT_WEIGHTS, correctness_cases, requests
    from bitkern.ops.grouped import GroupedMatmul

    grouped = [case for case in correctness_cases() if case.experts]
    def serves(name, zero):
        block = bitkern.ttype.get(name).block_size
        spec = GroupedMatmul(name, "float16", experts=2, zero_mode=zero, group_size=block if block > 1 else 128)
        return template("grouped_gemv").unsupported(spec, 128, 512, cuda_device("sm_90")) is None

    served = {(name, zero) for name, zero in FLOAT_WEIGHTS if serves(name, zero)}
    assert served and ("nvfp4", "none") not in served
    for activation in ("float16", "bfloat16"):
        assert {(c.weight, c.zero_mode) for c in grouped if c.activation == activation} >= served, activation
    assert any(c.activation == "int8" for c in grouped)
    assert {c.top_k for c in grouped} >= {1, 2, 8}
    empty = [c for c in grouped if c.experts - len(set(c.indices().flatten().tolist())) > 0]
    one = [c for c in grouped if c.m * c.top_k > 1 and len(set(c.indices().flatten().tolist())) == 1]
    assert {c.top_k for c in empty} >= {1, 2, 8} and {c.top_k for c in one} >= {1, 2, 8}
    for arch in ("sm_80", "sm_90"):
        assert all(case.supported_on(arch) and case.request(arch) is not None for case in grouped), arch
        pinned = {r.template for r in requests(arch) if r.template}
        assert "grouped_gemv" in pinned


def test_dispatch_holds_the_grouped_kernels_an_experts_decode_asks_for():
    """`DISPATCH_EXPERTS`' grouped kernels are those `bitkern.Experts.kernel_calls` lists for its decode on a CUDA GPU,
    whose grouped GEMV runs neither SwiGLU nor the weighted top-k sum (the GPU test's module asks for these there; a
    CPU's listing has both steps in its kernels)."""
    from bitkern.codegen.cuda.grouped import TEMPLATE
    from bitkern.gpukit.matrix import DISPATCH_EXPERTS, dispatch_specs, experts_kernels
    from bitkern.tuner.space import usable_templates

    listed = {(spec, n, k) for spec, n, k, _ in dispatch_specs() if spec.experts}
    for dtype, group, activation, num_experts, hidden, intermediate, tokens, top_k in DISPATCH_EXPERTS:
        experts = bitkern.Experts(num_experts, hidden, intermediate, dtype=dtype, group_size=group)
        calls = [call for call in experts.kernel_calls(getattr(torch, activation), top_k, fused=False)
                 if call.spec.experts]
        wanted = experts_kernels(dtype, group, activation, num_experts, hidden, intermediate, tokens, top_k)
        assert {(c.spec, c.n, c.k) for c in calls} == {(spec, n, k) for spec, n, k, _ in wanted} <= listed
        assert [m for *_, m in wanted] == [tokens, tokens * top_k]
        fused = [call for call in experts.kernel_calls(getattr(torch, activation), top_k) if call.spec.experts]
        assert {(call.spec.epilogue, call.spec.combine) for call in fused} == {("swiglu", False), ("none", True)}
        for call in fused:
            usable, unused = usable_templates(call.spec, call.n, call.k, (1, 1), "lop3", cuda_device("sm_90"))
            assert not usable and unused[TEMPLATE.name]


def test_smoke_kit_carries_a_grouped_kernel(smoke_kit):
    """The smoke kit's pinned kernels end with a grouped case's (the matrix lists them last), so the dry runs above
    check a grouped kernel's launches, the routing among its arguments, against its cubin."""
    kit = json.loads((smoke_kit / "kit.json").read_text())
    assert any(item["kind"] == "pinned" and item["key"]["pinned"].startswith("grouped_gemv:") for item in kit["kernels"])
