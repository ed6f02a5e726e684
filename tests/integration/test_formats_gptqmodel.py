"""Checkpoints bitkern exports to GPTQ load in gptqmodel (the tool transformers uses for GPTQ), and gptqmodel's
own dequantization of them equals bitkern's bit for bit.  gptqmodel runs in its own virtual environment, made
from the package registry on first use by tests/client_venv.py (torch==2.13.0 gptqmodel==7.6.0, a few
minutes); $BITKERN_GPTQMODEL_PYTHON names an existing interpreter with gptqmodel instead."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import bitkern
from bitkern.integration.formats import import_checkpoint, save_gptq

from tests.client_venv import client_python
from tests.integration.formats_fixtures import path

GPTQMODEL = "gptqmodel==7.6.0"
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gptqmodel_dequantize.py")


@pytest.fixture(scope="session")
def gptqmodel_python():
    return os.environ.get("BITKERN_GPTQMODEL_PYTHON") or str(client_python("gptqmodel", ["torch==2.13.0", GPTQMODEL]))


@pytest.mark.parametrize("name", ["gptq_3bit_asym_actorder", "gptq_4bit_sym", "awq_4bit_gemm"])
def test_gptqmodel_loads_bitkern_exports_and_dequantizes_them_identically(tmp_path, gptqmodel_python, name):
    save_gptq(bitkern.load_pretrained(path(name)), tmp_path / "checkpoint")
    output = tmp_path / "dequantized.safetensors"
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    subprocess.run([gptqmodel_python, SCRIPT, str(tmp_path / "checkpoint"), str(output)], check=True,
                   cwd=tmp_path, env={**environment, "GPTQMODEL_CPU_WORKERS": "2"}, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=sys.stderr)
    theirs = load_file(output)
    _, ours, _ = import_checkpoint(tmp_path / "checkpoint")
    assert sorted(theirs) == sorted(ours)
    for module, weight in theirs.items():
        assert torch.equal(ours[module].dequantize(torch.float16).view(torch.int16), weight.view(torch.int16)), module
