"""What the kit's ncu step profiles (`python -m bitkern.gpukit.ncu_target`, on a GPU, with the kit's cache): the
tuned benchmark kernels at `matrix.NCU_KERNELS`, each called once on random weights."""

from __future__ import annotations

import torch

from .. import pack, quantize
from .matrix import NCU_KERNELS, bench_specs


def main() -> None:
    specs = {spec.weight_dtype: spec for spec, _ in bench_specs()}
    for name, n, k, m in NCU_KERNELS:
        spec = specs[name]
        weight = torch.randn(n, k, device="cuda") * 0.02
        packed = pack(quantize(weight, name, group_size=spec.group_size, zero_mode=spec.zero_mode,
                               scale_dtype=torch.float16))
        spec(torch.randn(m, k, device="cuda").half(), packed)
        torch.cuda.synchronize()
        print(f"ncu target: {name} {n}x{k} M={m}", flush=True)


if __name__ == "__main__":
    main()
