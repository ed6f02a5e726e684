"""The kernel cache: disk store, cross-process building, fault tolerance, bundles, prebuild, CLI."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import bitkern
from bitkern.cache import DiskStore, KernelKey, cache_root, forget, kernel_for, versions
from bitkern.cache.prebuild import parse_shapes, prebuild, shapes_from_config
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu

pytestmark = pytest.mark.usefixtures("fresh_process_map")

SPEC = Matmul("int4", "bfloat16")


def _key(n=64, k=256, m=1):
    from bitkern.tuner import m_bucket

    return KernelKey(SPEC, n, k, m_bucket(m), "tile16", host_cpu().key)


def _check_kernel(kernel, n=64, k=256):
    q = bitkern.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), "int4")
    x = torch.randn(kernel.m_range[0], k).bfloat16()  # rows its bucket serves (a few-row kernel computes no others)
    y = kernel(x, bitkern.pack(q))
    torch.testing.assert_close(y.float(), SPEC.reference(x, q).float(), rtol=2e-2, atol=0.25)


def _run(code: str, cache_dir, timeout=300, **env):
    environment = {**os.environ, "BITKERN_CACHE_DIR": str(cache_dir), "BITKERN_TUNING": "model", **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=environment)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BITKERN_CACHE_DIR", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("BITKERN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "bitkern"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == __import__("pathlib").Path.home() / ".cache" / "bitkern"


def test_entry_holds_module_manifest_and_checksums(tmp_path):
    store = DiskStore(tmp_path)
    kernel = kernel_for(SPEC, 64, 256, 3, "tile16", store=store)
    key = _key(m=3)
    directory = store.entry_dir(key)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["versions"] == versions() and KernelKey.from_dict(manifest["key"]) == key
    assert set(manifest["files"]) >= {"kernel.so"} and manifest["record"]["summary"]
    assert str(directory).startswith(str(store.version_dir)) and store.version_dir.name.startswith("bitkern-")
    assert kernel_for(SPEC, 64, 256, 2, "tile16", store=store) is kernel  # same bucket: no new kernel
    forget()
    loaded = store.load(key)
    assert isinstance(loaded.record, dict) and loaded.config == kernel.config
    _check_kernel(loaded)


def test_a_new_process_loads_without_the_compiler(tmp_path):
    kernel_for(SPEC, 64, 256, 1, "tile16", store=DiskStore(tmp_path))
    result = _run("""
        import sys, torch, bitkern
        from bitkern.cache import kernel_for
        from bitkern.ops import Matmul
        kernel = kernel_for(Matmul("int4", "bfloat16"), 64, 256, 1, "tile16")
        q = bitkern.quantize(torch.randn(64, 256), "int4")
        kernel(torch.randn(1, 256).bfloat16(), bitkern.pack(q))
        print(isinstance(kernel.record, dict), "tvm.tirx" in sys.modules)
    """, tmp_path, BITKERN_TUNING="invalid-so-tuning-would-fail")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_eight_processes_build_each_kernel_once(tmp_path):
    code = """
        import json, torch
        from bitkern.cache import kernel_for
        from bitkern.ops import Matmul
        built = 0
        for n in (48, 64, 80, 96, 112):
            kernel = kernel_for(Matmul("int4", "bfloat16"), n, 128, 1, "tile16")
            built += not isinstance(kernel.record, dict)
        print(json.dumps({"built": built}))
    """
    environment = {**os.environ, "BITKERN_CACHE_DIR": str(tmp_path), "BITKERN_TUNING": "model"}
    processes = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=environment) for _ in range(8)]
    outputs = [p.communicate(timeout=600) for p in processes]
    assert all(p.returncode == 0 for p in processes), [err for _, err in outputs]
    assert sum(json.loads(out)["built"] for out, _ in outputs) == 5
    store = DiskStore(tmp_path)
    assert len(store.entries()) == 5 and all(reason is None for _, reason in store.verify())


def test_a_writer_killed_before_the_rename_leaves_nothing_that_loads(tmp_path):
    result = _run("""
        import os, signal
        from bitkern.cache import kernel_for
        from bitkern.ops import Matmul
        def die(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        os.rename = die
        kernel_for(Matmul("int4", "bfloat16"), 64, 256, 1, "tile16")
    """, tmp_path)
    assert result.returncode == -9
    store = DiskStore(tmp_path)
    leftovers = list((store.version_dir / host_cpu().key).glob(".*.tmp-*"))
    assert leftovers and (leftovers[0] / "kernel.so").exists()  # it died with everything written
    assert store.load(_key()) is None and store.entries() == [] and store.verify() == []
    forget()
    _check_kernel(kernel_for(SPEC, 64, 256, 1, "tile16", store=store))
    assert len(store.entries()) == 1


def test_a_writer_killed_while_writing_the_library_leaves_nothing_that_loads(tmp_path):
    result = _run("""
        import os, signal
        from bitkern.cache import disk, kernel_for
        from bitkern.ops import Matmul
        def half_then_die(path, data, mode):
            open(path, "wb").write(data[:len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        disk.write_file = half_then_die
        kernel_for(Matmul("int4", "bfloat16"), 64, 256, 1, "tile16")
    """, tmp_path)
    assert result.returncode == -9
    store = DiskStore(tmp_path)
    assert store.load(_key()) is None and store.entries() == []


def test_a_flipped_byte_is_detected_and_rebuilt(tmp_path, caplog):
    store = DiskStore(tmp_path)
    kernel_for(SPEC, 64, 256, 1, "tile16", store=store)
    library = store.entry_dir(_key()) / "kernel.so"
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0x40
    library.write_bytes(bytes(data))
    assert store.verify()[0][1] == "kernel.so does not match its checksum"
    forget()
    with caplog.at_level("WARNING", logger="bitkern"):
        rebuilt = kernel_for(SPEC, 64, 256, 1, "tile16", store=store)
    assert "is damaged (kernel.so does not match its checksum)" in caplog.text
    assert not isinstance(rebuilt.record, dict)  # built again in this process
    _check_kernel(rebuilt)
    assert store.verify()[0][1] is None


def test_entries_of_other_versions_are_never_used(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    kernel_for(SPEC, 64, 256, 1, "tile16", store=store)
    manifest_path = store.entry_dir(_key()) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["versions"]["tvm"] = "0.0.1"
    manifest_path.write_text(json.dumps(manifest))
    assert store.load(_key()) is None  # a manifest of other versions in this tree is damage
    monkeypatch.setattr("bitkern.cache.disk.versions", lambda: {**versions(), "bitkern": "9.9"})
    assert store.version_dir.name.startswith("bitkern-9.9")  # another version reads another tree
    monkeypatch.setattr("bitkern.cache.disk.versions", lambda: {**versions(), "code": "0" * 12})
    assert "_code-000000000000_" in store.version_dir.name  # kernels generated by other code too


def test_the_code_fingerprint_follows_the_kernel_generating_sources(tmp_path):
    """Any change to the files of ops, ttype or codegen (a template edited within one version) scopes the
    cache anew; compiled bytecode and the other packages do not count."""
    from bitkern.cache.key import CODE_PACKAGES, code_fingerprint

    installed = Path(bitkern.__file__).parent
    for package in CODE_PACKAGES:
        shutil.copytree(installed / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert code_fingerprint(tmp_path) == versions()["code"]
    (tmp_path / "codegen" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "codegen" / "__pycache__" / "lut.cpython-311.pyc").write_bytes(b"bytecode")
    (tmp_path / "nn").mkdir()
    (tmp_path / "nn" / "linear.py").write_text("# not a kernel generator\n")
    assert code_fingerprint(tmp_path) == versions()["code"]
    template = tmp_path / "codegen" / "cpu" / "lut.py"
    template.write_text(template.read_text() + "\n")
    assert code_fingerprint(tmp_path) != versions()["code"]


def test_export_then_import_into_another_store_needs_no_tuning(tmp_path, monkeypatch):
    first, second = DiskStore(tmp_path / "one"), DiskStore(tmp_path / "two")
    for n in (64, 96):
        kernel_for(SPEC, n, 256, 1, "tile16", store=first)
    bundle = tmp_path / "kernels.tar.gz"
    assert first.export(bundle) == 2
    assert second.import_(bundle) == 2 and second.import_(bundle) == 0
    forget()

    def no_tuning(*args, **kwargs):
        raise AssertionError("tuning happened")

    monkeypatch.setattr("bitkern.tuner.select.tune", no_tuning)
    for n in (64, 96):
        kernel = kernel_for(SPEC, n, 256, 1, "tile16", store=second)
        assert isinstance(kernel.record, dict)
        _check_kernel(kernel, n=n)


def test_a_bundle_of_other_versions_is_refused(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "one")
    kernel_for(SPEC, 64, 256, 1, "tile16", store=store)
    bundle = tmp_path / "kernels.tar.gz"
    store.export(bundle)
    monkeypatch.setattr("bitkern.cache.bundle.versions", lambda: {**versions(), "tvm": "9.9"})
    with pytest.raises(ValueError, match="never uses kernels built with other versions"):
        DiskStore(tmp_path / "two").import_(bundle)


def test_prebuild_compiles_repeated_layers_once(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_hidden_layers": 32}))
    shapes = shapes_from_config(config)
    assert {(s.out_features, s.in_features) for s in shapes} == {(256, 256), (128, 256), (512, 256), (256, 512)}
    assert next(s for s in shapes if s.out_features == 128).names == ("k_proj", "v_proj")
    store = DiskStore(tmp_path / "cache")
    report = prebuild(shapes, "int4", 128, "cpu", (1, 16), store=store, progress=False)
    assert report.kernels == 8 and report.built == 8
    again = prebuild(shapes, "int4", 128, "cpu", (1, 16), store=store, progress=False)
    assert again.built == 0


def test_prebuild_input_errors(tmp_path):
    with pytest.raises(ValueError, match="must be out_features:in_features"):
        parse_shapes("4096x4096")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 256}))
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size', 'num_attention_heads'\]"):
        shapes_from_config(config)
    with pytest.raises(ValueError, match=r"arch='sm_75' is not a known CUDA target"):
        prebuild(parse_shapes("64:64"), target="sm_75", store=DiskStore(tmp_path))


def test_command_line(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "bitkern", *args], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "BITKERN_CACHE_DIR": str(tmp_path / "c"), "BITKERN_TUNING": "model"})

    built = cli("prebuild", "--shapes", "64:128,128:128", "--m", "1")
    assert built.returncode == 0 and "prebuild: 2 kernels for cpu (2 built, 0 already cached)" in built.stdout
    listing = cli("cache", "ls")
    assert listing.returncode == 0 and "2 kernels in" in listing.stdout and "int4" in listing.stdout
    assert listing.stdout.count(" matmul ") == 2
    assert "2 of 2 entries verified" in cli("cache", "verify").stdout
    assert "exported 2 kernels" in cli("cache", "export", str(tmp_path / "b.tar.gz")).stdout
    assert "removed 2 kernels" in cli("cache", "clear").stdout
    assert "imported 2 kernels" in cli("cache", "import", str(tmp_path / "b.tar.gz")).stdout
    bad = cli("prebuild", "--shapes", "64x128")
    assert bad.returncode == 2 and "must be out_features:in_features" in bad.stderr


@pytest.mark.requires_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_prebuild_cross_compiles_and_loads_without_the_compiler(tmp_path, arch):
    store = DiskStore(tmp_path)
    report = prebuild(parse_shapes("256:512"), "int4", 128, arch, (1, 64), activation_dtype="float16", store=store,
                      progress=False)
    assert report.kernels == 2 and report.built == 2
    for entry in store.entries():
        assert entry["key"]["target"] == f"cuda-{arch}" and entry["template"] in ("gemm", "gemv", "mma_gemv")
        files = set(entry["files"])
        assert {"kernel.cu", "kernel.cubin", "kernel.ptx", "kernel.json"} <= files
        assert "mma" in open(os.path.join(entry["directory"], "kernel.ptx")).read() or entry["template"] == "gemv"
    assert all(reason is None for _, reason in store.verify())
    result = _run(f"""
        import sys
        from bitkern.cache import DiskStore, KernelKey
        from bitkern.ops import Matmul
        key = KernelKey(Matmul("int4", "float16"), 256, 512, (1, 1), "lop3", "cuda-{arch}")
        kernel = DiskStore().load(key)
        print(type(kernel).__name__, kernel.arch, "tvm.tirx" in sys.modules)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["CudaKernel", arch, "False"]


def test_row_shortcut_serves_the_bucket_kernel_until_forget(tmp_path, monkeypatch):
    """Host-CPU lookups without a device are remembered by M; the kernel is the bucket's, and forget()
    drops the shortcut too (the next call loads from disk again)."""
    monkeypatch.setenv("BITKERN_CACHE_DIR", str(tmp_path))
    first = kernel_for(SPEC, 64, 256, 3, "tile16")
    assert kernel_for(SPEC, 64, 256, 3, "tile16") is first
    assert kernel_for(SPEC, 64, 256, 2, "tile16") is first  # same bucket, another M
    assert kernel_for(SPEC, 64, 256, 3, "tile16", host_cpu()) is first
    forget()
    again = kernel_for(SPEC, 64, 256, 3, "tile16")
    assert again is not first and again.config == first.config


def test_pinned_entries_are_candidates_timed_where_the_device_is(tmp_path, monkeypatch):
    """Prebuilt candidates (entries pinned to configurations, as a GPU kit ships them) are what tuning times on the
    device, with nothing built; the fastest is stored as the kernel's entry, its record naming every candidate."""
    from bitkern.cache import pinned_kernel
    from bitkern.tuner import m_bucket, shortlist

    store, bucket = DiskStore(tmp_path), m_bucket(1)  # one row: three templates serve it at every level from AVX2
    candidates = shortlist(SPEC, 64, 256, bucket, "tile16", host_cpu(), top_k=3)
    assert len(candidates) == 3
    pinned = [pinned_kernel(SPEC, 64, 256, bucket, "tile16", host_cpu(), c.template, c.config, store)
              for c in candidates]
    assert [(k.template, k.config) for k in pinned] == [(c.template, c.config) for c in candidates]
    assert len(store.entries()) == 3 and len(store.pinned(_key(m=1))) == 3
    forget()

    def no_building(*args, **kwargs):
        raise AssertionError("a kernel was built")

    monkeypatch.setattr("bitkern.tuner.select.build_all", no_building)
    monkeypatch.setenv("BITKERN_TUNING", "profile")
    kernel = kernel_for(SPEC, 64, 256, 1, "tile16", store=store)
    record = kernel.record
    assert record.profiled and "chosen among 3 prebuilt candidates" in record.notes
    assert all(trial.measured_s > 0 for trial in record.trials)
    assert (kernel.template, kernel.config) in [(c.template, c.config) for c in candidates]
    assert store.load(_key(m=1)) is not None and len(store.entries()) == 4
    _check_kernel(kernel)


def test_prebuild_requests_in_worker_processes(tmp_path):
    """Requests of every kind built by two worker processes: the tuner's choice, a pinned configuration and a
    shortlist of candidates, each an entry of the store."""
    from bitkern.cache.prebuild import Request, prebuild_requests
    from bitkern.tuner import m_bucket, shortlist

    store = DiskStore(tmp_path)
    best = shortlist(SPEC, 64, 256, m_bucket(1), "tile16", host_cpu(), top_k=1)[0]
    requests = [Request(SPEC, 64, 256, m_bucket(1), "cpu"), Request(SPEC, 96, 256, (1, 1), "cpu", best.template,
                                                                    best.config),
                Request(SPEC, 64, 256, m_bucket(16), "cpu", candidates=2)]
    report = prebuild_requests(requests, store, workers=2, progress=False)
    assert (report.kernels, report.built, report.target) == (4, 4, "cpu")
    assert sorted(bool(entry["key"].get("pinned")) for entry in store.entries()) == [False, True, True, True]
    assert len(store.pinned(_key(m=16))) == 2
