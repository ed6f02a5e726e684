"""Hostile and unlucky inputs: checkpoint files, kernel bundles and kernel caches made to break bitkern or to
turn it against its user.  Each case asserts a clear error or a safe fallback (a warning, then a kernel
built in memory), and that nothing outside its temporary directory, nor the model, changed.

The user's world per test: tmp/cache (a kernel cache holding one entry, copied from a kernel compiled once
for the module), tmp/home (files an escape would hit: a shell profile, a .pth in site-packages), and the
listing of the directory around tmp.  We run as root, which no mode keeps out: foreign owners are made
with chown, a non-root user's view with a different effective uid, a read-only directory with chattr +i.
"""

import copy
import hashlib
import io
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

import bitkern
from bitkern.cache import DiskStore, KernelKey, forget, kernel_for
from bitkern.cache import bundle as bundles
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu, m_bucket

pytestmark = pytest.mark.usefixtures("fresh_process_map")

SPEC = Matmul("int4", "bfloat16")
N, K = 64, 256
OTHER_UID = 54321


# -- the user's world ------------------------------------------------------------------------------------

def _key() -> KernelKey:
    return KernelKey(SPEC, N, K, m_bucket(1), "tile16", host_cpu().key)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """A store holding one compiled kernel, and a bundle of it (compiled once for this module)."""
    root = tmp_path_factory.mktemp("golden")
    forget()
    kernel = kernel_for(SPEC, N, K, 1, "tile16", store=DiskStore(root))
    bundle = tmp_path_factory.mktemp("bundle") / "kernels.tar.gz"
    assert DiskStore(root).export(bundle) == 1
    forget()
    return SimpleNamespace(root=root, kernel=kernel, bundle=bundle)


@pytest.fixture
def world(tmp_path, golden):
    cache, home = tmp_path / "cache", tmp_path / "home"
    shutil.copytree(golden.root, cache, symlinks=True)
    (home / "site-packages").mkdir(parents=True)
    (home / ".bashrc").write_text("# the user's shell profile\n")
    (home / "site-packages" / "user.pth").write_text("/opt/user\n")
    (home / "data.bin").write_bytes(bytes(range(256)))
    store = DiskStore(cache)
    return SimpleNamespace(tmp=tmp_path, cache=cache, home=home, store=store, entry=store.entry_dir(_key()),
                           snapshot=lambda: (_tree(cache), _outside(tmp_path)))


def _tree(root: Path) -> dict:
    """Everything under `root` as it matters: kind, mode, owner and content (or link target) of each path."""
    found = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = Path(directory) / name
            status = os.lstat(path)
            if stat.S_ISLNK(status.st_mode):
                content = os.readlink(path)
            elif stat.S_ISREG(status.st_mode):
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                content = None
            found[str(path.relative_to(root))] = (stat.S_IFMT(status.st_mode), stat.S_IMODE(status.st_mode),
                                                  status.st_uid, content)
    return found


def _outside(tmp: Path) -> tuple:
    """What an escape from the cache could change: the test's directory but the cache, and the names around it."""
    mine = {path: value for path, value in _tree(tmp).items() if path != "cache" and not path.startswith("cache/")}
    return mine, sorted(os.listdir(tmp.parent))


@pytest.fixture
def in_memory_build(monkeypatch, golden):
    """The tuner, replaced for the fallback cases: it hands out the kernel compiled for the module (as a build in
    memory would) and counts its calls, so a fallback costs no compile."""
    from bitkern.tuner import Tuned

    calls = []

    def tune(spec, n, k, bucket, layout, device, profile=True):
        assert (spec, n, k, bucket) == (SPEC, N, K, m_bucket(1))
        calls.append(spec)
        return Tuned(golden.kernel, None)

    monkeypatch.setattr("bitkern.tuner.tune", tune)
    return calls


def _check_kernel(kernel):
    q = bitkern.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(1)), "int4")
    x = torch.randn(kernel.m_range[0], K, generator=torch.Generator().manual_seed(2)).bfloat16()  # rows of its bucket
    torch.testing.assert_close(kernel(x, bitkern.pack(q)).float(), SPEC.reference(x, q).float(), rtol=2e-2,
                               atol=0.25)


def _falls_back(world, caplog, builds, warning: str, store=None, changes_cache=False):
    """The kernel comes from an in-memory build, after a warning that says `warning`, and nothing changed
    outside the cache (nor in it, unless the case rebuilds a damaged entry)."""
    cache_before, outside_before = world.snapshot()
    with caplog.at_level(logging.WARNING, logger="bitkern"), _deadline(60):
        kernel = kernel_for(SPEC, N, K, 1, "tile16", store=store or world.store)
    assert builds and warning in caplog.text, caplog.text
    _check_kernel(kernel)
    cache_after, outside_after = world.snapshot()
    assert outside_after == outside_before
    if not changes_cache:
        assert cache_after == cache_before
    return kernel


@contextmanager
def _deadline(seconds: int):
    """Fail instead of hanging (a FIFO opened for reading, a lock waited on forever)."""
    def expired(*args):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def _read_only(path: Path):
    """`path` made unwritable for this process: mode 0500, or for root (whom no mode keeps out) chattr +i."""
    if os.geteuid() != 0:
        os.chmod(path, 0o500)
        try:
            yield
        finally:
            os.chmod(path, 0o700)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (root ignores file modes)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _chown_to_another_user(*paths: Path) -> None:
    """Give `paths` to another uid (only root can)."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    for path in paths:
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)


# -- the kernel cache --------------------------------------------------------------------------------------

def test_an_entry_of_this_user_loads_without_building(world, in_memory_build):
    kernel = kernel_for(SPEC, N, K, 1, "tile16", store=world.store)
    assert not in_memory_build and isinstance(kernel.record, dict)  # the control case: the entry is used


def test_a_root_owned_by_another_user_is_refused(world, caplog, in_memory_build):
    _chown_to_another_user(world.cache)
    _falls_back(world, caplog, in_memory_build, f"is owned by uid {OTHER_UID}, not by this user")


def test_a_cache_of_a_third_user_is_refused_with_the_fix(world, caplog, in_memory_build, monkeypatch):
    """The owner check as another user's process makes it (how it is tested without root): the cache belongs to
    neither that user nor root."""
    owner = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)
    monkeypatch.setattr("bitkern.cache.private.ROOT_UID", OTHER_UID + 1)  # the cache's owner is no root either
    _falls_back(world, caplog, in_memory_build, f"is owned by uid {owner}, not by this user (uid {OTHER_UID}) nor "
                f"root; its kernels are found or built elsewhere (make it trusted: own it and let nobody else "
                f"write it (chmod -R go-w {world.cache})")


def test_a_cache_root_owns_serves_other_users_read_only(world, caplog, in_memory_build, monkeypatch):
    """ssh's rule: a cache that root owns and only root can write is trusted by every user, who reads it and
    writes nothing there.  Seen as uid OTHER_UID (by its effective uid; a real other user's process is
    tests/cache/test_system_cache.py): its kernel loads; a kernel it lacks is built in memory, nothing written."""
    if os.stat(world.cache).st_uid != 0:
        monkeypatch.setattr("bitkern.cache.private.ROOT_UID", os.stat(world.cache).st_uid)  # stands in for root
    monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)
    kernel_for(SPEC, N, K, 1, "tile16", store=world.store)
    assert not in_memory_build
    forget()
    shutil.rmtree(world.entry)
    _falls_back(world, caplog, in_memory_build, f"so this user (uid {OTHER_UID}) only reads it); kernels it lacks are "
                f"built in memory for this process only")


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_root_others_can_write_is_refused(world, caplog, in_memory_build, mode):
    os.chmod(world.cache, mode)
    _falls_back(world, caplog, in_memory_build, "group or others can write it")


def test_an_entry_owned_by_another_user_is_refused_and_left_alone(world, caplog, in_memory_build):
    _chown_to_another_user(world.entry, *world.entry.iterdir())
    _falls_back(world, caplog, in_memory_build, "is not used")


def test_a_swapped_library_with_its_checksum_updated_by_another_user_never_runs(world, caplog, in_memory_build):
    """The issue's attack: another user who could write the cache replaced kernel.so and fixed the manifest."""
    library, manifest_path = world.entry / "kernel.so", world.entry / "manifest.json"
    payload = b"\x7fELF not what the user compiled"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["kernel.so"] = hashlib.sha256(payload).hexdigest()
    os.chmod(library, 0o666)
    library.write_bytes(payload)
    manifest_path.write_text(json.dumps(manifest))
    _chown_to_another_user(library)
    _falls_back(world, caplog, in_memory_build, f"is owned by uid {OTHER_UID}")


@pytest.mark.parametrize("name, mode", [("kernel.so", 0o664), ("manifest.json", 0o622), ("kernel.so", 0o606)])
def test_a_file_others_can_write_is_refused(world, caplog, in_memory_build, name, mode):
    os.chmod(world.entry / name, mode)
    _falls_back(world, caplog, in_memory_build, "group or others can write it")


@pytest.mark.parametrize("which", ["kernel.so", "manifest.json", "entry", "target", "version"])
def test_symbolic_links_in_the_cache_are_never_followed(world, caplog, in_memory_build, which):
    """A link anywhere below the root (to a copy of the genuine entry, so only the link itself is wrong)."""
    elsewhere = world.tmp / "elsewhere"
    paths = {"kernel.so": world.entry / "kernel.so", "manifest.json": world.entry / "manifest.json",
             "entry": world.entry, "target": world.entry.parent, "version": world.store.version_dir}
    path = paths[which]
    shutil.move(path, elsewhere)
    os.symlink(elsewhere, path)
    _falls_back(world, caplog, in_memory_build, "is a symbolic link")


def test_a_fifo_in_place_of_the_library_does_not_hang(world, caplog, in_memory_build):
    (world.entry / "kernel.so").unlink()
    os.mkfifo(world.entry / "kernel.so", 0o600)
    _falls_back(world, caplog, in_memory_build, "is not a regular file")


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"key": {}, "versions": {}}', b"\xff\xfe"])
def test_a_malformed_manifest_is_damage_named_and_rebuilt(world, caplog, in_memory_build, content):
    (world.entry / "manifest.json").write_bytes(content)
    _falls_back(world, caplog, in_memory_build, f"cache entry {world.entry} is damaged", changes_cache=True)
    assert world.store.verify() == [(world.entry, None)]  # stored again, whole


def test_a_manifest_naming_files_outside_the_entry_is_damage(world, caplog, in_memory_build):
    manifest = json.loads((world.entry / "manifest.json").read_text())
    manifest["files"]["../../../../home/.bashrc"] = hashlib.sha256(b"x").hexdigest()
    (world.entry / "manifest.json").write_text(json.dumps(manifest))
    _falls_back(world, caplog, in_memory_build, "are not entry files", changes_cache=True)


def test_an_oversized_file_is_not_read(world, caplog, in_memory_build, monkeypatch):
    monkeypatch.setattr("bitkern.cache.private.MAX_FILE_BYTES", 1024)
    _falls_back(world, caplog, in_memory_build, "more than the 1024 a cache file may have", changes_cache=True)


def test_a_stuck_build_lock_times_out_into_an_in_memory_build(world, caplog, in_memory_build):
    """A builder holding the lock and stopped (here: sleeping) must not hang the next process."""
    shutil.rmtree(world.entry)
    store = DiskStore(world.cache, lock_timeout=1.0)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from filelock import FileLock
        lock = FileLock({str(store.lock_path(_key()))!r})
        lock.acquire()
        print("held", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.perf_counter()
        _falls_back(world, caplog, in_memory_build, "has been held by another process for 1 s", store=store)
        assert time.perf_counter() - start < 30
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_file_linked_to_the_users_files_is_not_opened(world, caplog, in_memory_build):
    shutil.rmtree(world.entry)
    lock = world.store.lock_path(_key())
    lock.unlink()
    os.symlink(world.home / ".bashrc", lock)
    _falls_back(world, caplog, in_memory_build, "is a symbolic link")


def test_a_cache_dir_that_is_a_file_builds_in_memory_with_one_warning(world, caplog, in_memory_build, monkeypatch):
    target = world.tmp / "not-a-directory"
    target.write_text("a file")
    monkeypatch.setenv("BITKERN_CACHE_DIR", str(target))
    with caplog.at_level(logging.WARNING, logger="bitkern"):
        kernel = kernel_for(SPEC, N, K, 1, "tile16")
        forget()
        assert kernel_for(SPEC, N, K, 1, "tile16") is kernel
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is not a directory" in warnings[0].getMessage()
    assert "BITKERN_CACHE_DIR" in warnings[0].getMessage()
    assert target.read_text() == "a file"


def test_a_cache_dir_below_a_file_builds_in_memory(world, caplog, in_memory_build, monkeypatch):
    monkeypatch.setenv("BITKERN_CACHE_DIR", str(world.home / ".bashrc" / "cache"))
    _falls_back(world, caplog, in_memory_build, "Not a directory", store=DiskStore())


def test_prebuild_into_a_cache_it_cannot_use_is_an_error(world):
    """Prebuilding only makes sense into a cache: it refuses one it would not store kernels in."""
    from bitkern.cache.prebuild import parse_shapes, prebuild

    target = world.tmp / "a-file"
    target.write_text("not a directory")
    with pytest.raises(ValueError, match="is not a directory; prebuild stores kernels there"):
        prebuild(parse_shapes(f"{N}:{K}"), store=DiskStore(target), progress=False)
    os.chmod(world.cache, 0o777)
    with pytest.raises(ValueError, match="group or others can write it"):
        prebuild(parse_shapes(f"{N}:{K}"), store=world.store, progress=False)


def test_a_read_only_cache_builds_in_memory_with_a_warning(world, caplog, in_memory_build):
    shutil.rmtree(world.entry)
    with _read_only(world.entry.parent):
        _falls_back(world, caplog, in_memory_build, "cannot be written")
    assert not world.entry.exists()


def test_a_read_only_cache_still_serves_its_kernels(world, in_memory_build):
    with _read_only(world.entry.parent):
        kernel_for(SPEC, N, K, 1, "tile16", store=world.store)
    assert not in_memory_build


def test_a_layer_runs_on_a_cache_it_cannot_use(tmp_path, caplog, monkeypatch):
    """End to end, with a real build: bitkern.Linear computes, the cache being a file."""
    (tmp_path / "cache").write_text("not a directory")
    monkeypatch.setenv("BITKERN_CACHE_DIR", str(tmp_path / "cache"))
    layer = bitkern.Linear(K, N, bias=False, dtype="int4", compute_dtype=torch.bfloat16)
    x = torch.randn(2, K)
    with caplog.at_level(logging.WARNING, logger="bitkern"):
        y = layer(x)
    reference = x.bfloat16().double() @ layer.dequantize_weight(torch.float64).T
    torch.testing.assert_close(y.double(), reference.float().double(), rtol=2e-2, atol=0.25)
    assert "BITKERN_CACHE_DIR" in caplog.text


def test_entries_are_private_whatever_the_umask(tmp_path, in_memory_build):
    previous = os.umask(0)
    try:
        store = DiskStore(tmp_path / "cache")
        kernel_for(SPEC, N, K, 1, "tile16", store=store)
    finally:
        os.umask(previous)
    modes = {path: stat.S_IMODE(os.lstat(path).st_mode) for path in [store.root, *store.root.rglob("*")]}
    assert all(mode == (0o700 if path.is_dir() else 0o600) for path, mode in modes.items()), modes
    assert store.verify() == [(store.entry_dir(_key()), None)]


def test_clear_removes_only_bitkern_version_directories(world):
    version = world.store.version_dir
    (world.cache / "bitkern-notes").mkdir()
    (world.cache / "bitkern-notes" / "todo.txt").write_text("mine")
    (world.cache / "bitkern-backup.tar").write_bytes(b"mine")
    (world.cache / "my-data").mkdir()
    fake = version.name.replace("_code-", "_code-x")  # named almost like a version directory
    (world.cache / fake).mkdir()
    os.symlink(world.home, world.cache / version.name.replace("bitkern-", "bitkern-9", 1))  # a link named as one
    kept = ["bitkern-notes", "bitkern-backup.tar", "my-data", fake, version.name.replace("bitkern-", "bitkern-9", 1)]
    if os.geteuid() == 0:  # another user's directory named as a version directory
        kept.append(version.name.replace("bitkern-", "bitkern-8", 1))
        (world.cache / kept[-1]).mkdir()
        _chown_to_another_user(world.cache / kept[-1])
    outside = _outside(world.tmp)
    assert world.store.clear() == 1
    assert sorted(os.listdir(world.cache)) == sorted(kept)
    assert (world.cache / "bitkern-notes" / "todo.txt").read_text() == "mine"
    assert _outside(world.tmp) == outside


def test_verify_and_export_report_and_skip_what_is_not_trusted(world, tmp_path):
    os.chmod(world.entry / "kernel.so", 0o666)
    [(path, reason)] = world.store.verify()
    assert path == world.entry and "group or others can write it" in reason
    assert world.store.export(tmp_path / "out.tar.gz") == 0
    os.chmod(world.cache, 0o777)
    assert world.store.verify() == [(world.cache, "the kernel cache is not used: group or others can write it (mode 777)")]


# -- bundles ---------------------------------------------------------------------------------------------

def _golden_bundle(golden) -> tuple[dict, dict]:
    """(bundle.json, {member name: bytes}) of the golden bundle."""
    with tarfile.open(golden.bundle) as archive:
        members = {m.name: archive.extractfile(m).read() for m in archive if m.isreg()}
    return json.loads(members.pop("bundle.json")), members


def _write_bundle(path: Path, listing, members: dict, extra=()) -> Path:
    """A .tar.gz with bundle.json (`listing`: a dict, raw bytes, or None for none), regular members, and
    `extra` (TarInfo, data) members of any type."""
    with tarfile.open(path, "w:gz", format=tarfile.GNU_FORMAT) as archive:
        entries = [] if listing is None else [("bundle.json", listing if isinstance(listing, bytes) else
                                               json.dumps(listing).encode())]
        for name, data in [*entries, *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for info, data in extra:
            archive.addfile(info, None if data is None else io.BytesIO(data))
    return path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _refused(world, bundle: Path, match: str):
    """Importing `bundle` raises ValueError naming it (and matching `match`) and changes nothing, in the cache or
    outside."""
    before = world.snapshot()
    with pytest.raises(ValueError, match=re.escape(f"bundle {bundle}") + ".*" + match):
        world.store.import_(bundle)
    assert world.snapshot() == before


@pytest.fixture
def empty_world(world):
    """The world with an empty cache: a bundle would have somewhere to go."""
    shutil.rmtree(world.store.version_dir)
    return world


def test_a_genuine_bundle_imports(empty_world, golden):
    assert empty_world.store.import_(golden.bundle) == 1
    assert empty_world.store.verify() == [(empty_world.entry, None)]


def _relisted(golden, path: str, files_named=None) -> tuple[dict, dict]:
    """The golden bundle with its entry moved to `path` (files renamed by `files_named`), checksums kept valid:
    only the names can stop it."""
    listing, members = _golden_bundle(golden)
    entry = listing["entries"][0]
    renamed = {}
    for name, data in members.items():
        file = name.rsplit("/", 1)[1]
        file = files_named(file) if files_named else file
        renamed[f"{path}/{file}"] = data
    entry["path"] = path
    entry["files"] = {(files_named(n) if files_named else n): c for n, c in entry["files"].items()}
    return listing, renamed


@pytest.mark.parametrize("path", ["../../../home/escaped", "../../home", "cpu-x/../../../home",
                                  "/tmp/escaped/x", "cpu-host/..", ".", "cpu-host/0123/extra"])
def test_entry_paths_that_leave_the_cache_are_refused(empty_world, golden, path):
    listing, members = _relisted(golden, path)
    _refused(empty_world, _write_bundle(empty_world.tmp / "b.tar.gz", listing, members), "")
    assert not (empty_world.home / "escaped").exists()


def test_an_absolute_entry_path_into_the_users_home_is_refused(empty_world, golden):
    listing, members = _relisted(golden, str(empty_world.home / "site-packages"))
    _refused(empty_world, _write_bundle(empty_world.tmp / "b.tar.gz", listing, members), "is not named as")


@pytest.mark.parametrize("rename", [lambda name: "../../../../home/.bashrc" if name == "kernel.so" else name,
                                    lambda name: "/etc/passwd" if name == "kernel.so" else name,
                                    lambda name: "user.pth" if name == "kernel.so" else name])
def test_file_names_outside_the_entry_format_are_refused(empty_world, golden, rename):
    listing, _ = _golden_bundle(golden)
    path = listing["entries"][0]["path"]
    listing, members = _relisted(golden, path, rename)
    _refused(empty_world, _write_bundle(empty_world.tmp / "b.tar.gz", listing, members), "")


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE,
                                  tarfile.BLKTYPE])
def test_members_that_are_not_regular_files_are_refused(empty_world, golden, kind):
    listing, members = _golden_bundle(golden)
    library = next(name for name in members if name.endswith("kernel.so"))
    del members[library]
    info = tarfile.TarInfo(library)
    info.type = kind
    info.linkname = str(empty_world.home / ".bashrc")
    bundle = _write_bundle(empty_world.tmp / "b.tar.gz", listing, members, [(info, None)])
    _refused(empty_world, bundle, "is a (symbolic link|hard link|FIFO|character device|block device)")


@pytest.mark.parametrize("cap, value, message", [("MAX_MEMBER_BYTES", 1000, "a bundle's files have at most 1000"),
                                                 ("MAX_BUNDLE_BYTES", 20000, "holds more than 20000 bytes"),
                                                 ("MAX_MEMBERS", 2, "has more than 2 members")])
def test_size_and_count_caps(empty_world, golden, monkeypatch, cap, value, message):
    monkeypatch.setattr(bundles, cap, value)
    _refused(empty_world, golden.bundle, message)


def test_a_member_given_twice_is_refused(empty_world, golden):
    listing, members = _golden_bundle(golden)
    library = next(name for name in members if name.endswith("kernel.so"))
    info = tarfile.TarInfo(library)
    info.size = 3
    bundle = _write_bundle(empty_world.tmp / "b.tar.gz", listing, members, [(info, b"bad")])
    _refused(empty_world, bundle, "twice")


@pytest.mark.parametrize("listing, message", [
    (None, "has no bundle.json"), (b"{broken", "is not valid JSON"), (b"\xff\xfe\x00", "is not valid JSON"),
    (b"[]", "must be an object"), (b'{"entries": {}}', "must be an object"),
    (b'{"versions": {}, "entries": []}', "never uses kernels built with other versions")])
def test_a_malformed_bundle_manifest_is_refused(empty_world, golden, listing, message):
    _, members = _golden_bundle(golden)
    _refused(empty_world, _write_bundle(empty_world.tmp / "b.tar.gz", listing, members), message)


def test_a_listing_entry_of_the_wrong_shape_is_refused(empty_world, golden):
    listing, members = _golden_bundle(golden)
    listing["entries"][0]["files"] = ["kernel.so"]
    _refused(empty_world, _write_bundle(empty_world.tmp / "b.tar.gz", listing, members), "is not {'path'")


def test_an_entry_manifest_for_another_kernel_is_refused(empty_world, golden):
    """The manifest must describe the kernel its directory names (no filing a kernel under another key)."""
    listing, members = _golden_bundle(golden)
    other = KernelKey(SPEC, N, 2 * K, m_bucket(1), "tile16", host_cpu().key)
    path = f"{other.target}/{other.digest}"
    listing["entries"][0]["path"] = path
    members = {f"{path}/{name.rsplit('/', 1)[1]}": data for name, data in members.items()}
    _refused(empty_world, _write_bundle(empty_world.tmp / "b.tar.gz", listing, members), "its manifest describes")


@pytest.mark.parametrize("change, message", [
    ("checksum", "does not match its checksum"), ("manifest files", "its manifest lists files"),
    ("manifest json", "is not valid JSON"), ("manifest versions", "built with"),
    ("missing file", "lacks"), ("unlisted member", "does not list")])
def test_an_entry_that_contradicts_the_bundle_is_refused(empty_world, golden, change, message):
    listing, members = _golden_bundle(golden)
    entry = listing["entries"][0]
    manifest_name = f"{entry['path']}/manifest.json"
    library = f"{entry['path']}/kernel.so"
    manifest = json.loads(members[manifest_name])
    if change == "checksum":
        members[library] = members[library][:-1] + bytes([members[library][-1] ^ 1])
    elif change == "manifest files":
        manifest["files"]["kernel.so"] = _sha(b"another library")
        members[manifest_name] = json.dumps(manifest).encode()
    elif change == "manifest json":
        members[manifest_name] = b"{"
    elif change == "manifest versions":
        manifest["versions"] = {**manifest["versions"], "bitkern": "0.0.0"}
        members[manifest_name] = json.dumps(manifest).encode()
    elif change == "missing file":
        del members[library]
    else:
        members[f"{entry['path']}/kernel.cu"] = b"// not listed"
    _refused(empty_world, _write_bundle(empty_world.tmp / "b.tar.gz", listing, members), message)


@pytest.mark.parametrize("content", [b"not a gzip file", b"\x1f\x8b\x08\x00" + b"\x00" * 20])
def test_a_file_that_is_no_bundle_is_refused(empty_world, content):
    (empty_world.tmp / "b.tar.gz").write_bytes(content)
    _refused(empty_world, empty_world.tmp / "b.tar.gz", "is not a readable .tar.gz bundle")


def test_a_truncated_bundle_is_refused(empty_world, golden):
    data = golden.bundle.read_bytes()
    (empty_world.tmp / "b.tar.gz").write_bytes(data[: len(data) // 2])
    _refused(empty_world, empty_world.tmp / "b.tar.gz", "is not a readable .tar.gz bundle")


def test_one_bad_entry_fails_the_whole_import(empty_world, golden):
    """The good entry before the bad one is not added: a bundle imports whole or not at all."""
    listing, members = _golden_bundle(golden)
    good = listing["entries"][0]
    other = KernelKey(SPEC, N, 2 * K, m_bucket(1), "tile16", host_cpu().key)
    bad_path = f"{other.target}/{other.digest}"
    listing["entries"].append({"path": bad_path, "files": good["files"]})
    for name in list(members):
        members[f"{bad_path}/{name.rsplit('/', 1)[1]}"] = members[name]
    _refused(empty_world, _write_bundle(empty_world.tmp / "b.tar.gz", listing, members), "its manifest describes")


def test_the_command_line_says_an_import_runs_code(empty_world, golden):
    env = {**os.environ, "BITKERN_CACHE_DIR": str(empty_world.cache)}
    run = (lambda *args: subprocess.run([sys.executable, "-m", "bitkern", "cache", *args], capture_output=True,
                                        text=True, timeout=120, env=env))
    assert "native code" in run("import", "--help").stdout
    done = run("import", str(golden.bundle))
    assert done.returncode == 0 and "imported 1 kernels" in done.stdout and "import only bundles you trust" in done.stdout
    bad = run("import", str(empty_world.home / "data.bin"))
    assert bad.returncode == 2 and "is not a readable .tar.gz bundle" in bad.stderr


# -- checkpoint files --------------------------------------------------------------------------------------

class Model(nn.Module):
    """Layers of several sizes and kinds, and a float part, so that a problem can sit after a good layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 96)
        self.fc1 = nn.Linear(96, 48)
        self.fc2 = nn.Linear(48, 96)
        self.conv = nn.Conv2d(8, 16, 3)


def _float_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def _quantized(model: nn.Module) -> nn.Module:
    return bitkern.quantize_model(copy.deepcopy(model), "int4", group_size=24)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A genuine file: the model quantized to int4 (group 24), and what it holds."""
    path = tmp_path_factory.mktemp("checkpoint") / "model.safetensors"
    bitkern.save(_quantized(_float_model()), path)
    with safetensors.safe_open(path, "pt") as file:
        metadata = file.metadata()
    return SimpleNamespace(path=path, header=json.loads(metadata["bitkern"]),
                           tensors=safetensors.torch.load_file(path))


def _fingerprint(model: nn.Module) -> list:
    """The model as it matters: every module's class, its tensors (object, dtype, shape, device, bytes) and
    its bitkern settings."""
    def tensor(t):
        if t is None:
            return None
        data = None if t.is_meta else t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        return id(t), t.dtype, tuple(t.shape), t.device.type, t.requires_grad, data

    return [(name, type(module).__name__, {n: tensor(t) for n, t in module._parameters.items()},
             {n: tensor(t) for n, t in module._buffers.items()},
             module.weight_settings() if isinstance(module, bitkern.nn.storage.QuantizedModule) else None)
            for name, module in model.named_modules()]


def _hostile_file(tmp_path, checkpoint, header=None, tensors=None, metadata=None) -> Path:
    path = tmp_path / "hostile.safetensors"
    bitkern_metadata = json.dumps(checkpoint.header if header is None else header)
    safetensors.torch.save_file(checkpoint.tensors if tensors is None else tensors, path,
                                metadata={"format": "pt", "bitkern": bitkern_metadata, **(metadata or {})})
    return path


def _load_refused(model, path, match, tmp_path, error=ValueError):
    """Loading `path` raises `error` naming the file (and matching `match`); the model and the files around are
    unchanged."""
    before, outside = _fingerprint(model), _tree(tmp_path)
    with pytest.raises(error, match=re.escape(str(path)) + ".*" + match):
        bitkern.load(model, path)
    assert _fingerprint(model) == before  # bit-identical, the same tensor objects
    assert _tree(tmp_path) == outside


def _edited(header: dict, module: str, **fields) -> dict:
    header = copy.deepcopy(header)
    header["modules"][module].update(fields)
    return header


HEADER_CASES = {
    "class unknown": lambda h: _edited(h, "fc2", **{"class": "Attention"}),
    "dtype unknown": lambda h: _edited(h, "fc2", dtype="int17"),
    "group size a string": lambda h: _edited(h, "fc2", group_size="24"),
    "group size a bool": lambda h: _edited(h, "fc2", group_size=True),
    "group size zero": lambda h: _edited(h, "fc2", group_size=0),
    "later module of another size": lambda h: _edited(h, "fc2", weight_shape=[96, 64]),
    "later module of another group size": lambda h: _edited(h, "fc2", group_size=48),
    "layout unknown": lambda h: _edited(h, "fc2", layout="tile32"),
    "layout of other shapes": lambda h: _edited(h, "fc2", layout="lop3"),
    "compute dtype float64": lambda h: _edited(h, "fc2", compute_dtype="float64"),
    "scale dtype naming a module": lambda h: _edited(h, "fc2", scale_dtype="nn"),
    "settings not an object": lambda h: {**h, "modules": {**h["modules"], "fc2": "int4"}},
    "module the model lacks": lambda h: {**h, "modules": {**h["modules"], "fc3": h["modules"]["fc2"]}},
    "class of another module kind": lambda h: _edited(h, "conv", **{"class": "Linear"}),
    "root module in a float model": lambda h: {**h, "modules": {**h["modules"], "": h["modules"]["fc1"]}},
    "format of another version": lambda h: {**h, "format": "bitkern.safetensors/2"},
    "a field missing": lambda h: {key: value for key, value in h.items() if key != "aliases"},
    "an unknown field": lambda h: {**h, "hooks": ["run me"]},
    "modules a list": lambda h: {**h, "modules": list(h["modules"])},
    "alias to a missing tensor": lambda h: {**h, "aliases": {"embed.weight_tied": "nowhere"}},
    "alias over a stored tensor": lambda h: {**h, "aliases": {"fc1.bias": "fc2.bias"}},
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_malformed_or_contradicting_metadata_is_refused(case, checkpoint, tmp_path):
    path = _hostile_file(tmp_path, checkpoint, header=HEADER_CASES[case](checkpoint.header))
    _load_refused(_float_model(), path, "", tmp_path)


@pytest.mark.parametrize("metadata", ["{not json", "[]", '"a string"', "null"])
def test_metadata_that_is_no_json_object_is_refused(metadata, checkpoint, tmp_path):
    path = tmp_path / "hostile.safetensors"
    safetensors.torch.save_file(checkpoint.tensors, path, metadata={"bitkern": metadata})
    _load_refused(_float_model(), path, "bitkern metadata", tmp_path)


def _other_layer_tensors() -> dict:
    """The tensors of a [48, 64] int4 layer: the wrong qweight and scales for fc1 ([48, 96])."""
    layer = bitkern.Linear(64, 48, dtype="int4", group_size=32)
    return {name: tensor for name, tensor in layer.state_dict().items() if name != "_extra_state"}


TENSOR_CASES = {
    "qweight of a [48, 64] layer for a [48, 96] one": (lambda t: {**t, "fc1.qweight": _other_layer_tensors()["qweight"]},
                                                       "fc1.qweight has shape"),
    "scales of another layer": (lambda t: {**t, "fc1.scales": _other_layer_tensors()["scales"]}, "fc1.scales has shape"),
    "scales as float32 bits": (lambda t: {**t, "fc2.scales": torch.zeros(t["fc2.scales"].shape, dtype=torch.int32)},
                               "fc2.scales has dtype torch.int32"),
    "qweight as int64": (lambda t: {**t, "conv.qweight": t["conv.qweight"].long()}, "conv.qweight has dtype"),
    "zeros for a weight without zero points": (lambda t: {**t, "fc2.zeros": torch.zeros(6, 2, 16, dtype=torch.uint8)},
                                               "fc2.zeros is given"),
    "a weight's scales missing": (lambda t: {k: v for k, v in t.items() if k != "fc2.scales"}, "fc2.scales is missing"),
    "a float tensor missing": (lambda t: {k: v for k, v in t.items() if k != "embed.weight"}, "missing \\['embed.weight'\\]"),
    "an unexpected tensor": (lambda t: {**t, "fc9.weight": torch.zeros(3)}, "unexpected \\['fc9.weight'\\]"),
    "a float tensor of another shape": (lambda t: {**t, "embed.weight": torch.zeros(11, 96)}, "'embed.weight' has shape"),
    "an int tensor for a float parameter": (lambda t: {**t, "embed.weight": torch.zeros(10, 96, dtype=torch.int32)},
                                            "'embed.weight' has dtype"),
    "a bias of another size": (lambda t: {**t, "fc2.bias": torch.zeros(95)}, "'fc2.bias' has shape"),
    "an input order of another length": (lambda t: {**t, "fc2.input_order": torch.arange(47)},
                                         "fc2.input_order has shape \\[47\\]"),
    "an input order of floats": (lambda t: {**t, "fc2.input_order": torch.arange(48.0)}, "fc2.input_order has .* dtype"),
    "an input order that is no permutation": (lambda t: {**t, "fc2.input_order": torch.zeros(48, dtype=torch.long)},
                                              "fc2.input_order must be a permutation"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_tensors_that_contradict_the_metadata_are_refused_naming_them(case, checkpoint, tmp_path):
    change, match = TENSOR_CASES[case]
    path = _hostile_file(tmp_path, checkpoint, tensors=change(dict(checkpoint.tensors)))
    _load_refused(_float_model(), path, match, tmp_path)


def test_a_half_quantized_model_is_unchanged_by_a_file_of_other_settings(checkpoint, tmp_path):
    """bitkern modules already in the model are checked before anything changes, in place or swapped."""
    model = bitkern.quantize_model(_float_model(), "uint4", group_size=24, skip=["fc1", "conv"])
    _load_refused(model, checkpoint.path, "saved with dtype='int4', but this module has dtype='uint4'", tmp_path)


def test_a_meta_model_is_unchanged_by_a_bad_file(checkpoint, tmp_path):
    with torch.device("meta"):
        model = Model()
    header = _edited(checkpoint.header, "conv", weight_shape=[16, 8, 5, 5])
    _load_refused(model, _hostile_file(tmp_path, checkpoint, header=header), "weight shape", tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "huge header", "header not json", "empty"])
def test_a_damaged_safetensors_file_is_refused(damage, checkpoint, tmp_path):
    data = checkpoint.path.read_bytes()
    path = tmp_path / "damaged.safetensors"
    header_length = int.from_bytes(data[:8], "little")
    path.write_bytes({"truncated": data[: 8 + header_length + 100], "garbage": os.urandom(4096),
                      "huge header": (2**40).to_bytes(8, "little") + data[8:],
                      "header not json": data[:8] + b"{" * header_length + data[8 + header_length:],
                      "empty": b""}[damage])
    _load_refused(_float_model(), path, "", tmp_path)


def test_a_missing_file_is_an_os_error_and_changes_nothing(tmp_path):
    _load_refused(_float_model(), tmp_path / "absent.safetensors", "", tmp_path, error=OSError)


def test_the_genuine_file_loads(checkpoint):
    """The control case: the same model and file load, and compute as the saved model does."""
    model = bitkern.load(_float_model(), checkpoint.path)
    assert isinstance(model.fc2, bitkern.Linear) and isinstance(model.conv, bitkern.Conv2d)
    assert torch.equal(model.fc1.qweight, checkpoint.tensors["fc1.qweight"])


# -- a bitkern module's load_state_dict ------------------------------------------------------------------

STATE_CASES = {
    "qweight of another layer": (lambda s: {**s, "qweight": _other_layer_tensors()["qweight"]}, ValueError,
                                 "qweight has shape"),
    "other settings": (lambda s: {**s, "_extra_state": {**s["_extra_state"], "group_size": 48}}, ValueError,
                       "saved with group_size=48"),
    "scales of another dtype": (lambda s: {**s, "scales": s["scales"].float()}, ValueError, "scales has dtype"),
    "a bias missing": (lambda s: {k: v for k, v in s.items() if k != "bias"}, RuntimeError, "Missing key"),
    "an unexpected key": (lambda s: {**s, "weight": torch.zeros(48, 96)}, RuntimeError, "Unexpected key"),
    "a bias of another size": (lambda s: {**s, "bias": torch.zeros(47)}, ValueError, "bias has shape"),
    "an input order that is no permutation": (lambda s: {**s, "input_order": torch.zeros(96, dtype=torch.long)},
                                              ValueError, "input_order must be a permutation"),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_on_a_bitkern_module_is_all_or_nothing(case, assign):
    change, error, match = STATE_CASES[case]
    torch.manual_seed(1)
    layer = bitkern.Linear(96, 48, dtype="int4", group_size=24)
    state = change(bitkern.Linear(96, 48, dtype="int4", group_size=24).state_dict())
    before = _fingerprint(layer)
    with pytest.raises(error, match=match):
        layer.load_state_dict(state, assign=assign)
    assert _fingerprint(layer) == before
