"""Who this rank is and which group it averages gradients over.

Today there is one axis, data; tensor, pipeline and expert axes join it in later issues, and every
process group will come from here. A Megatron-style `mpu` (get_data_parallel_*) is honoured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """This rank's place: global rank and size, and its data-parallel rank, size and group."""

    rank: int
    world_size: int
    dp_rank: int
    dp_world_size: int
    dp_group: Any  # None means the default (world) group

    @classmethod
    def build(cls, mpu: Any = None) -> Topology:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if mpu is None:
            return cls(rank, world, rank, world, None)
        return cls(
            rank,
            world,
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
            mpu.get_data_parallel_group(),
        )
