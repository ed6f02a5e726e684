"""Types whose values bf16 does not hold (nf4) are computed exactly with float32 activations, their lossless
compute type, in every M bucket: no template decodes them through bf16 then (the AMX and AVX512-BF16
templates do not serve them), so a row's result does not depend on the rows that come with it."""

import pytest
import torch

import bitkern
from bitkern.codegen import template
from bitkern.ops import Matmul
from tests.helpers import MATRIX_TEMPLATES, matrix_device

N, K = 64, 256
ROWS = (1, 3, 8, 16, 17, 64, 130)  # one M per bucket


@pytest.fixture(scope="module")
def weight():
    q = bitkern.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)), "nf4", group_size=64)
    return q, bitkern.pack(q)


@pytest.mark.parametrize("name", MATRIX_TEMPLATES)
def test_the_bf16_templates_serve_nf4_but_for_float32_activations(name):
    device = matrix_device(name)
    for activation in ("float32", "float16", "bfloat16"):
        reason = template(name).unsupported(Matmul("nf4", activation, group_size=64), N, K, device)
        if activation == "float32":
            assert "bf16 holds its values inexactly" in reason
        else:
            assert reason is None


def test_float32_rows_are_exact_in_every_bucket(weight):
    q, packed = weight
    spec = Matmul.for_weight(q, "float32")
    x = torch.randn(max(ROWS), K, generator=torch.Generator().manual_seed(1))
    exact = spec.exact(x, q)
    for m in ROWS:
        error = float((spec(x[:m], packed).double() - exact[:m]).abs().max() / exact.abs().max())
        assert error < 1e-5, f"M={m}: relative error {error:.2g} (a bf16 decode gives ~1e-3)"
