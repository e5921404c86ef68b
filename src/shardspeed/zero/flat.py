"""Flat buffers: many tensors laid end to end in one contiguous tensor, each kept as a view.

One buffer means one collective, one norm and one copy per step instead of one per parameter.
Tensors are laid out group by group (an optimizer param group each); every group's region is padded
to a multiple of the shard count, so that each data-parallel rank owns one contiguous, equal range of
every group: a ZeRO shard.
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
    groups: tuple[tuple[int, int], ...]  # [start, end) of each group's region, padding included
    shards: int
    total: int

    @classmethod
    def of(cls, groups: Sequence[Sequence[torch.Tensor]], shards: int = 1) -> FlatLayout:
        """Lay the tensors of each group out in order, each region padded to a multiple of `shards`."""
        shapes, offsets, numels, regions, cursor = [], [], [], [], 0
        for tensors in groups:
            start = cursor
            for tensor in tensors:
                shape = logical_shape(tensor)
                shapes.append(shape)
                offsets.append(cursor)
                numels.append(shape.numel())
                cursor += shape.numel()
            cursor = start + -(-(cursor - start) // shards) * shards
            regions.append((start, cursor))
        return cls(tuple(shapes), tuple(offsets), tuple(numels), tuple(regions), shards, cursor)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view into `buffer` (which must have `total` elements)."""
        return [
            buffer.narrow(0, offset, numel).view(shape)
            for offset, numel, shape in zip(self.offsets, self.numels, self.shapes)
        ]

    def shard(self, group: int, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s shard of `group` in the flat buffer."""
        start, end = self.groups[group]
        size = (end - start) // self.shards
        return start + rank * size, start + (rank + 1) * size

    def shard_numel(self) -> int:
        """Elements one rank owns over all groups (equal for every rank)."""
        return sum(end - start for start, end in self.groups) // self.shards

    def owners(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Split [start, end) by owner: (rank, piece start, piece end, offset in the rank's shard)."""
        pieces = []
        shard_offset = 0
        for g, (g_start, g_end) in enumerate(self.groups):
            size = (g_end - g_start) // self.shards
            lo, hi = max(start, g_start), min(end, g_end)
            if lo < hi and size:
                for rank in range((lo - g_start) // size, (hi - 1 - g_start) // size + 1):
                    s_start, s_end = self.shard(g, rank)
                    a, b = max(lo, s_start), min(hi, s_end)
                    pieces.append((rank, a, b, shard_offset + a - s_start))
            shard_offset += size
        return pieces


def logical_shape(tensor: torch.Tensor) -> torch.Size:
    """A tensor's shape, or for a parameter sharded by `zero.Init` the shape it stands for."""
    return getattr(tensor, "ds_shape", tensor.shape)
