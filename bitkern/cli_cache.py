"""`python -m bitkern prebuild` and `python -m bitkern cache ls|verify|clear|export|import`."""

from __future__ import annotations

import argparse
import datetime
import os


IMPORT_WARNING = ("A bundle's kernels are native code that runs inside every process using this cache, as a "
                  "wheel's code does once installed: import only bundles you trust. The bundle is checked whole "
                  "(names, file types, sizes, manifests, checksums) before anything is written.")


def add_commands(commands) -> None:
    """Register the prebuild and cache subcommands on an argparse subparsers object."""
    prebuild = commands.add_parser("prebuild", help="compile a model's kernels into the cache ahead of time")
    source = prebuild.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a transformers model directory: the kernels its bitkern layers call (found "
                        "without reading the weights; a float checkpoint takes the quantization it will be loaded "
                        "with: --dtype, --group-size, --zero-mode, --compute-dtype as in bitkern.BitkernConfig)")
    source.add_argument("--config", help="a Hugging Face config.json: its distinct Linear shapes")
    source.add_argument("--shapes", help="explicit shapes out:in,out:in (e.g. 4096:4096,11008:4096)")
    prebuild.add_argument("--dtype", default=None, help="weight type (see bitkern.ttype.names()); default int4, but "
                          "for --model where the checkpoint is float (then required)")
    prebuild.add_argument("--group-size", type=int, default=None, help="default: 128, or the type's block")
    prebuild.add_argument("--zero-mode", default=None, help="none, gptq, awq or hqq (default: by type)")
    prebuild.add_argument("--compute-dtype", default=None, help="--model: the dtype the bitkern layers multiply in "
                          "(default: their input's)")
    prebuild.add_argument("--target", default="cpu", help="cpu (this CPU at its level), cpu:<level> (e.g. "
                          "cpu:x86-64-v3, for a fleet; levels: bitkern.codegen.cpu.isa), cpu:<part> (an aarch64 part, "
                          "e.g. cpu:neoverse-v1; parts: bitkern.tuner.device.CPU_TARGETS), or a CUDA arch: sm_80, "
                          "sm_86, sm_89, sm_90")
    prebuild.add_argument("--tokens", "--m", dest="tokens", default="1,16,128",
                          help="token counts (rows: batch x sequence length) the model will run with; one kernel per "
                               "M bucket they fall in")
    prebuild.add_argument("--activation", default=None, help="activation dtype: bfloat16, float16, float32 (default "
                          "bfloat16; for --model the checkpoint's dtype)")
    _add_store_arguments(prebuild, "write the system cache, which every user's processes read: run as root, e.g. "
                                   "while building a container image")
    prebuild.set_defaults(run=_prebuild)

    cache = commands.add_parser("cache", help="inspect and manage the kernel cache")
    _add_store_arguments(cache, "manage the system cache instead of yours")
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


def _add_store_arguments(parser: argparse.ArgumentParser, system_help: str) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--cache-dir", default=None, help="the cache (default: $BITKERN_CACHE_DIR, else "
                       "$XDG_CACHE_HOME/bitkern, else ~/.cache/bitkern)")
    where.add_argument("--system", action="store_true", help=f"{system_help} ($BITKERN_SYSTEM_CACHE_DIR, else "
                       f"/usr/local/share/bitkern/cache)")


def _store(args: argparse.Namespace):
    from .cache.disk import DiskStore

    return DiskStore(system=True) if args.system else DiskStore(args.cache_dir)


def _prebuild(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .cache.prebuild import parse_shapes, prebuild, prebuild_requests, shapes_from_config
    from .nn.prepare import check_tokens

    if args.system and os.geteuid() != 0:
        parser.error("--system writes the system cache that every user's processes trust, which only root may own "
                     "and write: run it as root (e.g. in the image build), or prebuild into your own cache")
    if args.compute_dtype is not None and not args.model:
        parser.error("--compute-dtype is a setting of --model's float checkpoints; for --config and --shapes, "
                     "--activation is the dtype the kernels multiply in")
    store = _store(args)
    try:
        rows = check_tokens([int(m) for m in args.tokens.split(",") if m.strip()], "--tokens")
    except ValueError:
        parser.error(f"--tokens={args.tokens!r} must be comma-separated positive token counts (batch x sequence "
                     f"length), e.g. 1,16,128")
    try:
        if args.model:
            from .integration.hf.prebuild import model_requests
            from .ops.grouped import GroupedMatmul

            requests = model_requests(args.model, rows, args.target, _settings(args, parser), args.activation)
            for spec, n, k in dict.fromkeys((r.spec, r.n, r.k) for r in requests):
                grouped = ""
                if isinstance(spec, GroupedMatmul):
                    stages = (", SwiGLU" if spec.epilogue == "swiglu" else "") + (", weighted sum" if spec.combine
                                                                                  else "")
                    grouped = f", {spec.experts} experts, top {spec.top_k}{stages}"
                print(f"  {n:>6} x {k:<6} {spec.weight_dtype} (group {spec.group_size}{grouped}) x "
                      f"{spec.activation_dtype}")
            report = prebuild_requests(requests, store, description=f"prebuild {args.model} for {args.target}")
        else:
            shapes = shapes_from_config(args.config) if args.config else parse_shapes(args.shapes)
            for shape in shapes:
                print(f"  {shape.out_features:>6} x {shape.in_features:<6} {', '.join(shape.names)}")
            report = prebuild(shapes, args.dtype or "int4", 128 if args.group_size is None else args.group_size,
                              args.target, rows, args.activation or "bfloat16", args.zero_mode, store=store)
    except ImportError as error:
        parser.error(f"--model reads transformers model directories, which needs transformers: {error}")
    except (OSError, ValueError) as error:
        parser.error(str(error))
    print(f"prebuild: {report.kernels} kernels for {report.target} ({report.built} built, "
          f"{report.kernels - report.built} already cached) in {report.seconds:.1f} s into {store.root}")
    return 0


def _settings(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The BitkernConfig a float --model checkpoint will be loaded with, from the flags (None: none given)."""
    given = {"group_size": args.group_size, "zero_mode": args.zero_mode, "compute_dtype": args.compute_dtype}
    if args.dtype is None:
        named = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
        if named:
            parser.error(f"{', '.join(named)} without --dtype: give the weight type the model will be quantized to")
        return None
    from .integration.hf.config import BitkernConfig

    return BitkernConfig(args.dtype, **given)


def _cache(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    store = _store(args)
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
        if store.unwritable():
            parser.error(f"the kernel cache {store.root} cannot be written: {store.unwritable()}")
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
