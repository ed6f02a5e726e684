"""The stored weight: one base for every weight object, its frozen format, the layouts, and the format's string
form (what crosses the torch.library op boundary)."""

import pytest
import torch

import bitkern
from bitkern.codegen import PackedWeight
from bitkern.codegen.cuda import Lop3Weight, to_lop3
from bitkern.ttype import Layout, StoredWeight, WeightFormat


@pytest.mark.parametrize("name, options, scale_dtype", [
    ("int4", dict(group_size=32), "float16"), ("uint4", dict(group_size=16, zero_mode="hqq", scale_dtype=torch.bfloat16), "bfloat16"),
    ("mxfp4", {}, "uint8"), ("nvfp4", {}, "uint8"), ("int8", dict(group_size=-1, scale_dtype=torch.float32), "float32")])
def test_every_weight_object_owns_its_format(name, options, scale_dtype):
    q = bitkern.quantize(torch.randn(48, 64), name, **options)
    for weight, layout, cls in ((q, Layout.ROWMAJOR, bitkern.QuantizedWeight), (bitkern.pack(q), Layout.TILE16, PackedWeight),
                                (to_lop3(q), Layout.LOP3, Lop3Weight)):
        assert isinstance(weight, StoredWeight) and type(weight) is cls
        assert weight.format == WeightFormat(name, (48, 64), q.group_size, q.zero_mode, scale_dtype, layout)
        assert (weight.ttype.name, weight.shape, weight.group_size, weight.layout) == (name, (48, 64), q.group_size,
                                                                                      layout)
        assert WeightFormat.decode(weight.format.encode()) == weight.format
        moved = weight.to("cpu")
        assert type(moved) is cls and moved.format == weight.format and torch.equal(moved.qweight, weight.qweight)
    zero = WeightFormat.decode(q.format.encode()).zero_dtype
    assert zero == {"none": None, "hqq": "bfloat16"}.get(q.zero_mode, "uint8")


def test_a_layout_is_its_name():
    assert Layout.TILE16 == "tile16" and hash(Layout.TILE16) == hash("tile16") and f"{Layout.LOP3}" == "lop3"
    assert {"tile16": 1}[Layout.TILE16] == 1 and Layout.of("rowmajor") is Layout.ROWMAJOR
    with pytest.raises(ValueError, match=r"layout='tile32' is not known; accepted: \['rowmajor', 'tile16', 'lop3'\]"):
        Layout.of("tile32")


def test_a_format_string_that_describes_no_weight_is_refused():
    text = bitkern.quantize(torch.randn(16, 32), "int4", group_size=16).format.encode()
    with pytest.raises(ValueError, match="layout='tile32' is not known"):
        WeightFormat.decode(text.replace("rowmajor", "tile32"))
    with pytest.raises(ValueError, match="unknown type 'int17'"):
        WeightFormat.decode(text.replace("int4", "int17"))
    with pytest.raises(ValueError, match="scale_dtype='float64' is not known"):
        WeightFormat.decode(text.replace("float16", "float64"))
    with pytest.raises(ValueError, match="is not a bitkern weight format"):
        WeightFormat.decode("int4 16x32")
