"""`python -m bitkern prebuild` and `python -m bitkern cache ls|verify|clear|export|import`."""

from __future__ import annotations

import argparse
import datetime


IMPORT_WARNING = ("A bundle's kernels are native code that runs inside every process using this cache, as a "
                  "wheel's code does once installed: import only bundles you trust. The bundle is checked whole "
                  "(names, file types, sizes, manifests, checksums) before anything is written.")


def add_commands(commands) -> None:
    """Register the prebuild and cache subcommands on an argparse subparsers object."""
    prebuild = commands.add_parser("prebuild", help="compile a model's kernels into the cache ahead of time")
    source = prebuild.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a Hugging Face config.json: its distinct Linear shapes")
    source.add_argument("--shapes", help="explicit shapes out:in,out:in (e.g. 4096:4096,11008:4096)")
    prebuild.add_argument("--dtype", default="int4", help="weight type (see bitkern.ttype.names())")
    prebuild.add_argument("--group-size", type=int, default=128)
    prebuild.add_argument("--zero-mode", default=None, help="none, gptq, awq or hqq (default: by type)")
    prebuild.add_argument("--target", default="cpu", help="cpu (this CPU at its level), cpu:<level> (e.g. "
                          "cpu:x86-64-v3, for a fleet; levels: bitkern.codegen.cpu.isa.LEVELS), or a CUDA arch: "
                          "sm_80, sm_86, sm_89, sm_90")
    prebuild.add_argument("--m", default="1,16,128", help="rows the model will run with (one kernel per bucket)")
    prebuild.add_argument("--activation", default="bfloat16", help="activation dtype: bfloat16, float16, float32")
    prebuild.add_argument("--cache-dir", default=None, help="store (default: $BITKERN_CACHE_DIR or ~/.cache/bitkern)")
    prebuild.set_defaults(run=_prebuild)

    cache = commands.add_parser("cache", help="inspect and manage the kernel cache")
    cache.add_argument("--cache-dir", default=None)
    actions = cache.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("ls", help="list the stored kernels")
    listing.add_argument("--all", action="store_true", help="include entries of other bitkern/TVM versions")
    actions.add_parser("verify", help="check every entry against its checksums")
    actions.add_parser("clear", help="remove every entry (bitkern's version directories; nothing else)")
    export = actions.add_parser("export", help="write the entries into one bundle file")
    export.add_argument("file")
    export.add_argument("--target", default=None, help="only this target's kernels")
    imported = actions.add_parser("import", help="add the kernels of a bundle file; they are native code that "
                                                 "will run in your processes: import only bundles you trust, as "
                                                 "you would install a wheel", description=IMPORT_WARNING)
    imported.add_argument("file")
    cache.set_defaults(run=_cache)


def _prebuild(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .cache.disk import DiskStore
    from .cache.prebuild import parse_shapes, prebuild, shapes_from_config

    try:
        shapes = shapes_from_config(args.config) if args.config else parse_shapes(args.shapes)
        rows = [int(m) for m in args.m.split(",") if m.strip()]
    except (OSError, ValueError) as error:
        parser.error(str(error))
    for shape in shapes:
        print(f"  {shape.out_features:>6} x {shape.in_features:<6} {', '.join(shape.names)}")
    report = prebuild(shapes, args.dtype, args.group_size, args.target, rows, args.activation, args.zero_mode,
                      store=DiskStore(args.cache_dir))
    print(f"prebuild: {report.kernels} kernels for {report.target} ({report.built} built, "
          f"{report.kernels - report.built} already cached) in {report.seconds:.1f} s")
    return 0


def _cache(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .cache.disk import DiskStore

    store = DiskStore(args.cache_dir)
    if args.action == "ls":
        entries = store.entries(all_versions=args.all)
        for entry in entries:
            if "error" in entry:
                print(f"{entry['directory']}: unreadable manifest ({entry['error']})")
                continue
            key = entry["key"]
            spec = key["spec"]
            created = datetime.datetime.fromtimestamp(entry["created"]).strftime("%Y-%m-%d %H:%M")
            print(f"{key['target']:<22} {spec['weight_dtype']:<8} {spec['activation_dtype']:<9} "
                  f"N={key['n']:<6} K={key['k']:<6} M={key['bucket'][0]}..{key['bucket'][1]:<10} "
                  f"{entry['template']:<8} {_operator(spec):<28} {created}  {entry['directory']}")
        print(f"{len(entries)} kernels in {store.root}")
    elif args.action == "verify":
        results = store.verify()
        bad = [(path, reason) for path, reason in results if reason]
        for path, reason in bad:
            print(f"DAMAGED {path}: {reason}")
        print(f"{len(results) - len(bad)} of {len(results)} entries verified")
        return 1 if bad else 0
    elif args.action == "clear":
        print(f"removed {store.clear()} kernels from {store.root}")
    elif args.action == "export":
        print(f"exported {store.export(args.file, args.target)} kernels to {args.file}")
    elif args.action == "import":
        try:
            print(f"imported {store.import_(args.file)} kernels into {store.version_dir} (native code that will "
                  f"run in your processes: import only bundles you trust)")
        except (OSError, ValueError) as error:
            parser.error(str(error))
    return 0


def _operator(spec: dict) -> str:
    """What a cached kernel computes: a matmul, or a convolution with its image and kernel sizes."""
    geometry = spec.get("geometry")
    if geometry is None:
        return "matmul"
    return (f"conv {geometry['height']}x{geometry['width']}x{geometry['in_channels']} "
            f"k{'x'.join(map(str, geometry['kernel']))} s{'x'.join(map(str, geometry['stride']))}")
