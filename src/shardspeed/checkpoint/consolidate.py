"""One whole state dict from a checkpoint, at any world size and stage, and its safetensors export.

`fp32_state_dict` reads every `param/<name>` (the fp32 master of a trainable parameter, a frozen
parameter as stored) and every `buffer/<name>` whole, keyed like `model.state_dict()`; the second
name of a tied parameter maps to the very same tensor. It needs no process group: it reads the
files' byte ranges through the manifest, checking each CRC-32 block it touches.

`write_safetensors` writes such a dict in Hugging Face's layout: `model.safetensors`, or when it is
larger than `max_shard_size`, `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`.
A tensor reachable under several names is written once, under its first name (as `save_pretrained`
does for tied weights, which `from_pretrained` ties back).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .engine_state import open_checkpoint, resolve_tag
from .format import MANIFEST, CheckpointError, TensorSource, frozen_parameter_names, fsync_dir

logger = logging.getLogger("shardspeed")

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


# -- reading ---------------------------------------------------------------------------------------


class LazyTensor:
    """A tensor of a checkpoint, read only when asked: `contiguous()` (as DeepSpeed's lazy mode)."""

    def __init__(self, source: TensorSource, name: str) -> None:
        self._source = source
        self.name = name
        self.shape = torch.Size(source.shape(name))
        self.dtype = source.dtype(name)

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def contiguous(self) -> torch.Tensor:
        return self._source.read_whole(self.name)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def checkpoint_path(checkpoint_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """The tag directory to read: `checkpoint_dir/tag`, `checkpoint_dir/<latest>`, or
    `checkpoint_dir` itself when it is a tag directory (holds a manifest) and no tag is given."""
    root = Path(checkpoint_dir)
    if tag is None and (root / MANIFEST).exists():
        return root
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory")
    path = resolve_tag(str(root), tag)
    if path is None:
        raise CheckpointError(
            f"{root}: no 'latest' file and no tag given (pass tag=, or the tag directory itself)"
        )
    return path


def _natural(name: str) -> list:
    """Sort key putting `layers.10` after `layers.9`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def lazy_state_dict(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> dict[str, LazyTensor]:
    """`fp32_state_dict` without reading any tensor yet: values are `LazyTensor`s (a tied name
    maps to the same object as the name it is tied to). A DeepSpeed checkpoint (ZeRO 0-3, AutoEP's
    included, or universal) is read whole at once, under the model's names: tensors."""
    from .deepspeed import deepspeed_tag_dir, is_deepspeed_checkpoint, read_deepspeed

    root = Path(checkpoint_dir)
    deepspeed_dir = (
        root if tag is None and is_deepspeed_checkpoint(root) else deepspeed_tag_dir(root, tag)
    )
    if deepspeed_dir is not None:
        found = read_deepspeed(deepspeed_dir)
        held = {**found.params, **({} if exclude_frozen_parameters else found.frozen)}
        return {n: held[n] for n in sorted(held, key=_natural)} | found.buffers
    path = checkpoint_path(checkpoint_dir, tag)
    manifest, source = open_checkpoint(path)  # validated: refused before any read if wrong
    aliases: dict[str, str] = manifest["aliases"]
    frozen = frozen_parameter_names(path, manifest) if exclude_frozen_parameters else set()
    params = sorted(
        (n[len("param/") :] for n in source.names("param/")),
        key=_natural,
    )
    # A save may also record a tied second name under `buffer/` (`state_dict()` lists it,
    # `named_parameters()` does not; empty at stage 3): the alias says what that name holds.
    buffers = sorted(
        (
            n[len("buffer/") :]
            for n in source.names("buffer/")
            if n[len("buffer/") :] not in aliases
        ),
        key=_natural,
    )
    state: dict[str, LazyTensor] = {}
    for name in params:
        if name not in frozen:
            state[name] = LazyTensor(source, f"param/{name}")
    for name in buffers:
        state[name] = LazyTensor(source, f"buffer/{name}")
    for alias, saved in sorted(aliases.items(), key=lambda kv: _natural(kv[0])):
        if saved in state:
            state[alias] = state[saved]
    return state


def materialize(state: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read lazy values (tensors pass through); names sharing a value keep sharing the result.
    `dtype` casts floating-point tensors only (integer and bool buffers keep theirs)."""
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, value in state.items():
        if id(value) not in done:
            tensor = value.contiguous()
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            done[id(value)] = tensor
        out[name] = done[id(value)]
    return out


def fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a checkpoint whole, on CPU, keyed like `model.state_dict()`.

    Trainable parameters are their fp32 masters; frozen ones and buffers are as stored. A tied
    parameter's second name maps to the same tensor, so `load_state_dict(strict=True)` on the
    model works. `tag=None` reads the tag named in `latest` (or `checkpoint_dir` itself if it is a
    tag directory). `exclude_frozen_parameters` leaves out parameters saved as frozen.
    """
    return materialize(lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters))


# -- writing ---------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "5GB" (10^9, as Hugging Face) or "512MiB" (2^20)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"a size must be positive, not {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {size!r} as a size: use bytes (an int) or a number with KB, MB, GB, "
            "TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2)"
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a size must be positive, not {size!r}")
    return value


def _nbytes(value: Any) -> int:
    return value.numel() * value.dtype.itemsize


def _unique(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Names to write, and the names left out because they hold a value written under another."""
    seen: dict[Any, str] = {}
    kept: dict[str, Any] = {}
    dropped: dict[str, str] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            key: Any = (
                value.untyped_storage().data_ptr() if value.numel() else id(value),
                value.storage_offset(),
                tuple(value.shape),
                value.stride(),
                value.dtype,
                value.device,
            )
        else:
            key = id(value)
        if key in seen:
            dropped[name] = seen[key]
        else:
            seen[key] = name
            kept[name] = value
    return kept, dropped


def plan_shards(
    state: dict[str, Any], max_shard_size: int | str | None, dtype: torch.dtype | None = None
) -> list[list[str]]:
    """Names per file, in order: a file is closed before a tensor would take it past the limit (a
    tensor larger than the limit gets a file of its own)."""
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    shards: list[list[str]] = [[]]
    size = 0
    for name, value in state.items():
        itemsize = dtype.itemsize if dtype is not None and value.dtype.is_floating_point else None
        n = value.numel() * itemsize if itemsize else _nbytes(value)
        if limit is not None and shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _tensors_for_file(values: Iterable[tuple[str, Any]], dtype: torch.dtype | None) -> dict:
    """CPU, contiguous tensors that share no storage (safetensors refuses shared storage)."""
    out = {}
    storages = set()
    for name, value in values:
        tensor = value.contiguous() if not isinstance(value, torch.Tensor) else value.detach()
        tensor = tensor.cpu().contiguous()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_safetensors(
    state_dict: dict[str, Any],
    output_dir: str | os.PathLike,
    max_shard_size: int | str | None = "5GB",
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write `state_dict` into `output_dir` as Hugging Face does; returns the file names written.

    One `model.safetensors`, or, when the tensors take more than `max_shard_size` (bytes, or a
    string such as "5GB" or "500MB"; None: never shard), `model-0000k-of-0000N.safetensors` files
    and `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}). A value
    reachable under several names (a tied weight) is written once, under its first name. Values
    may be tensors or `LazyTensor`s (read one file at a time). `dtype` casts floating-point tensors.

    Atomic: a new `output_dir` appears whole (written as a hidden sibling, then renamed). Into an
    existing directory each file is written under a temporary name, fsynced and renamed into
    place, the index (or the single file) last; then files of an earlier export that the new one
    does not use are removed, so `from_pretrained` never picks up a stale one.
    """
    output = Path(output_dir)
    kept, dropped = _unique(state_dict)
    if dropped:
        logger.info(
            "written once, under their first name: "
            + ", ".join(f"{a} (= {s})" for a, s in dropped.items())
        )
    shards = plan_shards(kept, max_shard_size, dtype)
    fresh = not output.exists()
    if not fresh and not output.is_dir():
        raise CheckpointError(f"{output}: exists and is not a directory")
    staging = _staging_directory(output, fresh)
    try:
        written = _write_export(staging, kept, shards, dtype)
        if fresh:
            staging.rename(output)
            fsync_dir(output.parent)
        else:
            _replace_export(staging, output, written)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _staging_directory(output: Path, fresh: bool) -> Path:
    """A new hidden directory to write the export in: a sibling of a new `output`, else inside it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    unique = f"{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    staging = output.parent / f".{output.name}.{unique}" if fresh else output / f".export.{unique}"
    staging.mkdir()  # not tempfile.mkdtemp: its mode 0700 would stay with a renamed directory
    return staging


def _write_export(
    staging: Path, kept: dict[str, Any], shards: list[list[str]], dtype: torch.dtype | None
) -> list[str]:
    """Write each shard's file (and, for several, the index) into `staging`, fsynced; returns
    the file names, the index (or the single file) last."""
    from safetensors.torch import save_file

    if len(shards) == 1:
        names = [SINGLE]
    else:
        names = [
            f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)
        ]
    # safetensors creates files readable by their owner only; give them the umask's usual mode.
    file_mode = staging.stat().st_mode & 0o666
    total = 0
    weight_map = {}
    for file, members in zip(names, shards):
        tensors = _tensors_for_file(((n, kept[n]) for n in members), dtype)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(staging / file), metadata={"format": "pt"})
        os.chmod(staging / file, file_mode)
        _fsync(staging / file)
        weight_map.update(dict.fromkeys(members, file))
        del tensors
    written = list(names)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(staging / INDEX, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        written.append(INDEX)
    fsync_dir(staging)
    return written


def _replace_export(staging: Path, output: Path, written: list[str]) -> None:
    """Move the files `written` from `staging` into the existing `output`, the last one (the index
    or the single file) committing the export; then remove an earlier export's files it no
    longer uses."""
    for file in written:
        os.replace(staging / file, output / file)
    fsync_dir(output)
    stale = [
        p
        for p in output.iterdir()
        if p.name not in written and (p.name in (SINGLE, INDEX) or _SHARD.fullmatch(p.name))
    ]
    for p in stale:
        p.unlink()
    if stale:
        fsync_dir(output)


def consolidate(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    tag: str | None = None,
    max_shard_size: int | str | None = "5GB",
    exclude_frozen_parameters: bool = False,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Checkpoint to Hugging Face safetensors in `output_dir`, one file's tensors in memory at a
    time; returns the file names written."""
    state = lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    return write_safetensors(state, output_dir, max_shard_size, dtype)
