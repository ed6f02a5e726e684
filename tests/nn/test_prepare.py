"""bitkern.prepare on plain modules: every kernel of a forward at the given token counts is ready before the first
call (a call then tunes nothing), each M bucket once, with a summary of where the kernels came from; bad arguments
are refused, naming them, before any kernel is built.  (A transformers model, fused, with bitkern's attention, and
BitkernConfig(prepare=...): tests/integration/test_hf_prepare.py.)"""

import pytest
import torch
from torch import nn

import bitkern
from bitkern.cache import forget
from bitkern.nn.prepare import PrepareReport, kernel_calls


pytestmark = pytest.mark.usefixtures("empty_cache")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return bitkern.quantize_model(nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64, bias=False)), "int4",
                                  group_size=32)


def _forbid_tuning(monkeypatch):
    def tuned(key, *args):
        raise AssertionError(f"tuned during a call: {key.describe()}")

    monkeypatch.setattr("bitkern.cache.lookup._tuned", tuned)


def test_prepared_kernels_serve_every_count_without_tuning(monkeypatch):
    model = _model()
    report = bitkern.prepare(model, tokens=(1, 12, 16), progress=False)
    assert isinstance(report, PrepareReport)
    assert (report.kernels, report.built, report.loaded, report.ready) == (4, 4, 0, 0)  # 2 layers x buckets 1, 5..16
    assert report.tokens == (1, 12, 16) and "4 kernels for 1, 12, 16 tokens (4 built, 0 loaded" in str(report)
    _forbid_tuning(monkeypatch)
    with torch.no_grad():
        for shape in [(1, 64), (2, 4, 64), (16, 64), (5, 64)]:
            x = torch.randn(*shape)
            reference = model[2].dequantize()(torch.relu(model[0].dequantize()(x)))
            torch.testing.assert_close(model(x), reference, rtol=1e-4, atol=1e-4)
        with pytest.raises(AssertionError, match="tuned during a call"):
            model(torch.randn(3, 64))  # rows of a bucket no count fell in


def test_a_second_prepare_finds_the_kernels_in_the_process_then_in_the_cache():
    model = _model()
    bitkern.prepare(model, 1, progress=False)
    again = bitkern.prepare(model, 1, progress=False)
    assert (again.kernels, again.built, again.loaded, again.ready) == (2, 0, 0, 2)
    forget()
    fresh = bitkern.prepare(model, range(1, 2), progress=False)
    assert (fresh.built, fresh.loaded, fresh.ready) == (0, 2, 0)


def test_the_kernel_listed_is_the_one_each_setting_calls(monkeypatch):
    """compute_dtype, bias and activation_quant change the kernel a call runs; what a layer lists for prepare is
    exactly what its forward asks the cache for."""
    asked = []
    real = bitkern.cache.dispatch.kernel_for

    def recording(spec, n, k, m, layout, device=None, store=None):
        asked.append((spec, n, k, layout))
        return real(spec, n, k, m, layout, device, store)

    monkeypatch.setattr("bitkern.cache.dispatch.kernel_for", recording)
    for options, dtype in [({}, torch.float32), ({"compute_dtype": torch.bfloat16}, torch.float32),
                           ({"activation_quant": "int8"}, torch.bfloat16), ({}, torch.float16)]:
        layer = bitkern.Linear(64, 32, bias=True, dtype="int4", group_size=32, **options)
        [call] = layer.kernel_calls(dtype)
        asked.clear()
        with torch.no_grad():
            layer(torch.randn(2, 64, dtype=dtype))
        assert asked == [(call.spec, call.n, call.k, call.layout)], options


def test_layers_not_listed_are_logged(caplog):
    model = nn.Sequential(nn.Linear(64, 32), nn.Conv2d(3, 8, 1))
    model = bitkern.quantize_model(model, "int8", group_size=-1)
    calls, unlisted = kernel_calls(model, torch.float32)
    assert len(calls) == 1 and unlisted == ["1"]
    with caplog.at_level("INFO", logger="bitkern"):
        bitkern.prepare(model, 1, progress=False)
    assert "1 layers are tuned on their first call instead" in caplog.text


@pytest.mark.parametrize("arguments, error, message", [
    ({"model": "a model"}, TypeError, "model must be a torch.nn.Module, got str"),
    ({"tokens": 0}, ValueError, "tokens=0 must be a positive int or a non-empty sequence of them"),
    ({"tokens": ()}, ValueError, r"tokens=\(\) must be a positive int"),
    ({"tokens": (1, True)}, ValueError, r"tokens=\(1, True\) must be a positive int"),
    ({"tokens": "16"}, ValueError, "tokens='16' must be a positive int"),
    ({"dtype": torch.int8}, ValueError, "dtype=torch.int8 is not supported; accepted: float32, float16, bfloat16"),
    ({"model": nn.Linear(4, 4)}, ValueError, "model has no bitkern layers whose kernels can be prepared"),
])
def test_bad_arguments_are_refused_before_any_kernel_is_built(monkeypatch, arguments, error, message):
    _forbid_tuning(monkeypatch)
    given = {"model": _model(), "tokens": (1, 16), **arguments}
    with pytest.raises(error, match=message):
        bitkern.prepare(given.pop("model"), **given, progress=False)


def test_a_model_of_mixed_float_dtypes_needs_its_input_dtype(monkeypatch):
    _forbid_tuning(monkeypatch)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32).to(torch.bfloat16))
    model = bitkern.quantize_model(model, "int4", group_size=32)
    with pytest.raises(ValueError, match=r"dtype=None: the model's floating-point tensors are \['bfloat16', "
                                         r"'float32'\].*pass it"):
        bitkern.prepare(model, 1, progress=False)


def test_a_model_without_weights_is_refused_naming_prebuild(monkeypatch):
    _forbid_tuning(monkeypatch)
    model = nn.Sequential(bitkern.Linear(64, 32, dtype="int4", group_size=32, device="meta"))
    with pytest.raises(ValueError, match=r"bitkern layers on \['meta'\].*python -m bitkern prebuild --model"):
        bitkern.prepare(model, 1, dtype=torch.float32, progress=False)
