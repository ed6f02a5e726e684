"""Shared test set-up: a fresh kernel cache per session, kernels chosen by the cost model (profiling top-k
candidates per kernel would multiply the suite's compile time; tests/tuner covers it), the hardware markers, and
compiling small TVM expressions for the host CPU."""

import os

import pytest

os.environ.setdefault("BITKERN_TUNING", "model")


def _has_amx() -> bool:
    from bitkern.tuner import host_cpu

    return host_cpu().has_amx_bf16


def _has_avx512_bf16() -> bool:
    from bitkern.tuner import host_cpu

    return "avx512_bf16" in host_cpu().flags


def _has_avx2() -> bool:
    from bitkern.tuner import host_cpu

    return "avx2" in host_cpu().flags


def _has_avx512_vnni() -> bool:
    from bitkern.tuner import host_cpu

    return "avx512_vnni" in host_cpu().flags


def _has_nvcc() -> bool:
    from bitkern.codegen.cuda.compile import find_nvcc

    return find_nvcc() is not None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# marker: (what the test needs, whether this machine has it)
HARDWARE = {
    "requires_amx": ("a CPU with AMX-BF16", _has_amx),
    "requires_avx512_bf16": ("a CPU with AVX512-BF16", _has_avx512_bf16),
    "requires_avx2": ("a CPU with AVX2", _has_avx2),
    "requires_avx512_vnni": ("a CPU with AVX512-VNNI", _has_avx512_vnni),
    "requires_nvcc": ("nvcc", _has_nvcc),
    "requires_cuda": ("a CUDA GPU", _has_cuda),
}


def pytest_configure(config):
    for name, (needs, _) in HARDWARE.items():
        config.addinivalue_line("markers", f"{name}: runs only on a machine with {needs} (skipped elsewhere)")
    config.addinivalue_line("markers", "lane_ci: the part of the emulated aarch64 lane (tests/aarch64) that the CI suite "
                                       "runs; tools/aarch64/test alone runs all of it")


def pytest_runtest_setup(item):
    for name, (needs, present) in HARDWARE.items():
        if item.get_closest_marker(name) is not None and not present():
            pytest.skip(f"needs {needs}")


# Set for a pytest session that a test starts in a subprocess (tests/integration/test_hf_versions.py): the inner
# session uses the outer session's kernel cache, so the kernels the outer one built are not built again.
OUTER_SESSION_CACHE = "BITKERN_TEST_OUTER_CACHE_DIR"


def run_folder(tmp_path_factory, name: str):
    """A folder of this test run, shared by its pytest-xdist workers (`python -m pytest -n auto`): what a session
    fixture builds there (the kernel cache, a checkout installed for a client environment) is built once for the
    run, not once per worker; those builds lock against each other.  Without xdist: a fresh folder of the session."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    base = tmp_path_factory.getbasetemp()
    if worker and base.name == f"popen-{worker}":  # (the variable also reaches pytest sessions a test starts)
        # a worker's base temporary folder is <the run's>/popen-gwN: the run's is shared by every worker
        path = base.parent / name
        path.mkdir(exist_ok=True)
        return path
    return tmp_path_factory.mktemp(name)


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_dir(tmp_path_factory):
    """A fresh disk cache for the session: kernels are compiled once per run (the cold path) and reused.  Run by a
    GPU kit ($BITKERN_KIT_DIR set), the tests use the kit's cache, which holds their prebuilt kernels; started by
    another session (OUTER_SESSION_CACHE set), that session's cache."""
    if os.environ.get("BITKERN_KIT_DIR"):
        yield os.environ["BITKERN_CACHE_DIR"]
        return
    if os.environ.get(OUTER_SESSION_CACHE):
        os.environ["BITKERN_CACHE_DIR"] = os.environ[OUTER_SESSION_CACHE]
        yield os.environ[OUTER_SESSION_CACHE]
        return
    path = run_folder(tmp_path_factory, "bitkern-cache")
    previous = os.environ.get("BITKERN_CACHE_DIR")
    os.environ["BITKERN_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("BITKERN_CACHE_DIR", None)
    else:
        os.environ["BITKERN_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def llvm_target():
    """A TVM LLVM target for this machine (the host's triple and CPU, as LLVM detects them)."""
    import tvm
    from tvm.target import codegen

    return tvm.target.Target({"kind": "llvm", "mtriple": codegen.llvm_get_system_triple(),
                              "mcpu": codegen.llvm_get_system_cpu()})


@pytest.fixture(scope="session")
def build_elementwise(llvm_target):
    """Compile `out[i] = expr(inputs..., i)` over 1-D tensors and return a callable on torch tensors."""
    import tvm
    from tvm import te

    def build(make_expr, input_specs, out_dtype):
        n = te.var("n")
        inputs = [te.placeholder(shape if shape else (n,), dtype, name=f"in{i}")
                  for i, (dtype, shape) in enumerate(input_specs)]
        out = te.compute((n,), lambda i: make_expr(*inputs, i), name="out")
        func = te.create_prim_func([*inputs, out])
        return tvm.compile(tvm.IRModule({"main": func}), target=llvm_target)["main"]

    return build


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty user cache, no system cache, cost-model tuning, a fresh process map: for tests that count what a
    call builds."""
    from bitkern.cache import forget

    monkeypatch.setenv("BITKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BITKERN_SYSTEM_CACHE_DIR", str(tmp_path / "no-system-cache"))
    monkeypatch.setenv("BITKERN_TUNING", "model")
    forget()
    yield
    forget()
