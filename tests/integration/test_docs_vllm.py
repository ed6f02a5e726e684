"""The docs' python blocks that import vllm, run as written in the vLLM test environment (see conftest.py), on the
tiny Llama of the docs tests (tests/docs_pages.py) with a tokenizer, since the examples pass prompts as text."""

import subprocess

import pytest

from tests.docs_pages import PAGES, ROOT, blocks, build_tiny_llama, placeholders, substitute
from tests.integration.conftest import USER_TOPOLOGY

VLLM_BLOCKS = [block for page in PAGES for block in blocks(page) if block.runs and block.needs_vllm]
RUN_TIMEOUT_S = 15 * 60


@pytest.mark.parametrize("block", VLLM_BLOCKS, ids=[block.where for block in VLLM_BLOCKS])
def test_a_vllm_example_runs(block, vllm_env, tmp_path):
    python, env = vllm_env
    llama = build_tiny_llama(tmp_path / "llama")
    script = tmp_path / "example.py"
    script.write_text(substitute(block.code, placeholders(llama, tmp_path)))
    result = subprocess.run([str(python), str(script)], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(env, TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1",
                                     **USER_TOPOLOGY),
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{block.where}\n{result.stdout[-3000:]}{result.stderr[-6000:]}"
    assert result.stdout.strip(), "the example prints the generated text"


def test_the_vllm_examples_are_found():
    assert [block.page.relative_to(ROOT).as_posix() for block in VLLM_BLOCKS] == ["docs/vllm.md"]
