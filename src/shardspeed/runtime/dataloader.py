"""The training data loader `initialize` returns: each data-parallel rank reads its own share of
the dataset in micro-batches, as DeepSpeed's `DeepSpeedDataLoader` does."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


class _EpochAwareSampler(DistributedSampler):
    """A `DistributedSampler` that notes when the caller chose the epoch, so the loader knows whether
    to advance it itself."""

    epoch_chosen = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.epoch_chosen = True


class _Skipping(Sampler):
    """`sampler` without its first `skip` indices: the rest of a pass that a checkpoint interrupted."""

    def __init__(self, sampler: Sampler, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        indices = iter(self.sampler)
        for _ in range(self.skip):
            next(indices, None)
        return indices

    def __len__(self) -> int:
        return max(len(self.sampler) - self.skip, 0)


class RepeatingLoader:
    """DeepSpeed's `RepeatingLoader`: iterates `loader` for ever, starting it again when it ends."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class DistributedDataLoader:
    """Micro-batches of `dataset` for one data-parallel rank.

    The rank's share comes from a `DistributedSampler` (shuffled with `seed` unless `shuffle` is
    off; padded by repeating samples so every rank gets the same count). `iter(loader)` starts a new
    pass and returns the loader itself; `next` raises `StopIteration` at the end of the pass and
    keeps raising it until `iter` is called again. Each new pass reshuffles, unless `set_epoch` (or
    `loader.data_sampler.set_epoch`) chose the epoch since the previous one.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        sampler: Sampler | None = None,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if sampler is None:
            sampler = _EpochAwareSampler(
                dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.data_sampler = sampler
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.dataloader: DataLoader | None = None
        self._batches: Iterator[Any] | None = None
        self._passes = 0
        self._consumed = 0  # micro-batches taken from the current pass
        self._resume_at: int | None = (
            None  # a loaded position: samples of this rank's share to skip
        )
        # Counted from the sampler, which already holds only this rank's (padded) share.
        if drop_last:
            self.len = len(sampler) // batch_size
        else:
            self.len = math.ceil(len(sampler) / batch_size)

    def __len__(self) -> int:
        """Micro-batches per pass on this rank."""
        return self.len

    def __iter__(self) -> DistributedDataLoader:
        """Start a new pass over this rank's share."""
        if self._resume_at is not None:
            sampler: Any = _Skipping(self.data_sampler, self._resume_at)
            self._resume_at = None
        else:
            self._advance_epoch()
            sampler = self.data_sampler
        self._consumed = 0
        self.dataloader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last,
        )
        self._batches = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        """The next micro-batch; a first `next` without `iter` starts the first pass."""
        if self._batches is None:
            iter(self)
        batch = next(self._batches)
        self._consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where the data stands: the epoch, and the samples all ranks took from the current pass."""
        replicas = getattr(self.data_sampler, "num_replicas", 1)
        return {
            "epoch": getattr(self.data_sampler, "epoch", 0),
            "passes": self._passes,
            "samples_consumed": self._consumed * self.batch_size * replicas,
            "in_pass": self._batches is not None and self._consumed < self.len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` stood: the next pass resumes the saved one mid-way.

        Positions are counted in samples over all ranks, so a different number of ranks resumes
        at the same place (exactly when the count divides evenly among them).
        """
        if hasattr(self.data_sampler, "set_epoch"):
            self.data_sampler.set_epoch(state["epoch"])
            self.data_sampler.epoch_chosen = False  # restored, not chosen: later passes advance
        self._passes = state["passes"]
        self._batches = None
        self._resume_at = None
        if state["in_pass"]:
            replicas = getattr(self.data_sampler, "num_replicas", 1)
            per_rank = state["samples_consumed"] // replicas
            self._resume_at = per_rank // self.batch_size * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch` to seed the shuffle of the next pass instead of advancing it automatically."""
        if not hasattr(self.data_sampler, "set_epoch"):
            raise TypeError(f"the sampler {type(self.data_sampler).__name__} has no set_epoch")
        self.data_sampler.set_epoch(epoch)

    def _advance_epoch(self) -> None:
        # DeepSpeed 0.19.8 never advanced the epoch, so every pass repeated the same order; later
        # DeepSpeed advances it once per pass unless the caller picked one, and so do we.
        sampler = self.data_sampler
        if not isinstance(sampler, _EpochAwareSampler):
            return
        if self._passes > 0 and not sampler.epoch_chosen:
            sampler.set_epoch(sampler.epoch + 1)
        sampler.epoch_chosen = False
        self._passes += 1
