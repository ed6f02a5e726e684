"""The on-disk kernel store: one directory per compiled kernel, written atomically, verified when loaded.

Layout: <root>/bitkern-<v>_code-<digest>_tvm-<v>_ffi-<v>/<target>/<key digest>/ holding the compiled kernel — for CPU
targets kernel.so (the module) and constants.safetensors (decode tables, if any); for CUDA targets
kernel.cubin, kernel.ptx, the generated kernel.cu source (for inspection) and kernel.json (launches) —
and manifest.json (the key, the versions, the template and its configuration, the tuning record, a
sha256 of every file).  An entry is written into a
hidden temporary directory and renamed into place, so a writer killed midway leaves nothing that loads;
a file whose checksum does not match is reported, removed and rebuilt; entries of other bitkern versions,
kernel-generating code (`key.code_fingerprint`), TVM or tvm-ffi versions live under another directory and
are never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tarfile
import time
import uuid
from pathlib import Path

from filelock import FileLock

from .key import KernelKey, versions

log = logging.getLogger("bitkern")

MANIFEST = "manifest.json"
LIBRARY = "kernel.so"
CONSTANTS = "constants.safetensors"
BUNDLE_MANIFEST = "bundle.json"
STALE_SECONDS = 3600  # temporary directories older than this were left by a killed writer


def cache_root() -> Path:
    """$BITKERN_CACHE_DIR, else $XDG_CACHE_HOME/bitkern, else ~/.cache/bitkern."""
    if os.environ.get("BITKERN_CACHE_DIR"):
        return Path(os.environ["BITKERN_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "bitkern"
    return Path.home() / ".cache" / "bitkern"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class DiskStore:
    """Compiled kernels under `root` (default `cache_root()`), scoped to the running versions."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else cache_root()

    @property
    def version_dir(self) -> Path:
        v = versions()
        return self.root / f"bitkern-{v['bitkern']}_code-{v['code']}_tvm-{v['tvm']}_ffi-{v['tvm_ffi']}"

    def entry_dir(self, key: KernelKey) -> Path:
        return self.version_dir / key.target / key.digest

    def lock(self, key: KernelKey) -> FileLock:
        """A cross-process lock for building `key` (processes that need the same kernel build it once)."""
        directory = self.version_dir / key.target
        directory.mkdir(parents=True, exist_ok=True)
        return FileLock(str(directory / f"{key.digest}.lock"))

    # -- entries ----------------------------------------------------------------------------------------
    def load(self, key: KernelKey):
        """The stored kernel for `key`, or None if there is none or it is damaged (then it is removed)."""
        directory = self.entry_dir(key)
        if not directory.is_dir():
            return None
        try:
            manifest = self._checked_manifest(directory)
            if KernelKey.from_dict(manifest["key"]) != key:
                raise ValueError("the manifest describes another kernel")
            return _kernel_from(directory, manifest)
        except Exception as error:  # a damaged entry of any kind is rebuilt, never used
            log.warning("bitkern: cache entry %s is damaged (%s); removing it, the kernel will be rebuilt",
                        directory, error)
            shutil.rmtree(directory, ignore_errors=True)
            return None

    def save(self, key: KernelKey, kernel) -> Path:
        """Write `kernel` (compiled in this process) as the entry of `key`, atomically."""
        from safetensors.torch import save_file

        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale(final.parent)
        temporary = final.parent / f".{key.digest}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        temporary.mkdir()
        try:
            if key.target.startswith("cuda-"):
                kernel.save(str(temporary))  # cubin, PTX, the .cu source and the launch description
            else:
                kernel.module.export_library(str(temporary / LIBRARY))
                if kernel.constants:
                    save_file({f"c{i}": c.contiguous() for i, c in enumerate(kernel.constants)},
                              str(temporary / CONSTANTS))
            files = {path.name: _sha256(path) for path in sorted(temporary.iterdir())}
            manifest = {"key": key.to_dict(), "versions": versions(), "template": kernel.template,
                        "config": _config_dict(kernel), "m_range": list(kernel.m_range), "files": files,
                        "created": time.time(), "record": _record_dict(kernel.record)}
            with open(temporary / MANIFEST, "w") as file:
                json.dump(manifest, file, indent=1)
                file.flush()
                os.fsync(file.fileno())
            os.rename(temporary, final)
        except OSError:
            shutil.rmtree(temporary, ignore_errors=True)
            if not final.is_dir():
                raise
        return final

    def entries(self, all_versions: bool = False) -> list[dict]:
        """Manifests of the stored entries (with their directory), the running versions' only by default."""
        found = []
        for base in (self.root.glob("bitkern-*") if all_versions else [self.version_dir]):
            for manifest_path in sorted(base.glob(f"*/*/{MANIFEST}")):
                if manifest_path.parent.name.startswith("."):  # a writer's unfinished directory
                    continue
                try:
                    manifest = json.loads(manifest_path.read_text())
                except (OSError, ValueError) as error:
                    manifest = {"error": str(error)}
                found.append({**manifest, "directory": str(manifest_path.parent)})
        return found

    def verify(self) -> list[tuple[Path, str | None]]:
        """Every entry of the running versions and what is wrong with it (None: nothing)."""
        results = []
        for target_dir in sorted(self.version_dir.glob("*")):
            for directory in sorted(p for p in target_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
                try:
                    self._checked_manifest(directory)
                    results.append((directory, None))
                except Exception as error:  # report every kind of damage
                    results.append((directory, str(error)))
        return results

    def clear(self) -> int:
        """Remove every entry of every version; returns how many kernels were removed."""
        count = len(self.entries(all_versions=True))
        for base in self.root.glob("bitkern-*"):
            shutil.rmtree(base, ignore_errors=True)
        return count

    # -- bundles ----------------------------------------------------------------------------------------
    def export(self, path: str | os.PathLike, target: str | None = None) -> int:
        """Write the entries (of one target, or all) into one .tar.gz bundle with a manifest."""
        entries = [e for e in self.entries() if "error" not in e and (target is None or e["key"]["target"] == target)]
        bundle = {"versions": versions(), "entries": [
            {"path": str(Path(e["directory"]).relative_to(self.version_dir)), "files": e["files"]} for e in entries]}
        with tarfile.open(path, "w:gz") as archive:
            data = json.dumps(bundle, indent=1).encode()
            info = tarfile.TarInfo(BUNDLE_MANIFEST)
            info.size = len(data)
            archive.addfile(info, _bytes_io(data))
            for entry in entries:
                archive.add(entry["directory"], arcname=str(Path(entry["directory"]).relative_to(self.version_dir)))
        return len(entries)

    def import_(self, path: str | os.PathLike) -> int:
        """Add the entries of a bundle (verified file by file); returns how many were added."""
        with tarfile.open(path, "r:gz") as archive:
            bundle = json.loads(archive.extractfile(BUNDLE_MANIFEST).read())
            if bundle["versions"] != versions():
                raise ValueError(f"bundle {path} was built with {bundle['versions']}; this process runs "
                                 f"{versions()} and never uses kernels built with other versions")
            added = 0
            for entry in bundle["entries"]:
                final = self.version_dir / entry["path"]
                if final.is_dir():
                    continue
                final.parent.mkdir(parents=True, exist_ok=True)
                temporary = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                temporary.mkdir()
                for name, checksum in entry["files"].items():
                    member = archive.extractfile(f"{entry['path']}/{name}")
                    (temporary / name).write_bytes(member.read())
                    if _sha256(temporary / name) != checksum:
                        shutil.rmtree(temporary)
                        raise ValueError(f"bundle {path}: {entry['path']}/{name} does not match its checksum")
                (temporary / MANIFEST).write_bytes(archive.extractfile(f"{entry['path']}/{MANIFEST}").read())
                os.rename(temporary, final)
                added += 1
        return added

    # -- internals --------------------------------------------------------------------------------------
    def _checked_manifest(self, directory: Path) -> dict:
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest["versions"] != versions():
            raise ValueError(f"built with {manifest['versions']}, running {versions()}")
        for name, checksum in manifest["files"].items():
            if _sha256(directory / name) != checksum:
                raise ValueError(f"{name} does not match its checksum")
        return manifest

    @staticmethod
    def _remove_stale(directory: Path) -> None:
        for leftover in directory.glob(".*.tmp-*"):
            try:
                if time.time() - leftover.stat().st_mtime > STALE_SECONDS:
                    shutil.rmtree(leftover, ignore_errors=True)
            except OSError:
                pass


def _kernel_from(directory: Path, manifest: dict):
    """Rebuild the callable kernel of an entry (runtime only: no TVM compiler, no nvcc)."""
    key = KernelKey.from_dict(manifest["key"])
    if key.target.startswith("cuda-"):
        from ..codegen.cuda import load_kernel

        kernel = load_kernel(str(directory))
        kernel.record = manifest.get("record")
        return kernel
    return _cpu_kernel_from(directory, manifest, key)


def _cpu_kernel_from(directory: Path, manifest: dict, key: KernelKey):
    from ..codegen import template
    from ..codegen.cpu.layout import aligned
    from .runtime import load_function

    constants = []
    if (directory / CONSTANTS).exists():
        from safetensors.torch import load_file

        loaded = load_file(str(directory / CONSTANTS))
        constants = [aligned(loaded[f"c{i}"]) for i in range(len(loaded))]  # file offsets are not aligned
    function = load_function(str(directory / LIBRARY))
    kernel = template(manifest["template"]).restore(key.spec, key.n, key.k, manifest["config"], key.layout,
                                                    tuple(manifest["m_range"]), function, constants)
    kernel.record = manifest.get("record")
    return kernel


def _config_dict(kernel) -> dict:
    import dataclasses

    return dataclasses.asdict(kernel.config)


def _record_dict(record) -> dict | None:
    """The tuning record in JSON: its one-line summary and every trial."""
    if record is None or isinstance(record, dict):
        return record
    import dataclasses

    return {"summary": record.summary(), "profiled": record.profiled, "seconds": record.seconds,
            "notes": list(record.notes), "chosen": record.chosen,
            "trials": [{"template": t.template, "config": dataclasses.asdict(t.config),
                        "modeled_s": t.modeled_s, "measured_s": t.measured_s} for t in record.trials]}


def _bytes_io(data: bytes):
    import io

    return io.BytesIO(data)
