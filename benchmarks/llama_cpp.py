"""bitkern against llama.cpp on one random-weight Llama model (hidden 2048, MLP 5632, 8 layers, 32 heads, 8 KV heads,
vocab 32000, untied output layer), in the same session: prompt processing of 128 and 512 tokens and generation of 64
tokens, 2 threads, each system's tokens/s next to the memory limit per generated token.  With --architecture moe
the model is a mixture of experts of Qwen3-MoE's shapes instead (MOE_CONFIG: 64 experts of 768, top-8, 8 layers),
whose memory limit counts the experts a token routes to (8 of 64 per layer), not all of them.

Recipe (CI does not run it; needs cmake, a C++ compiler and PyPI; everything built lands in --cache-dir, default
~/.cache/bitkern-llamacpp, never in the repository):

    python benchmarks/llama_cpp.py [--rounds 3] [--repetitions 2] [--cache-dir DIR] [--venv DIR] [--level LEVEL]
                                   [--architecture llama|moe] [--systems 'NAME;NAME'] [--out FILE]

1. llama.cpp: the source vendored in the sdist of llama-cpp-python (pinned: LLAMA_CPP_PYTHON; its CHANGELOG names
   the llama.cpp commit, passed to cmake as LLAMA_BUILD_COMMIT so that llama-bench reports it), built with
   GGML_NATIVE (-march=native: AVX-512, AVX512-BF16, VNNI on Zen 4), 2 jobs, targets llama-bench and llama-quantize;
   on a CPU with AMX twice, with and without AMX (NO_AMX says why).  With --level (e.g. x86-64-v3 on an AVX-512
   machine) one build with GGML_NATIVE off and exactly that level's instruction sets (GGML_LEVEL_OPTIONS, never
   AVX-512 below it), and bitkern's and torch's workers held to the level (benchmarks/torch_level.py).
2. The model: LlamaForCausalLM (or MixtralForCausalLM) with seed 0 in bf16, `save_pretrained` to <cache>/model
   (<cache>/model-moe), beside it a Llama-style
   byte-fallback BPE tokenizer of 32000 tokens made with the `tokenizers` library (the converter needs one).
3. GGUF: llama.cpp's convert_hf_to_gguf.py --outtype bf16, run in a virtual environment (--venv, default
   <cache>/convert-venv) holding the vendored requirements (torch pinned to this Python's version instead, the
   vendored gguf-py instead of PyPI's gguf); then llama-quantize to the types of the systems run (GGUF_TYPES: Q4_0
   with the output layer in Q6_K, its default, or in bf16 or Q8_0; Q4_K_M; Q8_0).
4. Rounds: llama-bench -t 2 -p 128,512 -n 0, then -p 0 -n 64, -r REPETITIONS per GGUF, interleaved with bitkern
   through transformers (one process per model, default environment, kernels prepared before the first round):
   prompt = one forward of 128 / 512 random tokens (cache on, logits of the last token only, as llama-bench and
   `generate` do); generation =
   `model.generate` greedy with a static KV cache and without an end-of-sequence token (as llama-bench), 65 new
   tokens after an 8-token prompt, timed from the first to the 65th new token with a stopping-criteria clock (64 decode steps, each with
   generate's own per-step work).  Every round also reads DRAM
   with the streaming probes of benchmarks/conftest.py and records the load average.  On a crowded machine (load
   above the 2 cores) wall times mostly measure waits for a core, so each round also counts generation at 1 thread
   in tokens per CPU second: llama-bench -t 1 -p 0 -n 64 (CPU time of a run of 1 + R repetitions less that of a run
   of 1, from getrusage of the children), bitkern with torch.set_num_threads(1) and time.process_time per step;
   its memory limit uses the GB per CPU second that one thread streams.
   Memory limit per generated token = (bytes of every tensor read per token: all layers, final norm and output
   layer, not the embedding table, of which one row is read; plus the KV cache at the mean context of the 64
   steps) / the round's DRAM bandwidth; fraction = tokens/s / that limit.  Medians over rounds; ratios per round.
Results: printed, and written to benchmarks/results/llama_cpp.md (llama_cpp_moe.md, ..._LEVEL.md; the figures drawn
from it redrawn) with the llama.cpp version and the commands, or to --out FILE (nothing redrawn).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import plots
import torch_level
from llama_threads import _environment
from provenance import header

LLAMA_CPP_PYTHON = "0.3.36"
# On a CPU with AMX, -march=native compiles ggml's AMX kernels: generation runs on them (weights repacked for AMX;
# measured on a 2-core Xeon VM, Q4_0 tg64 82 t/s, 44 without them), but the first prompt faults in this VM
# (ldtilecfg, a general protection fault; ggml-org/llama.cpp PR 26954 fixes the tile configuration and permission).
# There prompts run on a second build without them (GCC's explicit -mno-* outlast -march=native), its AVX-512
# VNNI/BF16 kernels (pp128 392 t/s; the AMX build with its repacking turned off, --repack 0, ran 276).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
RESULTS = Path(__file__).parent / "results"
# ggml's instruction-set options (cmake GGML_<option>) for each bitkern level it can be built for without
# -march=native, so an AVX-512 machine measures llama.cpp's AVX2 code beside bitkern's (--level); never above it.
_GGML_V3 = ("AVX", "AVX2", "FMA", "F16C", "BMI2")
GGML_LEVEL_OPTIONS = {
    "x86-64-v3": _GGML_V3,
    "avx-vnni": (*_GGML_V3, "AVX_VNNI"),
    "avx512": (*_GGML_V3, "AVX512"),
    "avx512-vnni": (*_GGML_V3, "AVX512", "AVX512_VNNI"),
    "avx512-bf16": (*_GGML_V3, "AVX512", "AVX512_VNNI", "AVX512_BF16"),
}
GGML_OPTIONS = tuple(dict.fromkeys(option for options in GGML_LEVEL_OPTIONS.values() for option in options))
CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
              num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
# A mixture of experts of Qwen3-MoE's shape family (Qwen3-30B-A3B's hidden size, 64 experts of 768, top-8; 8
# layers): 4.8 GB of bf16 experts, far beyond the last-level cache, of which a token reads its 8 of 64 per layer.
# Mixtral's architecture, not Qwen3-MoE's: llama.cpp's converter reads a Qwen model's vocabulary only from a
# tokenizer whose pre-tokenizer it knows by hash, which the benchmark's made-up tokenizer is not; it reads a
# Mixtral's as a Llama's.  The experts and their routing (softmax over the top 8) are the same computation.
MOE_CONFIG = dict(hidden_size=2048, intermediate_size=768, num_local_experts=64, num_experts_per_tok=8,
                  num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                  max_position_embeddings=4096, tie_word_embeddings=False)
# --architecture -> (transformers model_type, config, the model directory and GGUF files' prefix in the cache)
ARCHITECTURES = {"llama": ("llama", CONFIG, "model", "llama-"),
                 "moe": ("mixtral", MOE_CONFIG, "model-moe", "moe-")}
PROMPTS, GENERATED, GENERATE_PROMPT = (128, 512), 64, 8
THREADS = 2
# generate's options for every transformers model: a static KV cache (measured at 1 thread: ~6 ms less per decode
# step of bitkern int4 than the default DynamicCache, benchmarks/results/archive/llama_decode_profile_cpu.md)
GENERATE_OPTIONS = {"cache_implementation": "static"}
# GGUF name -> llama-quantize options and type (None: the converter's bf16 file itself)
GGUF_TYPES = {"Q4_0 (output Q6_K)": ["Q4_0"], "Q4_0, output bf16": ["--output-tensor-type", "bf16", "Q4_0"],
              "Q4_0, output Q8_0": ["--output-tensor-type", "q8_0", "Q4_0"], "Q4_K_M": ["Q4_K_M"], "Q8_0": ["Q8_0"],
              "bf16": None}
# bitkern model name -> (layers' type, group size, quantize_model's output_layer, activation_quant) or None (None:
# torch bf16).  output_layer "auto": the bf16 output layer as it is, on bitkern's kernels; "int8": quantized (group
# size the same).  activation_quant "int8" ("a8"): the quantized layers multiply int8 activations, per 32 inputs, as
# llama.cpp's Q4_0 and Q8_0 multiply Q8_0 activations
BITKERN = {"bitkern int4 g128": ("int4", 128, "auto", "none"),
           "bitkern int4 g128, output int8 g128": ("int4", 128, "int8", "none"),
           "bitkern nf4 g64": ("nf4", 64, "auto", "none"),
           "bitkern int8 g128, output int8 g128": ("int8", 128, "int8", "none"),
           "bitkern int4 g128, compiled": ("int4", 128, "auto", "none"),
           "bitkern int4 g128 a8": ("int4", 128, "auto", "int8"),
           "bitkern int4 g128 a8, output int8 g128": ("int4", 128, "int8", "int8"),
           "bitkern int8 g128 a8, output int8 g128": ("int8", 128, "int8", "int8"),
           "bitkern int4 g128 a8, compiled": ("int4", 128, "auto", "int8"),
           "bitkern int4 g128 a8, compiled, C++ wrapper": ("int4", 128, "auto", "int8"),
           "bitkern int4 g128 a8, bitkern.compile": ("int4", 128, "auto", "int8"),
           "bitkern int4 g128, bitkern.compile": ("int4", 128, "auto", "none"),
           "bitkern int4 g128 a8, output int8 g128, compiled": ("int4", 128, "int8", "int8"),
           "bitkern int8 g128 a8, output int8 g128, compiled": ("int8", 128, "int8", "int8"),
           "torch bf16": None}
# bitkern models decode with bitkern's attention (`use_grouped_attention`: the decode-attention kernel); these also
# run as a user compiling the model would: `model.forward = torch.compile(model.forward, dynamic=False)` (a graph
# per shape, compiled while the worker prepares its kernels: prompts and decode steps alike go through it); with
# ", C++ wrapper", Inductor's C++ wrapper (options={"cpp_wrapper": True}) runs the compiled graph instead of Python;
# ", bitkern.compile" compiles it as bitkern recommends: `bitkern.compile(model, dynamic=False)` (the C++ wrapper, and
# no guards on the model's modules)
COMPILED = tuple(name for name in BITKERN if ", compiled" in name)
BITKERN_COMPILED = tuple(name for name in BITKERN if name.endswith(", bitkern.compile"))
COMPILE_OPTIONS = {name: {"cpp_wrapper": True} for name in COMPILED if name.endswith(", C++ wrapper")}
# same-output-precision pairs compared round by round: (bitkern model, llama.cpp type or the bf16 model in torch);
# llama.cpp's Q8_0 keeps its output layer in Q8_0, Q4_0 puts it in Q6_K
PAIRS = [("bitkern int4 g128", "Q4_0, output bf16"), ("bitkern int4 g128, compiled", "Q4_0, output bf16"),
         ("bitkern int4 g128, output int8 g128", "Q4_0 (output Q6_K)"), ("bitkern nf4 g64", "Q4_0, output bf16"),
         ("bitkern int8 g128, output int8 g128", "Q8_0"),
         ("bitkern int4 g128 a8", "Q4_0, output bf16"), ("bitkern int4 g128 a8, compiled", "Q4_0, output bf16"),
         ("bitkern int4 g128 a8, compiled, C++ wrapper", "Q4_0, output bf16"),
         ("bitkern int4 g128 a8, bitkern.compile", "Q4_0, output bf16"),
         ("bitkern int4 g128, bitkern.compile", "Q4_0, output bf16"),
         ("bitkern int4 g128, bitkern.compile", "torch bf16"),
         ("bitkern int4 g128 a8, output int8 g128", "Q4_0, output Q8_0"),
         ("bitkern int4 g128 a8, output int8 g128, compiled", "Q4_0, output Q8_0"),
         ("bitkern int4 g128 a8, output int8 g128", "Q4_0 (output Q6_K)"),
         ("bitkern int8 g128 a8, output int8 g128", "Q8_0"),
         ("bitkern int8 g128 a8, output int8 g128, compiled", "Q8_0"), ("torch bf16", "bf16"),
         ("bitkern int4 g128", "torch bf16"), ("bitkern int4 g128 a8", "torch bf16")]
CPU_TEST = f"tg{GENERATED}, 1 thread, per CPU s"  # tokens per CPU second: a crowded machine's waits do not count
TESTS = [f"pp{n}" for n in PROMPTS] + [f"tg{GENERATED}", CPU_TEST]
LEVEL_ENVIRONMENT: dict[str, str] = {}  # with --level: what holds bitkern and torch to it (`torch_level`)
ARCHITECTURE = ["llama"]  # --architecture: the model benchmarked
COMMANDS: list[str] = []  # every command of the recipe, in order, whether it ran now or its output was cached


def run(command: list, **options) -> subprocess.CompletedProcess:
    """Run and record `command`; its output is captured (shown only should it fail) unless `options` say otherwise."""
    COMMANDS.append(shlex.join(str(part) for part in command))
    print(f"$ {COMMANDS[-1]}", file=sys.stderr, flush=True)
    options = {"capture_output": True, "text": True} | options
    result = subprocess.run([str(part) for part in command], **options)
    if result.returncode != 0:
        raise RuntimeError(f"{COMMANDS[-1]} failed ({result.returncode}):\n{(result.stdout or '')[-3000:]}"
                           f"{(result.stderr or '')[-3000:]}")
    return result


def produce(path: Path, command: list, output: Path | None = None) -> Path:
    """Run `command` (which writes `output`, default path + '.part') unless `path` exists; then move the output in
    place, so that an interrupted step never leaves a file that looks finished.  The command is recorded either way."""
    output = output or path.with_name(path.name + ".part")
    if path.exists():
        COMMANDS.append(shlex.join(str(part) for part in command) + "   # cached")
        return path
    run(command)
    output.rename(path)
    return path


# -- llama.cpp: source, build, converter -------------------------------------------------------------------------
def llama_cpp_source(cache: Path) -> tuple[Path, str]:
    """The llama.cpp tree vendored in llama-cpp-python's sdist, and its commit (from the sdist's CHANGELOG)."""
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    produce(sdist, [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", cache,
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], output=sdist)
    root = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    unpacked = cache / "unpacking"
    unpacked.mkdir(exist_ok=True)
    produce(root, ["tar", "xzf", sdist, "-C", unpacked], output=unpacked / root.name)
    changelog = (root / "CHANGELOG.md").read_text()
    section = changelog.split(f"## [{LLAMA_CPP_PYTHON}]", 1)[1].split("\n## [", 1)[0]
    commit = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    if commit is None:
        raise RuntimeError(f"the CHANGELOG of llama-cpp-python {LLAMA_CPP_PYTHON} names no llama.cpp commit")
    return root / "vendor" / "llama.cpp", commit.group(1)


def build_llama_cpp(source: Path, commit: str, cache: Path, level: str | None = None) -> tuple[Path, Path]:
    """Configure and build llama-bench and llama-quantize (incremental: quick when up to date); the bin folders of
    the builds that run prompts and generation (one build, or on an AMX CPU two: see NO_AMX).  With `level` (a bitkern
    instruction-set level) one build for exactly that level's instruction sets (GGML_LEVEL_OPTIONS), else -march=native."""
    amx = level is None and "amx_tile" in Path("/proc/cpuinfo").read_text().split()

    def build(name: str, flags: str) -> Path:
        folder = cache / name
        if level is None:
            isa = ["-DGGML_NATIVE=ON"]
        else:
            isa = ["-DGGML_NATIVE=OFF", *(f"-DGGML_{option}={'ON' if option in GGML_LEVEL_OPTIONS[level] else 'OFF'}"
                                          for option in GGML_OPTIONS)]
        run(["cmake", "-S", source, "-B", folder, "-DCMAKE_BUILD_TYPE=Release", *isa,
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             f"-DLLAMA_BUILD_COMMIT={commit}", f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"])
        run(["cmake", "--build", folder, "-j", "2", "--target", "llama-bench", "llama-quantize"])
        return folder / "bin"

    name = f"build-{LLAMA_CPP_PYTHON}" + (f"-{level}" if level else "")
    prompts = build(name, NO_AMX if amx else "")
    return prompts, build(f"build-{LLAMA_CPP_PYTHON}-amx", "") if amx else prompts


def matmul_harness(cache: Path, level: str | None = None) -> Path:
    """benchmarks/ggml_mul_mat.c compiled against the ggml of the llama.cpp build for `level` (built if missing):
    the program that times one MUL_MAT at any shape (see there)."""
    source, commit = llama_cpp_source(cache)
    bin_dir = build_llama_cpp(source, commit, cache, level)[0]
    harness = bin_dir / "ggml_mul_mat"
    code = Path(__file__).with_name("ggml_mul_mat.c")
    if not harness.exists() or harness.stat().st_mtime < code.stat().st_mtime:
        run(["cc", "-O2", "-o", harness, code, f"-I{source / 'ggml' / 'include'}", f"-L{bin_dir}", "-lggml",
             "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{bin_dir}"])
    return harness


def converter_python(source: Path, venv: Path) -> Path:
    """The Python of a virtual environment with convert_hf_to_gguf.py's requirements (made once)."""
    python = venv / "bin" / "python"
    done = venv / ".requirements-installed"
    if done.exists():
        return python
    import torch

    requirements = [f"torch=={torch.__version__.split('+')[0]}", source / "gguf-py"]
    vendored = _requirement_lines(source / "requirements" / "requirements-convert_hf_to_gguf.txt")
    requirements += [line for line in vendored if not line.startswith(("torch", "gguf"))]
    run([sys.executable, "-m", "venv", venv])
    run([python, "-m", "pip", "install", "-q", *requirements])
    done.touch()
    return python


def _requirement_lines(path: Path) -> list[str]:
    """The requirement specifiers of a pip requirements file, following its -r includes (options and comments out)."""
    lines = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            lines += _requirement_lines(path.parent / line[2:].strip())
        elif line and not line.startswith("-"):
            lines.append(line)
    return lines


# -- the model ---------------------------------------------------------------------------------------------------
def make_model(directory: Path, architecture: str = "llama") -> Path:
    """The random-weight model of `architecture` (ARCHITECTURES; seed 0, bf16) and a tokenizer, saved to `directory`
    (once)."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, config, _, _ = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config, bos_token_id=1,
                                                                  eos_token_id=2), dtype=torch.bfloat16)
    partial = directory.with_name(directory.name + ".part")
    model.save_pretrained(partial)
    save_tokenizer(partial, config["vocab_size"])
    partial.rename(directory)
    return directory


def read_per_token(sizes: dict[str, int], config: dict) -> float:
    """Bytes of the tensors `sizes` (name -> bytes) a generated token reads: all but the embedding table (one row of
    it is read), the experts' tensors (named "_exps" in GGUF files, ".experts." in transformers models) at the share
    of them one token routes to (top-k of the experts)."""
    share = config.get("num_experts_per_tok", 1) / (config.get("num_local_experts") or config.get("num_experts") or 1)
    return sum(size * (share if "_exps" in name or ".experts." in name else 1) for name, size in sizes.items()
               if name not in ("token_embd.weight", "model.embed_tokens.weight"))


def save_tokenizer(directory: Path, size: int) -> None:
    """A Llama-style tokenizer of `size` tokens (<unk> <s> </s>, 256 byte tokens for byte fallback, an alphabet,
    then merges of growing length), as tokenizer.json + tokenizer_config.json: no trained tokenizer is at hand,
    and llama.cpp's converter reads the vocabulary of one (the benchmark's tokens are random ids)."""
    from itertools import product

    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])}
    alphabet = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,")
    vocab.update({c: len(vocab) + i for i, c in enumerate(alphabet)})
    merges, longest = [], alphabet
    while len(vocab) < size:
        longer = [left + right for left, right in product(longest, alphabet) if left + right not in vocab]
        for token in longer[:size - len(vocab)]:
            merges.append((token[:-1], token[-1]))
            vocab[token] = len(vocab)
        longest = longer
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False}))


def make_ggufs(model: Path, source: Path, bin_dir: Path, python: Path, cache: Path, types, prefix: str = "llama-"
               ) -> dict[str, Path]:
    """The model in the GGUF `types` (names of GGUF_TYPES; converted to bf16, quantized from it; each made once), as
    files named with `prefix`."""
    bf16 = cache / "gguf" / f"{prefix}bf16.gguf"
    bf16.parent.mkdir(exist_ok=True)
    partial = bf16.with_name(bf16.name + ".part")
    produce(bf16, [python, source / "convert_hf_to_gguf.py", model, "--outtype", "bf16", "--outfile", partial])
    files = {}
    for name in types:
        arguments = GGUF_TYPES[name]
        if arguments is None:
            files[name] = bf16
            continue
        path = bf16.with_name(prefix + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") + ".gguf")
        partial = path.with_name(path.name + ".part")
        files[name] = produce(path, [bin_dir / "llama-quantize", *arguments[:-1], bf16, partial, arguments[-1],
                                     THREADS])
    return files


def gguf_tensor_bytes(path: Path, source: Path, python: Path) -> dict[str, int]:
    """Bytes of each tensor of a GGUF file (read with the vendored gguf-py)."""
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); from gguf import GGUFReader; "
              "print(json.dumps({t.name: int(t.n_bytes) for t in GGUFReader(sys.argv[2]).tensors}))")
    result = subprocess.run([str(python), "-c", script, str(source / "gguf-py"), str(path)], check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout)


def llama_bench(builds: tuple[Path, Path], gguf: Path, repetitions: int) -> tuple[dict[str, float], dict]:
    """tokens/s of each test (llama-bench's mean over `repetitions`; prompts with the first build, generation with
    the second) and the JSON record of the generation test."""
    records = []
    for bin_dir, prompts, generated in ((builds[0], ",".join(map(str, PROMPTS)), 0), (builds[1], 0, GENERATED)):
        result = run([bin_dir / "llama-bench", "-m", gguf, "-t", THREADS, "-p", prompts, "-n", generated,
                      "-r", repetitions, "-o", "json"], env=_environment("default"))
        records += json.loads(result.stdout)
    speeds = {(f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"): r["avg_ts"] for r in records}
    return speeds | {CPU_TEST: generated_per_cpu_second(builds[1], gguf, repetitions)}, records[-1]


def generated_per_cpu_second(bin_dir: Path, gguf: Path, repetitions: int) -> float:
    """Tokens generated per CPU second by llama-bench at 1 thread: the CPU time of a run of 1 + repetitions
    generations less that of a run of 1 (the same loading and warm-up), over the extra tokens."""
    cpu = []
    for runs in (1, 1 + repetitions):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run([bin_dir / "llama-bench", "-m", gguf, "-t", 1, "-p", 0, "-n", GENERATED, "-r", runs, "-o", "json"],
            env=_environment("default"))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return repetitions * GENERATED / (cpu[1] - cpu[0])


# -- bitkern through transformers: one model per process ----------------------------------------------------------
def load_model(model_dir, name: str, fused: bool = True):
    """The saved model in bf16 with bitkern's quantization `name` of BITKERN applied and, when `fused`, the fusions
    the cost model prices as wins for one row (`bitkern.fuse` without example inputs: q/k/v as one GEMM, gate/up
    with the SwiGLU epilogue; decided by the model, not by timings a crowded machine would sway), bitkern's attention
    (`use_grouped_attention`: its decode-attention kernel), compiled for the names in COMPILED; kernels not yet
    prepared."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    if BITKERN[name] is not None:
        import bitkern

        dtype, group, output_layer, activation_quant = BITKERN[name]
        bitkern.quantize_model(model, dtype, group_size=group, compute_dtype=torch.bfloat16, output_layer=output_layer,
                               activation_quant=activation_quant)
        if fused:
            bitkern.fuse(model)
        from bitkern.integration.hf import use_grouped_attention

        use_grouped_attention(model)
        if name in COMPILED:
            model.forward = torch.compile(model.forward, dynamic=False, options=COMPILE_OPTIONS.get(name))
        if name in BITKERN_COMPILED:
            bitkern.compile(model, dynamic=False)
    return model


def generation_steps(model, prompt, new_tokens: int, clock=time.perf_counter, **options) -> list[float]:
    """Seconds of each decode step of a greedy `model.generate` of `new_tokens` tokens after `prompt` (the first
    new token comes from the prompt's forward: new_tokens - 1 values), each with generate's own per-step work;
    clocked (by `clock`) in a stopping criterion that never stops.  No end-of-sequence token (eos_token_id=None),
    as llama-bench generates: min_new_tokens would keep generation going too, but its logits processor and the
    end-of-sequence check run torch.isin over the vocabulary every step (measured ~1-3 ms per step at 1 thread)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    times = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            times.append(clock())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new_tokens,
                   eos_token_id=None, stopping_criteria=StoppingCriteriaList([Clock()]),
                   pad_token_id=model.config.eos_token_id, **options)
    return [b - a for a, b in zip(times, times[1:])]


def worker(name: str, model_dir: str, repetitions: int) -> None:
    import torch
    from transformers import DynamicCache

    model = load_model(model_dir, name)
    random = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(0, model.config.vocab_size, (1, n), generator=random) for n in PROMPTS}
    short = torch.randint(0, model.config.vocab_size, (1, GENERATE_PROMPT), generator=random)

    def prompt(n: int) -> float:
        start = time.perf_counter()
        model(prompts[n], past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        return n / (time.perf_counter() - start)

    def generate() -> float:
        return GENERATED / sum(generation_steps(model, short, GENERATED + 1, **GENERATE_OPTIONS))

    def generate_one_thread() -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return GENERATED / sum(generation_steps(model, short, GENERATED + 1, clock=time.process_time,
                                                    **GENERATE_OPTIONS))
        finally:
            torch.set_num_threads(threads)

    tests = {f"pp{n}": (lambda n=n: prompt(n)) for n in PROMPTS} | {f"tg{GENERATED}": generate,
                                                                   CPU_TEST: generate_one_thread}
    with torch.inference_mode():
        for test in tests.values():  # prepares the kernels of every size (tuned, built or loaded: never timed)
            test()
        sizes = {name: t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]}
        print(json.dumps({"ready": True, "bytes": read_per_token(sizes, model.config.to_dict())}), flush=True)
        for line in sys.stdin:
            print(json.dumps({"tokens_per_s": [tests[line.strip()]() for _ in range(repetitions)]}), flush=True)


class Worker:
    """A bitkern model in a process of its own (default environment), answering one test per request."""

    def __init__(self, name: str, model_dir: Path, repetitions: int):
        self.process = subprocess.Popen([sys.executable, __file__, "--worker", name, "--model", str(model_dir),
                                         "--repetitions", str(repetitions)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True,
                                        env={**_environment("default"), **LEVEL_ENVIRONMENT})
        hello = json.loads(self.process.stdout.readline())
        if not hello.get("ready"):
            raise RuntimeError(f"worker {name} did not start")
        self.weight_bytes = hello["bytes"]

    def speeds(self) -> dict[str, float]:
        """Median tokens/s of each test."""
        speeds = {}
        for test in TESTS:
            self.process.stdin.write(test + "\n")
            self.process.stdin.flush()
            speeds[test] = statistics.median(json.loads(self.process.stdout.readline())["tokens_per_s"])
        return speeds

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# -- driver ------------------------------------------------------------------------------------------------------
def kv_bytes_per_token() -> int:
    """K and V of one token over all layers, 16-bit (llama.cpp's f16 cache, transformers' bf16 one)."""
    config = ARCHITECTURES[ARCHITECTURE[0]][1]
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=2, help="runs of each test per system and round")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "bitkern-llamacpp")
    parser.add_argument("--venv", type=Path, default=None, help="converter venv (default <cache>/convert-venv)")
    parser.add_argument("--level", choices=list(GGML_LEVEL_OPTIONS), default=None,
                        help="an instruction-set level below the host's: llama.cpp built for exactly it, bitkern and "
                             "torch held to it (default: the host's own, llama.cpp with -march=native)")
    parser.add_argument("--architecture", choices=list(ARCHITECTURES), default="llama",
                        help="the model: the dense Llama (default) or the mixture of experts (MOE_CONFIG)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the results to this file instead of benchmarks/results/ (figures not redrawn)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--systems", default=";".join([*GGUF_TYPES, *BITKERN]),
                        help="the systems to run, ';'-separated (default: all of them); a quick rerun of one pair: "
                             "--systems 'bitkern int4 g128;Q4_0, output bf16'")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.repetitions)
    chosen = [name.strip() for name in args.systems.split(";")]
    unknown = [name for name in chosen if name not in GGUF_TYPES and name not in BITKERN]
    if unknown:
        parser.error(f"--systems: {unknown} are not known; known: {[*GGUF_TYPES, *BITKERN]}")
    cache = args.cache_dir.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if args.level:
        LEVEL_ENVIRONMENT.update(torch_level.environment(args.level))
    source, commit = llama_cpp_source(cache)
    builds = build_llama_cpp(source, commit, cache, args.level)
    python = converter_python(source, args.venv or cache / "convert-venv")
    ARCHITECTURE[0] = args.architecture
    _, config, directory, prefix = ARCHITECTURES[args.architecture]
    model = make_model(cache / directory, args.architecture)
    ggufs = make_ggufs(model, source, builds[1], python, cache, [name for name in GGUF_TYPES if name in chosen],
                       prefix)
    weight_bytes = {name: read_per_token(gguf_tensor_bytes(path, source, python), config)
                    for name, path in ggufs.items()}
    workers = {}
    for name in [name for name in BITKERN if name in chosen]:
        print(f"preparing {name} ...", file=sys.stderr, flush=True)
        workers[name] = Worker(name, model, args.repetitions)
        weight_bytes[name] = workers[name].weight_bytes
    import torch
    from conftest import best_read_gbs, read_probes

    probes = read_probes()

    def bandwidths() -> dict:
        """DRAM GB/s now (2 threads, wall clock) and GB per CPU second of one thread (robust to a crowded CPU)."""
        gbs = best_read_gbs(*probes, reads=5)
        torch.set_num_threads(1)
        try:
            return {"gbs": gbs, "cpu": best_read_gbs(*probes, reads=5, clock=time.process_time)}
        finally:
            torch.set_num_threads(THREADS)

    order = [system for pair in itertools.zip_longest(GGUF_TYPES, BITKERN) for system in pair if system in chosen]
    samples = {system: {test: [] for test in TESTS} for system in order}
    rounds, info = [], {}
    for round_ in range(args.rounds):
        rounds.append({"load": os.getloadavg()[0], **bandwidths()})
        for system in order:
            if system in workers:
                speeds = workers[system].speeds()
            else:
                speeds, info = llama_bench(builds, ggufs[system], args.repetitions)
            for test in TESTS:
                samples[system][test].append(speeds[test])
        rounds[-1] |= {key: max(value, rounds[-1][key]) for key, value in bandwidths().items()}
        print(f"round {round_ + 1}/{args.rounds}: {rounds[-1]}", file=sys.stderr, flush=True)
        (cache / "last_run.json").write_text(json.dumps({"samples": samples, "weight_bytes": weight_bytes,
                                                          "rounds": rounds, "info": info}))  # kept should a round fail
    for process in workers.values():
        process.close()
    text = report(samples, weight_bytes, rounds, info, commit, args)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    name = "llama_cpp" + (f"_{args.architecture}" if args.architecture != "llama" else "") + \
        (f"_{args.level}" if args.level else "")
    path = args.out or RESULTS / f"{name}.md"
    path.write_text(text + "\n")
    if args.out is None:
        plots.render(path)


def memory_limits(system: str, weight_bytes: dict, rounds: list, bandwidth: str) -> tuple[float, list[float]]:
    """Bytes read per generated token, and the round-by-round memory limit in tokens/s (bandwidth "gbs") or tokens
    per CPU second at 1 thread ("cpu")."""
    context = (GENERATED - 1) / 2 if system in GGUF_TYPES else GENERATE_PROMPT + (GENERATED + 1) / 2
    per_token = weight_bytes[system] + context * kv_bytes_per_token()
    return per_token, [r[bandwidth] * 1e9 / per_token for r in rounds]


def report(samples, weight_bytes, rounds, info, commit, args) -> str:
    tg = f"tg{GENERATED}"
    loads = ", ".join(f"{r['load']:.1f}" for r in rounds)
    bandwidths = ", ".join(f"{r['gbs']:.1f}" for r in rounds)
    cpu_bandwidths = ", ".join(f"{r['cpu']:.1f}" for r in rounds)
    lines = [header(), "",
             f"llama.cpp {commit} (vendored in llama-cpp-python {LLAMA_CPP_PYTHON}; llama-bench build_commit "
             f"{info.get('build_commit')}, {info.get('cpu_info')}, backends {info.get('backends')}, flash_attn "
             f"{info.get('flash_attn')}, KV {info.get('type_k')}/{info.get('type_v')}, n_ubatch "
             f"{info.get('n_ubatch')}) "
             f"against bitkern through transformers, {THREADS} threads, "
             + (f"all held to the {args.level} level ({LEVEL_ENVIRONMENT})." if args.level else "default environment."),
             f"Model: {ARCHITECTURES[args.architecture][0]} {ARCHITECTURES[args.architecture][1]}, random weights "
             f"(seed 0).",
             f"Medians over {args.rounds} interleaved rounds of {args.repetitions} runs; load average (1 min) per "
             f"round: {loads}; DRAM read GB/s per round (best of the streaming probes, {THREADS} threads): "
             f"{bandwidths}; GB read per CPU second by one thread: {cpu_bandwidths}.", "",
             f"| system | pp{PROMPTS[0]} t/s | pp{PROMPTS[1]} t/s | {tg} t/s | {tg} at 1 thread, t per CPU s | MB "
             f"read per generated token | memory limit t/s | {tg} / limit | 1 thread: limit t per CPU s | 1 thread: "
             f"fraction |", "|---|---|---|---|---|---|---|---|---|---|"]
    for system, tests in samples.items():
        cells = [f"{statistics.median(tests[test]):.1f}" for test in TESTS]
        for test, bandwidth in ((tg, "gbs"), (CPU_TEST, "cpu")):
            per_token, limits = memory_limits(system, weight_bytes, rounds, bandwidth)
            fraction = statistics.median(speed / limit for speed, limit in zip(tests[test], limits))
            cells += [f"{statistics.median(limits):.0f}", f"{fraction:.2f}"]
        lines.append(f"| {system} | {' | '.join(cells[:4])} | {per_token / 1e6:.1f} | {' | '.join(cells[4:])} |")
    lines += ["", "Same output-layer precision, bitkern / llama.cpp (or torch bf16), median of per-round ratios:", "",
              "| bitkern | llama.cpp | " + " | ".join(TESTS) + " |", "|---|---|" + "---|" * len(TESTS)]
    for ours, theirs in [(a, b) for a, b in PAIRS if a in samples and b in samples]:
        ratios = [statistics.median(a / b for a, b in zip(samples[ours][test], samples[theirs][test]))
                  for test in TESTS]
        lines.append(f"| {ours} | {theirs} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    lines += ["", "Commands (each once; the cached ones made their output in an earlier run):", "", "```",
              *dict.fromkeys(COMMANDS), "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
