"""The command line: `python -m bitkern demo` runs and reports; bad arguments give a clear message."""

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "bitkern", *args], capture_output=True, text=True, timeout=300)


def test_demo_prints_a_row_per_type():
    result = _run("demo", "--shape", "256,512", "--dtypes", "int4,nf4,mxfp4", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("bitkern demo: weight [256, 512]")
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    assert set(rows) == {"int4", "nf4", "mxfp4"}
    assert rows["mxfp4"][1] == "32"  # block types keep their block
    for row in rows.values():
        assert 0.0 < float(row[5]) < 0.2  # weight error: a 4-bit type, but not garbage


def test_demo_rejects_unknown_types():
    result = _run("demo", "--dtypes", "int4,int17")
    assert result.returncode == 2
    assert "unknown type 'int17'; known types:" in result.stderr
