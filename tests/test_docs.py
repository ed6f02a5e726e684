"""README.md and docs/: short enough, true where a test can tell, links that resolve, no paragraph in both the
README and a page, and every code block meant to run run as written (tests/docs_pages.py has the conventions)."""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

import bitkern
from bitkern.codegen.cpu import isa
from bitkern.ops import Matmul
from bitkern.tuner import cuda_device, device_for, host_cpu, tune

from tests.docs_pages import (LANGUAGES, PAGES, README, ROOT, blocks, build_tiny_llama, placeholders, prose,
                              substitute, support_matrix)

DOCS = [page for page in PAGES if page != README]
RUN_TIMEOUT_S = 600
GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu_kit_h100"


def _ids(pages):
    return [str(page.relative_to(ROOT)) for page in pages]


# -- shape --------------------------------------------------------------------------------------------------------

def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\((docs/[^)#]+)", README.read_text()))
    assert linked == {str(page.relative_to(ROOT)) for page in DOCS}


def test_ci_runs_exactly_the_readme_test_command():
    commands = [line for block in blocks(README) for line in block.code.splitlines() if "python -m pytest" in line]
    assert len(commands) == 1, commands
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == commands


def test_pytest_prints_the_slowest_25_tests():
    """`.ci/run` runs the README's command unchanged; the durations report comes from the pytest configuration."""
    from configparser import ConfigParser

    config = ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert "--durations=25" in config["tool:pytest"]["addopts"].split()


# -- truth ---------------------------------------------------------------------------------------------------------

NEVER_RAN = [r"(has|have) not (yet )?(been )?run on (a|any) GPU", r"not run on a GPU yet", r"never (been )?run on (a|any) GPU",
             r"(CUDA|GPU) (backend|path|kernels?)[^.]{0,60}(has|have) (not|never) (yet )?(been )?(run|ran)"]


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_page_says_the_cuda_path_never_ran(page):
    text = " ".join(page.read_text().split())
    for pattern in NEVER_RAN:
        assert not re.search(pattern, text, re.I), (pattern, re.search(pattern, text, re.I).group(0))


def test_the_gpu_run_the_readme_cites_is_the_saved_one():
    """The H100 date and test count the README gives are those of benchmarks/results/gpu_kit_h100, whose junit file
    records the GPU tests as run, not skipped."""
    summary = (GPU_RESULTS / "summary.md").read_text()
    tests = re.search(r"\| tests \| passed \| [\d.]+ \| (\d+) passed, (\d+) skipped", summary)
    assert "H100" in summary and tests is not None
    readme = README.read_text()
    assert re.search(rf"H100[^|]*lent on 2026-11-27 \({tests[1]} GPU tests and memcheck passed", " ".join(readme.split()))
    cases = ElementTree.parse(GPU_RESULTS / "junit.xml").getroot().iter("testcase")
    ran = [case for case in cases if case.find("skipped") is None and case.find("failure") is None
           and case.find("error") is None]
    assert len(ran) == int(tests[1]) > 0


LEGEND = ("tested", "emulated", "measured", "H100", "built", "no")
COLUMNS = ["hardware", "weight types", "MoE experts", "int8 activations", "fusion"]
ROWS = ("x86 AVX2", "AVX-VNNI", "AVX-512", "AVX512-BF16", "AMX", "ARM64", "NVIDIA sm_90", "NVIDIA sm_80", "AMD GPUs")


def test_the_support_matrix_has_its_rows_and_columns_and_every_cell_says_how_it_is_known():
    header, rows = support_matrix()
    assert header == COLUMNS
    assert [next(label for label in ROWS if row[0].startswith(label)) for row in rows] == list(ROWS)
    for row in rows:
        for cell in row[1:]:
            terms = re.findall(r"\*\*([^*]+)\*\*", cell)
            assert terms and set(terms) <= set(LEGEND), (row[0], cell)


def _cpu_rows():
    """(level, cells) of the matrix's x86 rows, one per level named in backticks in the hardware column."""
    _, rows = support_matrix()
    names = [level.name for level in isa.LEVELS]
    found = []
    for row in rows:
        for level in re.findall(r"`([^`]+)`", row[0]):
            if level in names:
                found.append((level, row[1:]))
    return found


def test_the_matrix_names_every_x86_level_above_the_baseline():
    assert sorted(level for level, _ in _cpu_rows()) == sorted(level.name for level in isa.LEVELS[1:])


# the levels the CI VM the matrix describes runs (AMD EPYC Zen 5: every level but AMX)
CI_LEVELS = {level.name for level in isa.LEVELS} - {"amx"}


@pytest.mark.parametrize("level, cells", _cpu_rows(), ids=[level for level, _ in _cpu_rows()])
def test_a_level_the_matrix_calls_tested_or_emulated_runs_here(level, cells):
    """Where the matrix says the tests run a level's kernels (tested, emulated), they do on the CI VM: its tests
    run every level the host runs (tests/codegen/cpu/test_isa_levels.py) and only build the others, which the
    matrix must then call built.  On a CPU that runs other levels than the CI VM's this cannot be checked."""
    here = {name for name in (lv.name for lv in isa.LEVELS) if host_cpu().at_level(name).runs_here()}
    if here != CI_LEVELS:
        pytest.skip(f"the matrix describes a CI VM running {sorted(CI_LEVELS)}; this CPU runs {sorted(here)}")
    claims = any(re.search(r"\*\*(tested|emulated)\*\*", cell) for cell in cells)
    runs = level in here
    assert claims == runs or (level == "amx" and "**built**" in cells[0]), (level, cells)


def test_the_arm_row_names_aarch64_levels_and_parts_and_claims_only_emulation_and_builds():
    """The ARM row: the levels and parts it names exist (aarch64), its weight types are run under emulation
    (tools/aarch64/test) and built, never tested or measured on an ARM CPU, by the dense templates that serve
    aarch64 (each named); the MoE cell claims the grouped template built and emulated (tools/aarch64/test's grouped
    cases), nothing more."""
    from bitkern.codegen.cpu import TEMPLATES, isa

    _, rows = support_matrix()
    row = next(row for row in rows if row[0].startswith("ARM64"))
    names = re.findall(r"`([^`]+)`", row[0])
    assert names and all(device_for(name if ":" in name else f"cpu:{name}").level.arch == "aarch64" for name in names)
    assert re.findall(r"\*\*([^*]+)\*\*", row[1]) == ["emulated", "built"]
    serving = [t for t in TEMPLATES if t.runs_at(isa.level("armv8-a"))]
    assert {t.name for t in serving} == {"generic", "fma", "lut", "grouped_fma"}
    assert all(t.title in row[1] for t in serving if not t.grouped)
    assert "grouped" in row[2] and re.findall(r"\*\*([^*]+)\*\*", row[2]) == ["built", "emulated"]


@pytest.mark.parametrize("weight, activation_quant", [("int4", "int8"), ("int3", "none")])
def test_cuda_refuses_what_the_matrix_says_it_refuses(weight, activation_quant):
    """int8 activation quantization and 3-bit codes on sm_90: refused by the tuner before anything is built, with
    the error the matrix's footnote quotes."""
    qweight = bitkern.quantize(torch.randn(256, 256), weight, group_size=128)
    spec = Matmul.for_weight(qweight, "float16", activation_quant=activation_quant)
    with pytest.raises(ValueError, match="no kernel configuration builds .* on cuda-sm_90"):
        tune(spec, 256, 256, (1, 1), "lop3", cuda_device("sm_90"))
    assert "`ValueError: no kernel configuration builds … on cuda-sm_90`" in README.read_text()


def test_mixture_of_experts_experts_are_quantized_as_the_matrix_says(tmp_path):
    """The MoE column: quantize_model and BitkernConfig quantize a Mixtral's experts into bitkern.Experts (no 3-D
    float parameter left) as well as its attention projections, and the footnote's bound on the calls that run the
    grouped kernel is the one Experts uses."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2)
    MixtralForCausalLM(config).save_pretrained(tmp_path)
    quantized = bitkern.quantize_model(MixtralForCausalLM(config), "int4", group_size=32)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bitkern.BitkernConfig("int4",
                                                                                                       group_size=32))
    for model in (quantized, loaded):
        layer = model.model.layers[0]
        assert isinstance(layer.self_attn.q_proj, bitkern.Linear)
        assert isinstance(layer.mlp.experts, bitkern.Experts) and layer.mlp.experts.down.weight_dtype == "int4"
        assert not [name for name, p in model.named_parameters() if p.dim() == 3]
    footnote = " ".join(README.read_text().split())
    from bitkern.nn.experts import GROUPED_PAIRS

    assert f"calls of up to {GROUPED_PAIRS} token-expert pairs (decode: {GROUPED_PAIRS // 8} tokens at top-8) run one " \
           "grouped kernel call per projection" in footnote


# -- links and duplicates ------------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in prose(page).splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_relative_link_resolves(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor:
            assert anchor in _anchors(linked), f"{page.name}: {target} (anchors: {sorted(_anchors(linked))})"


def _paragraphs(page: Path) -> set[str]:
    """The page's paragraphs, list items, table rows and code blocks, whitespace normalized, of 60 characters or
    more."""
    found = {" ".join(block.code.split()) for block in blocks(page)}
    for chunk in re.split(r"\n\s*\n", prose(page)):
        for item in re.split(r"\n(?=\s*(?:- |\d+\. |\|))", chunk):
            found.add(" ".join(item.split()))
    return {paragraph for paragraph in found if len(paragraph) >= 60}


def test_no_paragraph_is_both_in_the_readme_and_in_a_docs_page():
    readme = _paragraphs(README)
    for page in DOCS:
        shared = readme & _paragraphs(page)
        assert not shared, f"in README.md and {page.name}: {sorted(shared)}"


# -- code blocks ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_code_block_says_what_it_is(page):
    for block in blocks(page):
        assert block.language in LANGUAGES, f"{block.where}: a ``` fence needs one of {LANGUAGES}"
        if block.language in ("python", "sh") and not block.runs:
            assert re.search(r"# not run: \S", block.code), f"{block.where}: say why it is not run"


def _bitkern_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(where, argv) of every `python -m bitkern ...` command in the page's sh and console blocks."""
    found = []
    for block in blocks(page):
        if block.language not in ("sh", "console"):
            continue
        for command in block.code.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", command.split(" #")[0]):
                words = shlex.split(part)
                if words[:3] == ["python", "-m", "bitkern"]:
                    found.append((block.where, words[3:]))
    return found


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_bitkern_command_in_the_docs_parses(page, monkeypatch):
    """Commands the tests do not run (console blocks) still name real subcommands and options."""
    import bitkern.__main__ as cli

    parse = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    for where, argv in _bitkern_commands(page):
        try:
            cli.main(argv)
        except SystemExit as error:
            pytest.fail(f"{where}: python -m bitkern {shlex.join(argv)} does not parse ({error})")
        except _Parsed:
            pass


@pytest.fixture(scope="module")
def docs_llama(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("docs-llama"))


def _environment(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python"
    if not python.exists():  # a script, not a symlink: a venv's interpreter reached by a link elsewhere is its base's
        python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
        python.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))


RUNNER = textwrap.dedent("""
    import json, sys
    namespace = {"__name__": "__main__"}
    for where, code in json.load(open(sys.argv[1])):
        print(f"--- {where}", flush=True)
        exec(compile(code, where, "exec"), namespace)
""")

PYTHON_PAGES = [page for page in PAGES if any(b.runs and b.language == "python" and not b.needs_vllm
                                              for b in blocks(page))]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_ids(PYTHON_PAGES))
def test_the_python_blocks_of_a_page_run(page, docs_llama, tmp_path):
    """A page's python blocks run in order in one fresh interpreter (in a scratch directory, the kernel cache the
    session's), with the example model names pointing at the tiny checkpoint."""
    names = placeholders(docs_llama, tmp_path)
    runnable = [(block.where, substitute(block.code, names)) for block in blocks(page)
                if block.runs and block.language == "python" and not block.needs_vllm]
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    (tmp_path / "runner.py").write_text(RUNNER)
    result = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
                            cwd=tmp_path, env=_environment(tmp_path), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


SH_PAGES = [page for page in PAGES if any(b.runs and b.language == "sh" for b in blocks(page))]


@pytest.fixture(scope="module")
def sh_cache(tmp_path_factory):
    """The kernel cache of the sh blocks: their own (they list, export and import a whole cache), shared by the
    pages (their prebuilds name the same kernels)."""
    return tmp_path_factory.mktemp("docs-sh-cache")


@pytest.mark.parametrize("page", SH_PAGES, ids=_ids(SH_PAGES))
def test_the_sh_blocks_of_a_page_run(page, docs_llama, sh_cache, tmp_path):
    names = placeholders(docs_llama, tmp_path)
    for block in blocks(page):
        if not (block.runs and block.language == "sh"):
            continue
        result = subprocess.run(["bash", "-e", "-c", substitute(block.code, names)], cwd=tmp_path,
                                env=dict(_environment(tmp_path), BITKERN_CACHE_DIR=str(sh_cache)),
                                capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert result.returncode == 0, f"{block.where}\n{result.stdout[-3000:]}{result.stderr[-6000:]}"
