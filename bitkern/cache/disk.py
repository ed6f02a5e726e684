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

Trust: the cache holds native code that runs in the process, so only this user or root may be able to write
it (ssh's and sudo's rule).  Directories are 0700 and files 0600 whatever the umask (0755 and 0644 in a system
cache, which other users read); a root or entry that another user owns or that group or others can write, and any
symbolic link below the root, is refused with a warning that says how to make it trusted (the kernel is then
built in memory); each file is read once, and a library is loaded from the bytes its checksum was checked on
(see `private`).  A cache this process cannot write (root's, or on a read-only file system) is read and never
written: nothing is attempted there, a kernel it lacks is built in memory, with one warning; so is a kernel whose
build lock is held past `lock_timeout`.

Layers: the user's cache, then the system cache (`system_cache_root`), read-only, e.g. prebuilt by root into a
container image with `python -m bitkern prebuild --system`; `lookup` reads both and builds into the user's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from pathlib import Path

from filelock import FileLock, Timeout

from ..tuner.device import host_cpu, unrunnable
from . import bundle
from .entry import CONSTANTS, LIBRARY, MANIFEST, parse_manifest
from .key import KernelKey, versions
from .private import (PRIVATE_MODES, SHARED_MODES, Untrusted, check_directory, make_directories, make_directory,
                      read_file, untrusted_reason, write_file, write_protection)

log = logging.getLogger("bitkern")

STALE_SECONDS = 3600  # temporary directories older than this were left by a killed writer
LOCK_TIMEOUT_SECONDS = 60.0  # a build lock held longer belongs to a stopped or hung builder
VERSION_DIR = re.compile(r"bitkern-[^_/]+_code-[0-9a-f]{12}_tvm-[^_/]+_ffi-[^_/]+")
SYSTEM_CACHE_DIR = "/usr/local/share/bitkern/cache"
_warned: set = set()


def cache_root() -> Path:
    """$BITKERN_CACHE_DIR, else $XDG_CACHE_HOME/bitkern, else ~/.cache/bitkern."""
    if os.environ.get("BITKERN_CACHE_DIR"):
        return Path(os.environ["BITKERN_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "bitkern"
    return Path.home() / ".cache" / "bitkern"


def system_cache_root() -> Path:
    """$BITKERN_SYSTEM_CACHE_DIR, else /usr/local/share/bitkern/cache: the read-only cache searched after the
    user's own."""
    return Path(os.environ.get("BITKERN_SYSTEM_CACHE_DIR") or SYSTEM_CACHE_DIR)


def default_lock_timeout() -> float:
    """$BITKERN_LOCK_TIMEOUT (seconds, default 60): how long a process waits for another one building the
    same kernel before it builds the kernel in memory itself."""
    text = os.environ.get("BITKERN_LOCK_TIMEOUT")
    if text is None:
        return LOCK_TIMEOUT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"BITKERN_LOCK_TIMEOUT={text!r} must be a positive number of seconds")
    return seconds


class DiskStore:
    """Compiled kernels under `root` (default `cache_root()`), scoped to the running versions.

    system: a cache other users read (default root `system_cache_root()`): written with modes 0755/0644, and
    its messages name the system cache's fixes.  read_only: never written, not even to remove a damaged entry
    (what serving processes make of the system cache)."""

    def __init__(self, root: str | os.PathLike | None = None, lock_timeout: float | None = None,
                 system: bool = False, read_only: bool = False):
        self.system, self.read_only = system, read_only
        self.root = Path(root) if root is not None else system_cache_root() if system else cache_root()
        self.lock_timeout = default_lock_timeout() if lock_timeout is None else lock_timeout
        self.modes = SHARED_MODES if system else PRIVATE_MODES

    @property
    def version_dir(self) -> Path:
        v = versions()
        return self.root / f"bitkern-{v['bitkern']}_code-{v['code']}_tvm-{v['tvm']}_ffi-{v['tvm_ffi']}"

    def entry_dir(self, key: KernelKey) -> Path:
        return self.version_dir / key.target / key.digest

    def lock_path(self, key: KernelKey) -> Path:
        """The file whose lock a process holds while it builds `key`."""
        return self.version_dir / key.target / f"{key.digest}.lock"

    def problem(self) -> str | None:
        """Why the store cannot be used at all (None: it can; a missing root holds nothing yet).  An existing root
        must be a directory that this user or root owns and that group and others cannot write (the root itself
        may be a symbolic link, e.g. ~/.cache on another disk; nothing below it is followed)."""
        try:
            status = os.stat(self.root)
        except FileNotFoundError:
            return None
        except OSError as error:
            return f"cannot be read ({error})"
        if not stat.S_ISDIR(status.st_mode):
            return "is not a directory"
        reason = untrusted_reason(status)
        return None if reason is None else f"is not used: {reason}"

    def unwritable(self) -> str | None:
        """Why this process cannot store kernels here (None: it can), found without writing anything: a read-only
        store, a read-only file system, or a root this user may not write (root's system cache)."""
        if self.read_only:
            return "it is read-only (a system cache, written only by `python -m bitkern prebuild --system`)"
        try:
            owner, user = os.stat(self.root).st_uid, os.geteuid()
        except FileNotFoundError:
            return write_protection(self.root)
        except OSError as error:
            return f"it cannot be read ({error})"
        if owner != user:
            return f"it belongs to uid {owner}, so this user (uid {user}) only reads it"
        return write_protection(self.root)

    def how_to_trust(self) -> str:
        """What makes a refused store trusted, for messages."""
        if self.system:
            return (f"make it trusted as root: chown -R root:root {self.root} && chmod -R go-w {self.root} (as "
                    f"`python -m bitkern prebuild --system` leaves it), or set BITKERN_SYSTEM_CACHE_DIR to a "
                    f"trusted one")
        return (f"make it trusted: own it and let nobody else write it (chmod -R go-w {self.root}), or set "
                f"BITKERN_CACHE_DIR to a directory of yours that only you can write")

    # -- entries ----------------------------------------------------------------------------------------
    def load(self, key: KernelKey):
        """The stored kernel for `key`, or None if there is none, it is damaged (then it is removed where this
        process may write the store, else left alone), or it is not trusted (then it is left alone); a warning
        says which."""
        if self._refused():
            return None
        directory = self.entry_dir(key)
        try:
            found = self._read_entry(directory)
            if found is None:
                return None
            manifest, files = found
            if KernelKey.from_dict(manifest["key"]) != key:
                raise ValueError("the manifest describes another kernel")
            return _kernel_from(manifest, files)
        except Untrusted as error:
            _warn_once(("entry", str(directory)), "bitkern: cache entry %s is not used: %s; the kernel is found or "
                       "built elsewhere (%s)", directory, error, self.how_to_trust())
            return None
        except Exception as error:  # a damaged entry of any kind is rebuilt, never used
            if self.unwritable():
                _warn_once(("entry", str(directory)), "bitkern: cache entry %s is damaged (%s) and not used; the "
                           "kernel is found or built elsewhere", directory, error)
                return None
            log.warning("bitkern: cache entry %s is damaged (%s); removing it, the kernel will be rebuilt",
                        directory, error)
            shutil.rmtree(directory, ignore_errors=True)
            return None

    @contextlib.contextmanager
    def building(self, key: KernelKey):
        """Hold the cross-process lock for building `key` (processes that need the same kernel build it once)
        and yield True; yield False, after one warning, where the store cannot be used or written (nothing is
        attempted in a store `unwritable` names a reason for) or the lock stays held past `lock_timeout` seconds
        (a stopped or hung builder): the caller builds in memory."""
        lock = self._acquire(key)
        try:
            yield lock is not None
        finally:
            if lock is not None:
                lock.release()

    def save(self, key: KernelKey, kernel, copy_of: KernelKey | None = None) -> Path | None:
        """Write `kernel` (compiled in this process) as the entry of `key`, atomically; None (after one
        warning) where the store cannot be written.  `copy_of`: the entry `kernel` was loaded from (a prebuilt
        candidate), whose files, read and checked against its checksums, are the new entry's."""
        try:
            return self._save(key, kernel, copy_of)
        except (OSError, Untrusted) as error:
            self._warn_unwritable(str(error))
            return None

    def pinned(self, key: KernelKey) -> list:
        """(key, kernel) of the stored kernels pinned to a configuration (`KernelKey.pinned`) for the kernel `key`
        names, e.g. a kit's prebuilt tuning candidates: loaded (verified), ordered by their configurations' names."""
        found = []
        for entry in self.entries():
            stored = entry.get("key")
            if not isinstance(stored, dict) or not stored.get("pinned") or stored.get("target") != key.target:
                continue
            try:
                other = KernelKey.from_dict(stored)
            except (AttributeError, KeyError, TypeError, ValueError):  # a damaged manifest: load() reports it
                continue
            if other.tuned() == key.tuned():
                kernel = self.load(other)
                if kernel is not None:
                    found.append((other, kernel))
        return sorted(found, key=lambda item: item[0].pinned)

    def entries(self, all_versions: bool = False) -> list[dict]:
        """Manifests of the stored entries (with their directory), the running versions' only by default."""
        found = []
        for base in (self._version_dirs() if all_versions else [self.version_dir]):
            for directory in _entry_dirs(base):
                try:
                    manifest = json.loads(read_file(directory / MANIFEST))
                    if not isinstance(manifest, dict):
                        raise ValueError("the manifest is not a JSON object")
                except (OSError, ValueError, Untrusted) as error:
                    manifest = {"error": str(error)}
                found.append({**manifest, "directory": str(directory)})
        return found

    def verify(self) -> list[tuple[Path, str | None]]:
        """Every entry of the running versions and what is wrong with it (None: nothing); the root alone where
        the store cannot be used at all."""
        problem = self.problem()
        if problem:
            return [(self.root, f"the kernel cache {problem}")]
        results = []
        for directory in _entry_dirs(self.version_dir):
            try:
                self._read_entry(directory)
                results.append((directory, None))
            except Exception as error:  # report every kind of damage
                results.append((directory, str(error)))
        return results

    def clear(self) -> int:
        """Remove bitkern's version directories (every version's; nothing else under the root, such as a
        user's own files); returns how many kernels were removed."""
        count = len(self.entries(all_versions=True))
        for base in self._version_dirs():
            shutil.rmtree(base, ignore_errors=True)
        return count

    # -- bundles ----------------------------------------------------------------------------------------
    def export(self, path: str | os.PathLike, target: str | None = None) -> int:
        """Write the verified entries (of one target, or all) into one .tar.gz bundle with a manifest."""
        found = []
        for directory, problem in self.verify():
            if problem is None and (target is None or directory.parent.name == target):
                found.append(bundle.Entry(directory.parent.name, directory.name, self._read_entry(directory)[1]))
        bundle.write(path, found)
        return len(found)

    def import_(self, path: str | os.PathLike) -> int:
        """Add the entries of a bundle; returns how many were added.  A bundle holds native code that runs in
        the processes that use this cache: import only bundles you trust, as you would install a wheel.  The
        bundle is checked whole before anything is written (its structure, names, member types and sizes,
        every manifest against the bundle, every checksum); a failed import leaves the store as it was."""
        entries = bundle.read(path)
        problem = self.problem()
        if problem:
            raise ValueError(f"the kernel cache {self.root} {problem}; {self.how_to_trust()}")
        unwritable = self.unwritable()
        if unwritable:
            raise ValueError(f"the kernel cache {self.root} cannot be written: {unwritable}")
        added: list[Path] = []
        try:
            make_directory(self.root, self.modes[0])
            for entry in entries:
                final = self.version_dir / entry.target / entry.digest
                if check_directory(final):
                    continue
                self._commit(final, entry.files)
                added.append(final)
        except (OSError, Untrusted) as error:
            for final in added:
                shutil.rmtree(final, ignore_errors=True)
            raise OSError(f"importing {path} into {self.version_dir} failed ({error}); nothing was added") from error
        for target in sorted({entry.target for entry in entries}):
            reason = unrunnable(target)
            if reason:
                log.warning("bitkern: the %s kernels of %s are kept but never run here: %s (they serve machines of "
                            "that level; this CPU's kernels are keyed %s)", target, path, reason, host_cpu().key)
        return len(added)

    # -- internals --------------------------------------------------------------------------------------
    def _refused(self) -> bool:
        problem = self.problem()
        if problem:
            self._warn_unusable(problem)
        return problem is not None

    def _warn_unusable(self, problem: str) -> None:
        _warn_once(("root", str(self.root)), "bitkern: the %s %s %s; its kernels are found or built elsewhere "
                   "(%s)", self._name, self.root, problem, self.how_to_trust())

    def _warn_unwritable(self, reason: str) -> None:
        _warn_once(("root", str(self.root)), "bitkern: the %s %s cannot be written (%s); kernels it lacks are built "
                   "in memory for this process only (set BITKERN_CACHE_DIR to a writable directory of yours to keep "
                   "them)", self._name, self.root, reason)

    @property
    def _name(self) -> str:
        return "system kernel cache" if self.system else "kernel cache"

    def _acquire(self, key: KernelKey) -> FileLock | None:
        """The held build lock of `key`, or None (after one warning) where there is none to be had."""
        if self._refused():
            return None
        unwritable = self.unwritable()
        if unwritable:
            self._warn_unwritable(unwritable)
            return None
        path = self.lock_path(key)
        try:
            make_directory(self.root, self.modes[0])
            make_directories(self.root, path.parent, self.modes[0])
            if os.path.islink(path):
                raise Untrusted(f"{path} is a symbolic link")
            lock = FileLock(str(path), timeout=self.lock_timeout, mode=self.modes[1])
            lock.acquire()
            return lock
        except Timeout:
            _warn_once(("lock", str(self.root)), "bitkern: the build lock %s has been held by another process for "
                       "%.0f s (a stopped or hung build?); building the kernel in memory instead (set "
                       "BITKERN_LOCK_TIMEOUT to wait longer)", path, self.lock_timeout)
        except (OSError, Untrusted) as error:
            self._warn_unwritable(str(error))
        return None

    def _read_entry(self, directory: Path) -> tuple[dict, dict[str, bytes]] | None:
        """(manifest, {file name: bytes}, the manifest's own included) of the entry in `directory`, each file
        read once and checked against its checksum; None if there is no entry.  Untrusted where a path is not this user's
        private file, ValueError where the entry is damaged."""
        for path in (self.version_dir, directory.parent, directory):
            if not check_directory(path):
                return None
        files = {MANIFEST: read_file(directory / MANIFEST)}
        manifest = parse_manifest(files[MANIFEST], str(directory / MANIFEST))
        for name, checksum in manifest["files"].items():
            files[name] = read_file(directory / name)
            if hashlib.sha256(files[name]).hexdigest() != checksum:
                raise ValueError(f"{name} does not match its checksum")
        return manifest, files

    def _save(self, key: KernelKey, kernel, copy_of: KernelKey | None = None) -> Path:
        from safetensors.torch import save as save_tensors

        final = self.entry_dir(key)
        make_directories(self.root, final.parent, self.modes[0])
        _remove_stale(final.parent)
        files: dict[str, bytes] = {}
        if copy_of is not None:
            found = self._read_entry(self.entry_dir(copy_of))
            if found is None:
                raise OSError(f"the entry {self.entry_dir(copy_of)} to copy is gone")
            files = {name: data for name, data in found[1].items() if name != MANIFEST}
        elif key.target.startswith("cuda-"):
            files = kernel.files()  # cubin, PTX, the .cu source and the launch description
        else:
            files[LIBRARY] = Path(kernel.library).read_bytes()
            if kernel.constants:
                files[CONSTANTS] = save_tensors({f"c{i}": c.contiguous() for i, c in enumerate(kernel.constants)})
        manifest = {"key": key.to_dict(), "versions": versions(), "template": kernel.template,
                    "config": _config_dict(kernel), "m_range": list(kernel.m_range),
                    "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
                    "created": time.time(), "record": _record_dict(kernel.record)}
        self._commit(final, {**files, MANIFEST: json.dumps(manifest, indent=1).encode()})
        return final

    def _commit(self, final: Path, files: dict[str, bytes]) -> None:
        """Write `files` into a hidden directory beside `final` and rename it into place; whatever is at
        `final` already (another writer's entry, or one this process refused) stays."""
        make_directories(self.root, final.parent, self.modes[0])
        if os.path.lexists(final):
            return
        temporary = _temporary_beside(final, self.modes[0])
        try:
            for name, data in files.items():
                write_file(temporary / name, data, self.modes[1])
            os.rename(temporary, final)
        except OSError:
            shutil.rmtree(temporary, ignore_errors=True)
            if not check_directory(final):
                raise

    def _version_dirs(self) -> list[Path]:
        """bitkern's version directories under the root (real directories of this user, named as bitkern
        names them)."""
        try:
            children = sorted(self.root.iterdir())
        except OSError:
            return []
        found = []
        for child in children:
            with contextlib.suppress(Untrusted):
                if VERSION_DIR.fullmatch(child.name) and check_directory(child):
                    found.append(child)
        return found


def _entry_dirs(base: Path) -> list[Path]:
    """The entry directories under a version directory of this user (no symbolic links, no writers' hidden
    ones)."""
    with contextlib.suppress(Untrusted):
        if check_directory(base):
            return [entry for parent in _subdirectories(base) for entry in _subdirectories(parent)]
    return []


def _subdirectories(path: Path) -> list[Path]:
    try:
        children = sorted(path.iterdir())
    except OSError:
        return []
    return [child for child in children if not child.name.startswith(".") and child.is_dir()
            and not child.is_symlink()]


def _temporary_beside(final: Path, mode: int) -> Path:
    temporary = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(temporary, mode)
    os.chmod(temporary, mode)
    return temporary


def _remove_stale(directory: Path) -> None:
    for leftover in directory.glob(".*.tmp-*"):
        try:
            status = os.lstat(leftover)
            if stat.S_ISDIR(status.st_mode) and time.time() - status.st_mtime > STALE_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def _warn_once(topic: tuple, message: str, *args) -> None:
    if topic not in _warned:
        _warned.add(topic)
        log.warning(message, *args)


def _kernel_from(manifest: dict, files: dict[str, bytes]):
    """Rebuild the callable kernel of an entry from its verified files (runtime only: no TVM compiler, no
    nvcc)."""
    key = KernelKey.from_dict(manifest["key"])
    if key.target.startswith("cuda-"):
        from ..codegen.cuda import kernel_from_files

        kernel = kernel_from_files(files)
    else:
        kernel = _cpu_kernel_from(manifest, files, key)
    kernel.record = manifest.get("record")
    return kernel


def _cpu_kernel_from(manifest: dict, files: dict[str, bytes], key: KernelKey):
    from ..codegen import template
    from ..codegen.cpu.layout import aligned
    from .private import load_library

    constants = []
    if CONSTANTS in files:
        from safetensors.torch import load as load_tensors

        loaded = load_tensors(files[CONSTANTS])
        constants = [aligned(loaded[f"c{i}"]) for i in range(len(loaded))]  # file offsets are not aligned
    return template(manifest["template"]).restore(key.spec, key.n, key.k, manifest["config"], key.layout,
                                                  tuple(manifest["m_range"]), load_library(files[LIBRARY]), constants)


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
