"""The command line: `python -m bitkern demo` runs and reports; bad arguments give a clear message."""

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "bitkern", *args], capture_output=True, text=True, timeout=300)


def test_demo_prints_a_row_per_type():
    result = _run("demo", "--dim", "128", "--heads", "2", "--hidden", "256", "--tokens", "4",
                  "--dtypes", "int8,nf4,mxfp4", "--device", "cpu", "--seconds", "0.05")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("bitkern demo: transformer block dim=128 heads=2 SwiGLU hidden=256 on cpu")
    rows = {line.split()[0]: line.split() for line in lines[2:7]}
    assert list(rows) == ["float32", "bfloat16", "int8", "nf4", "mxfp4"]
    assert rows["mxfp4"][1] == "32" and rows["nf4"][1] == "128"  # block types keep their block
    assert float(rows["float32"][5]) == 0
    assert float(rows["int8"][5]) < 1e-2 < float(rows["nf4"][5]) < 0.3  # error vs float32
    float_mib = float(rows["float32"][2])
    assert abs(float_mib - 4 * (4 * 128 * 128 + 3 * 128 * 256) / 2**20) < 0.05  # the Linear weights
    assert float(rows["int8"][4].rstrip("x")) > 3.5  # int8 weights: ~4x smaller than float32


def test_demo_rejects_unknown_types():
    result = _run("demo", "--dtypes", "int4,int17")
    assert result.returncode == 2
    assert "unknown or unsupported weight types ['int17']; known:" in result.stderr


def test_demo_rejects_bad_sizes():
    result = _run("demo", "--dim", "100", "--heads", "3")
    assert result.returncode == 2
    assert "heads=3 must divide dim=100" in result.stderr


def test_gpu_kit_rejects_bad_arguments(tmp_path):
    """Bad architectures and a directory already in use are refused before anything is built."""
    unknown = _run("gpu-kit", "--arch", "sm_75", str(tmp_path / "kit"))
    assert unknown.returncode == 2 and "arch='sm_75' is not supported; accepted:" in unknown.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("")
    used = _run("gpu-kit", "--arch", "sm_90", str(tmp_path / "used"))
    assert used.returncode == 2 and "is not an empty directory" in used.stderr
    assert not (tmp_path / "kit").exists()
