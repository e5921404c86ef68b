"""`shardspeed.comm` (DeepSpeed's `deepspeed.comm`): process groups and counted collectives."""

from .comm import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    comm_volume,
    default_backend,
    free_port,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    reduce,
    reduce_scatter_tensor,
    reset_comm_volume,
)
from .topology import Topology

__all__ = [
    "ReduceOp",
    "Topology",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "comm_volume",
    "default_backend",
    "free_port",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "reduce",
    "reduce_scatter_tensor",
    "reset_comm_volume",
]
