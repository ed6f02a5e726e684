"""The transformers integration on the oldest transformers it supports as well as the newest: the whole of
test_hf_integration.py runs again under transformers 5.19 (the version vLLM's CPU build pins), in an
environment of its own built once from the package registry (tests/client_venv.py) with this checkout
installed into it.  The inner session shares this session's kernel cache, so the kernels test_hf_integration.py
built here are loaded there, not built again."""

import os
import subprocess
from importlib.metadata import version
from pathlib import Path

from tests.client_venv import client_python, install_checkout
from tests.conftest import OUTER_SESSION_CACHE

OLDEST = "5.19.0"
MODULE = Path(__file__).resolve().parent / "test_hf_integration.py"
RUN_TIMEOUT_S = 60 * 60


def test_the_integration_tests_pass_under_the_oldest_transformers(tmp_path_factory, kernel_cache_dir):
    python = client_python(f"transformers-{OLDEST}", [f"transformers=={OLDEST}", "torch==2.13.0",
                                                      f"peft=={version('peft')}", "pytest"])
    site = install_checkout(python, tmp_path_factory.mktemp("transformers-oldest-site"))
    environment = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1",
                       **{OUTER_SESSION_CACHE: str(kernel_cache_dir)})
    found = subprocess.run([str(python), "-c", "import transformers; print(transformers.__version__)"],
                           capture_output=True, text=True, env=environment, check=True).stdout.strip()
    assert found == OLDEST
    result = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", str(MODULE)],
                            cwd=tmp_path_factory.mktemp("transformers-oldest-run"), capture_output=True, text=True,
                            env=environment, timeout=RUN_TIMEOUT_S)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
