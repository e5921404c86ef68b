"""Checkpoints at real world sizes on one machine: what a save and a load cost each rank.

`world_checkpoint` writes the checkpoint a save of a whole world writes, rank by rank in this
process on torch's fake process group: each rank runs its own part of the save
(`write_rank_files`: its files, as headers with holes where meta tensors' bytes would be, so they
have their real sizes and layout but take no disk), then rank 0 publishes the manifest of all
their reports, as `save_checkpoint` does once it has them. `file_opens` counts the files a
process opens under a directory (Python's audit events, so every reader is seen), the measure
of what a rank reads.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..autotuning.systems import Cluster
from ..checkpoint.engine_state import publish_tag, write_rank_files
from ..runtime.api import initialize
from .dry_run import _quiet, fake_world
from .models import ModelSource, build_model

_watched: list[tuple[str, Counter]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _watched and isinstance(args[0], (str, Path)):
        path = str(args[0])
        for prefix, counts in _watched:
            if path.startswith(prefix):
                counts[Path(path).name] += 1


_hooked = False


@contextmanager
def file_opens(directory: str | Path) -> Iterator[Counter]:
    """Count the opens of files under `directory` in the body, by file name."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_audit)  # audit hooks cannot be removed: one, idle unless watching
        _hooked = True
    entry = (str(Path(directory).resolve()), Counter())
    _watched.append(entry)
    try:
        yield entry[1]
    finally:
        _watched.remove(entry)


def engine_as(rank: int, model: ModelSource, config: dict[str, Any]) -> Any:
    """`initialize` of `model` (on the meta device) in the current fake world, quietly."""
    with _quiet(rank != 0):
        engine, *_ = initialize(model=build_model(model), config=config)
    return engine


def world_checkpoint(
    model: ModelSource, config: dict[str, Any], cluster: Cluster, directory: Path, tag: str = "dry"
) -> Path:
    """The tag directory a save of every rank of `cluster`'s world writes into `directory`."""
    partial = directory / f".{tag}.partial"
    partial.mkdir(parents=True)
    reports = [None] * cluster.world_size
    # Rank 0 last: it publishes, with its engine, once every report is in.
    for rank in [*range(1, cluster.world_size), 0]:
        with fake_world(rank, cluster):
            engine = engine_as(rank, model, config)
            reports[rank] = write_rank_files(engine, partial, {}, False)
            if reports[rank]["error"]:
                raise RuntimeError(f"rank {rank}: {reports[rank]['error']}")
            if rank == 0:
                publish_tag(engine, directory, partial, tag, reports, True, False)
    return directory / tag


__all__ = ["engine_as", "file_opens", "world_checkpoint"]
