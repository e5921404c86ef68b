"""Flat buffers: many tensors laid end to end in one contiguous tensor, each kept as a view.

One buffer means one collective, one norm and one copy per step instead of one per parameter.
Tensors are laid out region by region (an optimizer param group, or part of one, each); every
region is padded to a multiple of its shard count, so that each rank of the group sharing it owns one
contiguous, equal range of it: a ZeRO shard. Regions may have different shard counts: a mixture of
experts' expert weights are sharded over the ranks holding the same experts, the rest over the whole
data-parallel group.

A region of whole tensors (for optimizers whose update of an element depends on its whole tensor:
Lamb's trust ratio, Muon's orthogonalisation, Adafactor's factored moments) is laid out as one bin
per shard instead: its tensors, in order, are cut into as many consecutive runs as it has shards,
with the largest run as small as possible, and every bin is padded to that largest run. Each shard
then holds whole tensors only, and every collective over equal shards works unchanged; the price
is the padding, at most the largest tensor per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor sits (`offsets[i]`, `numels[i]`) and each group's padded region."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    groups: tuple[tuple[int, int], ...]  # [start, end) of each region, padding included
    shards: tuple[int, ...]  # each region's shard count
    total: int

    @classmethod
    def of(
        cls,
        groups: Sequence[Sequence[torch.Tensor]],
        shards: int | Sequence[int] = 1,
        whole: Sequence[bool] = (),
    ) -> FlatLayout:
        """Lay the tensors of each region out in order, each padded to a multiple of its `shards`
        (one count for all regions, or one per region); a region with `whole` true is laid out
        in bins of whole tensors (see the module docstring)."""
        counts = (shards,) * len(groups) if isinstance(shards, int) else tuple(shards)
        whole = tuple(whole) or (False,) * len(groups)
        shapes, offsets, numels, regions, cursor = [], [], [], [], 0
        for tensors, shards, in_bins in zip(groups, counts, whole, strict=True):
            start = cursor
            sizes = [logical_shape(t).numel() for t in tensors]
            shapes += [logical_shape(t) for t in tensors]
            numels += sizes
            if in_bins and shards > 1:
                bins = whole_tensor_bins(sizes, shards)
                width = max((sum(sizes[i] for i in b) for b in bins), default=0)
                for b, members in enumerate(bins):
                    cursor = start + b * width
                    for i in members:
                        offsets.append(cursor)
                        cursor += sizes[i]
                cursor = start + shards * width
            else:
                for size in sizes:
                    offsets.append(cursor)
                    cursor += size
                cursor = start + -(-(cursor - start) // shards) * shards
            regions.append((start, cursor))
        return cls(tuple(shapes), tuple(offsets), tuple(numels), tuple(regions), counts, cursor)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view into `buffer` (which must have `total` elements)."""
        return [
            buffer.narrow(0, offset, numel).view(shape)
            for offset, numel, shape in zip(self.offsets, self.numels, self.shapes)
        ]

    def shard(self, group: int, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s shard of region `group` in the flat buffer (`rank` in the
        group of ranks that share the region)."""
        start = self.groups[group][0]
        size = self.shard_size(group)
        return start + rank * size, start + (rank + 1) * size

    def shard_size(self, group: int) -> int:
        """Elements of each rank's shard of region `group`."""
        start, end = self.groups[group]
        return (end - start) // self.shards[group]

    def shard_numel(self) -> int:
        """Elements one rank owns over all regions (equal for every rank)."""
        return sum(self.shard_size(g) for g in range(len(self.groups)))

    def place_gathered(
        self, rows: torch.Tensor, regions: Sequence[int], buffer: torch.Tensor, base: int = 0
    ) -> None:
        """Put all-gathered `rows` (row k: rank k's shards of consecutive `regions`, side by side)
        in place in `buffer`, which holds the layout from element `base` on. Each region is cut
        into as many equal pieces as there are rows: its shards, or fewer, larger pieces (the
        secondary pieces of ZeRO++'s hpZ, one per rank of a node)."""
        sizes = [(self.groups[r][1] - self.groups[r][0]) // len(rows) for r in regions]
        for r, columns in zip(regions, rows.split(sizes, dim=1)):
            start, end = self.groups[r]
            buffer[start - base : end - base].view(len(rows), -1).copy_(columns)

    def owners(self, start: int, end: int) -> list[tuple[int, int, int, int, int]]:
        """Split [start, end) by owner: (region, rank, piece start, piece end, offset in the rank's
        shard); a rank counts within the ranks that share the region."""
        pieces = []
        shard_offset = 0
        for g, (g_start, g_end) in enumerate(self.groups):
            size = self.shard_size(g)
            lo, hi = max(start, g_start), min(end, g_end)
            if lo < hi and size:
                for rank in range((lo - g_start) // size, (hi - 1 - g_start) // size + 1):
                    s_start, s_end = self.shard(g, rank)
                    a, b = max(lo, s_start), min(hi, s_end)
                    pieces.append((g, rank, a, b, shard_offset + a - s_start))
            shard_offset += size
        return pieces


def whole_tensor_bins(sizes: Sequence[int], bins: int) -> list[range]:
    """`sizes` cut into `bins` consecutive runs (some may be empty) whose largest sum is as small
    as it can be: a binary search on that largest sum, each candidate filled greedily."""

    def fill(capacity: int) -> list[range]:
        runs, first, total = [], 0, 0
        for i, size in enumerate(sizes):
            if total + size > capacity and i > first:
                runs.append(range(first, i))
                first, total = i, 0
            total += size
        runs.append(range(first, len(sizes)))
        return runs

    low, high = max(sizes, default=0), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if len(fill(middle)) <= bins:
            high = middle
        else:
            low = middle + 1
    runs = fill(low)
    return runs + [range(len(sizes), len(sizes))] * (bins - len(runs))


def logical_shape(tensor: torch.Tensor) -> torch.Size:
    """A tensor's shape, or for a parameter sharded by `zero.Init` the shape it stands for."""
    return getattr(tensor, "ds_shape", tensor.shape)
