"""Command line: `python -m bitkern demo | prebuild | cache ...`."""

from __future__ import annotations

import argparse
import sys

from . import cli_cache, demo, ttype


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bitkern", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="quantize a layer-sized weight with several types and report")
    run_demo.add_argument("--dtypes", default=",".join(demo.DEFAULT_TYPES),
                          help=f"comma-separated type names (known: {', '.join(ttype.names())})")
    run_demo.add_argument("--shape", default="4096,4096", help="out_features,in_features")
    run_demo.add_argument("--group-size", type=int, default=128)
    run_demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    cli_cache.add_commands(commands)
    args = parser.parse_args(argv)
    if hasattr(args, "run"):
        return args.run(args, parser)
    if args.command == "demo":
        try:
            out_features, in_features = (int(s) for s in args.shape.split(","))
        except ValueError:
            parser.error(f"--shape={args.shape!r} must be two integers: out_features,in_features")
        dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
        for name in dtypes:
            try:
                ttype.get(name)
            except ValueError as error:
                parser.error(f"--dtypes: {error}")
        demo.run(out_features, in_features, dtypes, args.group_size, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
