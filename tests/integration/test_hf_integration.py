"""bitkern in transformers (`BitkernConfig`, the quantizer "bitkern"), on a tiny random-weight Llama saved
locally: quantize on load bit for bit as `bitkern.quantize_model`, save_pretrained and from_pretrained in a fresh
process, sharded files with no float copy of a quantized weight, generate (greedy, sampling, KV caches,
compiled), dequantize, device moves, LoRA training, bad input, and the registration `import bitkern` does.
The model is tests/integration/conftest.py's `tiny_llama` (hidden 256, MLP 512, 2 layers, vocabulary 1024).

test_hf_versions.py runs this module again under transformers 5.19 (its own environment)."""

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import bitkern
from bitkern.integration.hf.config import BitkernConfig

CASES = {"int4": 32, "nf4": 64, "int8": -1, "mxfp4": None}  # dtype: group size
PROMPT = torch.tensor([[1, 17, 200, 33, 95, 4, 250, 61, 7, 130]])


@pytest.fixture(scope="module")
def float_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.fixture(scope="module")
def quantized(tiny_llama):
    """dtype -> the tiny Llama quantized on load with CASES[dtype] (loaded once per dtype)."""
    models = {}

    def load(dtype):
        if dtype not in models:
            config = BitkernConfig(dtype, group_size=CASES[dtype])
            models[dtype] = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=config).eval()
        return models[dtype]

    return load


def _logits(model, ids=PROMPT):
    with torch.no_grad():
        return model(ids).logits


def _greedy(model, tokens=12, **options):
    return model.generate(PROMPT, max_new_tokens=tokens, do_sample=False, **options)


def _run(code: str, *arguments) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python (this environment, this checkout)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, arguments)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def _linears(model) -> dict:
    return {name: module for name, module in model.named_modules() if isinstance(module, (nn.Linear, bitkern.Linear))}


# -- quantize on load -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(CASES))
def test_quantize_on_load_is_quantize_model_bit_for_bit(float_model, quantized, dtype):
    model = quantized(dtype)
    reference = bitkern.quantize_model(copy.deepcopy(float_model), dtype, group_size=CASES[dtype], skip=["lm_head"])
    layers, expected = _linears(model), _linears(reference)
    assert layers.keys() == expected.keys()
    assert type(layers["lm_head"]) is nn.Linear and sum(isinstance(m, bitkern.Linear) for m in layers.values()) == 14
    for name, layer in layers.items():
        assert type(layer) is type(expected[name]), name
        if isinstance(layer, bitkern.Linear):
            assert layer.weight_dtype == dtype and layer.layout == "tile16"
            for buffer in ("qweight", "scales", "zeros", "tensor_scale"):
                mine, theirs = getattr(layer, buffer), getattr(expected[name], buffer)
                assert (mine is None and theirs is None) or torch.equal(mine, theirs), (name, buffer)
    assert torch.equal(_logits(model), _logits(reference))
    assert model.is_quantized and model.hf_quantizer.quantization_config.dtype == dtype


def test_per_module_overrides_and_modules_kept_float(tiny_llama, float_model):
    config = BitkernConfig("int4", group_size=32, overrides={"down_proj": {"dtype": "int8", "group_size": -1},
                                                             r"layers\.1\.self_attn\.(q|k)_proj": {"dtype": "nf4"}},
                           modules_to_not_convert=["model.layers.0.mlp"])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=config).eval()
    layers = _linears(model)
    assert type(layers["model.layers.0.mlp.down_proj"]) is nn.Linear
    assert type(layers["model.layers.0.mlp.gate_proj"]) is nn.Linear
    assert layers["model.layers.1.mlp.down_proj"].weight_dtype == "int8"
    assert layers["model.layers.1.mlp.down_proj"].group_size == 512  # per channel: in_features
    assert layers["model.layers.1.self_attn.q_proj"].weight_dtype == "nf4"
    assert layers["model.layers.1.self_attn.k_proj"].group_size == 32  # the config's own, the override's dtype
    assert layers["model.layers.1.self_attn.v_proj"].weight_dtype == "int4"
    assert layers["model.layers.0.self_attn.q_proj"].weight_dtype == "int4"
    reference = copy.deepcopy(float_model)
    for name, layer in layers.items():
        if isinstance(layer, bitkern.Linear):
            source = reference.get_submodule(name)
            replacement = bitkern.Linear.from_float(source, layer.weight_dtype, layer.group_size, layer.zero_mode)
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent), child, replacement)
    assert torch.equal(_logits(model), _logits(reference))


# -- save_pretrained / from_pretrained -----------------------------------------------------------------------
RELOAD = """
import sys, torch, bitkern
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
prompt = torch.tensor([[1, 17, 200, 33, 95, 4, 250, 61, 7, 130]])
with torch.no_grad():
    logits = model(prompt).logits
tokens = model.generate(prompt, max_new_tokens=12, do_sample=False)
layers = {n: m.weight_dtype for n, m in model.named_modules() if isinstance(m, bitkern.Linear)}
float_weights = [n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
torch.save({"logits": logits, "tokens": tokens, "layers": layers, "float_weights": float_weights}, sys.argv[2])
"""


@pytest.mark.parametrize("dtype", list(CASES))
def test_save_and_reload_in_a_fresh_process_is_bit_identical(quantized, tmp_path, dtype):
    model = quantized(dtype)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "bitkern" and saved["dtype"] == dtype and "lm_head" in saved["modules_to_not_convert"]
    _assert_no_float_copies(tmp_path / "saved", model)
    result = _run(RELOAD, tmp_path / "saved", tmp_path / "result.pt")
    assert result.returncode == 0, result.stderr[-3000:]
    reloaded = torch.load(tmp_path / "result.pt")
    assert torch.equal(reloaded["logits"], _logits(model))
    assert torch.equal(reloaded["tokens"], _greedy(model))
    assert set(reloaded["layers"].values()) == {dtype} and len(reloaded["layers"]) == 14
    assert reloaded["float_weights"] == []


def _assert_no_float_copies(folder: Path, model) -> None:
    """Every quantized layer is in the files as int32 codes and its scales (and zeros): nothing of [N, K] floats."""
    tensors = {}
    for file in folder.glob("*.safetensors"):
        with safetensors.safe_open(str(file), "pt") as opened:
            tensors.update({key: (opened.get_slice(key).get_shape(), opened.get_slice(key).get_dtype())
                            for key in opened.keys()})
    for name, layer in _linears(model).items():
        if not isinstance(layer, bitkern.Linear):
            continue
        mine = {key.removeprefix(name + "."): value for key, value in tensors.items() if key.startswith(name + ".")}
        assert mine["weight"][1] == "I32" and mine["weight"][0][1] < layer.in_features, name
        assert set(mine) <= {"weight", "weight_scale", "weight_zero", "weight_tensor_scale", "bias"}, name
        assert all(shape != [layer.out_features, layer.in_features] for shape, _ in mine.values()), name


def test_sharded_save_loads_back(quantized, tmp_path):
    model = quantized("int4")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(tmp_path.glob("sharded/model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    _assert_no_float_copies(tmp_path / "sharded", model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    assert torch.equal(_logits(reloaded), _logits(model))


def test_a_checkpoint_loads_without_float_weights_in_memory(quantized, tmp_path):
    """The pre-quantized load builds the layers from the packed tensors: no float [N, K] weight at any point
    (the layers' float parameters are the model's norms, embeddings and lm_head only)."""
    model = quantized("nf4")
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    floats = {name for name, p in reloaded.named_parameters() if p.dim() == 2}
    assert floats == {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(isinstance(m, bitkern.Linear) for n, m in _linears(reloaded).items() if n != "lm_head")


def test_load_pretrained_reads_a_save_pretrained_checkpoint(quantized, tmp_path):
    """`bitkern.load_pretrained`, the one call for checkpoints of other tools, loads bitkern's own transformers
    checkpoints too (sharded here), through the quantizer, bit for bit."""
    model = quantized("nf4")
    model.save_pretrained(tmp_path / "saved", max_shard_size="40KB")
    loaded = bitkern.load_pretrained(tmp_path / "saved")
    assert not loaded.training and loaded.is_quantized and loaded.hf_quantizer.quantization_config.dtype == "nf4"
    assert torch.equal(_logits(loaded), _logits(model)) and torch.equal(_greedy(loaded), _greedy(model))
    cast = bitkern.load_pretrained(tmp_path / "saved", dtype="bfloat16", compute_dtype=torch.bfloat16)
    assert cast.model.embed_tokens.weight.dtype == torch.bfloat16
    assert {m.compute_dtype for m in cast.modules() if isinstance(m, bitkern.Linear)} == {torch.bfloat16}


def test_quantized_activations_on_load_and_through_a_checkpoint(tiny_llama, float_model, tmp_path):
    """BitkernConfig(activation_quant="int8"): every converted layer quantizes its input (bit for bit
    quantize_model's), save_pretrained records it and from_pretrained gives it back with the same logits."""
    from bitkern.tuner import host_cpu

    if "avx2" not in host_cpu().flags:
        pytest.skip("needs a CPU with AVX2")
    config = BitkernConfig("int4", group_size=32, activation_quant="int8")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=config).eval()
    layers = [m for m in model.modules() if isinstance(m, bitkern.Linear)]
    assert len(layers) == 14 and {m.activation_quant for m in layers} == {"int8"}
    expected = bitkern.quantize_model(copy.deepcopy(float_model), "int4", group_size=32, output_layer=None,
                                      skip=["lm_head"], activation_quant="int8")
    assert torch.equal(_logits(model), _logits(expected))
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["activation_quant"] == "int8"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert {m.activation_quant for m in reloaded.modules() if isinstance(m, bitkern.Linear)} == {"int8"}
    assert torch.equal(_logits(reloaded), _logits(model)) and torch.equal(_greedy(reloaded), _greedy(model))


def test_hqq_on_load_is_recorded_and_not_rerun_on_reload(tiny_llama, float_model, tmp_path, monkeypatch):
    """BitkernConfig(method="hqq") quantizes on load exactly as quantize_model(method="hqq") does; save_pretrained
    records the method, and from_pretrained reads the stored tensors back without quantizing anything."""
    config = BitkernConfig("int4", group_size=32, method="hqq", overrides={"down_proj": {"method": "rtn"}})
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=config).eval()
    expected = bitkern.quantize_model(copy.deepcopy(float_model), "int4", group_size=32, skip=["lm_head"],
                                      method="hqq")
    layers, reference = _linears(model), _linears(expected)
    for name, layer in layers.items():
        if isinstance(layer, bitkern.Linear):
            assert layer.method == ("rtn" if name.endswith("down_proj") else "hqq"), name
            if layer.method == "hqq":
                assert torch.equal(layer.qweight, reference[name].qweight) and torch.equal(layer.scales,
                                                                                           reference[name].scales)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["method"] == "hqq" and saved["overrides"] == {"down_proj": {"method": "rtn"}}

    def never(*args, **kwargs):
        raise AssertionError("a checkpoint load quantized a weight")

    monkeypatch.setattr(bitkern.ttype, "quantize", never)
    reloaded = _linears(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval())
    for name, layer in layers.items():
        if isinstance(layer, bitkern.Linear):
            assert reloaded[name].method == layer.method and torch.equal(reloaded[name].qweight, layer.qweight), name


# -- generate, compile, dequantize, devices -------------------------------------------------------------------
def test_generate_greedy_sampling_and_kv_caches(quantized):
    model = quantized("int4")
    greedy = _greedy(model)
    assert greedy.shape == (1, PROMPT.shape[1] + 12) and torch.equal(greedy[:, :PROMPT.shape[1]], PROMPT)
    assert torch.equal(_greedy(model, use_cache=False), greedy)  # the KV cache changes nothing
    assert torch.equal(_greedy(model, cache_implementation="static"), greedy)
    torch.manual_seed(3)
    sampled = model.generate(PROMPT, max_new_tokens=12, do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(3)
    again = model.generate(PROMPT, max_new_tokens=12, do_sample=True, top_k=20, temperature=0.8)
    assert torch.equal(sampled, again) and sampled.shape == greedy.shape and int(sampled.max()) < 1024


def test_generate_with_torch_compile(tiny_llama):
    config = BitkernConfig("int4", group_size=32)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=config).eval()
    assert model.hf_quantizer.is_compileable
    eager = _greedy(model, cache_implementation="static")
    model.forward = torch.compile(model.forward)
    assert torch.equal(_greedy(model, cache_implementation="static"), eager)


def test_dequantize_gives_the_float_model_of_the_quantized_weights(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=BitkernConfig("nf4", group_size=64))
    expected = {name: layer.dequantize_weight() for name, layer in _linears(model).items()
                if isinstance(layer, bitkern.Linear)}
    quantized_logits = _logits(model.eval())
    model = model.dequantize()
    layers = _linears(model)
    assert not any(isinstance(layer, bitkern.Linear) for layer in layers.values())
    for name, weight in expected.items():
        assert type(layers[name]) is nn.Linear and torch.equal(layers[name].weight, weight)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    torch.testing.assert_close(_logits(model.eval()), quantized_logits, rtol=1e-2, atol=1e-2)  # kernel vs torch sums


def test_to_moves_and_casts_keep_the_quantized_weights(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=BitkernConfig("int4", group_size=32))
    layer = model.get_submodule("model.layers.0.mlp.up_proj")
    codes = layer.qweight.clone()
    logits = _logits(model.eval())
    assert model.to("cpu") is model and torch.equal(_logits(model), logits)
    model.to(torch.bfloat16)
    assert torch.equal(layer.qweight, codes) and layer.scale_dtype == torch.float16
    torch.testing.assert_close(_logits(model).float(), logits, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_map_puts_the_layers_on_the_gpu(tiny_llama, quantized, tmp_path):
    model = quantized("int4")
    model.save_pretrained(tmp_path / "saved")
    loads = {"pre-quantized": AutoModelForCausalLM.from_pretrained(tmp_path / "saved", device_map="cuda"),
             "on load": AutoModelForCausalLM.from_pretrained(tiny_llama, device_map="cuda",
                                                             quantization_config=BitkernConfig("int4", group_size=32))}
    expected = model.get_submodule("model.layers.0.mlp.up_proj").quantized_weight()
    for how, gpu in loads.items():
        layer = gpu.get_submodule("model.layers.0.mlp.up_proj")
        assert layer.qweight.is_cuda and layer.layout == "lop3", how
        assert torch.equal(layer.quantized_weight().qweight.cpu(), expected.qweight), how
        torch.testing.assert_close(_logits(gpu.eval(), PROMPT.cuda()).cpu(), _logits(model), rtol=2e-2, atol=2e-2)


# -- LoRA -------------------------------------------------------------------------------------------------------
def test_lora_adapters_train_on_the_quantized_base(tiny_llama):
    import peft

    from bitkern.integration.hf.lora import LoraLinear

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=BitkernConfig("int4", group_size=32))
    frozen = {name: buffer.clone() for name, buffer in model.named_buffers() if name.endswith("qweight")}
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    config._register_custom_module({bitkern.Linear: LoraLinear})
    model = peft.get_peft_model(model, config)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable) and len(trainable) == 2 * 3 * 2
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None for name, p in model.named_parameters() if p.requires_grad)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    for name, buffer in model.named_buffers():
        if name.endswith("qweight"):
            assert torch.equal(buffer, frozen[name.removeprefix("base_model.model.").replace(".base_layer", "")])


# -- bad input ----------------------------------------------------------------------------------------------------
def test_bad_settings_are_named_before_anything_loads(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="dtype='int5x'"):
        BitkernConfig("int5x")
    with pytest.raises(ValueError, match="zero_mode"):
        BitkernConfig("int4", zero_mode="gptq")
    with pytest.raises(ValueError, match=r"overrides\['down_proj'\]: .*dtype='bogus'"):
        BitkernConfig("int4", overrides={"down_proj": {"dtype": "bogus"}})
    with pytest.raises(ValueError, match=r"unknown settings \['bits'\]"):
        BitkernConfig("int4", overrides={"down_proj": {"bits": 4}})
    before = {file.name: file.read_bytes() for file in tiny_llama.iterdir()}
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=BitkernConfig("int4", group_size=96))
    assert "model.layers.0.self_attn.q_proj (in_features 256)" in str(error.value)
    assert "model.layers.1.mlp.down_proj (in_features 512)" in str(error.value)
    assert {file.name: file.read_bytes() for file in tiny_llama.iterdir()} == before


def test_a_config_dict_with_unknown_keys_is_refused(quantized, tmp_path):
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        BitkernConfig.from_dict({"quant_method": "bitkern", "dtype": "int4", "bogus": 1})
    config = BitkernConfig("nf4", group_size=64, overrides={"down_proj": {"dtype": "int8"}})
    assert BitkernConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    quantized("int4").save_pretrained(tmp_path / "saved")
    document = json.loads((tmp_path / "saved" / "config.json").read_text())
    document["quantization_config"]["bits"] = 4
    (tmp_path / "saved" / "config.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"unknown keys \['bits'\]"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")


def test_a_checkpoint_into_a_model_of_other_sizes_is_refused(quantized, tmp_path):
    quantized("int4").save_pretrained(tmp_path / "saved")
    other = AutoConfig.from_pretrained(tmp_path / "saved")
    other.intermediate_size = 192
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved", config=other)
    message = str(error.value)
    assert "does not fit this model" in message and "model.layers.0.mlp.up_proj: weight is [512, 32] int32, " \
                                                   "expected [192, 32] int32" in message


def test_without_bitkern_registered_a_checkpoint_fails_loudly(quantized, tmp_path):
    quantized("int4").save_pretrained(tmp_path / "saved")
    result = _run("""
        import sys
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained(sys.argv[1])
        """, tmp_path / "saved")
    assert result.returncode != 0
    assert "Unknown quantization type, got bitkern" in result.stderr
    assert "size mismatch" in result.stderr and "RuntimeError" in result.stderr


# -- registration -----------------------------------------------------------------------------------------------
def test_import_bitkern_registers_with_transformers_whichever_comes_first():
    check = """
        from bitkern.integration.hf.config import BitkernConfig
        from bitkern.integration.hf.quantizer import BitkernHfQuantizer
        assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["bitkern"] is BitkernConfig
        assert auto.AUTO_QUANTIZER_MAPPING["bitkern"] is BitkernHfQuantizer
        assert bitkern.BitkernConfig is BitkernConfig
        """
    for first, second in (("bitkern", "transformers.quantizers.auto as auto"),
                          ("transformers.quantizers.auto as auto", "bitkern"),
                          ("bitkern.integration.hf.quantizer", "transformers.quantizers.auto as auto")):
        result = _run(f"import {first}\nimport {second}\n" + textwrap.dedent(check))
        assert result.returncode == 0, (first, result.stderr[-3000:])


def test_import_bitkern_imports_no_transformers_and_works_without_it():
    result = _run("""
        import sys

        class NoTransformers:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "transformers":
                    raise ModuleNotFoundError("No module named 'transformers'")

        sys.meta_path.insert(0, NoTransformers())
        import bitkern
        assert "transformers" not in sys.modules
        layer = bitkern.Linear(64, 32, dtype="int4", group_size=32)
        try:
            bitkern.BitkernConfig
        except ImportError as error:
            assert "needs transformers" in str(error)
        else:
            raise AssertionError("BitkernConfig without transformers")
        """)
    assert result.returncode == 0, result.stderr[-3000:]
