"""Virtual environments for tests that drive a real client of bitkern (a vLLM engine, another transformers
version) whose pins differ from the test environment's.

`client_python(name, requirements)` builds one from the package registry the first time (bitkern's own
dependencies included), keyed by the pins, under ~/.cache/bitkern-test-venvs (or $BITKERN_TEST_VENVS), and reuses
it afterwards.  `install_checkout(python, target)` installs this checkout (not editable, no dependencies) into a
folder of the test session, so the environment runs the code under test with its entry points, and two checkouts
can share one environment.  `client_packages(name, requirements)` installs a reference tool alone (no dependencies)
into a folder the test puts on sys.path, where the test environment's torch serves it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

from filelock import FileLock

REPOSITORY = Path(__file__).resolve().parent.parent
COMPLETE = "bitkern-test-venv.json"  # written last: an environment without it is a failed build and is rebuilt
BUILD_TIMEOUT_S = 40 * 60


def venvs_root() -> Path:
    if os.environ.get("BITKERN_TEST_VENVS"):
        return Path(os.environ["BITKERN_TEST_VENVS"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bitkern-test-venvs"


def bitkern_requirements() -> list[str]:
    """bitkern's install requirements, as the installed distribution declares them (extras left out)."""
    return sorted(r for r in requires("bitkern") or [] if "extra ==" not in r)


def client_python(name: str, requirements: list[str], remove: tuple[str, ...] = ()) -> Path:
    """The python of a virtual environment holding `requirements` and bitkern's dependencies, with the packages
    in `remove` uninstalled afterwards (e.g. a pinned package's extras that break it)."""
    pins = {"python": list(sys.version_info[:2]), "requirements": sorted(requirements),
            "bitkern": bitkern_requirements(), "remove": sorted(remove)}

    def build(path: Path) -> None:
        python = path / "bin" / "python"
        _run([sys.executable, "-m", "venv", str(path)])
        _run([str(python), "-m", "pip", "install", "--quiet", *requirements, *pins["bitkern"]])
        if remove:
            _run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *remove])

    return _built_once(name, pins, build) / "bin" / "python"


def client_packages(name: str, requirements: list[str], environment: dict[str, str] | None = None) -> Path:
    """A folder holding `requirements` alone (no dependencies: the test environment's torch and numpy serve them),
    installed with `environment` added (e.g. a build switch); put it on sys.path to import them."""
    pins = {"python": list(sys.version_info[:2]), "requirements": sorted(requirements),
            "environment": environment or {}}

    def build(path: Path) -> None:
        _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(path), *requirements],
             environment)

    return _built_once(name, pins, build)


def _built_once(name: str, pins: dict, build) -> Path:
    """The folder `build(path)` fills for these pins, built by the first caller (under a lock, rebuilt where a
    build did not finish) and reused afterwards."""
    key = hashlib.sha256(json.dumps(pins, sort_keys=True).encode()).hexdigest()[:12]
    root = venvs_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}-{key}"
    with FileLock(str(root / f"{name}-{key}.lock"), timeout=BUILD_TIMEOUT_S):
        if not (path / COMPLETE).exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            (path / COMPLETE).write_text(json.dumps(pins, indent=1))
    return path


def install_checkout(python: Path, target: Path) -> Path:
    """Install this checkout into `target` with the environment's pip (no dependencies, no build isolation:
    the environment's setuptools and torch build it); put `target` on PYTHONPATH to use it.  A `target` this run
    already installed into (a folder the pytest-xdist workers share) is used as it is."""
    done = target.parent / f"{target.name}.installed"
    with FileLock(str(venvs_root() / "checkout-build.lock"), timeout=BUILD_TIMEOUT_S):
        if not done.exists():
            _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
                  str(target), str(REPOSITORY)])
            done.write_text(str(python))
    return target


def _run(command: list[str], environment: dict[str, str] | None = None) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                            env={**os.environ, **(environment or {})})
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                           f"{result.stderr[-4000:]}")
