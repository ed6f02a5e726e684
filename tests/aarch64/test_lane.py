"""The aarch64 lane in the CI suite: tools/aarch64/test (an emulated arm64 root, built on first use and cached) runs
the lane's CI share (tests/aarch64/test_emulated.py's lane_ci tests) and every one of them passes; the script refuses
arguments.  Where xdist runs it matters little: qemu keeps about two cores busy, so the lane costs the suite about
its own time whether it overlaps other files or runs last (xdist's loadfile starts files with fewer tests later)."""

import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

LANE = Path(__file__).resolve().parents[2] / "tools" / "aarch64" / "test"
LANE_TIMEOUT_S = 20 * 60  # a cold root (qemu from apt, Debian's packages, the aarch64 wheels) plus the run
ON_X86_AS_ROOT = platform.machine() == "x86_64" and os.geteuid() == 0


@pytest.mark.skipif(not ON_X86_AS_ROOT, reason="the lane emulates aarch64 on an x86-64 machine and needs root "
                                               "(apt-get, chroot, mount)")
def test_the_lanes_ci_share_passes():
    completed = subprocess.run([str(LANE)], capture_output=True, text=True, timeout=LANE_TIMEOUT_S,
                               env=dict(os.environ, PYTEST_ADDOPTS="-m lane_ci"))
    lines = completed.stdout.strip().splitlines()
    summary = re.fullmatch(r"(\d+) passed, \d+ deselected(, \d+ warnings?)? in .*", lines[-1]) if lines else None
    assert completed.returncode == 0 and summary and int(summary[1]) >= 5, \
        completed.stdout[-6000:] + completed.stderr[-6000:]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the lane runs on x86-64 machines")
def test_the_lane_takes_no_arguments():
    completed = subprocess.run([str(LANE), "--fast"], capture_output=True, text=True)
    assert completed.returncode == 2 and "it takes no arguments; got: --fast" in completed.stderr
