"""The aarch64 lane in the CI suite: tools/aarch64/test (an emulated arm64 root, built on first use and cached) runs
the lane's CI share (tests/aarch64/test_emulated.py's lane_ci tests) and every one of them passes; the script refuses
arguments.  The script runs everything emulated on one CPU, so the lane leaves the other cores to the suite's other
files."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

LANE = Path(__file__).resolve().parents[2] / "tools" / "aarch64" / "test"
EMULATED = Path(__file__).resolve().parent / "test_emulated.py"  # its lane_ci tests are the share
LANE_TIMEOUT_S = 20 * 60  # a cold root (qemu from apt, Debian's packages, the aarch64 wheels) plus the run
ON_X86_AS_ROOT = platform.machine() == "x86_64" and os.geteuid() == 0


@pytest.mark.skipif(not ON_X86_AS_ROOT, reason="the lane emulates aarch64 on an x86-64 machine and needs root "
                                               "(apt-get, chroot, mount)")
def test_the_lanes_ci_share_passes():
    share = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "lane_ci", "-p",
                            "no:cacheprovider", str(EMULATED)], capture_output=True, text=True, cwd=LANE.parents[2],
                           env={name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"})
    expected = sum("::" in line for line in share.stdout.splitlines())
    assert expected >= 5, share.stdout + share.stderr
    completed = subprocess.run([str(LANE)], capture_output=True, text=True, timeout=LANE_TIMEOUT_S,
                               env=dict(os.environ, PYTEST_ADDOPTS="-m lane_ci"))
    lines = completed.stdout.strip().splitlines()
    summary = re.fullmatch(r"(\d+) passed, \d+ deselected(, \d+ warnings?)? in .*", lines[-1]) if lines else None
    assert completed.returncode == 0 and summary and int(summary[1]) == expected, \
        completed.stdout[-6000:] + completed.stderr[-6000:]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the lane runs on x86-64 machines")
def test_the_lane_takes_no_arguments():
    completed = subprocess.run([str(LANE), "--fast"], capture_output=True, text=True)
    assert completed.returncode == 2 and "it takes no arguments; got: --fast" in completed.stderr
