"""DeepSpeed's `deepspeed.utils.groups`: process-group accessors over the running job's topology.

DeepSpeed keeps its groups in module globals that `initialize` fills; libraries built on it
(accelerate, transformers, TRL) and user code read them through these functions. Here they read the
`Topology` (the mesh) of the most recent `initialize` (`use_topology`), or the world's mesh before
one; every group is the mesh's. A group of None is the default (world) group, as everywhere in
torch.distributed.

With `sequence_parallel_size` (or `initialize(mesh_param=(dp, sp))`) the sequence-parallel group is
a run of `sp` consecutive ranks and the sequence-data-parallel group holds the data x sequence ranks
(those ZeRO shards over and gradients are reduced over), laid out as DeepSpeed's mesh does; the
data-parallel group is then the ranks at the same place in each sequence group. Without it, the
sequence-parallel group is this rank alone and the sequence-data-parallel group is the data-parallel
group, which is what DeepSpeed reports for a run without sequence parallelism.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .topology import Topology

_topology: Topology | None = None


def use_topology(topology: Topology) -> None:
    """Answer from `topology` from now on (`initialize` calls this)."""
    global _topology
    _topology = topology


def _current() -> Topology:
    if _topology is not None:
        return _topology
    if not dist.is_initialized():
        raise RuntimeError(
            "the process group is not initialized: call deepspeed.init_distributed() or "
            "deepspeed.initialize() first"
        )
    return Topology.world()


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's `groups.initialize`: adopt `mpu`'s groups (expert groups are made on demand)."""
    del ep_size
    if mpu is not None:
        use_topology(Topology.build(mpu))


# -- data parallel ------------------------------------------------------------------------------


def _get_data_parallel_group() -> Any:
    return _current().dp_group


def _get_data_parallel_world_size() -> int:
    return _current().dp_world_size


def _get_data_parallel_rank() -> int:
    return _current().dp_rank


def _get_data_parallel_group_ranks() -> list[int]:
    group = _current().dp_group
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _get_broadcast_src_rank() -> int:
    group = _current().get_sequence_data_parallel_group()  # DeepSpeed's: ZeRO's group
    return 0 if group is None else dist.get_global_rank(group, 0)


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank

# -- model (tensor) parallel ---------------------------------------------------------------------


def _get_model_parallel_group() -> Any:
    return _current().tp_group


def _get_model_parallel_world_size() -> int:
    return _current().tp_world_size


def _get_model_parallel_rank() -> int:
    return _current().tp_rank


get_tensor_model_parallel_group = get_model_parallel_group = _get_model_parallel_group
get_tensor_model_parallel_world_size = get_model_parallel_world_size = (
    _get_model_parallel_world_size
)
get_tensor_model_parallel_rank = get_model_parallel_rank = _get_model_parallel_rank


def get_tensor_model_parallel_src_rank() -> int:
    group = _current().tp_group
    return dist.get_rank() if group is None else dist.get_global_rank(group, 0)


# -- sequence parallel ---------------------------------------------------------------------------


def _get_sequence_parallel_group() -> Any:
    return _current().get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return _current().get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    return _current().get_sequence_parallel_rank()


def _get_sequence_data_parallel_group() -> Any:
    return _current().get_sequence_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _current().get_sequence_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _current().get_sequence_data_parallel_rank()


# -- expert parallel: group names are DeepSpeed's "ep_size_<N>" ----------------------------------


def _expert_size(group_name: str) -> int:
    prefix = "ep_size_"
    if not group_name.startswith(prefix) or not group_name[len(prefix) :].isdigit():
        raise ValueError(
            f"expert group name {group_name!r}: DeepSpeed names expert groups 'ep_size_<N>'"
        )
    return int(group_name[len(prefix) :])


def _get_expert_parallel_group(group_name: str) -> Any:
    return _current().expert_groups(_expert_size(group_name)).ep_group


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _current().expert_groups(_expert_size(group_name)).expert_data_group


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _expert_size(group_name)


def _get_expert_parallel_rank(group_name: str) -> int:
    return _current().expert_groups(_expert_size(group_name)).ep_rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _current().expert_groups(_expert_size(group_name)).expert_data_size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _current().expert_groups(_expert_size(group_name)).expert_data_rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    group = _get_expert_parallel_group(group_name)
    return dist.get_global_rank(group, 0) if group is not None else 0


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    group = _get_expert_data_parallel_group(group_name)
    return dist.get_global_rank(group, 0) if group is not None else 0


def _clone_world_group() -> Any:
    return None  # the default group, which holds every rank
