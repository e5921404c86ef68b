"""Process-group start-up and thin collective wrappers that count the bytes they move.

Everything goes through torch.distributed (gloo on CPU, NCCL on CUDA). The wrappers exist so that
every room reports its traffic the same way; they add nothing to the collective itself.
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from ..utils.net import free_port, port_is_free

ReduceOp = dist.ReduceOp
# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.4) have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_bytes: Counter[str] = Counter()
_calls: Counter[str] = Counter()

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start the default process group, as `deepspeed.init_distributed` does.

    Reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Without a
    launcher it starts a one-process group on a free local port rather than looking for MPI.
    `auto_mpi_discovery`, `verbose` and `config` are accepted for signature compatibility only: there
    is no MPI discovery to switch.
    """
    del auto_mpi_discovery, verbose, config
    if dist_init_required is False or dist.is_initialized():
        return
    backend = dist_backend or default_backend()
    if timeout is None:
        minutes = os.environ.get("DEEPSPEED_TIMEOUT")
        timeout = datetime.timedelta(minutes=float(minutes) if minutes else 30)
    if not all(key in os.environ for key in _ENV_KEYS) and init_method is None:
        if rank not in (-1, 0) or world_size not in (-1, 1):
            raise RuntimeError(
                f"init_distributed(rank={rank}, world_size={world_size}) needs MASTER_ADDR and "
                "MASTER_PORT (or init_method): start the script with `shardspeed` or `torchrun`"
            )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        port = distributed_port if port_is_free(distributed_port) else free_port()
        os.environ.setdefault("MASTER_PORT", str(port))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    if backend == "nccl":
        torch.cuda.set_device(get_local_rank())
    dist.init_process_group(**kwargs)


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def _count(name: str, tensor: torch.Tensor) -> None:
    _bytes[name] += tensor.numel() * tensor.element_size()
    _calls[name] += 1


def comm_volume() -> dict[str, dict[str, int]]:
    """Per collective, the calls this process made and their payload bytes since the last reset.

    Payload is the size of the full tensor a collective acts on (a reduce-scatter's input, an
    all-gather's output), the measure the ZeRO paper counts in; wire traffic depends on the algorithm.
    """
    return {name: {"calls": _calls[name], "bytes": _bytes[name]} for name in sorted(_calls)}


def reset_comm_volume() -> None:
    _bytes.clear()
    _calls.clear()


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    _count("all_reduce", tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    _count("broadcast", tensor)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_into_tensor(
    output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    _count("all_gather", output)
    return _all_gather_single(output, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    _count("reduce_scatter", tensor)
    return _reduce_scatter_single(output, tensor, op=op, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    _count("reduce", tensor)
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def all_gather(
    outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    for output in outputs:
        _bytes["all_gather"] += output.numel() * output.element_size()
    _calls["all_gather"] += 1
    return dist.all_gather(outputs, tensor, group=group, async_op=async_op)
