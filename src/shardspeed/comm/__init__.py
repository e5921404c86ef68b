"""`shardspeed.comm` (DeepSpeed's `deepspeed.comm`): process groups and counted collectives."""

from .comm import (
    ReduceOp,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    bytes_moved,
    default_backend,
    free_port,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    reduce_scatter_tensor,
)
from .topology import Topology

__all__ = [
    "ReduceOp",
    "Topology",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "bytes_moved",
    "default_backend",
    "free_port",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "reduce_scatter_tensor",
]
