"""What the documentation tests share: the pages, their fenced code blocks, the names the examples use for
models and what the tests put in their place, and the tiny checkpoint those names point at.

The conventions (see docs/architecture.md, "Documentation"):
- ```python blocks run, as written, in order, one interpreter per page (a block may use what an earlier block of
  its page defined); a block whose first line holds `# not run` is exempt and says why there.  Blocks that import
  vllm run in the vLLM test environment (tests/integration/test_docs_vllm.py), the others here.
- ```sh blocks run line by line (bash -e) in a scratch directory, `python` being this interpreter.
- ```console blocks are commands the tests do not run (installs, servers, the GPU machine's side); every
  `python -m bitkern ...` command in them must still parse with bitkern's command line.
- ```text blocks are output.
- Model names: PLACEHOLDERS maps each name the examples use to what the tests substitute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "sh", "console", "text")
NOT_RUN = "# not run"
FORMATS = ROOT / "tests" / "fixtures" / "formats"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str

    @property
    def runs(self) -> bool:
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        return self.language in ("python", "sh") and NOT_RUN not in first

    @property
    def needs_vllm(self) -> bool:
        return bool(re.search(r"^\s*(from|import) vllm\b", self.code, re.M))

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page (``` fences at the start of a line)."""
    found, opened, body = [], None, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            if opened is None:
                opened, body = (number, line[3:].strip()), []
            else:
                found.append(Block(page, opened[0], opened[1], "\n".join(body) + "\n"))
                opened = None
        elif opened is not None:
            body.append(line)
    assert opened is None, f"{page}: the code block opened at line {opened[0]} is never closed"
    return found


def prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    text, inside = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            text.append(line)
    return "\n".join(text)


def placeholders(tiny_llama: Path, scratch: Path) -> dict[str, str]:
    """Each model or path name the examples use -> what the tests run them with (longest names first)."""
    names = {
        "path/to/llama-gptq-4bit": str(FORMATS / "gptq_4bit_sym"),
        "path/to/float-checkpoint": str(tiny_llama),
        "path/to/llama": str(tiny_llama),
        "path/to/export": str(scratch / "export"),
    }
    return dict(sorted(names.items(), key=lambda item: -len(item[0])))


def substitute(code: str, names: dict[str, str]) -> str:
    for name, value in names.items():
        code = code.replace(name, value)
    return code


def build_tiny_llama(path: Path) -> Path:
    """A Llama with random weights as the integration tests build it (2 layers, grouped-query attention, float32;
    tests/integration/conftest.py), saved with a byte-level BPE tokenizer trained on a few sentences, so that the
    examples' `AutoTokenizer.from_pretrained` and string prompts work offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["The capital of France is Paris.", "bitkern stores weights in few bits."] * 8,
                                  trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def support_matrix() -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the README's support matrix: the table under "## What runs where"."""
    text = README.read_text()
    section = text.split("## What runs where", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return cells[0], [row for row in cells[2:]]
