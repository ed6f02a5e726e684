"""Adding a CPU template is one module and one registry line (docs/architecture.md): with the toy template of
toy_template.py in the registry, the tuner lists its configurations and prices them, picks and builds one, the
dispatch runs it, and the cache stores it and loads it again by its name."""

import pytest

import bitkern
from bitkern import codegen
from bitkern.cache import DiskStore, KernelKey, forget, kernel_for
from bitkern.codegen import cpu
from bitkern.tuner import host_cpu
from bitkern.tuner.cost import estimate
from bitkern.tuner.space import enumerate_candidates
from tests.codegen.cpu.toy_template import TEMPLATE, ToyConfig
from tests.helpers import assert_matches_reference, matmul_case


@pytest.fixture
def registry(monkeypatch, tmp_path):
    """The CPU registry with the toy template in it (what its registry line does), and a kernel cache of this
    test's own, which the toy's kernels leave with it."""
    monkeypatch.setattr(cpu, "TEMPLATES", [*cpu.TEMPLATES, TEMPLATE])
    monkeypatch.setenv("BITKERN_CACHE_DIR", str(tmp_path))
    forget()
    yield cpu.TEMPLATES
    forget()


def test_the_tuner_lists_and_prices_a_registered_template(registry):
    spec, *_ = matmul_case("int4", 64, 256, 1)
    _, candidates = enumerate_candidates(spec, 64, 256, (1, 1), "tile16", host_cpu())
    toy = [c.config for c in candidates if c.template == "toy"]
    assert toy == [ToyConfig(16), ToyConfig(64)] and codegen.template("toy") is TEMPLATE
    modeled = [estimate("toy", config, spec, 64, 256, 1, host_cpu()) for config in toy]
    assert all(m.seconds > 0 for m in modeled) and modeled[0].parts["tasks"] == 4


def test_a_registered_template_runs_through_the_tuner_the_dispatch_and_the_cache(registry, monkeypatch):
    """With the toy template alone in the registry: the call tunes (the model picks the toy), builds, stores and
    runs it; a new process map loads it from the disk store by its template's name."""
    monkeypatch.setattr(cpu, "TEMPLATES", [TEMPLATE])
    spec, q, x, b = matmul_case("nf4", 80, 256, 3, "float32", bias=True)
    packed = bitkern.pack(q)
    assert_matches_reference(spec, q, x, b, spec(x, packed, b))
    kernel = kernel_for(spec, 80, 256, 3, "tile16")
    assert kernel.template == "toy" and kernel.config == ToyConfig(16)
    forget()
    loaded = DiskStore().load(KernelKey(spec, 80, 256, (2, 4), "tile16", host_cpu().key))
    assert isinstance(loaded.record, dict) and (loaded.template, loaded.config) == ("toy", ToyConfig(16))
    assert_matches_reference(spec, q, x, b, loaded(x, packed, b))
