"""Shared test helpers: compiling small TVM expressions for the host CPU; kernels chosen by the cost model
(profiling top-k candidates per kernel would multiply the suite's compile time; test_tuner covers it)."""

import os

import pytest

os.environ.setdefault("BITKERN_TUNING", "model")


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_dir(tmp_path_factory):
    """A fresh disk cache for the session: kernels are compiled once per run (the cold path) and reused."""
    path = tmp_path_factory.mktemp("bitkern-cache")
    previous = os.environ.get("BITKERN_CACHE_DIR")
    os.environ["BITKERN_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("BITKERN_CACHE_DIR", None)
    else:
        os.environ["BITKERN_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def llvm_target():
    """A TVM LLVM target for this machine (the host's triple and CPU, as LLVM detects them)."""
    import tvm
    from tvm.target import codegen

    return tvm.target.Target({"kind": "llvm", "mtriple": codegen.llvm_get_system_triple(),
                              "mcpu": codegen.llvm_get_system_cpu()})


@pytest.fixture(scope="session")
def build_elementwise(llvm_target):
    """Compile `out[i] = expr(inputs..., i)` over 1-D tensors and return a callable on torch tensors."""
    import tvm
    from tvm import te

    def build(make_expr, input_specs, out_dtype):
        n = te.var("n")
        inputs = [te.placeholder(shape if shape else (n,), dtype, name=f"in{i}")
                  for i, (dtype, shape) in enumerate(input_specs)]
        out = te.compute((n,), lambda i: make_expr(*inputs, i), name="out")
        func = te.create_prim_func([*inputs, out])
        return tvm.compile(tvm.IRModule({"main": func}), target=llvm_target)["main"]

    return build
