"""The kit's entry script (`OUT/run`).

On a machine with an NVIDIA GPU and torch (no TVM, no nvcc, no network needed; nothing is installed), in one
command: check the GPU against the kit and the kit itself, run the GPU tests (junit), compute-sanitizer's memcheck
on the edge shapes, tune the benchmark's kernels on the device from the kit's candidates (the winners recorded in
the cache), run the benchmark and profile a few of its kernels with Nsight Compute; the results (8 files) go to
--results.  `--dry-run` checks the kit anywhere, without a GPU: every kernel found in the bundle, every launch
checked against its cubin, no TVM imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..cache import DiskStore, KernelKey, kernel_for
from .check import check

BUNDLE = "kernels.tar.gz"
TIME_LIMIT_S = 450  # the whole run, under the 8 minutes one device call may take
CAPS_S = {"tests": 200, "memcheck": 120, "tuning": 90, "benchmark": 150, "ncu": 60}  # each step at most
TUNING_LIMIT_S = 10.0  # tuning one new kernel on the device
STEPS = tuple(CAPS_S)
LOG_BYTES = 200_000  # the end of a step's output kept in its log
# where each CUDA tool is looked for beside the PATH
TOOLS = {"compute-sanitizer": ("/usr/local/cuda/bin/compute-sanitizer",
                               "/opt/nvidia/compute-sanitizer/compute-sanitizer"),
         "ncu": ("/usr/local/cuda/bin/ncu",)}
NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "LaunchStats", "Occupancy")


@dataclass
class Step:
    name: str
    status: str  # "passed", "failed", "skipped"
    seconds: float
    detail: str


def main(kit_dir, argv=None) -> int:
    start = time.monotonic()
    parser = argparse.ArgumentParser(prog="run", description=__doc__.split("\n\n")[1])
    parser.add_argument("--dry-run", action="store_true",
                        help="check the kit without a GPU: every kernel found, launches checked against the cubins")
    parser.add_argument("--results", default=None, help="directory for the results (default: <kit>/results)")
    parser.add_argument("--cache", default=None,
                        help="kernel cache the kit's bundle is imported into (default: a new temporary one)")
    parser.add_argument("--skip", action="append", choices=STEPS, default=[], help="leave a step out (repeatable)")
    args = parser.parse_args(argv)
    kit_dir = Path(kit_dir).resolve()
    kit = json.loads((kit_dir / "kit.json").read_text())
    cache = Path(args.cache or tempfile.mkdtemp(prefix="bitkern-kit-cache-"))
    os.environ["BITKERN_CACHE_DIR"] = str(cache)  # this process and the tests it starts use the kit's kernels
    os.environ["BITKERN_KIT_DIR"] = str(kit_dir)
    store = DiskStore(cache)
    print(f"kit: {store.import_(kit_dir / BUNDLE)} kernels imported into {store.version_dir}", flush=True)
    if args.dry_run:
        return _dry_run(kit, store, kit_dir)
    results = Path(args.results or kit_dir / "results")
    results.mkdir(parents=True, exist_ok=True)
    return _device_run(kit, store, kit_dir, results, set(args.skip), start)


def _dry_run(kit: dict, store: DiskStore, kit_dir: Path) -> int:
    report = check(kit, store, kit["archs"], kit_dir)
    if kit.get("gemlite") and not (kit_dir / kit["gemlite"]).is_file():
        report.problems.append(f"gemlite's wheel {kit['gemlite']} is missing")
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("tvm", "tvm_ffi"))
    print(f"dry run: {report.kernels} kernels found, {report.launches} launches checked against their cubins "
          f"({', '.join(kit['archs'])})")
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    if loaded:
        print(f"PROBLEM: TVM modules were imported: {loaded[:5]}")
    ok = not report.problems and not loaded
    print("dry run: OK" if ok else "dry run: FAILED")
    return 0 if ok else 1


def _device_run(kit: dict, store: DiskStore, kit_dir: Path, results: Path, skip: set, start: float) -> int:
    import torch

    if not torch.cuda.is_available():
        print("run: no CUDA device here (torch.cuda.is_available() is False); ./run --dry-run checks the kit "
              "without one")
        return 2
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    if arch not in kit["archs"]:
        print(f"run: this GPU is {arch}; the kit holds kernels for {kit['archs']} (build one with --arch {arch})")
        return 2
    environment = _environment(torch, arch)
    print(f"run: {environment['gpu']} ({arch}), torch {environment['torch']}, CUDA {environment['cuda']}", flush=True)
    began = time.monotonic()
    report = check(kit, store, [arch], kit_dir)
    steps = [Step("kit check", "failed" if report.problems else "passed", time.monotonic() - began,
                  f"{report.kernels} kernels, {report.launches} launches checked" +
                  "".join(f"; {problem}" for problem in report.problems[:5]))]
    for name, function in (("tests", _tests), ("memcheck", _memcheck), ("tuning", _tuning),
                           ("benchmark", _benchmark), ("ncu", _ncu)):
        budget = min(CAPS_S[name], TIME_LIMIT_S - (time.monotonic() - start))
        if name in skip or budget < 10:
            steps.append(Step(name, "skipped", 0.0, "--skip" if name in skip else "out of time"))
            continue
        print(f"run: {name} (at most {budget:.0f} s)", flush=True)
        began = time.monotonic()
        try:
            status, detail = function(kit, store, kit_dir, results, budget)
        except Exception:  # a broken step is reported; the next ones still run
            status, detail = "failed", traceback.format_exc(limit=3)[-1500:]
        steps.append(Step(name, status, time.monotonic() - began, detail))
        print(f"run: {name} {status} in {steps[-1].seconds:.0f} s: {detail.splitlines()[0] if detail else ''}",
              flush=True)
    _summary(results, environment, steps, time.monotonic() - start)
    print((results / "summary.md").read_text())
    return 0 if all(step.status == "passed" or step.detail == "--skip" for step in steps) else 1


def _environment(torch, arch: str) -> dict:
    props = torch.cuda.get_device_properties(0)
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    return {"gpu": props.name, "arch": arch, "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
            "driver": driver.stdout.strip() if driver and driver.returncode == 0 else "unknown",
            "python": sys.version.split()[0]}


def _subprocess(command: list, kit_dir: Path, budget: float, log: Path, extra_env: dict | None = None):
    """Run `command` in the kit directory (the kit's package first on the path) within `budget` seconds; its
    output's end goes to `log`.  Returns (exit status or None on timeout, output)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(kit_dir), os.environ.get("PYTHONPATH", "")]),
                   "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    try:
        result = subprocess.run(command, cwd=kit_dir, env=environment, capture_output=True, text=True,
                                timeout=budget)
        status, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        status = None
        output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
        output += f"\n(stopped after {budget:.0f} s)\n"
    log.write_text(output[-LOG_BYTES:])
    return status, output


def _tool(name: str) -> str | None:
    """The path of CUDA tool `name`: on the PATH, else at one of its usual places (`TOOLS`); None if neither."""
    return shutil.which(name) or next((path for path in TOOLS[name] if os.path.isfile(path)), None)


def _pytest(tests: list, *options) -> list:
    return [sys.executable, "-m", "pytest", *tests, "-m", "requires_cuda", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", *options]


def _last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _tests(kit, store, kit_dir, results, budget):
    """The GPU tests (every test marked requires_cuda in the kit's test modules) against the kit's kernels."""
    command = _pytest(kit["tests"], f"--junitxml={results / 'junit.xml'}", "-rfE")
    status, output = _subprocess(command, kit_dir, budget, results / "tests.log")
    return ("passed" if status == 0 else "failed"), _last_line(output)


def _memcheck(kit, store, kit_dir, results, budget):
    """compute-sanitizer --tool memcheck over the edge-shape cases (torch's caching allocator off, so that every
    tensor is its own allocation and an access past one is caught)."""
    sanitizer = _tool("compute-sanitizer")
    if sanitizer is None:
        return "failed", "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
    command = [sanitizer, "--tool", "memcheck", "--error-exitcode", "99", "--print-limit", "20",
               *_pytest(kit["tests"][:1], "-k", "edge")]
    status, output = _subprocess(command, kit_dir, budget, results / "memcheck.log",
                                 {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    summary = next((line for line in reversed(output.splitlines()) if "ERROR SUMMARY" in line), "no ERROR SUMMARY")
    clean = status == 0 and "ERROR SUMMARY: 0 errors" in output
    return ("passed" if clean else "failed"), f"{summary.strip()}; pytest: {_last_line(output)}"


def _tuning(kit, store, kit_dir, results, budget):
    """Tune each benchmark kernel on the device: its prebuilt candidates timed, the fastest stored as the cache's
    entry (what the benchmark then runs); tuning.json holds every record."""
    import torch

    from ..tuner import cuda_device

    os.environ["BITKERN_TUNING"] = "profile"
    device = cuda_device()
    deadline = time.monotonic() + budget
    tuned, slow, left = [], [], 0
    for item in kit["kernels"]:
        key = KernelKey.from_dict(item["key"])
        if item["kind"] != "candidates" or key.target != device.key:
            continue
        if time.monotonic() > deadline:
            left += 1
            continue
        began = time.monotonic()
        kernel_for(key.spec, key.n, key.k, key.bucket[0], key.layout, device, store)
        torch.cuda.synchronize()
        seconds = time.monotonic() - began
        tuned.append((key, seconds))
        if seconds > TUNING_LIMIT_S:
            slow.append(f"{key.describe()}: {seconds:.1f} s")
    manifests = {json.dumps(entry["key"], sort_keys=True): entry for entry in store.entries() if "key" in entry}
    records = [{"kernel": key.describe(), "seconds": round(seconds, 2),
                "record": manifests.get(json.dumps(key.to_dict(), sort_keys=True), {}).get("record")}
               for key, seconds in tuned]
    (results / "tuning.json").write_text(json.dumps({"device": device.name, "limit_s": TUNING_LIMIT_S,
                                                     "kernels": records}, indent=1))
    detail = (f"{len(tuned)} kernels tuned, slowest {max((s for _, s in tuned), default=0):.1f} s" +
              (f"; {left} left out of time" if left else "") + "".join(f"; over {TUNING_LIMIT_S:.0f} s: {s}"
                                                                        for s in slow[:3]))
    return ("passed" if tuned and not slow and not left else "failed"), detail


def _benchmark(kit, store, kit_dir, results, budget):
    """The benchmark module of the kit, with gemlite's wheel unpacked beside it (nothing installed)."""
    if kit.get("gemlite"):
        unpacked = Path(tempfile.mkdtemp(prefix="bitkern-kit-gemlite-"))
        with zipfile.ZipFile(kit_dir / kit["gemlite"]) as wheel:
            wheel.extractall(unpacked)
        sys.path.insert(0, str(unpacked))
    spec = importlib.util.spec_from_file_location("bitkern_kit_bench", kit_dir / kit["benchmark"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(results, budget)


def _ncu(kit, store, kit_dir, results, budget):
    """Nsight Compute's sections (`NCU_SECTIONS`) of the tuned kernels `ncu_target` calls, the GPU's clocks as they
    are (ncu.log): what limits each kernel (bandwidth, waves, occupancy)."""
    ncu = _tool("ncu")
    if ncu is None:
        return "failed", "ncu not found (PATH, /usr/local/cuda/bin)"
    sections = [option for section in NCU_SECTIONS for option in ("--section", section)]
    command = [ncu, "--clock-control", "none", "--kernel-name", "regex:gemv|gemm", *sections,
               sys.executable, "-m", "bitkern.gpukit.ncu_target"]
    status, output = _subprocess(command, kit_dir, budget, results / "ncu.log", {"BITKERN_TUNING": "model"})
    profiled = output.count("Section: GPU Speed Of Light Throughput")
    detail = f"{profiled} kernel launches profiled; {_last_line(output)}"
    return ("passed" if status == 0 and profiled else "failed"), detail


def _summary(results: Path, environment: dict, steps: list, seconds: float) -> None:
    lines = ["# bitkern GPU kit results", "",
             f"{environment['gpu']} ({environment['arch']}, {environment['sms']} SMs, {environment['memory_gib']} GiB), "
             f"driver {environment['driver']}, torch {environment['torch']}, CUDA {environment['cuda']}, "
             f"Python {environment['python']}; {seconds:.0f} s in all", "",
             "| step | status | seconds | detail |", "|---|---|---|---|"]
    for step in steps:
        detail = " ".join(step.detail.split())[:400].replace("|", "\\|")
        lines.append(f"| {step.name} | {step.status} | {step.seconds:.1f} | {detail} |")
    bench = results / "bench.md"
    if bench.is_file():
        lines += ["", bench.read_text()]
    (results / "summary.md").write_text("\n".join(lines) + "\n")
