"""The process that compiles CPU kernels for `compiler.py`, run as a script (it imports TVM and nothing of bitkern).

LLVM ends its process on some failures (`LLVM ERROR: ...`, then abort): here that ends this worker, not the caller.
Requests and replies are length-prefixed JSON on stdin and stdout: a request holds the kernel's IRModule (TVM's
JSON), the target, the pass settings and the path to export the shared library to; a reply is {"ok": true} or
{"error": "..."} for failures LLVM or TVM report as exceptions.  Code for another architecture (aarch64 kernels
cross-compiled on x86-64) is linked by that architecture's linker.
"""

import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import traceback

MACHINES = {"x86_64": "x86_64", "AMD64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}  # platform -> triple
CROSS_LINKERS = {"aarch64": ("aarch64-linux-gnu-ld", "ld.lld"), "x86_64": ("x86_64-linux-gnu-ld", "ld.lld")}


def read_message(stream) -> dict | None:
    """The next length-prefixed JSON message on a binary stream, or None at its end (also read by `compiler.py`)."""
    header = stream.read(8)
    if len(header) < 8:
        return None
    return json.loads(stream.read(struct.unpack("<Q", header)[0]))


def write_message(stream, message: dict) -> None:
    """Send one length-prefixed JSON message."""
    data = json.dumps(message).encode()
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _compile(request: dict) -> None:
    import tvm

    module = tvm.ir.load_json(request["module"])
    with tvm.transform.PassContext(config=request["config"], disabled_pass=request["disabled_passes"]):
        library = tvm.compile(module, target=tvm.target.Target(request["target"]))
    arch = request["target"]["mtriple"].split("-")[0]
    if arch == MACHINES.get(platform.machine()):
        library.export_library(request["path"])
    else:
        _cross_link(library, arch, request["path"])


def _cross_link(library, arch: str, path: str) -> None:
    """Export code of another architecture than this machine's: its object file linked by that architecture's
    linker (the system compiler links only its own)."""
    linker = next(filter(None, map(shutil.which, CROSS_LINKERS.get(arch, ()))), None)
    if linker is None:
        raise RuntimeError(f"linking {arch} kernels on this {platform.machine()} machine needs one of "
                           f"{list(CROSS_LINKERS.get(arch, ()))} on PATH (Debian: binutils-{arch.replace('_', '-')}"
                           f"-linux-gnu, or lld)")
    obj = f"{path}.o"
    library.mod.write_to_file(obj)
    try:
        subprocess.run([linker, "-shared", "-o", path, obj], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"{linker} failed: {error.stderr.strip()[-1000:]}") from None
    finally:
        os.remove(obj)


def main() -> None:
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed while compiling stays off the reply channel
    while (request := read_message(requests)) is not None:
        try:
            _compile(request)
            reply = {"ok": True}
        except Exception as error:  # noqa: BLE001 - every compiler failure goes back to the caller, named
            traceback.print_exc()
            reply = {"error": f"{type(error).__name__}: {error}"}
        write_message(replies, reply)


if __name__ == "__main__":
    main()
