"""Flat buffers: many tensors laid end to end in one contiguous tensor, each kept as a view.

One buffer means one collective, one norm and one copy per step instead of one per parameter.
ZeRO shards will be contiguous ranges of the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor sits in a flat buffer: `offsets[i]` to `offsets[i] + numels[i]`."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], align: int = 1) -> FlatLayout:
        """Lay `tensors` out in order; `total` is padded up to a multiple of `align`."""
        offsets, numels, cursor = [], [], 0
        for tensor in tensors:
            offsets.append(cursor)
            numels.append(tensor.numel())
            cursor += tensor.numel()
        total = -(-cursor // align) * align if align > 1 else cursor
        return cls(tuple(t.shape for t in tensors), tuple(offsets), tuple(numels), total)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view into `buffer` (which must have `total` elements)."""
        return [
            buffer.narrow(0, offset, numel).view(shape)
            for offset, numel, shape in zip(self.offsets, self.numels, self.shapes)
        ]

    def flatten(
        self, tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A new buffer holding copies of `tensors` (padding zeroed)."""
        buffer = torch.zeros(self.total, dtype=dtype, device=device)
        for view, tensor in zip(self.views(buffer), tensors):
            view.copy_(tensor.detach())
        return buffer
