"""Kernel bundles: the entries of a store in one .tar.gz (`python -m bitkern cache export | import`).

A bundle holds native code that runs in the processes of whoever imports it, so reading one checks it
whole, as a package installer checks a wheel, before anything is written: every member is a regular file
(or a directory) named as the store names entries — `bundle.json`, `<target>/<digest>/<entry file>` —
within size caps; `bundle.json` lists exactly the entries present with a sha256 of each file; every
entry's manifest describes the kernel its directory names, with the same files and checksums, and the
running versions.  Importing a bundle still means trusting whoever made it: the checks keep its files
inside the cache and make a damaged or mislabelled bundle fail whole; they cannot tell what its code does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
import time
import zlib

from .entry import DIGEST, FILES, MANIFEST, TARGET, parse_manifest
from .key import KernelKey, versions

BUNDLE_MANIFEST = "bundle.json"
MAX_MEMBER_BYTES = 64 << 20
MAX_BUNDLE_BYTES = 1 << 30  # all members together, uncompressed
MAX_MEMBERS = 100_000


@dataclasses.dataclass
class Entry:
    """One kernel of a bundle: its target and digest (the directory names) and its files, manifest included."""

    target: str
    digest: str
    files: dict[str, bytes]

    @property
    def path(self) -> str:
        return f"{self.target}/{self.digest}"


def write(path: str | os.PathLike, entries: list[Entry]) -> None:
    """Write `entries` (verified by the store) into a bundle at `path`."""
    listing = {"versions": versions(), "entries": [
        {"path": entry.path, "files": {name: hashlib.sha256(data).hexdigest()
                                       for name, data in entry.files.items() if name != MANIFEST}}
        for entry in entries]}
    with tarfile.open(path, "w:gz") as archive:
        _add(archive, BUNDLE_MANIFEST, json.dumps(listing, indent=1).encode())
        for entry in entries:
            for name, data in entry.files.items():
                _add(archive, f"{entry.path}/{name}", data)


def read(path: str | os.PathLike) -> list[Entry]:
    """The entries of the bundle at `path`, checked whole (see the module docstring); ValueError naming the
    bundle and what is wrong with it."""
    where = f"bundle {os.fspath(path)}"
    members = _members(path, where)
    if BUNDLE_MANIFEST not in members:
        raise ValueError(f"{where} has no {BUNDLE_MANIFEST}")
    listing = _listing(members.pop(BUNDLE_MANIFEST), where)
    entries = []
    for item in listing:
        target, digest = item["path"].split("/")
        names = {*item["files"], MANIFEST}
        files = {name: members.pop(f"{item['path']}/{name}", None) for name in names}
        missing = sorted(name for name, data in files.items() if data is None)
        if missing:
            raise ValueError(f"{where}: entry {item['path']} lacks {missing}")
        _check_entry(target, digest, item["files"], files, f"{where}: {item['path']}")
        entries.append(Entry(target, digest, files))
    if members:
        raise ValueError(f"{where} holds files that {BUNDLE_MANIFEST} does not list: {sorted(members)[:5]}")
    return entries


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
    archive.addfile(info, io.BytesIO(data))


def _members(path, where: str) -> dict[str, bytes]:
    """{name: bytes} of the bundle's regular files, after checking every member's name, type and size."""
    members: dict[str, bytes] = {}
    total = 0
    with open(path, "rb") as raw:
        try:
            with tarfile.open(fileobj=raw, mode="r:gz") as archive:
                for count, member in enumerate(archive, 1):
                    if count > MAX_MEMBERS:
                        raise ValueError(f"{where} has more than {MAX_MEMBERS} members")
                    kind = _kind(member.name)
                    if member.isdir() and kind == "directory":
                        continue
                    if not member.isreg():
                        raise ValueError(f"{where}: member {member.name!r} is a {_type_name(member)}; a bundle holds "
                                         f"regular files (and directories) named as the cache names them")
                    if kind != "file":
                        raise ValueError(f"{where}: member {member.name!r} is not named as a bundle's files are "
                                         f"({BUNDLE_MANIFEST} or <target>/<digest>/<one of {[MANIFEST, *FILES]}>)")
                    if member.name in members:
                        raise ValueError(f"{where} holds {member.name!r} twice")
                    if member.size > MAX_MEMBER_BYTES:
                        raise ValueError(f"{where}: {member.name!r} has {member.size} bytes; a bundle's files have at "
                                         f"most {MAX_MEMBER_BYTES}")
                    total += member.size
                    if total > MAX_BUNDLE_BYTES:
                        raise ValueError(f"{where} holds more than {MAX_BUNDLE_BYTES} bytes")
                    members[member.name] = archive.extractfile(member).read()
        except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
            raise ValueError(f"{where} is not a readable .tar.gz bundle ({error})") from None
    return members


def _kind(name: str) -> str | None:
    """"file" (the bundle's manifest or an entry's file), "directory" (a target's or an entry's) or None,
    from a member's name alone."""
    if name == BUNDLE_MANIFEST:
        return "file"
    parts = name.split("/")
    if not TARGET.fullmatch(parts[0]) or len(parts) > 3:
        return None
    if len(parts) > 1 and not DIGEST.fullmatch(parts[1]):
        return None
    if len(parts) == 3:
        return "file" if parts[2] in (MANIFEST, *FILES) else None
    return "directory"


def _type_name(member: tarfile.TarInfo) -> str:
    for test, name in ((member.issym, "symbolic link"), (member.islnk, "hard link"), (member.isdir, "directory"),
                       (member.ischr, "character device"), (member.isblk, "block device"), (member.isfifo, "FIFO")):
        if test():
            return name
    return "special member"


def _listing(data: bytes, where: str) -> list[dict]:
    """The checked entry list of a bundle's manifest."""
    try:
        listing = json.loads(data)
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{where}: {BUNDLE_MANIFEST} is not valid JSON ({error})") from None
    if not isinstance(listing, dict) or not isinstance(listing.get("entries"), list):
        raise ValueError(f"{where}: {BUNDLE_MANIFEST} must be an object with 'versions' and a list of 'entries'")
    if listing.get("versions") != versions():
        raise ValueError(f"{where} was built with {listing.get('versions')}; this process runs {versions()} and "
                         f"never uses kernels built with other versions")
    seen = set()
    for item in listing["entries"]:
        path = item.get("path") if isinstance(item, dict) else None
        parts = path.split("/") if isinstance(path, str) else []
        if len(parts) != 2 or _kind(path) != "directory" or not isinstance(item.get("files"), dict) \
                or not all(name in FILES for name in item["files"]) or path in seen:
            raise ValueError(f"{where}: {BUNDLE_MANIFEST} entry {item!r} is not {{'path': '<target>/<digest>', "
                             f"'files': {{name: sha256}}}} with names from {list(FILES)}, each path once")
        seen.add(path)
    return listing["entries"]


def _check_entry(target: str, digest: str, listed: dict, files: dict[str, bytes], where: str) -> None:
    """An entry's manifest describes the kernel its path names, with the files and checksums the bundle
    lists, and every file matches its checksum."""
    manifest = parse_manifest(files[MANIFEST], f"{where}/{MANIFEST}")
    key = KernelKey.from_dict(manifest["key"])
    if key.target != target or key.digest != digest:
        raise ValueError(f"{where}: its manifest describes the kernel {key.target}/{key.digest}")
    if manifest["files"] != listed:
        raise ValueError(f"{where}: its manifest lists files {manifest['files']}, {BUNDLE_MANIFEST} lists {listed}")
    for name, checksum in listed.items():
        if hashlib.sha256(files[name]).hexdigest() != checksum:
            raise ValueError(f"{where}/{name} does not match its checksum")
