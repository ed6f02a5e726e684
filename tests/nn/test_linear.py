"""bitkern.Linear against torch: F.linear on the dequantized weight, autograd, state dicts, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import bitkern
from bitkern import ttype
from bitkern.nn.storage import weight_dtypes
from tests.helpers import assert_matches

IN, OUT = 256, 96


def _float_linear(bias=True, seed=0, in_features=IN, out_features=OUT):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("name, zero_mode", [("int8", None), ("int4", None), ("nf4", None), ("uint4", "gptq"),
                                             ("uint4", "hqq"), ("mxfp4", None), ("nvfp4", None), ("int3", None)])
def test_forward_is_f_linear_on_the_dequantized_weight(name, zero_mode):
    """float32 compute: the kernel sums the dequantized weight, decoded exactly, in float32 (types whose values
    bfloat16 does not hold, nf4, included)."""
    source = _float_linear()
    group = None if ttype.get(name).block_size > 1 else 64
    layer = bitkern.Linear.from_float(source, name, group_size=group, zero_mode=zero_mode)
    x = torch.randn(3, 5, IN)
    reference = F.linear(x.double(), layer.dequantize_weight(torch.float64), source.bias.double()).float()
    assert_matches(layer(x), reference, 1e-5)
    independent = bitkern.quantize(source.weight.detach(), name, group_size=group, zero_mode=zero_mode).dequantize()
    assert torch.equal(layer.dequantize_weight(), independent)


@pytest.mark.parametrize("input_dtype, compute_dtype, tolerance", [
    (torch.float32, torch.bfloat16, 2**-7), (torch.bfloat16, None, 2**-6), (torch.float16, None, 2**-9),
    (torch.float16, torch.float32, 2**-10)])
def test_compute_dtype_and_output_dtype(input_dtype, compute_dtype, tolerance):
    """x is cast to compute_dtype (or kept), the output comes back in x's dtype."""
    source = _float_linear()
    layer = bitkern.Linear.from_float(source, "int4", group_size=64, compute_dtype=compute_dtype)
    x = torch.randn(4, IN).to(input_dtype)
    computed = x.to(compute_dtype or input_dtype).double()
    reference = F.linear(computed, layer.dequantize_weight(torch.float64), source.bias.double()).to(input_dtype)
    assert_matches(layer(x), reference, tolerance)


def test_compute_dtype_can_be_switched_after_construction():
    layer = bitkern.Linear.from_float(_float_linear(), "int4", group_size=64)
    x = torch.randn(4, IN)
    layer.compute_dtype = "bfloat16"
    assert layer.compute_dtype is torch.bfloat16
    reference = F.linear(x.bfloat16().double(), layer.dequantize_weight(torch.float64), layer.bias.double())
    assert_matches(layer(x), reference.float(), 2**-7)
    with pytest.raises(ValueError, match="compute_dtype='int8' is not supported; accepted: float32, float16"):
        layer.compute_dtype = "int8"


def test_constructor_initialises_like_nn_linear():
    torch.manual_seed(3)
    layer = bitkern.Linear(IN, OUT, dtype="int8", group_size=128)
    weight = layer.dequantize_weight()
    bound = 1 / math.sqrt(IN)  # nn.Linear's kaiming_uniform(a=√5) bound
    assert weight.abs().max() <= bound * 1.01 and weight.std() > bound / 2
    assert layer.bias.shape == (OUT,) and layer.bias.abs().max() <= bound
    assert bitkern.Linear(IN, OUT, bias=False).bias is None


def test_group_size_defaults():
    assert bitkern.Linear(IN, OUT, dtype="int4").group_size == 128
    assert bitkern.Linear(IN, OUT, dtype="mxfp4").group_size == 32
    assert bitkern.Linear(IN, OUT, dtype="int4", group_size=-1).group_size == IN  # per channel


def test_repr_names_type_group_and_bytes_saved():
    layer = bitkern.Linear(IN, OUT, dtype="nf4", group_size=64)
    text = repr(layer)
    assert "in_features=256, out_features=96, bias=True, dtype=nf4, group_size=64, zero_mode=none" in text
    saved = IN * OUT * 4 - layer.nbytes
    assert layer.nbytes == IN * OUT // 2 + OUT * (IN // 64) * 2  # 4-bit codes + fp16 scales
    assert f"weight={layer.nbytes / 2**10:.2f} KiB (saves {saved / 2**10:.2f} KiB, 87% of float32)" in text


def test_dequantize_gives_an_equivalent_float_module():
    layer = bitkern.Linear.from_float(_float_linear(), "int4", group_size=64)
    module = layer.dequantize()
    assert type(module) is nn.Linear and module.weight.dtype == torch.float32
    x = torch.randn(2, IN)
    assert_matches(layer(x), module(x), 1e-5)


def test_input_gradient_matches_the_float_layer_and_weights_stay_frozen():
    layer = bitkern.Linear.from_float(_float_linear(), "nf4", group_size=64)
    reference = layer.dequantize()
    before = layer.qweight.clone()
    x = torch.randn(6, IN, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad_out = torch.randn(6, OUT)
    layer(x).backward(grad_out)
    reference(x_ref).backward(grad_out)
    assert_matches(x.grad, x_ref.grad, 1e-5)
    assert_matches(layer.bias.grad, reference.bias.grad, 1e-6)
    assert torch.equal(layer.qweight, before)
    assert [name for name, p in layer.named_parameters()] == ["bias"]


def test_inference_calls_skip_the_dispatcher_and_give_the_op_s_results():
    """Eager inference runs the op's body on the weight object the layer keeps (made once, remade when the buffers
    are replaced); calls that autograd records go through torch.ops.bitkern.linear: the same results, bit for bit."""
    layer = bitkern.Linear.from_float(_float_linear(), "int4", compute_dtype=torch.bfloat16)
    x = torch.randn(3, IN)
    with torch.inference_mode():
        direct = layer(x)
    assert layer.packed_weight() is layer.packed_weight()
    recorded = layer(x.clone().requires_grad_())
    assert recorded.grad_fn is not None and torch.equal(recorded.detach(), direct)
    other = bitkern.Linear.from_float(_float_linear(seed=1), "int4", compute_dtype=torch.bfloat16)
    kept = layer.packed_weight()
    layer.load_state_dict(other.state_dict(), assign=True)
    assert layer.packed_weight() is not kept
    with torch.no_grad():
        assert torch.equal(layer(x), other(x)) and not torch.equal(layer(x), direct)


def test_asking_for_the_weight_or_its_gradient_is_an_explicit_error():
    layer = bitkern.Linear(IN, OUT, dtype="int4")
    with pytest.raises(AttributeError, match="no float `weight`.*frozen.*no weight gradient.*dequantize"):
        layer.weight
    with pytest.raises(RuntimeError, match="floating point"):
        layer.qweight.requires_grad_()


class LoRA(nn.Module):
    """y = base(x) + (x · Aᵀ) · Bᵀ, with A, B trainable (B starts small, so every gradient is non-zero)."""

    def __init__(self, base, in_features, out_features, rank=4):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, in_features) / in_features**0.5)
        self.b = nn.Parameter(torch.randn(out_features, rank) * 1e-2)

    def forward(self, x):
        return self.base(x) + x @ self.a.T @ self.b.T


def test_lora_trains_on_a_quantized_base_like_on_its_float_equivalent():
    """QLoRA-style: adapters on two 4-bit layers learn a change of the model as they do on the dequantized
    float layers; the first adapter learns only through the second layer's input gradient.  (The nf4
    kernel decodes through bfloat16 values: 2^-8 relative.)"""
    bases = [bitkern.Linear.from_float(_float_linear(seed=seed, out_features=size), "nf4", group_size=64)
             for seed, size in ((0, IN), (1, OUT))]
    models = {}
    for label, layers in (("quantized", bases), ("float", [b.dequantize() for b in bases])):
        torch.manual_seed(2)
        first, second = (LoRA(layer.requires_grad_(False), layer.in_features, layer.out_features) for layer in layers)
        models[label] = nn.Sequential(first, nn.GELU(), second)
    torch.manual_seed(1)
    x = torch.randn(64, IN)
    with torch.no_grad():
        target = models["float"](x) + torch.randn(OUT) * models["float"](x).std()
    losses, first_gradients = {}, {}
    for label, model in models.items():
        adapters = [p for p in model.parameters() if p.requires_grad]
        assert len(adapters) == 4
        optimizer = torch.optim.Adam(adapters, lr=0.01)
        losses[label] = []
        for step in range(25):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            if step == 0:
                first_gradients[label] = [p.grad.clone() for p in adapters]
            optimizer.step()
            losses[label].append(loss.item())
    # the first adapter's gradients come through the second quantized layer's input gradient
    for quantized, floating in zip(first_gradients["quantized"], first_gradients["float"]):
        assert_matches(quantized, floating, 1e-2)
    assert losses["quantized"][-1] < 0.5 * losses["quantized"][0]
    assert all(abs(q - f) <= 2e-2 * f for q, f in zip(losses["quantized"], losses["float"]))


def test_module_dtype_casts_leave_the_stored_weight_alone():
    """model.half() / .to(bfloat16) cast the bias; the codes and scales are kept bit for bit."""
    layer = bitkern.Linear.from_float(_float_linear(), "int4", group_size=64, scale_dtype=torch.float16)
    before = {name: t.clone() for name, t in layer.named_buffers()}
    weight = layer.dequantize_weight()
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    assert all(torch.equal(before[name], t) for name, t in layer.named_buffers())
    assert torch.equal(layer.dequantize_weight(), weight)
    x = torch.randn(2, IN, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


def test_state_dict_round_trip_into_a_meta_layer():
    layer = bitkern.Linear.from_float(_float_linear(), "uint4", group_size=64, zero_mode="gptq")
    state = layer.state_dict()
    assert set(state) == {"bias", "qweight", "scales", "zeros", "_extra_state"}
    assert state["_extra_state"]["dtype"] == "uint4" and state["_extra_state"]["layout"] == "tile16"
    fresh = bitkern.Linear(IN, OUT, dtype="uint4", group_size=64, zero_mode="gptq", device="meta")
    fresh.load_state_dict(state, assign=True)
    x = torch.randn(3, IN)
    assert torch.equal(fresh(x), layer(x))


def test_assigned_tensors_that_start_mid_line_are_realigned():
    """Tensors assigned from a state (e.g. slices of a mapped file) may start anywhere; the module copies
    those that do not start on a 64-byte boundary and keeps the bias a Parameter."""
    layer = bitkern.Linear.from_float(_float_linear(), "uint4", group_size=64, zero_mode="gptq")
    state = layer.state_dict()
    for name in ("bias", "qweight", "scales"):
        raw = torch.empty(state[name].numel() * state[name].element_size() + 72, dtype=torch.uint8)
        start = (64 - raw.data_ptr() % 64) % 64 + 8
        state[name] = raw[start:start + raw.numel() - 72].view(state[name].dtype).view(state[name].shape).copy_(
            state[name])
        assert state[name].data_ptr() % 64 == 8
    fresh = bitkern.Linear(IN, OUT, dtype="uint4", group_size=64, zero_mode="gptq", device="meta")
    fresh.load_state_dict(state, assign=True)
    assert all(t.data_ptr() % 64 == 0 for t in (fresh.bias, fresh.qweight, fresh.scales, fresh.zeros))
    assert isinstance(fresh.bias, torch.nn.Parameter) and fresh.zeros is state["zeros"]  # aligned: kept
    x = torch.randn(3, IN)
    assert torch.equal(fresh(x), layer(x))


def test_state_dict_in_the_portable_layout_is_re_laid_out_on_load():
    """A state whose layout differs from what this device's kernels read (here: the portable one, with
    its scales as float16 tensors rather than their bits) loads, and nothing is converted numerically."""
    layer = bitkern.Linear.from_float(_float_linear(), "nf4", group_size=64)
    portable = layer.quantized_weight()
    assert portable.scales.dtype == torch.float16
    state = {"bias": layer.bias, "qweight": portable.qweight, "scales": portable.scales,
             "_extra_state": {**layer.state_dict()["_extra_state"], "layout": "rowmajor"}}
    fresh = bitkern.Linear(IN, OUT, dtype="nf4", group_size=64)
    fresh.load_state_dict(state)
    assert fresh.layout == "tile16"
    assert all(torch.equal(a, b) for a, b in zip(fresh.buffers(), layer.buffers()))


@pytest.mark.parametrize("module_options, message", [
    ({"dtype": "int4", "group_size": 64}, "saved with dtype='nf4', but this module has dtype='int4'"),
    ({"dtype": "nf4", "group_size": 128}, "saved with group_size=64, but this module has group_size=128"),
    ({"dtype": "nf4", "group_size": 64, "scale_dtype": torch.bfloat16}, "scale_dtype='float16'")])
def test_loading_a_state_made_with_other_settings_names_the_setting(module_options, message):
    state = bitkern.Linear.from_float(_float_linear(), "nf4", group_size=64).state_dict()
    target = bitkern.Linear(IN, OUT, **module_options)
    before = target.qweight.clone()
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert torch.equal(target.qweight, before)  # nothing was copied


def test_loading_a_state_of_another_shape_is_refused():
    state = bitkern.Linear.from_float(_float_linear(), "int4", group_size=64).state_dict()
    with pytest.raises(ValueError, match=r"weight_shape=\[96, 256\], but this module has weight_shape=\[96, 128\]"):
        bitkern.Linear(128, OUT, dtype="int4", group_size=64).load_state_dict(state)


# -- bad input ----------------------------------------------------------------------------------------------


def test_wrong_in_features_is_refused_naming_it():
    layer = bitkern.Linear(IN, OUT, dtype="int4")
    with pytest.raises(ValueError, match=r"x has shape \(2, 128\); this Linear has in_features=256"):
        layer(torch.randn(2, 128))


def test_unsupported_dtype_name_lists_the_supported_ones():
    with pytest.raises(ValueError, match="dtype='int17' is not supported for weights; accepted: .*int8.*nf4.*mxfp4"):
        bitkern.Linear(IN, OUT, dtype="int17")
    with pytest.raises(ValueError, match="dtype='float16' is not supported for weights"):
        bitkern.Linear(IN, OUT, dtype="float16")


def test_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="group_size=100 does not divide in_features=256"):
        bitkern.Linear(IN, OUT, dtype="int4", group_size=100)
    with pytest.raises(ValueError, match="group_size=64: type 'mxfp4' has a fixed block of 32"):
        bitkern.Linear(IN, OUT, dtype="mxfp4", group_size=64)


def test_bias_of_the_wrong_shape_is_refused_naming_it():
    layer = bitkern.Linear(IN, OUT, dtype="int4")
    layer.bias = nn.Parameter(torch.zeros(OUT + 1))
    with pytest.raises(ValueError, match=r"bias has shape \(97,\); Linear with 96 outputs takes a bias of shape"):
        layer(torch.randn(2, IN))


@pytest.mark.parametrize("options, error, message", [
    ({"zero_mode": "gptq"}, ValueError, "zero_mode='gptq' needs an unsigned integer type"),
    ({"compute_dtype": torch.float64}, ValueError, "compute_dtype=torch.float64 is not supported; accepted: float32"),
    ({"scale_dtype": torch.int8}, ValueError, "scale_dtype=torch.int8 is not supported"),
    ({"group_size": "64"}, TypeError, "group_size must be an int")])
def test_bad_settings_name_the_argument(options, error, message):
    with pytest.raises(error, match=message):
        bitkern.Linear(IN, OUT, dtype="int4", **options)


def test_inputs_are_not_converted_silently():
    layer = bitkern.Linear(IN, OUT, dtype="int4")
    with pytest.raises(TypeError, match="x has dtype torch.float64; Linear takes float32, float16, bfloat16"):
        layer(torch.randn(2, IN, dtype=torch.float64))
    with pytest.raises(TypeError, match="module must be a torch.nn.Linear, got Conv2d"):
        bitkern.Linear.from_float(nn.Conv2d(3, 4, 3))


@pytest.mark.parametrize("dtype, zero_mode, scale_dtype", [("uint4", "gptq", torch.float16),
                                                          ("nf4", "none", torch.float32),
                                                          ("uint3", "awq", torch.float16)])
def test_from_quantized_holds_the_weight_as_it_is(dtype, zero_mode, scale_dtype):
    weight = bitkern.quantize(torch.randn(OUT, IN), dtype, group_size=64, zero_mode=zero_mode, scale_dtype=scale_dtype)
    bias = torch.randn(OUT)
    layer = bitkern.Linear.from_quantized(weight, bias)
    assert (layer.weight_dtype, layer.zero_mode, layer.scale_dtype) == (dtype, zero_mode, scale_dtype)
    assert torch.equal(layer.dequantize_weight(), weight.dequantize())
    back = layer.quantized_weight()
    assert all(torch.equal(getattr(back, f), getattr(weight, f)) for f in ("qweight", "scales", "zeros") if
               getattr(weight, f) is not None)
    x = torch.randn(3, IN)
    tolerance = 1e-5 if "bfloat16" in ttype.get(dtype).compute_types else 2**-8
    assert_matches(layer(x), F.linear(x.double(), weight.dequantize(torch.float64), bias.double()).float(), tolerance)


def test_a_layer_with_permuted_inputs_gathers_x_and_dequantizes_in_the_original_order(tmp_path):
    """input_order (GPTQ act-order): y = x[..., order] · dequant(W)ᵀ; dequantize_weight undoes the order, so the
    float module computes the same; torch.compile traces the gather; the order travels with the state and with
    bitkern.save / load."""
    torch.manual_seed(0)
    weight = bitkern.quantize(torch.randn(OUT, IN), "uint4", group_size=64)
    order = torch.randperm(IN)
    layer = bitkern.Linear.from_quantized(weight, input_order=order)
    plain = bitkern.Linear.from_quantized(weight)
    x = torch.randn(2, 3, IN)
    assert torch.equal(layer(x), plain(x[..., order]))
    assert torch.equal(layer.dequantize_weight()[:, order], plain.dequantize_weight())
    assert_matches(layer(x), F.linear(x.double(), layer.dequantize_weight(torch.float64)).float(), 1e-5)
    assert "input_order=permuted" in repr(layer)
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))
    model = nn.Sequential(layer)
    bitkern.save(model, tmp_path / "model.safetensors")
    with torch.device("meta"):
        fresh = nn.Sequential(nn.Linear(IN, OUT, bias=False))
    bitkern.load(fresh, tmp_path / "model.safetensors")
    assert torch.equal(fresh[0].input_order, order) and torch.equal(fresh[0](x), layer(x))


@pytest.mark.parametrize("order, error", [(torch.arange(IN - 1), ValueError), (torch.zeros(IN, dtype=torch.long), ValueError),
                                          (torch.arange(IN).float(), TypeError)])
def test_input_orders_that_are_not_permutations_are_refused(order, error):
    weight = bitkern.quantize(torch.randn(OUT, IN), "uint4", group_size=64)
    with pytest.raises(error, match="input_order"):
        bitkern.Linear.from_quantized(weight, input_order=order)


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(weight_dtypes()), in_blocks=st.integers(1, 9), out_features=st.integers(1, 9),
       seed=st.integers(0, 2**31))
def test_layers_of_a_few_inputs_and_outputs_hold_their_weight(name, in_blocks, out_features, seed):
    """Hostile sizes: K and N of a few elements (one packed word per row, a kernel tile mostly padding), every
    weight type.  The layer's weight, laid out for the kernels and back, is the independent quantization's."""
    block = ttype.get(name).block_size
    in_features = in_blocks * block
    torch.manual_seed(seed)
    source = nn.Linear(in_features, out_features)
    group = block if block > 1 else -1
    layer = bitkern.Linear.from_float(source, name, group_size=group)
    independent = bitkern.quantize(source.weight.detach(), name, group_size=group, zero_mode=layer.zero_mode)
    assert torch.equal(layer.dequantize_weight(), independent.dequantize())
    assert torch.equal(layer.quantized_weight().codes(), independent.codes())
