"""Compile a CPU kernel's TIR with LLVM in a separate process, so that a compiler failure never ends the caller.

LLVM aborts its process on some failures (e.g. `LLVM ERROR: Do not know how to split the result of this
operator!`, then SIGABRT).  `compile_library` sends the PrimFunc (TVM's JSON) to a worker process
(`compile_worker.py`, started on first use and kept for later builds, one per concurrent build) that compiles and
exports it as a shared library; the caller loads that library.  A worker that dies or reports an error raises
`KernelBuildError` with the reason (LLVM's last words from the worker's stderr, or the exception), and the next
build starts a new worker.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid

from ..template import KernelBuildError
from .compile_worker import read_message, write_message

WORKER = os.path.join(os.path.dirname(__file__), "compile_worker.py")
STDERR_TAIL = 2000  # characters of a dead worker's stderr quoted in the error


class _Worker:
    """One compiling process, serving one request at a time."""

    def __init__(self):
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.stderr)

    def compile(self, request: dict) -> None:
        start = self.stderr.seek(0, os.SEEK_END)
        try:
            write_message(self.process.stdin, request)
            reply = read_message(self.process.stdout)
        except (BrokenPipeError, ConnectionResetError):
            reply = None
        if reply is None:
            raise KernelBuildError(self._death(start))
        if "error" in reply:
            raise KernelBuildError(reply["error"])

    def alive(self) -> bool:
        return self.process.poll() is None

    def _death(self, start: int) -> str:
        code = self.process.wait()
        self.stderr.seek(start)
        said = self.stderr.read().decode(errors="replace").strip()[-STDERR_TAIL:]
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return f"the compiling process ended ({how})" + (f": {said}" if said else "")

    def close(self) -> None:
        if self.alive():
            self.process.stdin.close()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.stderr.close()


_idle: list[_Worker] = []
_every: list[_Worker] = []
_lock = threading.Lock()
_directory: list[str] = []
_owner = [os.getpid()]  # the process the workers and the directory belong to (a forked child starts its own)


def _forget_inherited() -> None:
    """In a child forked from the process that started them, leave the parent's workers and directory to it."""
    if _owner[0] != os.getpid():
        _owner[0] = os.getpid()
        _idle.clear()
        _every.clear()
        _directory.clear()


def compile_library(func, target: dict, pass_config: dict, disabled_passes: list[str]) -> str:
    """The path of the shared library LLVM makes of `func` (a PrimFunc named "main") for `target` (a TVM target
    dict), compiled in a worker process under these PassContext settings; KernelBuildError if it fails."""
    import tvm

    path = os.path.join(_library_directory(), f"{uuid.uuid4().hex}.so")
    request = {"module": tvm.ir.save_json(tvm.IRModule({"main": func})), "target": target, "config": pass_config,
               "disabled_passes": disabled_passes, "path": path}
    worker = _take()
    try:
        worker.compile(request)
    finally:
        _give_back(worker)
    return path


def _take() -> _Worker:
    with _lock:
        _forget_inherited()
        if _idle:
            return _idle.pop()
        worker = _Worker()
        _every.append(worker)
        return worker


def _give_back(worker: _Worker) -> None:
    with _lock:
        if worker.alive() and worker in _every:
            _idle.append(worker)
        elif worker in _every:
            _every.remove(worker)
            worker.close()


def _library_directory() -> str:
    """A private directory for this process's compiled libraries, removed when it exits."""
    with _lock:
        _forget_inherited()
        if not _directory:
            _directory.append(tempfile.mkdtemp(prefix="bitkern-kernels-"))
        return _directory[0]


@atexit.register
def _close_all() -> None:
    with _lock:
        _forget_inherited()
        for worker in _every:
            worker.close()
        _every.clear()
        _idle.clear()
        for directory in _directory:
            shutil.rmtree(directory, ignore_errors=True)
