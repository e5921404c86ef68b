"""DeepSpeed's `runtime.sequence_parallel.parallel_state_sp`: the Megatron-style `mpu` that
`UlyssesSPAttentionHF.register_with_transformers` returns and accelerate passes to `initialize`.

Its groups are the world mesh's with `sequence_parallel_size` ranks per sequence (runs of
consecutive ranks, as DeepSpeed's), so `deepspeed.utils.groups` answers the same from the moment it
is set up. Runs set up through this module usually compute the loss as transformers and
accelerate do (every sequence rank holds the whole loss); the engine reads that from the loss at
the first step (see docs/sequence-parallel.md, "The loss").
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ...comm import groups
from ...comm.topology import Topology


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Lay out the world as data x sequence with `sequence_parallel_size` ranks per sequence."""
    if not dist.is_initialized():
        raise RuntimeError(
            "sequence parallelism needs the process group: call deepspeed.init_distributed() "
            "(or let accelerate start it) before setting it up"
        )
    if sequence_parallel_size < 2:
        raise ValueError(
            f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}"
        )
    groups.use_topology(Topology.build(None, 1, sequence_parallel_size))


def get_sequence_parallel_group() -> Any:
    return groups._get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return groups._get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return groups._get_sequence_parallel_rank()


def get_sequence_data_parallel_group() -> Any:
    return groups._get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    return groups._get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    return groups._get_sequence_data_parallel_rank()
