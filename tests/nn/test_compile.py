"""The custom ops under torch.compile and torch.library's own checks; device moves; CUDA graphs (GPU only)."""

import copy

import pytest
import torch
from torch import nn

import bitkern
from bitkern.demo import TransformerBlock

from tests.helpers import assert_matches

DIM, HEADS, HIDDEN = 128, 4, 256


def _quantized_block(compute_dtype=torch.bfloat16):
    torch.manual_seed(0)
    return bitkern.quantize_model(TransformerBlock(DIM, HEADS, HIDDEN).eval(), "int4", group_size=64,
                                  compute_dtype=compute_dtype)


def test_torch_compile_fullgraph_traces_the_kernels_as_single_ops():
    """One graph (fullgraph=True raises on any break) holding the seven projections as bitkern ops."""
    model = _quantized_block()
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    x = torch.randn(2, 6, DIM)
    with torch.no_grad():
        y = torch.compile(model, fullgraph=True, backend=recording_backend)(x)
        assert torch.equal(y, model(x))
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.bitkern.linear) == 7


def test_torch_compile_inductor_matches_eager_forward_and_backward():
    model = _quantized_block()
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True)
    x = torch.randn(2, 6, DIM)
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager, result = model(eager_x), compiled(compiled_x)
    assert_matches(result, eager, 1e-5)
    grad = torch.randn_like(eager)
    eager.backward(grad)
    result.backward(grad)
    assert_matches(compiled_x.grad, eager_x.grad, 1e-2)  # the input gradient is rounded to bf16 (compute dtype)



def test_torch_compile_with_the_cpp_wrapper_matches_eager():
    """Inductor's C++ wrapper (the graph's calls made from C++, no Python between kernels) writes each op's string
    arguments (the weight format) into C++ string literals: the ops' strings must compile there as they are."""
    model = _quantized_block()
    x = torch.randn(1, 6, DIM)
    with torch.no_grad():
        compiled = torch.compile(copy.deepcopy(model), fullgraph=True, options={"cpp_wrapper": True})
        assert_matches(compiled(x), model(x), 1e-5)

def _op_arguments(dtype="uint4", bias=True):
    torch.manual_seed(0)
    layer = bitkern.Linear(128, 48, bias=bias, dtype=dtype, group_size=None if dtype == "nvfp4" else 32)
    return layer, layer.op_weight()


@pytest.mark.parametrize("dtype, bias", [("uint4", True), ("nvfp4", False)])
def test_custom_ops_pass_torch_library_opcheck(dtype, bias):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch, as torch checks them."""
    layer, weight = _op_arguments(dtype, bias)
    x = torch.randn(3, 128, requires_grad=True)
    torch.library.opcheck(torch.ops.bitkern.linear.default, (x, *weight, layer.bias, torch.float32))
    torch.library.opcheck(torch.ops.bitkern.dequantize.default, (*weight, torch.float32))


def test_conv2d_op_passes_opcheck_and_compiles_without_graph_breaks():
    torch.manual_seed(0)
    layer = bitkern.Conv2d(32, 16, 3, stride=2, padding=1, dtype="int4", group_size=96)
    x = torch.randn(2, 7, 9, 32, requires_grad=True)  # channels-last, as the op takes it
    torch.library.opcheck(torch.ops.bitkern.conv2d.default,
                          (x, *layer.op_weight(), layer.bias, torch.float32, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]))
    model = nn.Sequential(layer, nn.ReLU(), bitkern.Conv2d(16, 8, 1, dtype="nf4", group_size=16)).eval()
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    image = torch.randn(2, 32, 9, 11)
    with torch.no_grad():
        assert torch.equal(torch.compile(model, fullgraph=True, backend=recording_backend)(image), model(image))
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1 and targets.count(torch.ops.bitkern.conv2d) == 2


def test_moves_to_meta_and_back_keep_the_weight_format():
    layer, _ = _op_arguments()
    state = layer.state_dict()
    x = torch.randn(2, 128)
    expected = layer(x)
    layer.to("meta")
    assert layer.qweight.is_meta and layer.layout == "tile16"
    assert layer(x.to("meta")).shape == (2, 48)  # the fake implementation
    layer.to_empty(device="cpu").load_state_dict(state)
    assert torch.equal(layer(x), expected)


@pytest.mark.requires_cuda
def test_cuda_move_runs_the_same_layer():
    """The layer moved to CUDA computes what torch computes on its dequantized weight (float32 activations)."""
    layer, _ = _op_arguments()
    x = torch.randn(2, 128)
    expected = torch.nn.functional.linear(x, layer.dequantize_weight(), layer.bias)
    assert_matches(layer.to("cuda")(x.cuda()).cpu(), expected, 1e-5)


@pytest.mark.requires_cuda
def test_cuda_graph_capture_and_replay():
    model = _quantized_block(compute_dtype=None).cuda()
    x = torch.randn(1, 4, DIM, device="cuda")
    with torch.no_grad():
        expected = model(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert_matches(captured, model(x), 1e-5)
        assert not torch.equal(captured, expected)


@pytest.mark.requires_cuda
def test_torch_compile_on_cuda_matches_eager():
    """Inductor on CUDA (fullgraph): the bitkern ops inside the compiled graph run the same kernels as eager."""
    model = _quantized_block(compute_dtype=torch.float16).cuda().half()
    x = torch.randn(2, 6, DIM, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    assert compiled.dtype == torch.float16
    assert_matches(compiled, eager, 1e-2)


def test_cuda_move_is_refused_clearly_where_torch_has_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    layer, _ = _op_arguments()
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        layer.to("cuda")
    assert layer.qweight.device.type == "cpu"
    assert isinstance(layer, nn.Module)
