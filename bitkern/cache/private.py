"""File-system primitives of the kernel cache, which treats its files as ssh treats ~/.ssh: directories are
made 0700 and files 0600 whatever the umask (0755 and 0644 in a shared cache, which other users read); a path is
used only if this user or root owns it and neither group nor others can write it (so a cache that root built
into a container image is trusted by the image's unprivileged user, read-only), and never a symbolic link below
the cache root; every file is read once, so the bytes checked against a checksum are the bytes used (a kernel
library is loaded from those bytes, not from its path again).
"""

from __future__ import annotations

import atexit
import errno
import functools
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

MAX_FILE_BYTES = 64 << 20  # a kernel library, cubin or manifest: far larger than any bitkern writes


class Untrusted(Exception):
    """A path in the cache that another user owns or could have written, a symbolic link, or not the kind
    of file expected: it is never used (nor removed)."""


ROOT_UID = 0
PRIVATE_MODES = (0o700, 0o600)  # (directories, files) of a user's own cache
SHARED_MODES = (0o755, 0o644)  # of a cache other users read (a system cache)


def untrusted_reason(status: os.stat_result) -> str | None:
    """Why a file with this status must not be trusted by this user (None: it may): only this user and root
    may own it (as ssh and sudo trust files), and neither group nor others may write it."""
    user = os.geteuid()
    if status.st_uid not in (user, ROOT_UID):
        return f"it is owned by uid {status.st_uid}, not by this user (uid {user}) nor root"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group or others can write it (mode {stat.S_IMODE(status.st_mode):03o})"
    return None


def check_directory(path: Path) -> bool:
    """True if `path` is a trusted directory (`untrusted_reason`), False if there is nothing there; Untrusted
    for anything else (a symbolic link is never followed)."""
    try:
        status = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (NotADirectoryError: a parent is a file)
        return False
    if stat.S_ISLNK(status.st_mode):
        raise Untrusted(f"{path} is a symbolic link")
    if not stat.S_ISDIR(status.st_mode):
        raise Untrusted(f"{path} is not a directory")
    reason = untrusted_reason(status)
    if reason:
        raise Untrusted(f"{path}: {reason}")
    return True


def make_directories(root: Path, path: Path, mode: int = PRIVATE_MODES[0]) -> None:
    """Create the directories below `root` down to `path` with `mode`; existing ones must pass
    `check_directory`."""
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if check_directory(current):
            continue
        try:
            os.mkdir(current, mode)
        except FileExistsError:  # another process made it meanwhile
            check_directory(current)
            continue
        os.chmod(current, mode)  # mkdir's mode is masked by the umask


def make_directory(path: Path, mode: int = PRIVATE_MODES[0]) -> None:
    """Create the directory `path` (its parents as usual) with `mode`; an existing one is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    os.chmod(path, mode)


def write_protection(path: Path) -> str | None:
    """Why this process cannot create or change files in the directory `path` (or create it, where it does not
    exist), found without writing: a read-only file system, or no write permission; None where it can."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"{existing} is on a read-only file system"
    except OSError as error:
        return f"{existing} cannot be examined ({error})"
    if not os.access(existing, os.W_OK | os.X_OK, effective_ids=True):
        return f"this user (uid {os.geteuid()}) cannot write {existing}"
    return None


def read_file(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path`, which must be this user's and not writable by others, and at most
    `limit` (default MAX_FILE_BYTES) long; opened without following a symbolic link and without blocking on
    a FIFO."""
    limit = MAX_FILE_BYTES if limit is None else limit
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise Untrusted(f"{path} is a symbolic link") from None
        raise
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise Untrusted(f"{path} is not a regular file")
        reason = untrusted_reason(status)
        if reason:
            raise Untrusted(f"{path}: {reason}")
        if status.st_size > limit:
            raise ValueError(f"{path} has {status.st_size} bytes, more than the {limit} a cache file may have")
        with os.fdopen(os.dup(descriptor), "rb") as file:
            data = file.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{path} grew past the {limit} bytes a cache file may have")
        return data
    finally:
        os.close(descriptor)


def write_file(path: Path, data: bytes, mode: int = PRIVATE_MODES[1]) -> None:
    """Create `path` (which must not exist) with `mode` holding `data`, flushed to disk."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(descriptor, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view):]
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def load_library(data: bytes, name: str = "main"):
    """The function `name` of a TVM kernel library given as bytes (already verified).  The bytes go into an
    anonymous memory file (memfd) that only this process holds; TVM picks its loader by the file name's
    suffix, so it is reached through a link named *.so in this process's private 0700 directory."""
    from ..codegen.cpu import runtime

    descriptor = os.memfd_create("bitkern-kernel", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view):]
        link = Path(_process_directory()) / f"kernel-{uuid.uuid4().hex}.so"  # the loader reuses a known name's library
        os.symlink(f"/proc/self/fd/{descriptor}", link)
        try:
            return runtime.load_library(str(link), name)
        finally:
            os.unlink(link)
    finally:
        os.close(descriptor)  # the loaded library keeps its mapping


@functools.lru_cache(maxsize=None)
def _process_directory() -> str:
    """A 0700 temporary directory of this process (removed at exit)."""
    directory = tempfile.mkdtemp(prefix="bitkern-")
    atexit.register(shutil.rmtree, directory, True)
    return directory
