"""Fuzzing bitkern.load: genuine files with randomly corrupted metadata, tensors and header bytes.

Whatever the corruption, a load either succeeds with every quantized module of the file converted and
consistent, or raises ValueError (the documented error) and leaves the model bit-identical: never another
exception, never a half-converted model.
"""

import copy
import json
import os
import tempfile

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import bitkern
from bitkern.nn.storage import WEIGHT_BUFFERS, QuantizedModule


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.fc1 = nn.Linear(64, 48)
        self.fc2 = nn.Linear(48, 64, bias=False)
        self.conv = nn.Conv2d(8, 16, 3)


def _float_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """(bitkern metadata, tensors, file bytes) of a model with int4, uint4 (zero points) and nf4 layers."""
    model = bitkern.quantize_model(_float_model(), "int4", group_size=16, skip=["fc2", "conv"])
    model = bitkern.quantize_model(model, "uint4", group_size=16, skip=lambda name, _: name != "fc2")
    model = bitkern.quantize_model(model, "nf4", group_size=24, skip=lambda name, _: name != "conv")
    path = tmp_path_factory.mktemp("genuine") / "model.safetensors"
    bitkern.save(model, path)
    with safetensors.safe_open(path, "pt") as file:
        header = json.loads(file.metadata()["bitkern"])
    return header, safetensors.torch.load_file(path), path.read_bytes()


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) |
                    st.text(max_size=12), lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
FIELDS = ["class", "dtype", "group_size", "zero_mode", "scale_dtype", "layout", "weight_shape", "compute_dtype",
          "format", "reduction_order"]
DTYPES = [torch.int32, torch.int16, torch.uint8, torch.int8, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]


@st.composite
def corruption(draw):
    """A list of edits of the metadata, the tensors, the header's bytes or the data's bytes (which a load takes
    as they are: values are not checked)."""
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "field", "module", "header", "aliases", "drop", "add", "reshape",
                                     "retype", "rename", "bytes", "data", "data"]))
        if kind == "field":
            edits.append((kind, draw(st.sampled_from(["fc1", "fc2", "conv"])), draw(st.sampled_from(FIELDS)),
                          draw(JSON | st.sampled_from(["int4", "uint4", "nf4", "int8", "tile16", "rowmajor", "lop3",
                                                       "Linear", "Conv2d", "float16", "gptq", 16, 32, 48, -1]))))
        elif kind in ("module", "header", "aliases"):
            edits.append((kind, draw(st.text(max_size=10)), draw(JSON)))
        elif kind in ("drop", "reshape", "retype", "rename"):
            edits.append((kind, draw(st.integers(0, 100)), draw(st.lists(st.integers(0, 70), max_size=4)),
                          draw(st.sampled_from(DTYPES))))
        elif kind == "add":
            edits.append((kind, draw(st.sampled_from(["fc1.", "fc2.", "conv.", "embed.", ""])) +
                          draw(st.sampled_from(list(WEIGHT_BUFFERS) + ["bias", "weight", "x"])),
                          draw(st.lists(st.integers(0, 8), max_size=3)), draw(st.sampled_from(DTYPES))))
        else:
            edits.append((kind, draw(st.integers(0, 10**6)), draw(st.integers(1, 255))))
    return edits


def _apply(edits, header, tensors, data: bytes) -> bytes:
    """The file bytes after `edits` to a copy of the genuine header and tensors."""
    header, tensors = copy.deepcopy(header), dict(tensors)
    flips, data_flips = [], []
    for edit in edits:
        kind = edit[0]
        names = sorted(tensors)
        if kind == "field":
            header["modules"][edit[1]][edit[2]] = edit[3]
        elif kind == "module":
            header["modules"][edit[1]] = edit[2]
        elif kind == "header":
            header[edit[1] or "format"] = edit[2]
        elif kind == "aliases":
            header["aliases"][edit[1]] = edit[2]
        elif kind == "drop" and names:
            del tensors[names[edit[1] % len(names)]]
        elif kind == "add":
            tensors[edit[1]] = torch.zeros(edit[2], dtype=edit[3])
        elif kind == "reshape" and names:
            tensors[names[edit[1] % len(names)]] = torch.zeros(edit[2], dtype=tensors[names[edit[1] % len(names)]].dtype)
        elif kind == "retype" and names:
            name = names[edit[1] % len(names)]
            tensors[name] = tensors[name].to(edit[3])
        elif kind == "rename" and names:
            name = names[edit[1] % len(names)]
            tensors[name + "_renamed"] = tensors.pop(name)
        elif kind == "bytes":
            flips.append(edit[1:])
        elif kind == "data":
            data_flips.append(edit[1:])
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "f.safetensors")
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt", "bitkern": json.dumps(header)})
        data = bytearray(open(path, "rb").read())
    header_end = 8 + int.from_bytes(data[:8], "little")
    for position, value in flips:  # within the 8-byte length and the JSON header: where a flip is structure
        data[position % header_end] ^= value
    for position, value in data_flips:
        if len(data) > header_end:
            data[header_end + position % (len(data) - header_end)] ^= value
    return bytes(data)


def _fingerprint(model: nn.Module) -> list:
    def tensor(t):
        data = None if t is None or t.is_meta else t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        return None if t is None else (id(t), t.dtype, tuple(t.shape), t.device.type, data)

    return [(name, type(m).__name__, {n: tensor(t) for n, t in m._parameters.items()},
             {n: tensor(t) for n, t in m._buffers.items()}) for name, m in model.named_modules()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(edits=corruption())
def test_a_corrupted_file_loads_whole_or_raises_value_error_and_changes_nothing(genuine, edits):
    header, tensors, data = genuine
    corrupted = _apply(edits, header, tensors, data)
    model = _float_model()
    before = _fingerprint(model)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "corrupted.safetensors")
        with open(path, "wb") as file:
            file.write(corrupted)
        try:
            bitkern.load(model, path)
        except ValueError as error:
            event("refused")
            assert path in str(error)
            assert _fingerprint(model) == before
            return
    event("loaded")
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedModule)}
    assert set(quantized) <= {"fc1", "fc2", "conv"}
    for name, module in quantized.items():
        module.check_weight_tensors({buffer: (t.shape, t.dtype) for buffer in WEIGHT_BUFFERS
                                     if (t := getattr(module, buffer)) is not None}, module.layout, name)
        assert not module.qweight.is_meta
        module.dequantize_weight()  # every tensor readable as the settings say


def test_the_genuine_file_loads_through_the_same_path(genuine):
    header, tensors, data = genuine
    model = _float_model()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "genuine.safetensors")
        with open(path, "wb") as file:
            file.write(_apply([], header, tensors, data))
        bitkern.load(model, path)
    assert {type(m).__name__ for m in (model.fc1, model.fc2, model.conv)} == {"Linear", "Conv2d"}
    assert model.fc2.weight_dtype == "uint4" and model.conv.weight_dtype == "nf4"
