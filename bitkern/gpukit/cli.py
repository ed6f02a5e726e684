"""`python -m bitkern gpu-kit --arch sm_90 [--arch sm_80 ...] OUT`."""

from __future__ import annotations

import argparse


def add_command(commands) -> None:
    """Register the gpu-kit subcommand on an argparse subparsers object."""
    kit = commands.add_parser("gpu-kit", help="prebuild the GPU tests' and benchmark's CUDA kernels into a "
                                              "self-contained kit that runs where only torch is (OUT/run)")
    kit.add_argument("out", help="the kit's directory (new or empty)")
    kit.add_argument("--arch", action="append", required=True,
                     help="CUDA architecture to build for (repeatable): sm_80, sm_86, sm_89, sm_90")
    kit.add_argument("--smoke", action="store_true", help="a few kernels only (one of each kind): a quick kit "
                                                          "for checking the kit itself (CI's dry run)")
    kit.add_argument("--workers", type=int, default=None, help="build processes (default: one per CPU core)")
    kit.add_argument("--gemlite", default="download",
                     help="gemlite's wheel for the benchmark: 'download' (pip builds it), a wheel's path, or 'none'")
    kit.set_defaults(run=_gpu_kit)


def _gpu_kit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .build import build

    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers={args.workers} must be positive")
    try:
        report = build(args.out, args.arch, args.smoke, args.workers,
                       None if args.gemlite == "none" else args.gemlite)
    except ValueError as error:
        parser.error(str(error))
    print(f"gpu-kit: {report.kernels} kernels ({report.built} compiled, {report.failed} failed) for "
          f"{', '.join(args.arch)} in "
          f"{report.seconds:.0f} s; {report.bytes / 1e6:.1f} MB in {report.directory}; check it with "
          f"{report.directory}/run --dry-run, run it on a GPU machine with {report.directory}/run --results DIR")
    return 0
