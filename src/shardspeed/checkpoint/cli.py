"""`shardspeed-ckpt`: look into, check, and consolidate checkpoints, with no process group.

    shardspeed-ckpt inspect DIR [--tag T]
    shardspeed-ckpt verify DIR [--tag T | --all]
    shardspeed-ckpt consolidate DIR OUTPUT_DIR [--tag T] [--max_shard_size S]
                                [--exclude_frozen_parameters] [--dtype fp32|fp16|bf16]

DIR is a save directory (holding `latest` and one directory per tag) or one tag directory.
Exit status: 0 when all went well, 1 when `verify` found problems, 2 for any other error
(no checkpoint there, an unreadable manifest for `inspect`, a bad argument).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from .consolidate import checkpoint_path, consolidate, parse_size
from .engine_state import LATEST
from .format import (
    CHECKSUM,
    INDEX,
    MANIFEST,
    UNCHECKSUMMED_WARNING,
    CheckpointError,
    check_index,
    checkpoint_problems,
    frozen_parameter_names,
    parse_manifest,
    read_manifest,
)

PROG = "shardspeed-ckpt"
_OUTPUT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def size_argument(text: str) -> int:
    """argparse `type` for sizes such as "5GB", "500MB" or a number of bytes."""
    try:
        return parse_size(int(text) if text.isdigit() else text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


# -- finding tags ----------------------------------------------------------------------------------


def _is_tag_dir(path: Path) -> bool:
    """A directory that holds (or, damaged, should hold) one tag's checkpoint."""
    if not path.is_dir() or path.name.startswith("."):
        return False
    return (path / MANIFEST).exists() or any(path.glob("rank*.safetensors"))


def _latest(root: Path) -> str | None:
    latest = root / LATEST
    return latest.read_text().strip() if latest.is_file() else None


def _tags(root: Path) -> list[Path]:
    """The tag directories of a save directory, or `root` itself if it is one."""
    if (root / MANIFEST).exists():
        return [root]
    return sorted((p for p in root.iterdir() if _is_tag_dir(p)), key=lambda p: p.name)


def _root(directory: str) -> Path:
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory")
    return root


# -- inspect ---------------------------------------------------------------------------------------


def _describe(path: Path, latest: bool) -> list[str]:
    manifest = read_manifest(path)
    by = manifest["written_by"]
    tensors = manifest["tensors"]
    params = {n[len("param/") :]: e for n, e in tensors.items() if n.startswith("param/")}
    aliases = manifest["aliases"]
    buffers = [n for n in tensors if n.startswith("buffer/") and n[len("buffer/") :] not in aliases]
    frozen = frozen_parameter_names(path, manifest)

    def numel(entry: dict[str, Any]) -> int:
        return int(torch.Size(entry["shape"]).numel())

    elements = sum(numel(e) for e in params.values())
    frozen_elements = sum(numel(params[n]) for n in frozen)
    states = sorted({n.split("/")[1] for n in tensors if n.startswith("optim/")})
    counters = manifest.get("counters", {})
    optimizer = manifest.get("optimizer") or {}
    lines = [
        f"{manifest['tag']}{'  (latest)' if latest else ''}  {path}",
        f"  written by: world size {by['world_size']} (data parallel {by['dp_world_size']}), "
        f"ZeRO stage {by['zero_stage']}, model dtype {by['model_dtype']}",
        f"  parameters: {len(params)} tensors, {elements:,} elements"
        + (f" ({len(frozen)} frozen, {frozen_elements:,} elements)" if frozen else "")
        + (
            f"; tied names: {', '.join(f'{a} = {s}' for a, s in aliases.items())}"
            if aliases
            else ""
        )
        + ("; frozen parameters excluded" if by.get("exclude_frozen_parameters") else ""),
        f"  buffers: {len(buffers)} tensors",
        f"  optimizer: {optimizer.get('type', '-')}"
        + (f" (states {', '.join(states)})" if states else ""),
        "  counters: "
        + ", ".join(
            f"{k} {counters[k]}"
            for k in ("global_steps", "global_samples", "skipped_steps")
            if k in counters
        ),
        "  files:",
    ]
    total = 0
    width = max((len(n) for n in manifest["files"]), default=0)
    for name, info in sorted(manifest["files"].items()):
        lines.append(f"    {name:<{width}}  {info['bytes']:>14,} bytes")
        total += info["bytes"]
    for name in (INDEX, MANIFEST):
        if (path / name).exists():
            size = (path / name).stat().st_size
            lines.append(f"    {name:<{width}}  {size:>14,} bytes")
            total += size
    lines.append(f"    {'total':<{width}}  {total:>14,} bytes ({_human(total)})")
    return lines


def _inspect(args: argparse.Namespace) -> int:
    root = _root(args.dir)
    if args.tag is not None:
        tags = [checkpoint_path(root, args.tag)]
    else:
        tags = _tags(root)
        if not tags:
            raise CheckpointError(f"{root}: no checkpoint there (no tag directory with a manifest)")
    latest = _latest(root)
    if len(tags) > 1 or (args.tag is None and tags[0] != root):
        names = ", ".join(p.name for p in _tags(root))
        print(
            f"{root}: tags {names}; latest: {latest if latest is not None else '(no latest file)'}"
        )
        partial = sorted(p.name for p in root.glob(".*.partial"))
        if partial:
            print(f"  left by interrupted saves (ignored): {', '.join(partial)}")
    status = 0
    for path in tags:
        print()
        try:
            print("\n".join(_describe(path, path.name == latest and path != root)))
        except CheckpointError as err:
            print(f"{path.name}: unreadable: {err}")
            status = 2
    return status


# -- verify ----------------------------------------------------------------------------------------


def _problems(path: Path) -> tuple[list[str], dict[str, Any] | None]:
    """Everything wrong with one tag: what a load refuses (`checkpoint_problems`, the same
    validation), and every CRC-32 block of every file besides."""
    try:
        manifest = parse_manifest(path)
    except CheckpointError as err:
        return [str(err)], None
    return checkpoint_problems(path, manifest, every_block=True), manifest


def _verify(args: argparse.Namespace) -> int:
    root = _root(args.dir)
    problems: list[str] = []
    if args.all:
        tags = _tags(root)
        if not tags:
            raise CheckpointError(f"{root}: no checkpoint there (no tag directory)")
        latest = _latest(root)
        if latest is not None and tags[0] != root and not (root / latest / MANIFEST).exists():
            problems.append(f"{root / LATEST}: names tag '{latest}', which has no {MANIFEST}")
    elif args.tag is None and (root / MANIFEST).exists():
        tags = [root]
    else:  # the directory a load would read (a re-saved tag's newest copy, `latest` checked)
        tags = [checkpoint_path(root, args.tag)]
    for path in tags:
        if not path.is_dir():
            problems.append(f"{path}: missing")
            continue
        found, manifest = _problems(path)
        problems.extend(found)
        if not found and manifest is not None:
            size = sum(info["bytes"] for info in manifest["files"].values())
            print(f"{path.name}: ok ({len(manifest['files'])} files, {size:,} bytes checked)")
            if CHECKSUM not in manifest:
                print(f"{path.name}: warning: {MANIFEST} {UNCHECKSUMMED_WARNING}")
            check_index(path, manifest, lambda line: print(f"warning: {line}"))
    for line in problems:
        print(line)
    if problems:
        return 1
    if len(tags) > 1:
        print("ok")
    return 0


# -- consolidate -----------------------------------------------------------------------------------


def _consolidate(args: argparse.Namespace) -> int:
    written = consolidate(
        args.dir,
        args.output_dir,
        tag=args.tag,
        max_shard_size=args.max_shard_size,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
        dtype=_OUTPUT_DTYPES[args.dtype],
    )
    output = Path(args.output_dir)
    for name in written:
        print(f"{output / name}  {(output / name).stat().st_size:,} bytes")
    return 0


def _import_deepspeed(args: argparse.Namespace) -> int:
    from .deepspeed import import_deepspeed

    written = import_deepspeed(args.src, args.dst, args.tag)
    print(f"{written}: shardspeed checkpoint of DeepSpeed's {Path(args.src) / written.name}")
    return 0


# -- main ------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, consolidate shardspeed checkpoints; import DeepSpeed's.",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dir_help = "a save directory (holding 'latest' and the tags) or one tag directory"

    inspect = sub.add_parser("inspect", help="tags, layout, sizes and counters of a checkpoint")
    inspect.add_argument("dir", metavar="DIR", help=dir_help)
    inspect.add_argument("--tag", help="describe only this tag (default: every tag)")
    inspect.set_defaults(run=_inspect)

    verify = sub.add_parser("verify", help="check manifests, file sizes and every CRC-32 block")
    verify.add_argument("dir", metavar="DIR", help=dir_help)
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--tag", help="check this tag (default: the latest)")
    which.add_argument("--all", action="store_true", help="check every tag")
    verify.set_defaults(run=_verify)

    cons = sub.add_parser(
        "consolidate", help="write the whole weights as Hugging Face safetensors files"
    )
    cons.add_argument("dir", metavar="DIR", help=dir_help)
    cons.add_argument("output_dir", metavar="OUTPUT_DIR", help="where to write the files")
    cons.add_argument("--tag", help="the tag to read (default: the latest)")
    cons.add_argument(
        "--max_shard_size",
        "--max-shard-size",
        type=size_argument,
        default="5GB",
        help='split into shards above this size, e.g. "5GB", "500MB", bytes (default 5GB)',
    )
    cons.add_argument(
        "--exclude_frozen_parameters",
        "--exclude-frozen-parameters",
        action="store_true",
        help="leave out parameters saved as frozen",
    )
    cons.add_argument(
        "--dtype",
        choices=sorted(_OUTPUT_DTYPES),
        default="fp32",
        help="floating-point dtype of the output (default fp32; integer buffers keep theirs)",
    )
    cons.set_defaults(run=_consolidate)

    imp = sub.add_parser(
        "import-deepspeed",
        help="convert a DeepSpeed checkpoint (any ZeRO stage, pipeline or universal) once",
    )
    imp.add_argument("src", metavar="SRC", help="DeepSpeed's save directory (holding 'latest')")
    imp.add_argument("dst", metavar="DST", help="the shardspeed save directory to write")
    imp.add_argument("--tag", help="the DeepSpeed tag to convert (default: its latest)")
    imp.set_defaults(run=_import_deepspeed)
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of `shardspeed-ckpt`; returns the exit status."""
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (CheckpointError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
