"""The system cache and the trust rule behind it: a cache that root (or this user) owns and that neither group nor
others can write is trusted, down to every entry (ssh's and sudo's rule); one this process cannot write (root's,
or on a read-only file system) is read and never written; the system cache ($BITKERN_SYSTEM_CACHE_DIR) is searched
after the user's, a kernel it lacks is built into the user's cache, and a refused one says why and how to make it
trusted.

The rule is tested as another uid sees it through the effective uid (no root needed), and, where the tests run as
root, end to end as a container image is used: `python -m bitkern prebuild --system --model` writes the cache as
root, then a process of the `nobody` user with TVM's compiler unavailable runs a transformers model on it.
"""

import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from bitkern.cache import DiskStore, KernelKey, forget, kernel_for
from bitkern.cache.private import untrusted_reason
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu, m_bucket

pytestmark = pytest.mark.usefixtures("fresh_process_map")

SPEC = Matmul("int4", "bfloat16")
N, K = 64, 256
USER, OTHER = 1000, 1001
REPOSITORY = Path(__file__).resolve().parents[2]


def _key(n=N) -> KernelKey:
    return KernelKey(SPEC, n, K, m_bucket(1), "tile16", host_cpu().key)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """A store holding one kernel (tuned by the cost model)."""
    root = tmp_path_factory.mktemp("golden")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BITKERN_TUNING", "model")
        forget()
        kernel = kernel_for(SPEC, N, K, 1, "tile16", store=DiskStore(root))
    forget()
    return root, kernel


@pytest.fixture
def builds(monkeypatch, golden):
    """The tuner, replaced: it hands out the golden kernel (as a build would) and counts its calls."""
    from bitkern.tuner import Tuned

    calls = []

    def tune(spec, n, k, bucket, layout, device, profile=True):
        calls.append((spec, n, k, bucket))
        return Tuned(golden[1], None)

    monkeypatch.setattr("bitkern.tuner.tune", tune)
    return calls


@pytest.fixture
def layers(tmp_path, golden, monkeypatch):
    """An empty user cache and a system cache holding the golden kernel, with a system cache's modes."""
    user, system = tmp_path / "user", tmp_path / "system"
    shutil.copytree(golden[0], system)
    for path in [system, *system.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    monkeypatch.setenv("BITKERN_CACHE_DIR", str(user))
    monkeypatch.setenv("BITKERN_SYSTEM_CACHE_DIR", str(system))
    return user, system


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (stat.S_IMODE(p.lstat().st_mode), p.read_bytes() if p.is_file() else None)
            for p in [root, *root.rglob("*")]} if root.exists() else {}


# -- the trust rule, as another uid sees it ----------------------------------------------------------------------

@pytest.mark.parametrize("owner, mode, reason", [
    (USER, 0o700, None), (USER, 0o755, None), (0, 0o755, None), (0, 0o644, None),
    (0, 0o775, "group or others can write it (mode 775)"), (USER, 0o702, "group or others can write it (mode 702)"),
    (OTHER, 0o755, f"it is owned by uid {OTHER}, not by this user (uid {USER}) nor root")])
def test_trusted_owners_are_this_user_and_root_and_nobody_else_may_write(monkeypatch, owner, mode, reason):
    monkeypatch.setattr(os, "geteuid", lambda: USER)
    status = os.stat_result((stat.S_IFDIR | mode, 0, 0, 1, owner, owner, 0, 0, 0, 0))
    assert untrusted_reason(status) == reason


# -- layers ----------------------------------------------------------------------------------------------------

def test_the_system_cache_serves_what_the_user_cache_lacks_and_is_never_written(layers, builds):
    user, system = layers
    before = _tree(system)
    kernel_for(SPEC, N, K, 1, "tile16")
    assert not builds and not user.exists()  # loaded from the system cache; nothing made in the user's
    forget()
    kernel_for(SPEC, 2 * N, K, 1, "tile16")  # in neither: built into the user's cache
    assert len(builds) == 1 and DiskStore(user).load(_key(2 * N)) is not None
    assert _tree(system) == before


def test_a_damaged_system_entry_is_skipped_not_removed(layers, builds, caplog):
    _, system = layers
    store = DiskStore(system, system=True, read_only=True)
    library = store.entry_dir(_key()) / "kernel.so"
    os.chmod(library, 0o644)
    library.write_bytes(library.read_bytes()[:-1] + b"x")
    before = _tree(system)
    with caplog.at_level(logging.WARNING, logger="bitkern"):
        kernel_for(SPEC, N, K, 1, "tile16")
    assert f"cache entry {store.entry_dir(_key())} is damaged" in caplog.text and "not used" in caplog.text
    assert len(builds) == 1 and _tree(system) == before


def test_a_system_cache_others_can_write_is_refused_naming_it_and_the_fix(layers, builds, caplog):
    _, system = layers
    os.chmod(system, 0o775)
    with caplog.at_level(logging.WARNING, logger="bitkern"):
        kernel_for(SPEC, N, K, 1, "tile16")
    assert len(builds) == 1
    assert (f"the system kernel cache {system} is not used: group or others can write it (mode 775)" in caplog.text
            and f"chown -R root:root {system} && chmod -R go-w {system}" in caplog.text), caplog.text


def test_a_read_only_file_system_is_read_and_nothing_is_attempted_there(layers, builds, caplog, monkeypatch):
    """The user's cache on a read-only file system (statvfs says so; no write is tried, so none fails)."""
    user, system = layers
    shutil.copytree(system, user)
    real_statvfs = os.statvfs

    def read_only(path):
        status = real_statvfs(path)
        return os.statvfs_result((*status[:8], status.f_flag | os.ST_RDONLY, status.f_namemax)) \
            if str(path).startswith(str(user)) else status

    def no_writes(*args, **kwargs):
        raise AssertionError(f"a write was attempted in the read-only cache: {args}")

    monkeypatch.setattr(os, "statvfs", read_only)
    for primitive in ("make_directory", "make_directories", "write_file", "FileLock"):
        monkeypatch.setattr(f"bitkern.cache.disk.{primitive}", no_writes)
    monkeypatch.setenv("BITKERN_SYSTEM_CACHE_DIR", str(user.parent / "none"))
    before = _tree(user)
    with caplog.at_level(logging.WARNING, logger="bitkern"):
        kernel_for(SPEC, N, K, 1, "tile16")  # stored: loaded
        assert not builds
        kernel_for(SPEC, 2 * N, K, 1, "tile16")  # missing: built in memory
    assert len(builds) == 1 and _tree(user) == before
    assert f"the kernel cache {user} cannot be written ({user} is on a read-only file system)" in caplog.text


# -- prebuild --system ------------------------------------------------------------------------------------------

def test_prebuild_system_needs_root(monkeypatch, capsys):
    from bitkern.__main__ import main

    monkeypatch.setattr(os, "geteuid", lambda: USER)
    with pytest.raises(SystemExit) as exit_status:
        main(["prebuild", "--system", "--shapes", "64:256"])
    assert exit_status.value.code == 2
    assert "--system writes the system cache that every user's processes trust, which only root may own" in \
        capsys.readouterr().err


def _bitkern(*args, **env):
    environment = {**os.environ, "BITKERN_TUNING": "model", **env}
    return subprocess.run([sys.executable, "-m", "bitkern", *args], capture_output=True, text=True, timeout=600,
                          env=environment)


@pytest.mark.skipif(os.geteuid() != 0, reason="writes a cache as root")
def test_prebuild_system_writes_a_cache_other_users_can_read_and_only_root_can_write(tmp_path):
    system = tmp_path / "share" / "cache"
    built = _bitkern("prebuild", "--system", "--shapes", f"{N}:{K}", "--tokens", "1", BITKERN_SYSTEM_CACHE_DIR=str(system))
    assert built.returncode == 0 and f"1 built, 0 already cached) in" in built.stdout and str(system) in built.stdout
    paths = [system, *system.rglob("*")]
    assert all(p.stat().st_uid == 0 and stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644)
               for p in paths if not p.name.endswith(".lock")), {str(p): oct(p.stat().st_mode) for p in paths}
    verified = _bitkern("cache", "--system", "verify", BITKERN_SYSTEM_CACHE_DIR=str(system))
    assert "1 of 1 entries verified" in verified.stdout


# -- a container image, end to end -----------------------------------------------------------------------------

NOBODY_RUN = """
import copy, os, sys, logging
import torch, transformers, safetensors.torch, tvm_ffi
import bitkern, bitkern.codegen.cpu
from bitkern.codegen.cpu import runtime
from bitkern.integration.hf.config import BitkernConfig

logging.basicConfig(level=logging.WARNING)
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32,
                                                          quantization_config=BitkernConfig("int4", group_size=32))
tokens = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    reference = bitkern.dequantize_model(copy.deepcopy(model)).eval()(tokens).logits
runtime.load_runtime()  # what nobody cannot read under root's Python (/root is 0700) is read before the switch:
bitkern.cache.versions()  # the TVM runtime and the installed versions
nobody = {nobody}
os.setgroups([])
os.setegid(nobody)
os.seteuid(nobody)
assert os.geteuid() == nobody
try:
    report = bitkern.prepare(model, tokens=(1, 5), progress=False)
except bitkern.cache.KernelNotFound as error:
    print("NOT FOUND:", error)
    raise SystemExit(3)
print("REPORT:", report.kernels, report.built, report.loaded)
with torch.no_grad():
    logits = model(tokens).logits
torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
print("LOGITS OK")
"""


@pytest.fixture
def image():
    """A directory that the nobody user can traverse (pytest's own temporary directories are root's, mode 0700),
    holding a tiny float Llama checkpoint; removed afterwards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(tempfile.mkdtemp(prefix="bitkern-image-"))
    os.chmod(root, 0o755)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    yield root
    shutil.rmtree(root)


def _run_as_nobody(image: Path, system: Path):
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("BITKERN_CACHE_DIR", "XDG_CACHE_HOME", "BITKERN_TUNING")}
    environment.update(HOME="/nonexistent", HF_HOME=str(image / "hf"), HF_HUB_OFFLINE="1",
                       BITKERN_SYSTEM_CACHE_DIR=str(system), TVM_USE_RUNTIME_LIB="1")  # the compiler: unavailable
    code = NOBODY_RUN.format(nobody=pwd.getpwnam("nobody").pw_uid)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(image / "model")], capture_output=True,
                          text=True, timeout=600, env=environment, cwd=image)


@pytest.mark.skipif(os.geteuid() != 0, reason="builds the image's cache as root and switches to the nobody user")
def test_an_image_cache_serves_the_nobody_user_without_the_compiler(image):
    system = image / "usr-local-share-bitkern-cache"
    built = _bitkern("prebuild", "--system", "--model", str(image / "model"), "--dtype", "int4", "--group-size", "32",
                     "--activation", "float32", "--tokens", "1,5", BITKERN_SYSTEM_CACHE_DIR=str(system))
    assert built.returncode == 0, built.stdout + built.stderr
    assert "prebuild: 8 kernels for cpu (8 built" in built.stdout  # q, k/v, o, gate/up, down x buckets 1, 5..16

    served = _run_as_nobody(image, system)
    assert served.returncode == 0, served.stdout + served.stderr
    assert "REPORT: 8 0 8" in served.stdout and "LOGITS OK" in served.stdout  # every kernel loaded, none built
    assert "WARNING" not in served.stderr, served.stderr  # nothing refused, nothing written (no home to write)

    os.chmod(system, 0o775)  # a group-writable system cache: refused, saying which and how to fix it
    refused = _run_as_nobody(image, system)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert f"the system kernel cache {system} is not used: group or others can write it (mode 775)" in refused.stderr
    assert f"chown -R root:root {system} && chmod -R go-w {system}" in refused.stderr
    assert "NOT FOUND:" in refused.stdout and "TVM's compiler (TVM_USE_RUNTIME_LIB=1" in refused.stdout
