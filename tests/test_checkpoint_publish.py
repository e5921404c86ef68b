"""Publishing a checkpoint: a crash at any file-system step of a save leaves `latest` loadable (the
old state or the new, bit for bit), tags resolve only inside the checkpoint directory, a failure on
one rank ends the save on all within seconds, all ranks load the one tag rank 0 resolved, and one
job at a time saves into a directory (its lock).

Crashes: `FileSystemSteps` sees every file-system step a rank takes during a save (mkdir, open for
writing, safetensors write, fsync, rename/replace, link, unlink, rmdir: the calls `os`, `io` and
`safetensors` offer, so steps in any checkpoint module count) and copies the save directory
before each. That copy is what a crash of that rank at that step leaves on disk: its earlier steps
done, that one and all later not. With 2 ranks the other rank's steps in flight are in the copy
as a crash would find them. (A rank that stopped there for real would leave its peers waiting in
a collective, so one save is recorded instead of one job per step.) A process that did not save
then reads each copy, and the saving job saves again into each.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardspeed
from reference_training import batch, config, make_model
from shardspeed.checkpoint import CheckpointError, fp32_state_dict, lock, resolve_tag
from shardspeed.checkpoint.format import write_manifest
from shardspeed.testing import RankPool

SCENARIOS = (("new_tag", "t2"), ("resaved_tag", "t1"))  # saved after tag t1 holds the old state


@pytest.fixture(scope="module")
def pool1():
    with RankPool(1) as pool:
        yield pool


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory) -> dict[str, Any]:
    """2 ranks, stage 2: `old` holds t1 (the old state); `new_tag/ckpt` t1 and t2 (the new
    state, latest); `resaved_tag/ckpt` t1@1 (the new state, latest)."""
    root = tmp_path_factory.mktemp("saved")
    recorded = pool2.run(record_saves, str(root), 2)
    return {"root": root, "old": recorded[0]["old"], "new": recorded[0]["new"]}


class FileSystemSteps:
    """While active, calls `before(n, what)` before the n-th file-system step this thread takes."""

    WRAPPED_OS = ("mkdir", "rename", "replace", "unlink", "remove", "rmdir", "fsync", "link")

    def __init__(self, before: Callable[[int, str], None]) -> None:
        self.before = before
        self.count = 0
        self._thread = threading.get_ident()
        self._inside = False  # the callback's own file operations are not steps

    def _wrap(self, fn: Callable, what: str, counts: Callable[..., bool]) -> Callable:
        def step(*args: Any, **kwargs: Any) -> Any:
            mine = threading.get_ident() == self._thread and not self._inside
            if mine and counts(*args, **kwargs):
                self.count += 1
                self._inside = True
                try:
                    self.before(self.count, f"{what} {args[0] if args else ''}")
                finally:
                    self._inside = False
            return fn(*args, **kwargs)

        return step

    def __enter__(self) -> FileSystemSteps:
        def always(*args: Any, **kwargs: Any) -> bool:
            return True

        def writes(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> bool:
            return any(c in mode for c in "wax+")

        def creates(path: Any, flags: int, *args: Any, **kwargs: Any) -> bool:
            return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

        targets = [(os, name, always) for name in self.WRAPPED_OS]
        targets += [(io, "open", writes), (builtins, "open", writes), (os, "open", creates)]
        targets += [(safetensors.torch, "save_file", always)]
        self._saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
        for module, name, counts in targets:
            setattr(module, name, self._wrap(getattr(module, name), name, counts))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in self._saved:
            setattr(module, name, fn)


# --- on the ranks ---------------------------------------------------------------------------------

_engine: dict[str, Any] = {}  # the engine of the last `record_saves` on this rank


def _build(stage: int) -> Any:
    world = dist.get_world_size()
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(8 // world, zero_optimization={"stage": stage}),
    )
    return engine


def _train_step(engine: Any, step: int) -> None:
    rank, world = engine.global_rank, engine.dp_world_size
    micro = 8 // world
    x, y = batch(step)
    x, y = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()


def _params(engine: Any) -> dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with shardspeed.zero.GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _copy_while_written(source: Path, destination: Path) -> None:
    """Copy `source` while another rank may be writing its own file into the save's partial
    directory: a file there that goes (renamed or removed) between listing and copying is left
    out of the copy, as a crash at that moment could leave it. Anywhere else, a copy error fails."""
    try:
        shutil.copytree(source, destination)
    except shutil.Error as errors:
        for src, _, why in errors.args[0]:
            if (
                ".partial" not in Path(src).relative_to(source).parts[0]
                or "No such file" not in why
            ):
                raise


def record_saves(root: str, stage: int) -> dict[str, Any]:
    """Save tag t1 (the old state) into `root/old`, train a step, then for each scenario save the
    new state into a copy of `root/old`, copying the directory before every file-system step."""
    base, rank = Path(root), dist.get_rank()
    engine = _build(stage)
    _train_step(engine, 0)
    engine.save_checkpoint(str(base / "old"), tag="t1")
    old = _params(engine)
    _train_step(engine, 1)
    _engine["engine"] = engine
    steps: dict[str, list[str]] = {}
    for scenario, tag in SCENARIOS:
        target = base / scenario / "ckpt"
        if rank == 0:
            shutil.copytree(base / "old", target)
        dist.barrier()
        done = steps.setdefault(scenario, [])

        def snapshot(n: int, what: str, target: Path = target, done: list = done) -> None:
            done.append(what)
            _copy_while_written(target, target.parent / "crashes" / f"rank{rank}-step{n:03d}")

        with FileSystemSteps(snapshot):
            engine.save_checkpoint(str(target), tag=tag)
        dist.barrier()
    return {"old": old, "new": _params(engine), "steps": steps}


def save_again(directories: list[str], tag: str) -> None:
    """The job that crashed saves again, into each crash state."""
    for directory in directories:
        _engine["engine"].save_checkpoint(directory, tag=tag)


# --- a crash at every step ------------------------------------------------------------------------


def _state(directory: Path, tag: str | None, states: dict[str, dict]) -> str:
    """Which of `states` a reader gets from `directory` (its `latest`, or `tag`)."""
    loaded = fp32_state_dict(str(directory), tag)
    for name, params in states.items():
        if loaded.keys() == params.keys() and all(
            torch.equal(loaded[n], params[n]) for n in params
        ):
            return name
    raise AssertionError(f"{directory} (tag {tag}) holds neither the old nor the new state")


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_a_crash_at_any_step_of_a_save_leaves_latest_loadable(pool1, pool2, tmp_path, world, stage):
    pool = {1: pool1, 2: pool2}[world]
    recorded = pool.run(record_saves, str(tmp_path), stage)
    states = {"old": recorded[0]["old"], "new": recorded[0]["new"]}
    assert not torch.equal(states["old"]["0.weight"], states["new"]["0.weight"])
    for scenario, tag in SCENARIOS:
        crashes = sorted((tmp_path / scenario / "crashes").iterdir())
        steps = [s for r in recorded for s in r["steps"][scenario]]
        assert len(crashes) == len(steps) > 10, steps
        seen = []
        for crash, step in zip(crashes, steps):
            seen.append(_state(crash, None, states))
            # t1 is the old state until a re-save of it replaces it.
            expected_t1 = ("old", "new") if tag == "t1" else ("old",)
            assert _state(crash, "t1", states) in expected_t1, (crash.name, step)
        rank0 = [s for c, s in zip(crashes, seen) if c.name.startswith("rank0")]
        # `latest` moves once, from the old state to the new, never back.
        assert rank0 == sorted(rank0, key=["old", "new"].index) and rank0[0] == "old", rank0
        assert "new" in rank0 and _state(tmp_path / scenario / "ckpt", None, states) == "new"

        # The same job saves again into every crash state: that save completes and cleans up.
        pool.run(save_again, [str(c) for c in crashes], tag)
        for crash in crashes:
            names = sorted(p.name for p in crash.iterdir())
            assert _state(crash, None, states) == "new" and _state(crash, tag, states) == "new"
            assert not [n for n in names if n.endswith((".partial", ".tmp"))], names
            copies = [n for n in names if n.split("@")[0] in ("t1", "t2")]
            assert len(copies) == (1 if tag == "t1" else 2), names


def test_latest_naming_a_missing_tag_loads_the_complete_copy(saved, tmp_path):
    """An earlier version's save of an existing tag, killed after moving `<tag>` aside to
    `.<tag>.old` and before renaming the new copy in: `latest` names a directory that is gone."""
    crashed = tmp_path / "crashed"
    shutil.copytree(saved["root"] / "old", crashed)
    (crashed / "t1").rename(crashed / ".t1.old")
    resaved = resolve_tag(str(saved["root"] / "resaved_tag" / "ckpt"), "t1")
    shutil.copytree(resaved, crashed / ".t1.partial")  # complete, with its manifest
    assert (crashed / "latest").read_text() == "t1"
    for tag in (None, "t1"):
        assert resolve_tag(str(crashed), tag) == crashed / ".t1.old"
        assert _state(crashed, tag, {"old": saved["old"]}) == "old"
    (crashed / ".t1.old" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"latest names 't1', but .* no other complete copy"):
        resolve_tag(str(crashed), None)


# --- tags stay inside the checkpoint directory -----------------------------------------------------


@pytest.mark.parametrize("name", ["../outside/t1", "<absolute>", "a/b", "..", "."])
def test_a_tag_leading_out_of_the_directory_is_refused(saved, tmp_path, name):
    outside = tmp_path / "outside"
    shutil.copytree(saved["root"] / "old", outside)  # a checkpoint the tag would reach
    inside = tmp_path / "ckpt"
    inside.mkdir()
    name = str(outside / "t1") if name == "<absolute>" else name
    (inside / "latest").write_text(name)
    with pytest.raises(
        CheckpointError, match=rf"latest names {re.escape(repr(name))}, which is not a dir"
    ):
        fp32_state_dict(str(inside))
    with pytest.raises(
        CheckpointError, match=rf"tag {re.escape(repr(name))} is not a directory inside"
    ):
        fp32_state_dict(str(inside), tag=name)


def _save_as(save_dir: str, tag: str | None) -> None:
    _build(0).save_checkpoint(save_dir, tag=tag)


def _failed_save(save_dir: str, tag: str) -> tuple[float, str]:
    """(seconds the save took on this rank before it raised, its message)."""
    engine = _build(0)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as failure:
        engine.save_checkpoint(save_dir, tag=tag)
    return time.monotonic() - start, str(failure.value)


def test_saving_under_a_tag_leading_out_fails_on_every_rank(pool2, tmp_path):
    failed = pool2.run(_failed_save, str(tmp_path / "ckpt"), "../escaped", timeout=60)
    assert (
        failed[0][1] == failed[1][1]
        and "tag '../escaped' is not a directory inside" in failed[0][1]
    )
    assert not (tmp_path / "escaped").exists() and not (tmp_path / ".escaped.partial").exists()


# --- failures are collective ------------------------------------------------------------------------


def test_a_save_rank_0_cannot_start_fails_on_every_rank_within_seconds(pool2, tmp_path):
    not_a_dir = tmp_path / "ckpt"
    not_a_dir.write_text("a file where the checkpoint directory should be")
    failed = pool2.run(_failed_save, str(not_a_dir), "t1", timeout=60)
    (seconds_0, message), (seconds_1, message_1) = failed
    assert max(seconds_0, seconds_1) < 5 and message_1 == message
    assert message.startswith(f"saving checkpoint 't1' to {not_a_dir} failed (rank 0: ")
    assert f"{not_a_dir}" in message.split("(rank 0: ")[1], message


def _failed_load(directories: list[str], stage: int) -> tuple[float, str]:
    """(seconds this rank's load took before it raised, its message); each rank its own copy."""
    engine = _build(stage)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as failure:
        engine.load_checkpoint(directories[dist.get_rank()])
    return time.monotonic() - start, str(failure.value)


def test_a_load_failing_on_one_rank_fails_on_every_rank_within_seconds(pool2, saved, tmp_path):
    """Rank 1's copy of its own shard file has a corrupt data block: rank 0 validates the tag
    (headers, not every block) and finds nothing; only rank 1 finds out, while reading its
    parameters, and rank 0 must not go on into the collectives that publish them."""
    both = saved["root"] / "new_tag" / "ckpt"
    seen_by_0, seen_by_1 = tmp_path / "rank0_view", tmp_path / "rank1_view"
    shutil.copytree(both, seen_by_0)
    shutil.copytree(both, seen_by_1)
    shard = seen_by_1 / "t2" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte: tensor data, past the header
    shard.write_bytes(bytes(data))
    failed = pool2.run(_failed_load, [str(seen_by_0), str(seen_by_1)], 2, timeout=60)
    (seconds_0, message), (seconds_1, message_1) = failed
    # The same error (rank 1's), each rank naming the directory it was given.
    assert max(seconds_0, seconds_1) < 5
    assert message.split(" failed (", 1)[1] == message_1.split(" failed (", 1)[1]
    assert "rank 1: " in message and f"{shard}: checksum mismatch" in message, message
    assert "rank 0: " not in message, message


def test_a_rank_that_sees_another_manifest_than_rank_0_fails_the_load_everywhere(
    pool2, saved, tmp_path
):
    """Rank 0 validates the tag once for every rank; a rank whose manifest is not the one rank 0
    validated (another copy, edited here with its checksum rewritten) refuses it, on every rank."""
    both = saved["root"] / "new_tag" / "ckpt"
    seen_by_0, seen_by_1 = tmp_path / "rank0_view", tmp_path / "rank1_view"
    shutil.copytree(both, seen_by_0)
    shutil.copytree(both, seen_by_1)
    manifest = json.loads((seen_by_1 / "t2" / "manifest.json").read_text())
    manifest["counters"]["global_steps"] += 1
    del manifest["checksum"]
    write_manifest(seen_by_1 / "t2", manifest)
    failed = pool2.run(_failed_load, [str(seen_by_0), str(seen_by_1)], 2, timeout=60)
    (_, message), (_, message_1) = failed
    assert message.split(" failed (", 1)[1] == message_1.split(" failed (", 1)[1]
    # Rank 1 reads the manifest through its index (written with it), and refuses that.
    assert "rank 1: " in message and "index.jsonl is not the one rank 0 validated" in message, (
        message
    )


# --- one tag for all ranks --------------------------------------------------------------------------


def _load_own_dir(directories: list[str], stage: int) -> tuple[str, dict[str, torch.Tensor]]:
    engine = _build(stage)
    path, _ = engine.load_checkpoint(directories[dist.get_rank()])
    return Path(path).name, _params(engine)


def test_ranks_load_the_tag_rank_0_resolved(pool2, saved, tmp_path):
    """Rank 1 sees `latest` naming another tag than rank 0 saw (it moved between their reads)."""
    both = saved["root"] / "new_tag" / "ckpt"  # t1: the old state, t2: the new; latest: t2
    seen_by_0, seen_by_1 = tmp_path / "rank0_view", tmp_path / "rank1_view"
    shutil.copytree(both, seen_by_0)
    shutil.copytree(both, seen_by_1)
    (seen_by_0 / "latest").write_text("t1")
    loaded = pool2.run(_load_own_dir, [str(seen_by_0), str(seen_by_1)], 2)
    assert [name for name, _ in loaded] == ["t1", "t1"]
    for _, params in loaded:
        assert all(torch.equal(params[n], saved["old"][n]) for n in saved["old"])


# --- the lock ---------------------------------------------------------------------------------------


def _take_lock_in_another_process(directory: Path, exit_code: str) -> int:
    """A process that locks `directory` and ends (`sys.exit`: atexit runs; `os._exit`: it does
    not, as in a crash); returns its pid."""
    code = (
        "import os, sys; from pathlib import Path; from shardspeed.checkpoint import lock; "
        f"lock.acquire(Path(sys.argv[1])); print(os.getpid(), flush=True); {exit_code}"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_a_second_job_is_refused_naming_the_holder(pool2, tmp_path):
    directory = tmp_path / "ckpt"
    pool2.run(_save_as, str(directory), "t1")  # the pool's rank 0 holds the lock, and lives on
    holder = json.loads((directory / ".lock").read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] != os.getpid()
    engine = _build_here()
    with pytest.raises(CheckpointError) as refused:
        engine.save_checkpoint(str(directory), tag="t2")
    message = str(refused.value)
    for part in (f"host {holder['host']}", f"pid {holder['pid']}", holder["started"], "delete"):
        assert part in message, message
    assert not (directory / ".t2.partial").exists() and not (directory / "t2").exists()
    engine.load_checkpoint(str(directory))  # reading needs no lock


def _build_here() -> Any:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(8)
    )
    return engine


def test_the_lock_of_a_crashed_process_is_taken_over(tmp_path):
    dead = _take_lock_in_another_process(tmp_path, "os._exit(0)")
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == dead
    lock.acquire(tmp_path)
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release_all()
    assert not (tmp_path / ".lock").exists()


def test_a_lock_is_released_when_its_process_exits(tmp_path):
    _take_lock_in_another_process(tmp_path, "sys.exit(0)")
    assert not (tmp_path / ".lock").exists()


def _write_lock(directory: Path, age: float, **holder: Any) -> None:
    fields = {"host": "elsewhere", "pid": 1, "started": "2020-01-01 00:00:00", "job": "other"}
    (directory / ".lock").write_text(json.dumps({**fields, **holder}))
    then = time.time() - age
    os.utime(directory / ".lock", (then, then))


def test_a_lock_on_another_host_is_stale_once_not_refreshed(tmp_path):
    _write_lock(tmp_path, age=60)
    with pytest.raises(CheckpointError, match=r"another job \(host elsewhere, pid 1, since 2020"):
        lock.acquire(tmp_path)
    _write_lock(tmp_path, age=lock.STALE_SECONDS + 60)
    lock.acquire(tmp_path)
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release_all()


def test_a_restarted_rank_of_the_same_torchrun_job_retakes_the_lock(tmp_path, monkeypatch):
    # Held by a live process of this host (our parent) for torchrun run "run-7".
    live = dict(host=socket.gethostname(), pid=os.getppid(), job="torchrun run run-7")
    _write_lock(tmp_path, age=0, **live)
    with pytest.raises(CheckpointError, match=f"pid {os.getppid()}"):
        lock.acquire(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    lock.acquire(tmp_path)
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release_all()
