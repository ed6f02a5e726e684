"""method="gptq": GPTQ against calibration inputs.  Its layer output error on held-out inputs is at most
round-to-nearest's on every type it applies to (random layers with correlated inputs of unequal scales), its
results are bitwise the same across runs and thread counts, act-order is stored as the importers store it (the
weight's columns permuted, `input_order`) or, with static groups, in the weight's own order, a quantized model
round-trips through a checkpoint without quantizing again, and "gptq" without calibration data is refused by name
before anything is quantized."""

import copy

import pytest
import torch

import bitkern
from bitkern.ttype.gptq import Hessian, gptq
from bitkern.ttype.quantize import CAST_TYPES

# every type quantize takes (at most 8 bits), with each zero mode that applies to it
CASES = [(name, zero_mode) for name in bitkern.ttype.names()
         if bitkern.ttype.get(name).bits <= 8 and name not in CAST_TYPES and name != "float8_e8m0"
         for zero_mode in (("none", "gptq", "awq", "hqq") if bitkern.ttype.get(name).kind == "uint"
                           and bitkern.ttype.get(name).block_size == 1 else ("none",))]
OPTIONS = [(False, False), (True, False), (True, True)]  # (act_order, static_groups), taken in turn


def _layer(seed: int, n: int = 32, k: int = 128):
    """A weight with heavy-tailed rows and 8·k input rows (half for calibration, half held out) whose features
    are correlated and of unequal scales."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator).add_(0.05)
    weight[::5] = torch.distributions.StudentT(3.0).sample((len(range(0, n, 5)), k)) * 0.05
    mixing = torch.randn(k, k, generator=generator) * 0.15 + torch.eye(k)
    inputs = (torch.randn(8 * k, k, generator=generator) @ mixing) * (torch.rand(k, generator=generator) * 3 + 0.1)
    return weight, inputs[:4 * k], inputs[4 * k:]


def _group_size(name: str) -> int | None:
    return 32 if bitkern.ttype.get(name).block_size == 1 else None


def _dequantized(quantized, order) -> torch.Tensor:
    weight = quantized.dequantize()
    return weight if order is None else weight[:, torch.argsort(order)]


def _output_error(weight, quantized, inputs) -> float:
    return float(((inputs @ (quantized - weight).T) ** 2).sum())


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gptq_output_error_is_at_most_rtn(case):
    name, zero_mode = CASES[case]
    act_order, static_groups = OPTIONS[case % len(OPTIONS)]
    weight, calibration, held_out = _layer(case)
    hessian = Hessian(weight.shape[1])
    hessian.add(calibration)
    rtn = bitkern.quantize(weight, name, group_size=_group_size(name), zero_mode=zero_mode).dequantize()
    quantized, order = gptq(weight, hessian.matrix, name, _group_size(name), zero_mode, act_order=act_order,
                            static_groups=static_groups)
    assert (order is not None) == (act_order and not static_groups)
    ours, theirs = _output_error(weight, _dequantized(quantized, order), held_out), _output_error(weight, rtn, held_out)
    assert ours <= theirs, (name, zero_mode, act_order, static_groups, ours, theirs)


@pytest.mark.parametrize("name,zero_mode,act_order", [("uint4", "gptq", True), ("nf4", "none", False),
                                                      ("mxfp4", "none", True), ("nvfp4", "none", False)])
def test_gptq_is_deterministic_across_runs_and_threads(name, zero_mode, act_order):
    weight, calibration, _ = _layer(3, 64, 256)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            hessian = Hessian(weight.shape[1])
            for batch in calibration.split(300):
                hessian.add(batch)
            quantized, order = gptq(weight, hessian.matrix, name, _group_size(name), zero_mode, act_order=act_order)
            results.append([t for t in (*quantized.tensors(), order) if t is not None])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_static_groups_keep_the_column_order_and_the_groups_of_the_original_weight():
    weight, calibration, _ = _layer(5)
    hessian = Hessian(weight.shape[1])
    hessian.add(calibration)
    quantized, order = gptq(weight, hessian.matrix, "uint4", 32, "gptq", act_order=True, static_groups=True)
    assert order is None
    rtn = bitkern.quantize(weight, "uint4", group_size=32, zero_mode="gptq", method="hqq")
    assert torch.equal(quantized.scales, rtn.scales) and torch.equal(quantized.zeros, rtn.zeros)



def test_symmetric_integer_groups_take_their_signed_range():
    """The default for int types without zeros ("range"): a group's scale maps its larger signed extreme onto
    the type's end of that sign, max(max(w) / 7, min(w) / -8) for int4, computed here from the weight itself
    (static groups: the original weight's).  With a diagonal Hessian (independent inputs: no error to feed
    forward) GPTQ rounds to the nearest code of those scales, so a negative extreme is coded -8 exactly and no
    weight is clipped."""
    weight, calibration, _ = _layer(7)
    groups = weight.reshape(weight.shape[0], -1, 32)
    expected = torch.maximum(groups.amax(-1) / 7, groups.amin(-1) / -8).to(torch.float16)
    hessian = Hessian(weight.shape[1])
    hessian.add(calibration)
    quantized, _ = gptq(weight, hessian.matrix, "int4", 32, act_order=True, static_groups=True)
    assert torch.equal(quantized.scales, expected)
    quantized, order = gptq(weight, torch.diag(hessian.matrix.diagonal()), "int4", 32)
    assert order is None and torch.equal(quantized.scales, expected)
    scale = expected.float().unsqueeze(-1)
    values = quantized.dequantize().reshape_as(groups)
    assert torch.equal(values, torch.round(groups / scale).clamp(-8, 7) * scale)
    negative = groups.amin(-1) / -8 >= groups.amax(-1) / 7  # groups whose extreme is negative
    assert bool(negative.any()) and bool((~negative).any())
    assert torch.equal(values.amin(-1)[negative], -8 * expected.float()[negative])
    with pytest.raises(ValueError, match=r"group_method='range' is for the signed integer types"):
        gptq(weight, hessian.matrix, "nf4", 32, group_method="range")


def _model_and_calibration():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    mixing = torch.randn(64, 64) * 0.2 + torch.eye(64)
    calibration = [torch.randn(128, 64) @ mixing for _ in range(4)]
    return model, calibration, torch.randn(256, 64) @ mixing


def test_quantize_model_gptq_beats_rtn_and_round_trips_through_a_checkpoint(tmp_path):
    """The model's layers quantized in turn (the second against the first's quantized output), its output closer
    to float than rtn's; saved and loaded, the same weights, permutations and method (weights compared
    dequantized: no kernel is built)."""
    model, calibration, held_out = _model_and_calibration()
    with torch.no_grad():
        expected = model(held_out)
        rtn = bitkern.dequantize_model(bitkern.quantize_model(_model_and_calibration()[0], "int4", group_size=32))
        rtn_error = float(((rtn(held_out) - expected) ** 2).sum())
    quantized = bitkern.quantize_model(model, "int4", group_size=32, method="gptq", calibration=iter(calibration),
                                       act_order=True)
    layers = [m for m in quantized if isinstance(m, bitkern.Linear)]
    assert [m.method for m in layers] == ["gptq", "gptq"] and layers[0].weight_settings()["method"] == "gptq"
    assert all(m.input_order is not None for m in layers)
    with torch.no_grad():
        error = float(((bitkern.dequantize_model(copy.deepcopy(quantized))(held_out) - expected) ** 2).sum())
    assert error < rtn_error
    path = tmp_path / "model.safetensors"
    bitkern.save(quantized, path)
    with pytest.MonkeyPatch.context() as patch:  # loading reads the stored codes: nothing is quantized again
        patch.setattr("bitkern.nn.calibration.gptq", None)
        patch.setattr("bitkern.ttype.quantize", None)
        loaded = bitkern.load(_model_and_calibration()[0], path)
    for ours, theirs in zip(layers, [m for m in loaded if isinstance(m, bitkern.Linear)]):
        assert theirs.method == "gptq" and torch.equal(theirs.input_order, ours.input_order)
        assert torch.equal(theirs.dequantize_weight(), ours.dequantize_weight())


class _TwoHeads(torch.nn.Module):
    """Two layers reading one input (as q/k/v projections do), then a layer reading both."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.out = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.out(torch.cat([self.query(x), self.key(x)], -1))


def test_layers_reading_one_input_share_its_hessian_and_its_passes():
    """One tracing forward, then per calibration input one forward for query and key together (stopped at query)
    and one for out; the result equals GPTQ on each layer's own Hessian."""
    torch.manual_seed(0)
    model, calibration = _TwoHeads(), [torch.randn(96, 64) for _ in range(3)]
    reference = copy.deepcopy(model)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    bitkern.quantize_model(model, "uint4", group_size=32, method="gptq", calibration=calibration)
    assert len(forwards) == 1 + 2 * len(calibration)
    hessian = Hessian(64)
    for x in calibration:
        hessian.add(x)
    for name in ("query", "key"):
        weight, _ = gptq(getattr(reference, name).weight, hessian.matrix, "uint4", 32)
        assert torch.equal(getattr(model, name).dequantize_weight(), weight.dequantize())


def test_gptq_without_calibration_is_refused_by_name_before_anything_is_quantized():
    model, calibration, _ = _model_and_calibration()
    with pytest.raises(ValueError, match=r"method='gptq' needs calibration data.*calibration=\.\.\."):
        bitkern.quantize_model(model, "int4", group_size=32, method="gptq")
    with pytest.raises(ValueError, match=r"method='gptq' needs calibration data"):
        bitkern.quantize(model[0].weight, "int4", group_size=32, method="gptq")
    with pytest.raises(ValueError, match=r"method='gptq' needs calibration data"):
        bitkern.Linear.from_float(model[0], "int4", group_size=32, method="gptq")
    with pytest.raises(ValueError, match=r"calibration= is taken by method='gptq' only; method='hqq'"):
        bitkern.quantize_model(model, "int4", group_size=32, method="hqq", calibration=calibration)
    with pytest.raises(ValueError, match=r"act_order= is taken by method='gptq' only"):
        bitkern.quantize_model(model, "int4", group_size=32, act_order=True)
    with pytest.raises(ValueError, match=r"damp= is taken by method='gptq' only"):
        bitkern.quantize_model(model, "int4", group_size=32, damp=0.1)
    with pytest.raises(ValueError, match=r"damp=1.5 must be a number in \[0, 1\)"):
        bitkern.quantize_model(model, "int4", group_size=32, method="gptq", calibration=calibration, damp=1.5)
    with pytest.raises(ValueError, match=r"calibration must be a non-empty iterable"):
        bitkern.quantize_model(model, "int4", group_size=32, method="gptq", calibration=[])
    with pytest.raises(ValueError, match=r"method='gptq' does not apply to dtype='bfloat16'"):
        bitkern.quantize_model(model, "bfloat16", method="gptq", calibration=calibration)
    convolutional = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 36, 4))
    with pytest.raises(ValueError, match=r"nn.Linear layers only; these are nn.Conv2d: 0; pass them in skip"):
        bitkern.quantize_model(convolutional, "int8", group_size=-1, method="gptq",
                               calibration=[torch.randn(2, 3, 8, 8)])
    assert all(type(m) in (torch.nn.Linear, torch.nn.GELU) for m in model)
    assert type(convolutional[0]) is torch.nn.Conv2d and type(convolutional[2]) is torch.nn.Linear


def test_bitkern_config_refuses_gptq_naming_the_setting():
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"BitkernConfig: method='gptq' needs calibration data, which "
                                         r"quantize-on-load has none of"):
        bitkern.BitkernConfig("int4", method="gptq")
    with pytest.raises(ValueError, match=r"overrides\['down_proj'\]: method='gptq' needs calibration data"):
        bitkern.BitkernConfig("int4", overrides={"down_proj": {"method": "gptq"}})


def test_vllm_settings_refuse_gptq_naming_the_setting():
    settings_module = pytest.importorskip("bitkern.integration.vllm_plugin.settings")
    with pytest.raises(ValueError, match=r"method='gptq' needs calibration data"):
        settings_module.Settings.from_json('{"dtype": "int4", "method": "gptq"}')
