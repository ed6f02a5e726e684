"""The cache key of a compiled kernel and the versions that scope it."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from importlib import metadata

from ..ops import spec_from_dict
from ..ops.matmul import Matmul


@functools.lru_cache(maxsize=None)
def versions() -> dict[str, str]:
    """The versions a compiled kernel depends on: an entry built under others is never used."""
    from .. import __version__
    from ..codegen import KERNEL_ABI

    return {"bitkern": __version__, "kernel_abi": str(KERNEL_ABI), "tvm": metadata.version("apache-tvm"),
            "tvm_ffi": metadata.version("apache-tvm-ffi")}


@dataclass(frozen=True)
class KernelKey:
    """(op spec — a Matmul, or a Conv2d with its geometry —, N, K, M bucket, weight layout, target): what one
    compiled kernel serves."""

    spec: Matmul
    n: int
    k: int
    bucket: tuple[int, int]
    layout: str
    target: str

    def to_dict(self) -> dict:
        return {"spec": dataclasses.asdict(self.spec), "n": self.n, "k": self.k, "bucket": list(self.bucket),
                "layout": self.layout, "target": self.target}

    @classmethod
    def from_dict(cls, fields: dict) -> "KernelKey":
        return cls(spec_from_dict(fields["spec"]), fields["n"], fields["k"], tuple(fields["bucket"]), fields["layout"],
                   fields["target"])

    @property
    def digest(self) -> str:
        """A stable name for the key (and the versions it is scoped to)."""
        canonical = json.dumps({**self.to_dict(), "versions": versions()}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]
