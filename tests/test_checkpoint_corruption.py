"""Corrupt checkpoints are refused before anything loads, at load and by `shardspeed-ckpt verify`
alike, with the message naming the manifest field or the file.

Two layers. The manifest's checksum catches an edit that does not update it (bit rot, a hand
edit): those cases leave the checksum stale. Field validation catches an edit that does update
it yet leaves a field wrong (a piece outside its file, a deleted optimizer state, a file name
leading out of the tag, a shape the model does not have): those cases rewrite the checksum.
One tiny checkpoint per ZeRO stage is saved once, at world size 1 in this process; each case
corrupts a copy. One 2-rank case runs through the rank pool.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from reference_training import SCHEDULE, batch, config
from shardspeed.checkpoint import CheckpointError
from shardspeed.checkpoint.cli import main as ckpt
from shardspeed.checkpoint.deepspeed import import_deepspeed
from shardspeed.checkpoint.format import (
    CHECKSUM,
    INDEX,
    MANIFEST,
    STALE_INDEX_WARNING,
    UNCHECKSUMMED_WARNING,
    manifest_checksum,
)
from shardspeed.testing import RankFailure

TAG = "global_step1"
RANK0 = "rank00000.safetensors"
DEEPSPEED_FIXTURE = Path(__file__).parent / "data" / "deepspeed_checkpoints" / "z0_fp32_ws1"


def make_model() -> nn.Module:
    """A frozen parameter (no optimizer state) and buffers beside trained parameters; `0.bias`
    and `1.weight` have one shape, so their pieces can be swapped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    model[3].bias.requires_grad_(False)
    return model


def zero(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def run(stage: int, save: str | None = None, load: str | None = None) -> int:
    """Load `load` or else take one step and save to `save`; returns the engine's global steps."""
    engine, *_ = shardspeed.initialize(
        model=make_model(), config=config(8 // _world(), scheduler=SCHEDULE, **zero(stage))
    )
    if load is not None:
        engine.load_checkpoint(load)
        return engine.global_steps
    x, y = batch(0)
    micro = 8 // _world()
    rank = engine.global_rank
    mine = slice(rank * micro, (rank + 1) * micro)
    engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
    engine.step()
    engine.save_checkpoint(save)
    return engine.global_steps


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, Path]:
    """A save directory per ZeRO stage, written once."""
    dirs = {}
    for stage in (0, 3):
        dirs[stage] = tmp_path_factory.mktemp(f"stage{stage}") / "ckpt"
        run(stage, save=str(dirs[stage]))
    return dirs


# -- corruptions ------------------------------------------------------------------------------------


def edit(change: Callable[[dict[str, Any]], Any], checksum: bool) -> Callable[[Path], None]:
    """Apply `change` to the manifest; `checksum`: re-write the checksum to match the edit."""

    def corrupt(tag_dir: Path) -> None:
        manifest = json.loads((tag_dir / MANIFEST).read_text())
        change(manifest)
        if checksum:
            manifest[CHECKSUM] = manifest_checksum(manifest)
        (tag_dir / MANIFEST).write_text(json.dumps(manifest))

    return corrupt


def piece(name: str) -> Callable[[dict[str, Any]], list]:
    return lambda m: m["tensors"][name]["pieces"][0]


def move_offset(by: int, shorten: int = 0) -> Callable[[dict[str, Any]], None]:
    """Move `param/0.weight`'s piece `by` bytes on, `shorten` elements shorter (so that it
    still ends inside the stored tensor)."""

    def change(m: dict[str, Any]) -> None:
        piece("param/0.weight")(m)[1] += by
        piece("param/0.weight")(m)[3] -= shorten

    return change


def offset_past_end(m: dict[str, Any]) -> None:
    last = piece("param/3.weight")(m)
    last[1] = m["files"][last[0]]["bytes"] - 8


def swap_pieces(m: dict[str, Any]) -> None:
    a, b = m["tensors"]["param/0.bias"], m["tensors"]["param/1.weight"]
    a["pieces"], b["pieces"] = b["pieces"], a["pieces"]


def to_f16(m: dict[str, Any]) -> None:
    m["tensors"]["param/0.weight"]["dtype"] = "F16"
    piece("param/0.weight")(m)[4] = "F16"


def reshape(*names: str, shape: list[int]) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        for name in names:
            m["tensors"][name]["shape"] = shape

    return change


def delete(*names: str) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        for name in names:
            del m["tensors"][name]

    return change


def set_value(*path: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = value

    return change


def rename_file(new: Callable[[Path], str], place: bool = True) -> Callable[[Path], None]:
    """List rank 0's file under the name `new(tag_dir)` (checksum re-written), with the real file
    put where that name leads: a load that followed the name would read it."""

    def corrupt(tag_dir: Path) -> None:
        name = new(tag_dir)
        if place:
            shutil.copy(tag_dir / RANK0, tag_dir / name)

        def change(m: dict[str, Any]) -> None:
            m["files"][name] = m["files"].pop(RANK0)
            for entry in m["tensors"].values():
                for p in entry["pieces"]:
                    if p[0] == RANK0:
                        p[0] = name

        edit(change, checksum=True)(tag_dir)

    return corrupt


def symlink_out(tag_dir: Path) -> None:
    outside = tag_dir.parent / "outside.safetensors"
    (tag_dir / RANK0).rename(outside)
    (tag_dir / RANK0).symlink_to(outside)


def flip_byte(tag_dir: Path) -> None:
    data = bytearray((tag_dir / RANK0).read_bytes())
    data[-5] ^= 0xFF
    (tag_dir / RANK0).write_bytes(bytes(data))


def truncate(tag_dir: Path) -> None:
    (tag_dir / RANK0).write_bytes((tag_dir / RANK0).read_bytes()[:-100])


def not_json(tag_dir: Path) -> None:
    (tag_dir / MANIFEST).write_text((tag_dir / MANIFEST).read_text()[:-40])


@dataclass(frozen=True)
class Case:
    corrupt: Callable[[Path], None]
    message: str  # a regular expression the load error and `verify` output both match
    verify: bool = True  # False: only a load, which knows the model, can tell


STALE = r"checksum: .* does not match the manifest's content"
CASES = {
    # Edits that leave the checksum stale: the checksum catches them, whatever they change.
    "offset moved": Case(edit(move_offset(4), checksum=False), STALE),
    "pieces of two parameters swapped": Case(edit(swap_pieces, checksum=False), STALE),
    "dtype changed": Case(edit(to_f16, checksum=False), STALE),
    "shape changed": Case(edit(reshape("param/3.weight", shape=[16, 4]), False), STALE),
    "optimizer entry deleted": Case(edit(delete("optim/exp_avg/0.weight"), False), STALE),
    "global_steps changed": Case(
        edit(set_value("counters", "global_steps", value=1000), checksum=False), STALE
    ),
    "lr changed": Case(
        edit(set_value("optimizer", "groups", 0, "hyper", "lr", value=1.0), False), STALE
    ),
    "scheduler changed": Case(
        edit(set_value("lr_scheduler", "last_batch_iteration", value=50), False), STALE
    ),
    "checksum altered": Case(edit(set_value(CHECKSUM, value="sha256:" + "0" * 64), False), STALE),
    "checksum removed": Case(
        edit(lambda m: m.pop(CHECKSUM), checksum=False),
        r"checksum: missing, which a version 2 manifest always has",
    ),
    # Edits with the checksum re-written: field validation catches them.
    "offset past the end of the file": Case(
        edit(offset_past_end, checksum=True),
        r"tensors\['param/3.weight'\]\.pieces\[0\]: bytes \d+\.\.\d+ lie past the end of "
        r"rank0000\d\.safetensors",
    ),
    "offset off the element grid": Case(
        edit(move_offset(2, shorten=1), checksum=True),
        r"tensors\['param/0.weight'\]\.pieces\[0\]: .* not on a F32 element",
    ),
    "offset into the header": Case(
        edit(set_value("tensors", "param/0.bias", "pieces", 0, 1, value=8), checksum=True),
        r"tensors\['param/0.bias'\]\.pieces\[0\]: bytes 8\.\.72 are not inside one tensor stored",
    ),
    "dtype changed, checksum re-written": Case(
        edit(to_f16, checksum=True),
        r"tensors\['param/0.weight'\]\.pieces\[0\]: .* lie in .*'s F32 tensor",
    ),
    "unknown dtype": Case(
        edit(set_value("tensors", "param/0.bias", "dtype", value="F8"), checksum=True),
        r"tensors\['param/0.bias'\]\.dtype: unknown dtype 'F8'",
    ),
    "element count changed": Case(
        edit(reshape("param/3.weight", shape=[4, 15]), checksum=True),
        r"tensors\['param/3.weight'\]\.pieces: do not cover its 60 elements exactly once",
    ),
    "parameter shape unlike its optimizer states": Case(
        edit(reshape("param/3.weight", shape=[16, 4]), checksum=True),
        r"tensors\['optim/exp_avg/3.weight'\]: has shape \[4, 16\], its parameter "
        r"'param/3.weight' \[16, 4\]",
    ),
    "shape unlike the model's": Case(
        edit(
            reshape(
                "param/3.weight",
                "optim/exp_avg/3.weight",
                "optim/exp_avg_sq/3.weight",
                shape=[16, 4],
            ),
            checksum=True,
        ),
        r"tensors\['param/3.weight'\]\.shape is \[16, 4\], the model's param '3.weight' has "
        r"\[4, 16\]",
        verify=False,
    ),
    "buffer shape unlike the model's": Case(
        edit(reshape("buffer/1.running_mean", shape=[4, 4]), checksum=True),
        r"tensors\['buffer/1.running_mean'\]\.shape is \[4, 4\], the model's buffer "
        r"'1.running_mean' has \[16\]",
        verify=False,
    ),
    "one optimizer state deleted": Case(
        edit(delete("optim/exp_avg/0.weight"), checksum=True),
        r"tensors\['optim/exp_avg/0.weight'\]: missing: the optimizer state 'exp_avg' of "
        r"trained parameter '0.weight'",
    ),
    "every optimizer state of a parameter deleted": Case(
        edit(delete("optim/exp_avg/0.bias", "optim/exp_avg_sq/0.bias"), checksum=True),
        r"tensors\['optim/exp_avg_sq/0.bias'\]: missing",
    ),
    "section missing": Case(
        edit(lambda m: m.pop("counters"), checksum=True), rf"{MANIFEST}: counters: missing"
    ),
    "section missing, checksum stale": Case(
        edit(lambda m: m.pop("optimizer"), checksum=False), r"optimizer: missing"
    ),
    "section of the wrong type": Case(
        edit(set_value("optimizer", "groups", value={}), checksum=True),
        r"optimizer\.groups: is \{\}, not a list",
    ),
    "unknown counter": Case(
        edit(set_value("counters", "optimizer", value=1), checksum=True),
        r"counters\.optimizer: unknown counter",
    ),
    "piece in an unlisted file": Case(
        edit(set_value("tensors", "param/0.bias", "pieces", 0, 0, value="x"), checksum=True),
        r"tensors\['param/0.bias'\]\.pieces\[0\]: file 'x' is not a listed",
    ),
    "file name ../x": Case(
        rename_file(lambda tag_dir: "../stolen.safetensors"),
        r"files\['\.\./stolen\.safetensors'\]: does not name a file inside the tag directory",
    ),
    "absolute file name": Case(
        rename_file(lambda tag_dir: str(tag_dir.parent / "stolen.safetensors")),
        r"files\['/.*/stolen\.safetensors'\]: does not name a file inside the tag directory",
    ),
    "file name with a separator": Case(
        rename_file(lambda tag_dir: "sub/rank.safetensors", place=False),
        r"files\['sub/rank\.safetensors'\]: does not name a file inside the tag directory",
    ),
    "symbolic link out of the tag": Case(
        symlink_out, rf"files\['{RANK0}'\]: does not name a file inside the tag directory"
    ),
    # The files themselves.
    "flipped byte in a tensor file": Case(flip_byte, rf"{RANK0}: checksum mismatch in bytes 0\.\."),
    "truncated file": Case(truncate, rf"{RANK0}: \d+ bytes, the manifest says \d+ \(truncated"),
    "file missing": Case(lambda tag_dir: (tag_dir / RANK0).unlink(), rf"{RANK0}: missing"),
    "manifest not JSON": Case(not_json, rf"{MANIFEST}: not JSON"),
}


def corrupted(saved: dict[int, Path], stage: int, case: str, tmp_path: Path) -> Path:
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved[stage], save_dir)
    CASES[case].corrupt(save_dir / TAG)
    return save_dir


def verify(save_dir: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    status = ckpt(["verify", str(save_dir)])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_corruption_is_refused_by_load_and_verify(saved, tmp_path, capsys, stage, case):
    save_dir = corrupted(saved, stage, case, tmp_path)
    with pytest.raises(CheckpointError, match=CASES[case].message) as refused:
        run(stage, load=str(save_dir))
    assert TAG in str(refused.value)
    status, out = verify(save_dir, capsys)
    if CASES[case].verify:
        assert status == 1, out
        assert re.search(CASES[case].message, out), out
    else:
        assert status == 0, out


def test_intact_checkpoint_loads_and_verifies(saved, tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved[3], save_dir)
    assert run(3, load=str(save_dir)) == 1
    assert verify(save_dir, capsys) == (0, f"{TAG}: ok (1 files, " + _size(save_dir))


def _size(save_dir: Path) -> str:
    return f"{(save_dir / TAG / RANK0).stat().st_size:,} bytes checked)\n"


def test_consolidate_refuses_a_file_name_leading_out(saved, tmp_path, capsys):
    save_dir = corrupted(saved, 0, "file name ../x", tmp_path)
    capsys.readouterr()
    assert ckpt(["consolidate", str(save_dir), str(tmp_path / "out")]) == 2
    assert "'../stolen.safetensors'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_manifest_of_the_previous_version_loads_with_a_warning(saved, tmp_path, capsys, caplog):
    """Version 1 manifests had no checksum: read, fields validated, with a warning."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved[0], save_dir)

    def to_version_1(m: dict[str, Any]) -> None:
        del m[CHECKSUM]
        m["version"] = 1

    edit(to_version_1, checksum=False)(save_dir / TAG)
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        assert run(0, load=str(save_dir)) == 1
    assert f"{MANIFEST}: {UNCHECKSUMMED_WARNING}" in caplog.text
    status, out = verify(save_dir, capsys)
    assert status == 0 and f"warning: {MANIFEST} {UNCHECKSUMMED_WARNING}" in out, out

    edit(delete("optim/exp_avg/0.weight"), checksum=False)(save_dir / TAG)
    with pytest.raises(CheckpointError, match=r"tensors\['optim/exp_avg/0.weight'\]: missing"):
        run(0, load=str(save_dir))


def test_imported_deepspeed_checkpoint_has_a_valid_checksum(tmp_path, capsys):
    written = import_deepspeed(DEEPSPEED_FIXTURE, tmp_path / "imported")
    manifest = json.loads((written / MANIFEST).read_text())
    assert manifest[CHECKSUM] == manifest_checksum(manifest)
    status, out = verify(tmp_path / "imported", capsys)
    assert status == 0 and "ok" in out and "warning" not in out, out


def _corrupt_and_load(save_dir: str, case: str) -> None:
    if torch.distributed.get_rank() == 0:
        CASES[case].corrupt(Path(save_dir) / TAG)
    torch.distributed.barrier()
    run(2, load=save_dir)


@pytest.mark.parametrize("case", ["offset past the end of the file", "lr changed"])
def test_two_ranks_refuse_alike(pool2, tmp_path, case):
    save_dir = tmp_path / case.replace(" ", "_")
    pool2.run(run, 2, str(save_dir))
    with pytest.raises(RankFailure, match=r"failed on ranks \[0, 1\]") as failure:
        pool2.run(_corrupt_and_load, str(save_dir), case)
    assert str(failure.value).count("CheckpointError") >= 2
    assert re.search(CASES[case].message, str(failure.value))


def _edit_steps_and_load(save_dir: str) -> int:
    if torch.distributed.get_rank() == 0:
        edit(set_value("counters", "global_steps", value=7), checksum=True)(Path(save_dir) / TAG)
    torch.distributed.barrier()
    return run(2, load=save_dir)


def test_a_manifest_edited_after_the_save_is_read_whole_by_every_rank(pool2, tmp_path, capsys):
    """The index (what ranks other than 0 read) is derived from the manifest at save: after a
    valid edit of the manifest, rank 0 finds it stale and every rank reads the manifest; verify
    passes the tag and warns."""
    save_dir = tmp_path / "ckpt"
    pool2.run(run, 2, str(save_dir))
    assert pool2.run(_edit_steps_and_load, str(save_dir)) == [7, 7]
    status, out = verify(save_dir, capsys)
    assert status == 0 and f"warning: {save_dir / TAG / INDEX} {STALE_INDEX_WARNING}" in out, out
