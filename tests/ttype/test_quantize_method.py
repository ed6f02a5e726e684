"""`method="hqq"`: scales and zeros optimized per group without data.  Its squared reconstruction error is never
above round-to-nearest's (on every type and zero mode, over random weights with heavy tails), it is bitwise
deterministic across runs and thread counts, and a method a type cannot take is refused before anything is
quantized, wherever a weight is quantized."""

import pytest
import torch

import bitkern
from bitkern.ttype.quantize import CAST_TYPES, METHODS

# every type quantize takes (at most 8 bits), with each zero mode that applies to it
CASES = [(name, zero_mode) for name in bitkern.ttype.names()
         if bitkern.ttype.get(name).bits <= 8 and name not in CAST_TYPES and name != "float8_e8m0"
         for zero_mode in (("none", "gptq", "awq", "hqq") if bitkern.ttype.get(name).kind == "uint"
                           and bitkern.ttype.get(name).block_size == 1 else ("none",))]


def _weights(seed: int) -> torch.Tensor:
    """[48, 256] weights: Gaussian rows of varied spread, a Student-t (3 degrees of freedom) block for heavy tails,
    outliers, a constant group and an all-zero group."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(48, 256, generator=generator) * torch.rand(48, 1, generator=generator).add_(0.05)
    t = torch.distributions.StudentT(3.0)
    weight[:16] = t.sample((16, 256)) * 0.02 if seed % 2 else weight[:16]
    weight[20, ::17] *= 25
    weight[30, :64] = 0.3
    weight[31, 64:128] = 0
    return weight


def _error(weight, name, zero_mode, method):
    q = bitkern.quantize(weight, name, group_size=64 if bitkern.ttype.get(name).block_size == 1 else None,
                         zero_mode=zero_mode, method=method)
    return float(((q.dequantize() - weight.float()) ** 2).sum())


@pytest.mark.parametrize("name,zero_mode", CASES)
def test_hqq_error_is_never_above_rtn(name, zero_mode):
    for seed in range(3):
        weight = _weights(seed)
        rtn, hqq = _error(weight, name, zero_mode, "rtn"), _error(weight, name, zero_mode, "hqq")
        assert hqq <= rtn * (1 + 1e-6) + 1e-12, (seed, rtn, hqq)


def test_hqq_gains_at_4_and_3_bits():
    """On heavy-tailed weights the optimized scales and zeros cut 4-bit and 3-bit error by a margin."""
    weight = _weights(1)
    for name, zero_mode in (("int4", "none"), ("uint4", "gptq"), ("uint3", "hqq"), ("nf4", "none")):
        assert _error(weight, name, zero_mode, "hqq") < 0.97 * _error(weight, name, zero_mode, "rtn"), name


@pytest.mark.parametrize("name,zero_mode", [("int4", "none"), ("uint4", "gptq"), ("uint4", "hqq"), ("nf4", "none"),
                                            ("mxfp4", "none")])
def test_hqq_is_deterministic_across_runs_and_threads(name, zero_mode):
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(7)).half()
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            q = bitkern.quantize(weight, name, zero_mode=zero_mode, method="hqq")
            results.append([t for t in (q.qweight, q.scales, q.zeros, q.tensor_scale) if t is not None])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_a_method_is_refused_where_it_does_not_apply():
    weight = torch.randn(8, 128)
    with pytest.raises(ValueError, match=r"method='best' is not known; accepted: \['rtn', 'hqq', 'gptq'\]"):
        bitkern.quantize(weight, "int4", method="best")
    with pytest.raises(ValueError, match=r"method='hqq' does not apply to dtype='bfloat16'.*accepted: method='rtn'"):
        bitkern.quantize(weight, "bfloat16", method="hqq")
    with pytest.raises(ValueError, match="method='best' is not known"):
        bitkern.Linear.from_float(torch.nn.Linear(128, 8), "int4", method="best")
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match="method='hqq' does not apply to dtype='bfloat16'"):
        bitkern.quantize_model(model, "bfloat16", method="hqq")
    assert all(type(m) is torch.nn.Linear for m in model)  # refused before any layer was replaced
    assert METHODS == ("rtn", "hqq", "gptq")


def test_the_method_is_recorded_in_checkpoints_and_not_rerun_on_load(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    float_model = torch.nn.Sequential(torch.nn.Linear(128, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    quantized = bitkern.quantize_model(model, "uint4", group_size=32, zero_mode="hqq", method="hqq")
    assert quantized[0].method == "hqq" and quantized[0].weight_settings()["method"] == "hqq"
    path = tmp_path / "model.safetensors"
    bitkern.save(quantized, path)
    loaded = bitkern.load(float_model, path)  # float_model's own (other) weights are never quantized
    assert loaded[0].method == "hqq"
    assert torch.equal(loaded[0].dequantize_weight(), quantized[0].dequantize_weight())
    layer = bitkern.Linear(128, 32, dtype="uint4", group_size=32, zero_mode="hqq")  # built with "rtn"
    layer.load_state_dict({k[2:]: v for k, v in quantized.state_dict().items() if k.startswith("0.")})
    assert layer.method == "hqq" and torch.equal(layer.dequantize_weight(), quantized[0].dequantize_weight())
    state = quantized[0].get_extra_state()
    with pytest.raises(ValueError, match="method='magic' is not known"):
        layer.set_extra_state({**state, "method": "magic"})


def test_vllm_settings_take_and_check_the_method():
    settings_module = pytest.importorskip("bitkern.integration.vllm_plugin.settings")
    settings = settings_module.Settings.from_json('{"dtype": "int4", "method": "hqq"}')
    assert settings.linear_options()["method"] == "hqq"
    with pytest.raises(ValueError, match="method='fast' is not known"):
        settings_module.Settings.from_json('{"dtype": "int4", "method": "fast"}')


def test_bitkern_config_records_and_checks_the_method():
    pytest.importorskip("transformers")
    config = bitkern.BitkernConfig("int4", method="hqq", overrides={"down_proj": {"dtype": "nf4", "method": "rtn"}})
    assert config.to_dict()["method"] == "hqq" and config.layer_settings("mlp.down_proj").method == "rtn"
    assert config.layer_settings("mlp.up_proj").method == "hqq"
    assert type(config).from_dict(config.to_dict()).method == "hqq"
    with pytest.raises(ValueError, match="BitkernConfig: method='best' is not known"):
        bitkern.BitkernConfig("int4", method="best")
    with pytest.raises(ValueError, match=r"overrides\['lm_head'\]: method='hqq' does not apply to dtype='bfloat16'"):
        bitkern.BitkernConfig("int4", overrides={"lm_head": {"dtype": "bfloat16", "method": "hqq"}})
