"""The process that compiles CPU kernels for `compiler.py`, run as a script (it imports TVM and nothing of bitkern).

LLVM ends its process on some failures (`LLVM ERROR: ...`, then abort): here that ends this worker, not the caller.
Requests and replies are length-prefixed JSON on stdin and stdout: a request holds the kernel's IRModule (TVM's
JSON), the target, the pass settings and the path to export the shared library to; a reply is {"ok": true} or
{"error": "..."} for failures LLVM or TVM report as exceptions.
"""

import json
import struct
import sys
import traceback


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
    library.export_library(request["path"])


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
