"""Command line: `python -m bitkern demo | prebuild | cache ... | gpu-kit`."""

from __future__ import annotations

import argparse
import sys

import torch

from . import cli_cache, demo
from .gpukit import cli as cli_gpukit
from .nn.storage import weight_dtypes

_COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bitkern", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="quantize a transformer block with several types; error, memory, "
                                                "speed vs float")
    run_demo.add_argument("--dtypes", default=",".join(demo.DEFAULT_TYPES),
                          help=f"comma-separated weight types (known: {', '.join(weight_dtypes())})")
    run_demo.add_argument("--dim", type=int, default=1024, help="model width")
    run_demo.add_argument("--heads", type=int, default=16, help="attention heads (must divide --dim)")
    run_demo.add_argument("--hidden", type=int, default=2816, help="SwiGLU hidden size")
    run_demo.add_argument("--tokens", type=int, default=64, help="prompt length timed besides one token")
    run_demo.add_argument("--group-size", type=int, default=None,
                          help="elements per scale (default 128, or the type's block)")
    run_demo.add_argument("--compute-dtype", default="bfloat16", choices=_COMPUTE_DTYPES,
                          help="activation type of the quantized layers (bfloat16: the fast path on AMX CPUs)")
    run_demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    run_demo.add_argument("--seconds", type=float, default=0.5, help="time spent timing each model and size")
    cli_cache.add_commands(commands)
    cli_gpukit.add_command(commands)
    args = parser.parse_args(argv)
    if hasattr(args, "run"):
        return args.run(args, parser)
    if args.command == "demo":
        dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
        unknown = [name for name in dtypes if name not in weight_dtypes()]
        if unknown:
            parser.error(f"--dtypes: unknown or unsupported weight types {unknown}; "
                         f"known: {', '.join(weight_dtypes())}")
        for flag in ("dim", "heads", "hidden", "tokens"):
            if getattr(args, flag) < 1:
                parser.error(f"--{flag}={getattr(args, flag)} must be positive")
        try:
            demo.run(dtypes, args.dim, args.heads, args.hidden, args.tokens, args.group_size,
                     getattr(torch, args.compute_dtype), args.device, seconds=args.seconds)
        except ValueError as error:
            parser.error(str(error))
        except NotImplementedError as error:
            print(f"bitkern demo: {error}; run it with --device cpu", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
