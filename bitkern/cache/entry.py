"""What one stored kernel is made of: its directory's name parts, its files and its manifest's schema
(shared by the store, which reads entries, and bundles, which carry them)."""

from __future__ import annotations

import json
import re

from .key import KernelKey, versions

MANIFEST = "manifest.json"
LIBRARY = "kernel.so"
CONSTANTS = "constants.safetensors"
CUDA_FILES = ("kernel.cubin", "kernel.ptx", "kernel.cu", "kernel.json")
FILES = (LIBRARY, CONSTANTS, *CUDA_FILES)  # the names an entry's files (besides its manifest) may have
TARGET = re.compile(r"(?:cpu|cuda)-[A-Za-z0-9_.+-]{1,64}")  # a device key (`tuner.device`): a directory name
DIGEST = re.compile(r"[0-9a-f]{32}")  # `KernelKey.digest`
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"key": dict, "versions": dict, "template": str, "config": dict, "m_range": list, "files": dict}


def required_files(target: str) -> tuple[str, ...]:
    """The files an entry for `target` cannot do without."""
    return CUDA_FILES if target.startswith("cuda-") else (LIBRARY,)


def parse_manifest(data: bytes, where: str) -> dict:
    """The manifest in `data`, checked: a JSON object of the running versions, with a valid key, template
    fields and a sha256 for each of its files (named as entries' files are).  ValueError naming `where`."""
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{where} is not a JSON object")
    for field, kind in _FIELDS.items():
        if not isinstance(manifest.get(field), kind):
            raise ValueError(f"{where}: field {field!r} must be a JSON {kind.__name__}, got {manifest.get(field)!r}")
    if manifest["versions"] != versions():
        raise ValueError(f"{where}: built with {manifest['versions']}, running {versions()}")
    try:
        key = KernelKey.from_dict(manifest["key"])
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: the key is not a kernel key ({error!r})") from None
    files = manifest["files"]
    wrong = [name for name, checksum in files.items()
             if name not in FILES or not isinstance(checksum, str) or not _SHA256.fullmatch(checksum)]
    if wrong:
        raise ValueError(f"{where}: files {wrong} are not entry files ({list(FILES)}) with a sha256")
    missing = [name for name in required_files(key.target) if name not in files]
    if missing:
        raise ValueError(f"{where}: a {key.target} kernel needs files {missing}")
    m_range = manifest["m_range"]
    if len(m_range) != 2 or not all(isinstance(m, int) and not isinstance(m, bool) for m in m_range):
        raise ValueError(f"{where}: m_range must be two ints, got {m_range!r}")
    return manifest
