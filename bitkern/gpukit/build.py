"""Build a GPU kit (`python -m bitkern gpu-kit --arch sm_90 OUT`): on a machine with TVM and nvcc and no GPU,
prebuild every kernel of `matrix.requests` into a fresh store, export it as a bundle, and write beside it what the
GPU machine runs with torch alone: bitkern's package (with the TVM versions the kernels were built with), the GPU
tests, the GPU benchmark, the decode test's cubins, gemlite's wheel, kit.json (what the kit holds) and `run`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..cache import DiskStore, KernelKey, versions
from ..cache.key import BUILT_WITH, code_fingerprint, pinned_name
from ..cache.prebuild import Request, prebuild_requests
from ..codegen.cuda.compile import check_arch
from ..ttype import Layout
from ..tuner import cuda_device
from ..tuner.device import CUDA_ARCHS
from . import matrix

log = logging.getLogger("bitkern")

BUNDLE = "kernels.tar.gz"
MANIFEST = "kit.json"
SIZE_BUDGET = 40 << 20
GEMLITE = "gemlite==0.6.0.post2"  # pure Python + Triton; the GPU machine has Triton
# The modules holding the GPU tests (run there with `-m requires_cuda`), and the files they import.
GPU_TESTS = ("tests/codegen/cuda/test_gpu.py", "tests/cache/test_dispatch_gpu.py", "tests/nn/test_compile.py",
             "tests/tuner/test_profile_gpu.py")
TEST_FILES = ("tests/__init__.py", "tests/conftest.py", "tests/helpers.py", "tests/codegen/__init__.py",
              "tests/codegen/cuda/__init__.py", "tests/cache/__init__.py", "tests/nn/__init__.py",
              "tests/tuner/__init__.py", *GPU_TESTS)
BENCHMARK_FILES = ("benchmarks/bench_gpu.py", "benchmarks/provenance.py")
_ENTRY = '''#!/usr/bin/env python3
"""bitkern GPU kit.  ./run --dry-run: check the kit (no GPU needed).  ./run --results DIR: on a machine with an
NVIDIA GPU and torch (no TVM, no nvcc, no network needed): tests, memcheck, tuning, benchmark; results in DIR."""
import os
import sys

KIT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, KIT)
from bitkern.gpukit.run import main  # noqa: E402

sys.exit(main(KIT, sys.argv[1:]))
'''


@dataclass
class KitReport:
    directory: Path
    kernels: int
    built: int
    seconds: float
    bytes: int
    failed: int  # kernels that did not build (kit.json lists them; the dry run reports them)


def build(out: str | os.PathLike, archs: list[str], smoke: bool = False, workers: int | None = None,
          gemlite: str | None = "download", progress: bool = True) -> KitReport:
    """Write a kit for `archs` into the new or empty directory `out` (see the module docstring).  smoke: a few
    kernels only (CI's dry check); gemlite: "download" (pip builds the wheel of `GEMLITE`), a wheel's path, or
    None (the benchmark then skips gemlite)."""
    start = time.perf_counter()
    out = Path(out)
    archs = list(dict.fromkeys(archs))
    for arch in archs:
        check_arch(arch)
        if arch not in CUDA_ARCHS:
            raise ValueError(f"arch={arch!r} has no device description; accepted: {sorted(CUDA_ARCHS)}")
    if not archs:
        raise ValueError("archs must name at least one CUDA architecture, e.g. ['sm_90']")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; the kit is written into a new one")
    repo = _source_checkout()
    out.mkdir(parents=True, exist_ok=True)
    requests = [request for arch in archs for request in matrix.requests(arch, smoke)]
    with tempfile.TemporaryDirectory(prefix="bitkern-kit-cache-") as cache:
        store = DiskStore(cache)
        report = prebuild_requests(requests, store, workers or os.cpu_count() or 1, progress,
                                   f"gpu-kit {','.join(archs)}", keep_going=True)
        listing = [_listed(request, store) for request in requests]
        failed = [{"key": _key(job).to_dict(), "error": error} for job, error in report.failed]
        store.export(out / BUNDLE)
    _copy_package(repo, out)
    for name in TEST_FILES + BENCHMARK_FILES:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / name, out / name)
    decode = {arch: _decode_cubin(repo, arch, out) for arch in archs}
    wheel = _gemlite_wheel(gemlite, out / "wheels")
    kit = {"archs": archs, "versions": versions(), "profile": "smoke" if smoke else "full", "kernels": listing,
           "failed": failed, "decode": decode, "gemlite": wheel, "tests": list(GPU_TESTS), "benchmark": BENCHMARK_FILES[0],
           "built": {"kernels": report.kernels, "compiled": report.built, "seconds": round(report.seconds, 1)}}
    (out / MANIFEST).write_text(json.dumps(kit, indent=1))
    (out / "run").write_text(_ENTRY)
    (out / "run").chmod(0o755)
    size = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    if size > SIZE_BUDGET:
        log.warning("bitkern: the kit in %s holds %.1f MB, over the %.0f MB budget", out, size / 1e6,
                    SIZE_BUDGET / 1e6)
    for item in failed:
        log.warning("bitkern: gpu-kit could not build %s: %s", KernelKey.from_dict(item["key"]).describe(),
                    item["error"])
    return KitReport(out, report.kernels, report.built, time.perf_counter() - start, size, len(failed))


def _source_checkout() -> Path:
    """The checkout bitkern runs from: the kit copies its tests and benchmark from there."""
    repo = Path(__file__).resolve().parents[2]
    missing = [name for name in TEST_FILES + BENCHMARK_FILES if not (repo / name).is_file()]
    if missing:
        raise ValueError(f"gpu-kit copies the GPU tests and benchmark from bitkern's source checkout; {repo} lacks "
                         f"{missing} (run it from a git clone)")
    return repo


def _key(request: Request) -> KernelKey:
    pinned = pinned_name(request.template, request.config) if request.template else ""
    return KernelKey(request.spec, request.n, request.k, tuple(request.bucket), Layout.LOP3.value,
                     cuda_device(request.target).key, pinned)


def _listed(request: Request, store: DiskStore) -> dict:
    """The kit.json entry of a request: its kind and key (and how many candidates the store holds)."""
    key = _key(request)
    if request.template:
        return {"kind": "pinned", "key": key.to_dict()}
    if request.candidates:
        return {"kind": "candidates", "key": key.to_dict(), "candidates": len(store.pinned(key))}
    return {"kind": "tuned", "key": key.to_dict()}


def _copy_package(repo: Path, out: Path) -> None:
    """bitkern's package as it is installed (no caches; integration, a link in the checkout, copied in its place),
    with the TVM versions its kernels were built with; its code fingerprint must be unchanged."""
    shutil.copytree(repo / "bitkern", out / "bitkern", ignore=shutil.ignore_patterns("__pycache__", "integration"))
    shutil.copytree(repo / "integration", out / "bitkern" / "integration", ignore=shutil.ignore_patterns("__pycache__"))
    (out / "bitkern" / "cache" / BUILT_WITH.name).write_text(
        json.dumps({"tvm": versions()["tvm"], "tvm_ffi": versions()["tvm_ffi"]}))
    if code_fingerprint(out / "bitkern") != versions()["code"]:
        raise RuntimeError("the kit's copy of bitkern has another code fingerprint than this process's; its "
                           "kernels would not be found (is the checkout being changed?)")


def _decode_cubin(repo: Path, arch: str, out: Path) -> str:
    """Compile the decode test's kernels (tests/helpers.py's device_source) for `arch` into the kit."""
    name = f"decode-{arch}.cubin"
    script = ("import sys; from tests.helpers import DECODERS, device_source; from bitkern.codegen.cuda.compile "
              "import nvcc; open(sys.argv[2], 'wb').write(nvcc(device_source(DECODERS), sys.argv[1]).cubin)")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script, arch, str(out / name)], cwd=repo, env=environment, check=True)
    return name


def _gemlite_wheel(source: str | None, directory: Path) -> str | None:
    """gemlite's wheel in `directory` (built by pip from `GEMLITE` for "download", copied from a path), or None."""
    if source is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    if source != "download":
        shutil.copy(source, directory)
        return f"wheels/{Path(source).name}"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                             str(directory), GEMLITE], capture_output=True, text=True)
    wheels = sorted(directory.glob("gemlite-*.whl"))
    if result.returncode or not wheels:
        raise RuntimeError(f"pip could not build gemlite's wheel ({GEMLITE}): {result.stderr[-2000:]}; pass "
                           f"--gemlite PATH to a wheel, or --gemlite none to leave gemlite out of the benchmark")
    return f"wheels/{wheels[0].name}"
