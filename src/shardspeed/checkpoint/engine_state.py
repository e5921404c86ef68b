"""Save and load an engine's whole training state, at any world size and ZeRO stage.

What is saved, as logical tensors named by parameter (so any layout can read them back):
`param/<name>` (the fp32 master value of a trainable parameter; a frozen one in its own dtype),
`optim/<state>/<name>` (each optimizer state of a parameter's size), `buffer/<name>`. Each rank
writes the pieces it owns (its master shards at stages 1 to 3; rank 0 everything at stage 0) into
its own file. The rest is JSON in the manifest: optimizer hyperparameters and per-group scalars
(Adam's step), loss scaler, LR scheduler, engine counters, data loader position, every rank's RNG
states, and `client_state` (its tensors go into rank 0's file).

Loading reads, for each master tensor of the new layout, just the element ranges it holds, then
publishes the masters into the model exactly as a step does. The model's 16-bit weights are not
saved: they are always the masters cast, so casting again restores them bit for bit.

A save locks `<save_dir>` for its job (`lock.py`), writes into `<save_dir>/.<tag>.partial`, fsyncs
every file, has rank 0 write the manifest and rename the directory to a name not in use (`<tag>`,
or `<tag>@<k>` when the tag was saved before), then point `latest` at that directory, and only then
remove the tag's older copy: at every instant `latest` names a complete checkpoint. A failure on
any rank fails the save on every rank (the ranks agree on success at each step instead of waiting
at a barrier) and removes the partial directory; the previous tag and `latest` are untouched.
A load has rank 0 resolve the tag and share the directory, so every rank reads the same one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm import get_rank, get_world_size
from ..zero.offload import per_element
from . import lock
from .deepspeed import deepspeed_tag_dir, imported
from .format import (
    DTYPE_NAMES,
    DTYPES,
    FORMAT,
    INDEX,
    MANIFEST,
    VERSION,
    ByteReader,
    CheckpointError,
    ManifestIndex,
    Piece,
    Split,
    StoredTensors,
    TensorSource,
    check_index,
    check_tag_name,
    fsync_dir,
    manifest_checksum,
    parse_manifest,
    rank_of_file,
    read_manifest,
    write_manifest,
    write_tensor_file,
)
from .values import all_gather_json, any_rank, broadcast_json, decode, encode, gather_json

logger = logging.getLogger("shardspeed")
LATEST = "latest"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# -- saving ---------------------------------------------------------------------------------------


def require_states(engine: Any, action: str) -> None:
    """Refuse `action` while `offload_states()` holds any of the engine's states in host memory
    (their device memory is freed: reading it would fail)."""
    if engine.optimizer is not None:
        engine.optimizer.state_offload.require(action)


def save_engine(
    engine: Any,
    save_dir: str,
    tag: str | None,
    client_state: dict[str, Any],
    save_latest: bool,
    exclude_frozen_parameters: bool,
) -> bool:
    """`engine.save_checkpoint`: every rank calls it; True once the tag is in place everywhere.
    Any rank's failure fails the save on every rank, with the same `CheckpointError`."""
    require_states(engine, "save_checkpoint")
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    tag = _agreed_tag(tag, engine.run_config.checkpoint.tag_validation)
    root = Path(save_dir)
    check_tag_name(tag, root)
    partial = root / f".{tag}.partial"
    rank = get_rank()
    doing = f"saving checkpoint '{tag}' to {root}"
    with _agreed(doing):
        if rank == 0:
            lock.acquire(root)
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
            partial.mkdir()

    report = write_rank_files(engine, partial, client_state, exclude_frozen_parameters)
    # The reports (what grows with the world) go to rank 0 alone, which writes the manifest;
    # every rank learns rank 0's verdict: which ranks failed, then whether publishing did.
    reports = gather_json(report)
    failed: list[dict[str, Any]] = []
    if reports is not None:
        failed = [{"rank": r["rank"], "error": r["error"]} for r in reports if r["error"]]
        if failed:
            shutil.rmtree(partial, ignore_errors=True)
    _raise_if_any_failed(broadcast_json(failed), doing)

    outcome: dict[str, Any] = {"rank": 0, "error": None}
    if reports is not None:
        try:
            publish_tag(engine, root, partial, tag, reports, save_latest, exclude_frozen_parameters)
        except Exception as err:
            shutil.rmtree(partial, ignore_errors=True)
            outcome["error"] = _error_text(err)
    _raise_if_any_failed([broadcast_json(outcome)], doing)
    return True


def write_rank_files(
    engine: Any, partial: Path, client_state: dict[str, Any], exclude_frozen: bool
) -> dict[str, Any]:
    """This rank's part of a save (no collective): write its files into `partial` and report
    them (files, the pieces they hold, its JSON state; rank 0's also the shared state), or the
    error it met."""
    rank = get_rank()
    report: dict[str, Any] = {"rank": rank, "error": None}
    try:
        files = _RankFiles(partial, rank)
        logical, report["rank_state"] = _collect(
            engine, files, client_state if rank == 0 else None, exclude_frozen
        )
        files.flush(last=True)
        report["file"] = files.described
        report["tensors"] = _place_pieces(logical, files.where)
        if rank == 0:
            report["shared"] = report["rank_state"].pop("shared")
    except Exception as err:
        report["error"] = _error_text(err)
    return report


def _error_text(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


def _raise_if_any_failed(reports: list[dict[str, Any]], doing: str) -> None:
    """Raise, alike on every rank, the errors the ranks reported (`{"rank", "error"}` each)."""
    failed = [r for r in reports if r["error"]]
    if failed:
        details = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
        raise CheckpointError(f"{doing} failed ({details})")


@contextmanager
def _agreed(doing: str) -> Iterator[None]:
    """Run the body (which must hold no collective) on every rank, then raise any rank's error on
    all of them: a rank that fails alone never leaves the others waiting in a later collective."""
    report: dict[str, Any] = {"rank": get_rank(), "error": None}
    try:
        yield
    except Exception as err:
        report["error"] = _error_text(err)
    # One integer each when all went well; every rank's error only when one failed.
    if any_rank(report["error"] is not None):
        _raise_if_any_failed(all_gather_json(report), doing)


def _decided_by_rank_0(decide: Callable[[], Any], doing: str) -> Any:
    """`decide()` run on rank 0 alone, its result (JSON) or its error shared with every rank.
    On torch's fake process group (a dry run) nothing reaches the other ranks: each decides."""
    found: dict[str, Any] = {"rank": 0, "value": None, "error": None}
    if get_rank() == 0 or _dry_run():
        try:
            found["value"] = decide()
        except Exception as err:
            found["error"] = _error_text(err)
    found = broadcast_json(found)
    _raise_if_any_failed([found], doing)
    return found["value"]


def _dry_run() -> bool:
    """Whether this runs on torch's fake process group (`shardspeed.planning`)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def _agreed_tag(tag: str, mode: str) -> str:
    """Rank 0's tag, which every rank writes under; `tag_validation` says what a difference does."""
    first = broadcast_json(tag)
    if any_rank(tag != first) and mode != "Ignore":
        message = f"checkpoint tags differ between ranks: {all_gather_json(tag)}"
        if mode == "Fail":
            raise CheckpointError(message + " (checkpoint.tag_validation is Fail)")
        logger.warning(f"{message}; saving under rank 0's tag '{first}'")
    return first


class _RankFiles:
    """This rank's tensors, written into files of about `part_bytes` as they are added.

    A save then holds at most that much beyond what training holds anyway (states read back from
    NVMe swap files, device tensors copied to the host). The first file is `rank<R>.safetensors`,
    later ones `rank<R>-<i>.safetensors`.
    """

    def __init__(self, directory: Path, rank: int, part_bytes: int = 1 << 30) -> None:
        self.directory, self.rank, self.part_bytes = directory, rank, part_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._count = 0
        self.described: dict[str, Any] = {}  # file -> size and CRC blocks, for the manifest
        self.where: dict[str, tuple[str, int, str]] = {}  # key -> (file, byte offset, dtype)

    def __setitem__(self, key: str, tensor: torch.Tensor) -> None:
        self._pending[key] = tensor
        self._bytes += tensor.numel() * tensor.element_size()
        self._count += 1
        if self._bytes >= self.part_bytes:
            self.flush()

    def __len__(self) -> int:
        return self._count  # `encode` numbers the tensors it sets aside by this

    def flush(self, last: bool = False) -> None:
        if not self._pending and not (last and not self.described):
            return
        part = len(self.described)
        name = rank_file(self.rank) if part == 0 else f"rank{self.rank:05d}-{part}.safetensors"
        info = write_tensor_file(self.directory / name, self._pending)
        self.described[name] = {k: v for k, v in info.items() if k != "tensors"}
        self.where.update({k: (name, *place) for k, place in info["tensors"].items()})
        self._pending, self._bytes = {}, 0


class _LogicalTensors:
    """The manifest's logical tensors as this rank collects them: name -> shape, dtype and the
    pieces [file key, start, length, offset in the logical tensor] this rank writes.

    A rank's piece of a split parameter (a tensor-parallel slice, a run of experts) is a logical
    tensor of its own (`tp/<name>/<piece index>`); `splits` records how the manifest joins the
    pieces back."""

    def __init__(self, engine: Any) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self.splits: dict[str, dict[str, Any]] = {}
        # Parameters with states saved whole in their own shapes: each one's state names.
        self.whole_states: dict[str, list[str]] = {}
        self._split_params = parameter_splits(engine)

    def stored_name(self, logical_name: str, param_name: str) -> str:
        """The name `logical_name` (of parameter `param_name`'s tensor) is saved under."""
        if param_name not in self._split_params:
            return logical_name
        split, index = self._split_params[param_name]
        self.splits[logical_name] = {"dim": split.dim, "stride": split.stride, "parts": split.parts}
        return f"tp/{logical_name}/{index}"

    def add(
        self, name: str, key: str, value: torch.Tensor, piece: tuple[int, int, int], shape: Any
    ) -> None:
        """Record that file tensor `key` holds `piece` (start, length, offset) of `name`."""
        entry = self.entries.setdefault(
            name, {"shape": list(shape), "dtype": DTYPE_NAMES[value.dtype], "pieces": []}
        )
        entry["pieces"].append([key, *piece])


def _collect(
    engine: Any, tensors: _RankFiles, client_state: dict[str, Any] | None, exclude_frozen: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Add this rank's tensors to `tensors`; (logical tensors -> [(key, start, length, offset)],
    JSON state)."""
    rank = get_rank()
    # What every replica of a stage holds alike, the first replica writes: rank 0 without a
    # pipeline, data-parallel rank 0 of each stage with one.
    topology = engine.topology
    model_parallel = topology.num_stages > 1 or topology.tp_world_size > 1
    writes_replicated = topology.dp_rank == 0 if model_parallel else rank == 0
    logical = _LogicalTensors(engine)
    _collect_masters(engine.optimizer, tensors, logical, writes_replicated)
    _collect_whole_tensors(engine, tensors, logical, writes_replicated, exclude_frozen)
    rank_state: dict[str, Any] = {
        "rng": encode(_rng_state(), tensors, f"rng.{rank}."),
        "splits": logical.splits,
        "whole_states": logical.whole_states,
    }
    scalars = group_scalars(engine.optimizer)
    if rank == 0:
        rank_state["shared"] = _shared_state(engine, tensors, client_state, scalars)
    return logical.entries, rank_state


def _collect_masters(
    zopt: Any, tensors: _RankFiles, logical: _LogicalTensors, writes_replicated: bool
) -> None:
    """Each master tensor this rank writes and its per-element optimizer states, as pieces of the
    parameters they hold. Shards are each rank's own; whole copies are written once
    (expert-parallel experts by the first rank holding them)."""
    shapes = dict(zip(zopt.param_names, zopt.layout.shapes))
    varying = _varying_scalars(zopt)
    for k, pieces in enumerate(zopt.master_pieces()):
        if not zopt.writes_master(k, writes_replicated):
            continue
        flat = zopt.master_value(k)
        tensors[f"master.{k}"] = flat
        state = zopt.state_of(k)
        sized = {n: v.reshape(-1) for n, v in state.items() if per_element(v, flat.numel())}
        for n, v in sized.items():
            tensors[f"optim.{n}.{k}"] = v.detach()
        master = zopt.plan.masters[k]
        whole = _whole_states(zopt, state, sized, master.param is not None, varying)
        for n, v in whole.items():
            tensors[f"optim.{n}.{k}"] = v.detach().reshape(-1)
            name = pieces[0][0]
            key = logical.stored_name(f"optim/{n}/{name}", name)
            logical.add(key, f"optim.{n}.{k}", v, (0, v.numel(), 0), v.shape)
        # A tensor of a whole-tensor param group may keep other states than its neighbours
        # (Muon's matrices a momentum, its AdamW half two moments): listed, each has its own.
        if master.param is not None and (whole or zopt.plan.region_whole[master.region]):
            logical.whole_states[pieces[0][0]] = sorted([*sized, *whole])
        for name, start, offset, length in pieces:
            piece = (start, length, offset)
            key = logical.stored_name(f"param/{name}", name)
            logical.add(key, f"master.{k}", flat, piece, shapes[name])
            for n, v in sized.items():
                key = logical.stored_name(f"optim/{n}/{name}", name)
                logical.add(key, f"optim.{n}.{k}", v, piece, shapes[name])


def _whole_states(
    zopt: Any,
    state: dict[str, Any],
    sized: dict[str, torch.Tensor],
    one_parameter: bool,
    varying: set[str],
) -> dict[str, torch.Tensor]:
    """A master's optimizer states that are not per element and not one scalar per param group
    (Adafactor's factored moments; 1-bit Lamb's per-tensor coefficients, named in `varying`),
    saved whole in their own shapes. Only a master that is `one_parameter` whole can have them:
    the shard plan steps such optimizers on whole tensors."""
    others = {
        n: v
        for n, v in state.items()
        if isinstance(v, torch.Tensor) and n not in sized and (v.dim() > 0 or n in varying)
    }
    if others and not one_parameter:
        n, v = next(iter(others.items()))
        raise CheckpointError(
            f"{type(zopt.optimizer).__name__} keeps optimizer state '{n}' of shape "
            f"{list(v.shape)} for a flat shard: such a state cannot be cut "
            "into parameters. Drop 'zero_allow_untested_optimizer' so that this optimizer is "
            "stepped on whole tensors"
        )
    return others


def _varying_scalars(zopt: Any) -> set[str]:
    """Names of 0-dimensional tensor states whose values differ between masters of one param
    group on this rank: per-tensor values, which one scalar per group would lose."""
    varying = set()
    for group in zopt.optimizer.param_groups:
        seen: dict[str, float] = {}
        for master in group["params"]:
            for n, v in zopt.optimizer.state.get(master, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    value = float(v)
                    if seen.setdefault(n, value) != value:
                        varying.add(n)
    return varying


def _collect_whole_tensors(
    engine: Any,
    tensors: _RankFiles,
    logical: _LogicalTensors,
    writes_replicated: bool,
    exclude_frozen: bool,
) -> None:
    """Frozen parameters and persistent buffers (the state dict less every parameter name, second
    names of tied ones too), whole: one copy each, written by its first holder."""
    managed = set(engine.optimizer.params)
    param_names = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    whole = [
        ("buffer", "buffer", n, b)
        for n, b in engine.module.state_dict(keep_vars=True).items()
        if n not in param_names and isinstance(b, torch.Tensor)
    ]
    if not exclude_frozen:
        managed.update(p for store in engine.untrained_shards for p in store.plan.params)
        frozen = [(n, p) for n, p in engine.module.named_parameters() if p not in managed]
        whole += [("param", "frozen", n, p) for n, p in frozen]
        _collect_untrained_shards(engine, tensors, logical)
    for kind, prefix, module_name, value in whole:
        name, first_holder = _checkpoint_name(engine, module_name, writes_replicated)
        if first_holder:
            key = f"{prefix}.{name}"
            tensors[key] = value.detach().reshape(-1)
            # A frozen parameter split over tensor-parallel ranks is saved as a piece of the whole.
            stored_name = logical.stored_name(f"{kind}/{name}", module_name)
            logical.add(stored_name, key, value, (0, value.numel(), 0), value.shape)


def _untrained_pieces(engine: Any) -> Iterator[tuple[Any, int, list[Any]]]:
    """Stage 3's shards of the parameters no optimizer steps (`zero.stores.shard_untrained`):
    (the shard store, a region, the parameter elements this rank holds of it, as `master_pieces`
    gives them)."""
    for store in engine.untrained_shards:
        plan, shard = store.plan, store.sharded_params.store
        for master, pieces in zip(plan.masters, plan.master_pieces()):
            yield shard, master.region, pieces


def _collect_untrained_shards(engine: Any, tensors: _RankFiles, logical: _LogicalTensors) -> None:
    """Each rank writes its own shards of the frozen parameters stage 3 partitions, as pieces
    of them: no gather, and each rank writes 1/N."""
    shapes = dict(engine.module.named_parameters())
    for j, (shard, region, pieces) in enumerate(_untrained_pieces(engine)):
        key = f"frozen.shard.{j}"
        tensors[key] = value = shard.piece(region)
        for name, start, offset, length in pieces:
            stored = logical.stored_name(f"param/{name}", name)
            logical.add(stored, key, value, (start, length, offset), shapes[name].ds_shape)


def _shared_state(
    engine: Any,
    tensors: _RankFiles,
    client_state: dict[str, Any] | None,
    scalars: list[dict[str, Any]],
) -> dict[str, Any]:
    """The training state every rank shares (rank 0 saves it): optimizer hyperparameters, loss
    scaler, scheduler, counters, data loader position and the caller's `client_state`."""
    return {
        "optimizer": _optimizer_json(engine.optimizer, tensors, scalars),
        "loss_scaler": encode(engine.optimizer.loss_scaler.state_dict(), tensors, "extra."),
        "lr_scheduler": encode(
            engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            tensors,
            "extra.",
        ),
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "_first_micro_step": engine._first_micro_step,
        },
        "data_loader": (
            engine.training_dataloader.state_dict()
            if engine.training_dataloader is not None
            else None
        ),
        "client_state": encode(client_state or {}, tensors, "client.", "client_state"),
    }


def _optimizer_json(
    zopt: Any, tensors: dict[str, torch.Tensor], scalars: list[dict[str, Any]]
) -> dict[str, Any]:
    """Hyperparameters and per-group scalar states (`group_scalars`) of the torch optimizer."""
    groups = [
        {"hyper": encode({k: v for k, v in group.items() if k != "params"}, tensors, "extra.")}
        for group in zopt.optimizer.param_groups
    ]
    for group, values in zip(groups, scalars):
        group["scalars"] = values
    return {"type": type(zopt.optimizer).__name__, "groups": groups}


def group_scalars(zopt: Any) -> list[dict[str, Any]]:
    """Each param group's scalar states (such as Adam's step), from the first master holding
    them. Collective where groups are stepped on whole tensors: a rank may own none of a group's
    tensors, so every rank's are merged, in rank order."""
    mine = []
    for group in zopt.optimizer.param_groups:
        scalars: dict[str, Any] = {}
        for master in group["params"]:
            for n, v in zopt.optimizer.state.get(master, {}).items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    scalars.setdefault(n, float(v) if isinstance(v, torch.Tensor) else v)
        mine.append(scalars)
    if not any(zopt.plan.region_whole):
        return mine
    merged: list[dict[str, Any]] = [{} for _ in mine]
    for ranks in all_gather_json(mine, group=zopt.dp_group):
        for into, scalars in zip(merged, ranks):
            for n, v in scalars.items():
                into.setdefault(n, v)
    return merged


def _place_pieces(
    logical: dict[str, dict[str, Any]], where: dict[str, tuple[str, int, str]]
) -> dict[str, dict[str, Any]]:
    """Turn (key, start, length, element offset) into Pieces with files and absolute byte offsets."""
    placed = {}
    for name, entry in logical.items():
        pieces = []
        for key, start, length, element_offset in entry["pieces"]:
            file, byte_offset, dtype = where[key]
            offset = byte_offset + element_offset * _itemsize(dtype)
            pieces.append(Piece(file, offset, start, length, dtype).to_json())
        placed[name] = {**entry, "pieces": pieces}
    return placed


def _itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def publish_tag(
    engine: Any,
    root: Path,
    partial: Path,
    tag: str,
    reports: list[dict[str, Any]],
    save_latest: bool,
    exclude_frozen: bool,
) -> None:
    """Rank 0: write the manifest, rename the partial directory to a new name, point `latest` at
    it, then remove the tag's older copies."""
    tensors: dict[str, dict[str, Any]] = {}
    files: dict[str, Any] = {}
    for report in reports:
        files.update(report["file"])
        for name, entry in report["tensors"].items():
            merged = tensors.setdefault(name, {**entry, "pieces": []})
            # A weight tied across pipeline stages is written by each: keep one copy of a range.
            have = {tuple(p[2:4]) for p in merged["pieces"]}  # (start, length)
            merged["pieces"].extend(p for p in entry["pieces"] if tuple(p[2:4]) not in have)
    splits: dict[str, dict[str, Any]] = {}
    for report in reports:
        for name, split in report["rank_state"].pop("splits").items():
            splits[name] = {
                "dim": split["dim"],
                "stride": split["stride"],
                "parts": [f"tp/{name}/{r}" for r in range(split["parts"])],
            }
    whole_states: dict[str, list[str]] = {}
    for report in reports:
        whole_states.update(report["rank_state"].pop("whole_states"))
    shared = reports[0]["shared"]
    shared["optimizer"]["whole_states"] = whole_states
    zopt = engine.optimizer
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "written_by": {
            "world_size": get_world_size(),
            "dp_world_size": engine.dp_world_size,
            "pipeline_stages": engine.topology.num_stages,
            "tensor_parallel": engine.topology.tp_world_size,
            "zero_stage": zopt.stage,
            "model_dtype": DTYPE_NAMES[zopt.params[0].dtype],
            "exclude_frozen_parameters": exclude_frozen,
        },
        "aliases": _aliases(engine.module),
        "files": files,
        "tensors": tensors,
        "splits": splits,
        "ranks": [r["rank_state"] for r in reports],
        **shared,
    }
    write_manifest(partial, manifest)
    fsync_dir(partial)
    # The tag goes into a directory of a name not in use, so that `latest` can name the old copy
    # until it names the new one: `<tag>`, or `<tag>@<k>` when the tag was saved before.
    named = _named(root, tag)
    taken = [k for k, _, _ in named if k >= 0]
    final = root / (tag if not taken else f"{tag}@{max(taken) + 1}")
    partial.rename(final)
    fsync_dir(root)
    # Older copies of the tag, and what an interrupted removal of one left (no manifest).
    older = [path for _, path, saved in named if saved in (tag, None)]
    if save_latest or read_latest(root) in {path.name for path in older}:
        _write_latest(root, final.name)
    for path in older:
        shutil.rmtree(path, ignore_errors=True)
    _write_recovery_script(root)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(root / LATEST)
    fsync_dir(root)


# What DeepSpeed users (and transformers' Trainer, in its messages) run from a checkpoint folder.
RECOVERY_SCRIPT = "zero_to_fp32.py"
_RECOVERY_SOURCE = '''#!/usr/bin/env python
"""Written by shardspeed beside its checkpoints, as DeepSpeed writes its own: consolidate a
checkpoint into one fp32 state dict (safetensors; nothing is unpickled).

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--tag TAG] [--max_shard_size 5GB]

CHECKPOINT_DIR is the folder holding `latest` (this one: `.`). See
`python -m shardspeed.utils.zero_to_fp32 --help`.
"""

import sys

from shardspeed.utils.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


def _write_recovery_script(root: Path) -> None:
    """Rank 0: put `zero_to_fp32.py` in the checkpoint folder (atomically; once)."""
    target = root / RECOVERY_SCRIPT
    if target.exists() and target.read_text() == _RECOVERY_SOURCE:
        return
    tmp = root / f".{RECOVERY_SCRIPT}.tmp"
    tmp.write_text(_RECOVERY_SOURCE)
    tmp.chmod(0o755)
    tmp.replace(target)


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """Second names of shared parameters (a tied head), each mapped to the name that is saved."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy

        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    except ImportError:
        pass
    return state


# -- loading --------------------------------------------------------------------------------------


def resolve_tag(load_dir: str, tag: str | None) -> Path | None:
    """The directory of `load_dir` that holds `tag`, or, with no tag, the one `latest` names (None
    when there is no `latest`). A re-saved tag lives in `<tag>@<k>`; when `latest` names a
    directory that is gone (an interrupted save of an earlier version), the newest complete copy
    of its tag is taken."""
    root = Path(load_dir)
    if tag is None:
        name = read_latest(root)
        if name is None:
            return None
        check_tag_name(name, root, f"{root / LATEST} names '{name}', which")
        if (root / name / MANIFEST).exists():
            return root / name
        base, at, generation = name.rpartition("@")
        tags = [name, base] if at and generation.isdigit() else [name]
        copies = sorted(c for t in tags for c in _copies(root, t))
        if not copies:
            raise CheckpointError(
                f"{root / LATEST} names '{name}', but {root / name} holds no checkpoint (no "
                f"{MANIFEST}) and no other complete copy of that tag is there: name a tag to load"
            )
        logger.warning(f"{root / LATEST} names '{name}', which is missing: loading {copies[-1][1]}")
        return copies[-1][1]
    tag = str(tag)
    check_tag_name(tag, root)
    copies = _copies(root, tag)
    if copies:
        return copies[-1][1]
    path = root / tag
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{path}: no checkpoint there (no {MANIFEST})")
    return path  # a tag directory renamed by hand: its manifest names another tag


def read_latest(root: Path) -> str | None:
    """What `<root>/latest` says (the directory of the latest save), or None without one."""
    try:
        return (root / LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _named(root: Path, tag: str) -> list[tuple[int, Path, str | None]]:
    """The entries of `root` named as a copy of `tag` would be, oldest first: (generation, path,
    the tag its manifest names or None); generation -1 for `.<tag>.old` (left by an earlier
    version's interrupted save), 0 for `<tag>`, k for `<tag>@<k>`."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        if name == tag:
            generation = 0
        elif name == f".{tag}.old":
            generation = -1
        elif name.startswith(f"{tag}@") and name[len(tag) + 1 :].isdigit():
            generation = int(name[len(tag) + 1 :])
        else:
            continue
        found.append((generation, root / name, _manifest_tag(root / name)))
    return sorted(found)


def _copies(root: Path, tag: str) -> list[tuple[int, Path]]:
    """The complete copies of `tag` in `root`, oldest first: those whose manifest names it."""
    return [(k, path) for k, path, saved in _named(root, tag) if saved == tag]


def _manifest_tag(path: Path) -> str | None:
    try:
        tag = json.loads((path / MANIFEST).read_text()).get("tag")
    except (OSError, ValueError, AttributeError):
        return None
    return tag if isinstance(tag, str) else None


def open_checkpoint(path: Path) -> tuple[dict[str, Any], TensorSource]:
    """Tag directory `path`'s validated manifest (`read_manifest`: refused before anything is
    read when any field is wrong) and its tensors."""
    manifest = read_manifest(path)
    reader = ByteReader(path, manifest["files"])
    return manifest, TensorSource(reader, manifest["tensors"], manifest["splits"])


def _open_validated_once(
    path: Path, doing: str
) -> tuple[dict[str, Any], TensorSource, dict[str, Any] | None, list[str]]:
    """`open_checkpoint` for every rank of a load, each rank's cost independent of the world:
    rank 0 validates the tag (`read_manifest`: every file's size and header, every piece), and
    checks that the index is the manifest's (`check_index`); it shares its verdict, the index's
    checksum. Every other rank reads the index's first line, checks that it is the one rank 0
    validated, and then reads just the rows it needs (`ManifestIndex`). Without a matching index
    (a checkpoint of an earlier version, an edited manifest), the verdict is the manifest's
    checksum, and every rank parses the manifest.

    Returns the manifest (less `files`, `ranks` and pieces when read through the index), the
    tensors, this rank's entry of `ranks` (None when the save had fewer ranks) and the files of
    rank 0 and of this rank, where the tensors of the JSON state lie."""
    rank = get_rank()
    verdict: dict[str, Any] = {"rank": 0, "error": None, "index": False, "checksum": None}
    manifest: Any = None
    index: ManifestIndex | None = None
    try:
        if rank == 0:
            manifest = read_manifest(path)
            verdict["checksum"] = check_index(path, manifest)
            verdict["index"] = verdict["checksum"] is not None
        elif (path / INDEX).exists():
            index = ManifestIndex(path)
            verdict.update(index=True, checksum=index.checksum)
        if not verdict["index"]:
            manifest = manifest if rank == 0 else parse_manifest(path)
            verdict["checksum"] = (
                manifest_checksum(manifest) if isinstance(manifest, dict) else None
            )
    except Exception as err:
        verdict["error"] = _error_text(err)
    mine, my_error = verdict["checksum"], verdict["error"]
    verdict = broadcast_json(verdict)
    _raise_if_any_failed([verdict], doing)
    with _agreed(doing):
        if my_error:  # rank 0 read the tag, this rank could not
            raise CheckpointError(my_error)
        if index is not None and not verdict["index"]:  # rank 0 found the index stale
            index, manifest = None, parse_manifest(path)
            mine = manifest_checksum(manifest) if isinstance(manifest, dict) else None
        if mine != verdict["checksum"]:
            raise CheckpointError(
                f"{path / (INDEX if verdict['index'] else MANIFEST)} is not the one rank 0 "
                "validated (it changed while loading, or this node sees another copy of the "
                "directory): load again, from a directory every node sees alike"
            )
    if index is not None:
        reader = ByteReader(path, index.files)
        manifest = index.manifest
        source = TensorSource(reader, manifest["tensors"], manifest["splits"], index.pieces)
        entry, own = index.rank(rank)
        return manifest, source, entry, [*index.rank(0)[1], *(own if rank else [])]
    reader = ByteReader(path, manifest["files"])
    source = TensorSource(reader, manifest["tensors"], manifest["splits"])
    entry = manifest["ranks"][rank] if rank < len(manifest["ranks"]) else None
    return manifest, source, entry, [n for n in manifest["files"] if rank_of_file(n) in (0, rank)]


def load_engine(
    engine: Any,
    load_dir: str,
    tag: str | None,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[str | None, dict[str, Any] | None]:
    """`engine.load_checkpoint`: every rank reads what its layout holds. A DeepSpeed checkpoint
    is converted first (`deepspeed.imported`: each rank reads it once, into a temporary
    shardspeed checkpoint) and loaded from that."""
    require_states(engine, "load_checkpoint")
    options = (
        load_module_strict,
        load_optimizer_states,
        load_lr_scheduler_states,
        load_module_only,
    )
    # Rank 0 alone reads DeepSpeed's `latest`, as it does ours (`_load`).
    deepspeed_tag = _decided_by_rank_0(
        lambda: _name_of(deepspeed_tag_dir(Path(load_dir), tag)),
        f"loading checkpoint from {load_dir}",
    )
    if deepspeed_tag is None:
        return _load(engine, load_dir, tag, *options)
    with imported(Path(load_dir), deepspeed_tag) as converted:
        if converted is None:  # changed on disk since rank 0 looked
            return _load(engine, load_dir, tag, *options)
        logger.info("loading DeepSpeed checkpoint %s/%s", load_dir, converted[1])
        _, client_state = _load(engine, str(converted[0]), converted[1], *options)
        return str(Path(load_dir) / converted[1]), client_state


def _name_of(path: Path | None) -> str | None:
    return None if path is None else path.name


def _load(
    engine: Any,
    load_dir: str,
    tag: str | None,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[str | None, dict[str, Any] | None]:
    # Rank 0 finds the directory and tells the others: every rank reads the same one, even when
    # `latest` changes meanwhile, and all fail alike when there is none.
    name = _decided_by_rank_0(
        lambda: _name_of(resolve_tag(load_dir, tag)), f"loading checkpoint from {load_dir}"
    )
    if name is None:
        logger.warning(f"no '{LATEST}' file in {load_dir}: nothing loaded")
        return None, None
    path = Path(load_dir) / name
    doing = f"loading checkpoint {path}"
    manifest, source, rank_entry, state_files = _open_validated_once(path, doing)
    if engine.run_config.checkpoint.load_universal:
        logger.info("checkpoint.load_universal: every shardspeed checkpoint is universal already")
    pieces = load_parameters(
        engine,
        source,
        load_module_strict,
        f"checkpoint {manifest['tag']}",
        manifest["written_by"]["exclude_frozen_parameters"],
    )

    # The tensors a load restores from JSON sit in rank 0's files (client state, scheduler) and
    # in this rank's (its RNG states): read those headers first, and no others unless needed.
    read_extra = StoredTensors(source.reader, state_files).get

    with _agreed(doing):  # also the load's last barrier
        if not load_module_only:
            _load_training_state(
                engine,
                manifest,
                source,
                pieces,
                read_extra,
                (load_optimizer_states, load_lr_scheduler_states),
                rank_entry,
            )
        client_state = decode(manifest["client_state"], read_extra)
    return str(path), client_state


def _load_training_state(
    engine: Any,
    manifest: dict[str, Any],
    source: TensorSource,
    pieces: list[list[tuple[str, int, int, int]]],
    read_extra: Callable[[str], torch.Tensor],
    options: tuple[bool, bool],
    rank_entry: dict[str, Any] | None,
) -> None:
    """Optimizer, loss scaler, LR scheduler, counters, data loader position and this rank's RNG
    (from `rank_entry`, its entry of the manifest's `ranks`), as `options` (load optimizer
    states, load LR scheduler states) say."""
    load_optimizer_states, load_lr_scheduler_states = options
    zopt = engine.optimizer
    if load_optimizer_states:
        _load_optimizer(zopt, manifest, source, pieces, read_extra, _piece_reader(engine, source))
        zopt.loss_scaler.load_state_dict(decode(manifest["loss_scaler"], read_extra))
    if load_lr_scheduler_states and engine.lr_scheduler is not None and manifest["lr_scheduler"]:
        engine.lr_scheduler.load_state_dict(decode(manifest["lr_scheduler"], read_extra))
    for key, value in manifest["counters"].items():
        setattr(engine, key, value)
    # Accumulation windows start afresh: the saved count was in the saving run's
    # accumulation steps, which a load at another world size or batch split changes.
    engine._first_micro_step = engine.micro_steps
    if engine.training_dataloader is not None and manifest["data_loader"] is not None:
        engine.training_dataloader.load_state_dict(manifest["data_loader"])
    if rank_entry is not None:
        _set_rng_state(decode(rank_entry["rng"], read_extra))


def load_parameters(
    engine: Any, source: TensorSource, strict: bool, label: str, exclude_frozen: bool = False
) -> list[list[tuple[str, int, int, int]]]:
    """Read `param/<name>` and `buffer/<name>` from `source` into the engine's model, each rank only
    the element ranges its master tensors hold; returns those ranges (`master_pieces`)."""
    zopt = engine.optimizer
    pieces = zopt.master_pieces()
    read = _piece_reader(engine, source)
    with _agreed(f"loading {label}"), torch.no_grad():
        _check_names(engine, source, strict, label, exclude_frozen)
        for k, own in enumerate(pieces):
            with zopt.writable_master(k) as flat:
                for name, start, offset, length in own:
                    if f"param/{name}" in source:
                        flat[offset : offset + length] = read(f"param/{name}", name, start, length)
        managed = set(zopt.params)
        managed.update(p for store in engine.untrained_shards for p in store.plan.params)
        for shard, region, own in _untrained_pieces(engine):
            flat = shard.piece(region).clone()
            for name, start, offset, length in own:
                if f"param/{name}" in source:
                    flat[offset : offset + length] = read(f"param/{name}", name, start, length)
            shard.write(region, flat)
        for module_name, p in engine.module.named_parameters():
            key = f"param/{_checkpoint_name(engine, module_name)[0]}"
            if p not in managed and key in source:  # frozen: this rank's piece, whole
                p.copy_(read(key, module_name, 0, p.numel()).view_as(p))
        for module_name, b in engine.module.named_buffers():
            key = f"buffer/{_checkpoint_name(engine, module_name)[0]}"
            if key in source:
                b.copy_(source.read_whole(key))
    zopt.publish()
    for store in engine.untrained_shards:
        store.publish(None)
    return pieces


def _checkpoint_name(engine: Any, module_name: str, first_replica: bool = True) -> tuple[str, bool]:
    """(checkpoint name, whether this rank writes it) of a whole tensor held in the model: an
    expert-parallel expert's is its global name, written by its expert-data group's first rank;
    any other keeps its module name, written by the first replica."""
    expert = engine.expert_tensor_names.get(module_name)
    return expert if expert is not None else (module_name, first_replica)


def parameter_splits(engine: Any) -> dict[str, tuple[Split, int]]:
    """The engine's parameters held as pieces, by name: how each is cut and which piece this
    rank holds. Tensor-parallel slices (piece: the tensor-parallel rank), and the fused expert
    tensors of expert-parallel Hugging Face blocks (a run of experts on the first dimension;
    piece: the expert-parallel rank)."""
    parts, tp_rank = engine.topology.tp_world_size, engine.topology.tp_rank
    splits = {
        name: (Split(p.partition_dim, parts, getattr(p, "partition_stride", 1)), tp_rank)
        for name, p in engine.module.named_parameters()
        if getattr(p, "tensor_model_parallel", False) and parts > 1
    }
    for name, (pieces, index, *_) in engine.experts.splits.items():
        splits[name] = (Split(0, pieces), index)
    return splits


def _piece_reader(engine: Any, source: TensorSource) -> Any:
    """read(logical name, parameter name, start, length) of this rank's piece of a parameter:
    its slice of the whole (whatever split it was saved with), or all of it."""
    splits = parameter_splits(engine)

    def read(logical: str, name: str, start: int, length: int) -> torch.Tensor:
        split, index = splits.get(name, (None, 0))
        return source.read_piece(logical, split, index, start, length)

    return read


def _check_names(
    engine: Any, source: TensorSource, strict: bool, label: str, exclude_frozen: bool
) -> None:
    saved = {n[len("param/") :] for n in source.names("param/")}
    zopt = engine.optimizer
    managed = set(zopt.params)
    # Parameters by checkpoint name: the optimizer's names (an expert-parallel expert is called
    # by its global index), and frozen parameters by their module names.
    params = dict(zip(zopt.param_names, zopt.params))
    params.update(
        (_checkpoint_name(engine, n)[0], p)
        for n, p in engine.module.named_parameters()
        if p not in managed
    )
    model = set(params)
    if exclude_frozen:
        model = {n for n, p in params.items() if p.requires_grad}
    # Second names of shared parameters and buffers may be present without being parameters.
    buffers = {_checkpoint_name(engine, n)[0] for n, _ in engine.module.named_buffers()}
    known = model | set(_aliases(engine.module)) | buffers
    if engine.topology.num_stages > 1 or engine.expert_tensor_names:
        # A name is expected if any rank holds it (another stage, other experts).
        known = set().union(*map(set, all_gather_json(sorted(known))))
    missing, unexpected = sorted(model - saved), sorted(saved - known)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{label} does not match the model (strict loading): "
            f"missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    shapes = dict(zip(zopt.param_names, zopt.layout.shapes))
    splits = parameter_splits(engine)
    expected = {}
    for name in model & saved:
        # (A frozen parameter partitioned at stage 3 reads as empty: `ds_shape` is its own.)
        shape = tuple(shapes.get(name, getattr(params[name], "ds_shape", params[name].shape)))
        expected[f"param/{name}"] = splits[name][0].whole_shape(shape) if name in splits else shape
    for module_name, b in engine.module.named_buffers():
        key = f"buffer/{_checkpoint_name(engine, module_name)[0]}"
        if key in source:
            expected[key] = tuple(b.shape)
    # A shardspeed checkpoint's shapes are its manifest's; a foreign file's, its own header's.
    where = f" ({source.reader.directory / MANIFEST})" if source.reader.files is not None else ""
    for key, shape in sorted(expected.items()):
        if shape != source.shape(key):
            kind, name = key.split("/", 1)
            raise CheckpointError(
                f"{label}{where}: tensors['{key}'].shape is {list(source.shape(key))}, the "
                f"model's {kind} '{name}' has {list(shape)}: the checkpoint is of another model, "
                "or was edited"
            )


def _load_optimizer(
    zopt: Any,
    manifest: dict[str, Any],
    source: TensorSource,
    pieces: list[list[tuple[str, int, int, int]]],
    read_extra: Any,
    read: Any,
) -> None:
    saved = manifest["optimizer"]
    groups = zopt.optimizer.param_groups
    if len(saved["groups"]) != len(groups):
        raise CheckpointError(
            f"checkpoint {manifest['tag']} has {len(saved['groups'])} optimizer param groups, "
            f"the optimizer {len(groups)}"
        )
    state_names = sorted({n.split("/")[1] for n in source.names("optim/")})
    index = {id(m): i for i, m in enumerate(zopt.masters)}
    state: dict[int, dict[str, Any]] = {}
    flat_ids = []
    for g, group in enumerate(groups):
        scalars = saved["groups"][g]["scalars"]
        for master in group["params"]:
            k = index.get(id(master))
            flat_ids.append(len(flat_ids))
            if k is None:
                continue
            entry: dict[str, Any] = {
                n: torch.tensor(v) if isinstance(v, float) else v for n, v in scalars.items()
            }
            numel = zopt.master_numel(k)
            param = zopt.plan.masters[k].param
            for n in state_names:
                if param is not None:  # one whole parameter: its own states, in their shapes
                    key = f"optim/{n}/{zopt.param_names[param]}"
                    if key not in source:
                        continue  # a state other tensors keep (Adafactor's by shape, Muon's by half)
                    if source.shape(key) != source.shape(f"param/{zopt.param_names[param]}"):
                        entry[n] = source.read_whole(key).view(source.shape(key)).to(master.device)
                        continue
                values = torch.zeros(numel, dtype=torch.float32)
                for name, start, offset, length in pieces[k]:
                    if f"optim/{n}/{name}" in source:
                        values[offset : offset + length] = read(
                            f"optim/{n}/{name}", name, start, length
                        )
                entry[n] = (values.view(master.shape) if master.numel() == numel else values).to(
                    master.device
                )
            if entry:
                state[flat_ids[-1]] = entry
    param_groups = []
    cursor = 0
    for g, group in enumerate(groups):
        hyper = decode(saved["groups"][g]["hyper"], read_extra)
        for k, v in hyper.items():
            if isinstance(group.get(k), tuple) and isinstance(v, list):
                hyper[k] = tuple(v)
        ids = list(range(cursor, cursor + len(group["params"])))
        cursor += len(group["params"])
        param_groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, **hyper, "params": ids}
        )
    zopt.load_optimizer_state({"state": state, "param_groups": param_groups})


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].to(torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8))
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
