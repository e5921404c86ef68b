"""`shardspeed.zero.Init`: build a model with each parameter kept as 1/N slices from the start.

Inside the context, when a module's (outermost) `__init__` returns, each of its own parameters is
made equal across ranks (rank 0's values), cut into N equal slices of its flattened values, and only
this rank's slice is kept (`p.ds_tensor`; `p.ds_shape` and `p.ds_numel` keep the logical shape,
`p.ds_id` numbers it, `p.ds_status` says whether it is whole now). The parameter's own storage
becomes empty. So a rank never holds more than (model / N) plus the module being built. The stage-3
engine rebuilds its unit shards from these slices one unit at a time (`full_value`), so the whole
model never exists in one process.

Before `initialize`, `GatheredParameters` makes such parameters whole with `gather` and puts them
back with `release`: with a modifier rank, that rank's values are broadcast and re-sliced into
every rank's `ds_tensor` (how transformers initialises and loads weights under ZeRO-3).
"""

from __future__ import annotations

import enum
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_gather_into_tensor, broadcast, init_distributed
from .offload import return_large_blocks_to_the_os


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's states of a ZeRO-3 parameter (`p.ds_status`)."""

    AVAILABLE = 1  # whole on this rank now
    NOT_AVAILABLE = 2  # only this rank's slice is held
    INFLIGHT = 3  # being gathered


_ids = itertools.count()


class Init:
    """Context manager (or `Init(module=...)`) that shards parameters as modules are built."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
    ) -> None:
        del mem_efficient_linear, pin_memory  # no effect without custom kernels or offload
        if remote_device not in (None, "none"):
            raise ValueError(
                f"zero.Init(remote_device={remote_device!r}) is not supported: slices are built "
                "on the training device; to hold them in host memory or on NVMe once training "
                "starts, set 'zero_optimization.offload_param.device' in the config"
            )
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None and enabled:
            from ..config import read_config_source

            settings = read_config_source(source)
            stage = settings.get("zero_optimization", {}).get("stage", 0)
            if stage != 3:
                raise ValueError(
                    f"zero.Init shards parameters for ZeRO stage 3, but the config says stage {stage}"
                )
            if dtype is None:  # DeepSpeed's: the config's precision, so half models build half
                dtype = _config_dtype(settings)
        self.enabled = enabled
        self.dtype = dtype
        self._patched: list[tuple[type, Callable]] = []
        if not enabled:
            return
        init_distributed()
        self.group = mpu.get_data_parallel_group() if mpu is not None else data_parallel_group
        self.world = dist.get_world_size(self.group)
        problem = single_rank_group_problem(self.world, self.group, os.environ)
        if problem is not None:
            raise RuntimeError(problem)
        self.rank = dist.get_rank(self.group)
        self.root = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        if module is not None:
            for sub in module.modules():
                self._shard_own(sub)

    def __enter__(self) -> Init:
        if self.enabled:
            return_large_blocks_to_the_os()
            for cls in _subclasses(nn.Module):
                if "__init__" in cls.__dict__:
                    original = cls.__dict__["__init__"]
                    cls.__init__ = self._wrap(original)
                    self._patched.append((cls, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched = []

    def _wrap(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def init(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            # Shard once, when the outermost __init__ of this instance returns: subclasses may
            # still touch their parents' parameters during their own __init__.
            depth = module.__dict__.get("_shardspeed_init_depth", 0)
            module.__dict__["_shardspeed_init_depth"] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                module.__dict__["_shardspeed_init_depth"] = depth
            if depth == 0:
                self._shard_own(module)

        return init

    def _shard_own(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if hasattr(p, "ds_tensor"):
                continue
            values = p.data if self.dtype is None else p.data.to(self.dtype)
            flat = values.reshape(-1).contiguous()
            if self.world > 1:
                broadcast(flat, src=self.root, group=self.group)
            p.ds_shape = values.shape
            p.ds_numel = values.numel()
            p.ds_group = self.group
            p.ds_id = next(_ids)
            _keep_slice(p, flat)


def _config_dtype(settings: dict[str, Any]) -> torch.dtype | None:
    """The parameters' dtype a config asks for: fp16 or bf16 when enabled (DeepSpeed also reads
    `bfloat16`), else None (as built)."""
    enabled = {
        name: (settings.get(name) or {}).get("enabled") is True
        for name in ("fp16", "bf16", "bfloat16")
    }
    if enabled["fp16"] and (enabled["bf16"] or enabled["bfloat16"]):
        raise ValueError("the config enables both fp16 and bf16: choose one")
    if enabled["fp16"]:
        return torch.float16
    return torch.bfloat16 if enabled["bf16"] or enabled["bfloat16"] else None


def _keep_slice(p: torch.Tensor, whole: torch.Tensor) -> None:
    """Keep this rank's slice of `whole` (p's flattened values) as `p.ds_tensor`; free the rest."""
    world, rank = _group_world_rank(p.ds_group)
    chunk = -(-whole.numel() // world)
    padded = torch.zeros(chunk * world, dtype=whole.dtype, device=whole.device)
    padded[: whole.numel()] = whole
    p.ds_tensor = padded[rank * chunk : (rank + 1) * chunk].clone()
    p.data = torch.empty(0, dtype=whole.dtype, device=whole.device)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def single_rank_group_problem(
    world: int, explicit_group: Any, environ: Mapping[str, str | None]
) -> str | None:
    """Why zero.Init must not go on, or None: the launcher started several processes
    (`WORLD_SIZE` > 1) but the default process group has one rank, so every rank would build the
    whole model instead of its slice. A group the caller passed is taken as meant."""
    try:
        launched = int(environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return None
    if explicit_group is not None or world != 1 or launched <= 1:
        return None
    return (
        f"zero.Init found a process group of one rank, but the launcher started WORLD_SIZE="
        f"{launched} processes: a single-process group was created before shardspeed's "
        "(for example by from_pretrained before init_distributed). Call "
        "shardspeed.init_distributed() (or torch.distributed.init_process_group with the "
        "launcher's world) before building the model, or pass data_parallel_group= to zero.Init"
    )


def _group_world_rank(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def full_value(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: its data, or for a `zero.Init` parameter its slices gathered."""
    if not is_init_sharded(p) or p.ds_status == ZeroParamStatus.AVAILABLE:
        return p.data
    return _gathered([p])[0]


def is_init_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_tensor")


def _gathered(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole values of `zero.Init` parameters of one group: one all-gather for all of them."""
    world, _ = _group_world_rank(params[0].ds_group)
    slices = [p.ds_tensor.to(device=p.device, dtype=p.dtype) for p in params]
    mine = torch.cat(slices) if len(slices) > 1 else slices[0]
    out = torch.empty(mine.numel() * world, dtype=mine.dtype, device=mine.device)
    if world > 1:
        all_gather_into_tensor(out, mine, group=params[0].ds_group)
    else:
        out.copy_(mine)
    by_rank = out.view(world, mine.numel())
    values, start = [], 0
    for p, piece in zip(params, slices):
        whole = by_rank[:, start : start + piece.numel()].reshape(-1)
        values.append(whole[: p.ds_numel].view(p.ds_shape))
        start += piece.numel()
    return values


def _by_group(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[int, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(id(p.ds_group), []).append(p)
    return list(groups.values())


def gather(params: Iterable[torch.Tensor]) -> None:
    """Make `zero.Init` parameters whole on every rank of their group (collective)."""
    for members in _by_group(p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE):
        for p, value in zip(members, _gathered(members)):
            p.data = value
            p.ds_status = ZeroParamStatus.AVAILABLE


def release(params: Iterable[torch.Tensor], modifier_rank: int | None) -> None:
    """Back to slices. With `modifier_rank` (a rank of the parameters' group), that rank's whole
    values are broadcast and become every rank's slices; without, changes are dropped, as in
    DeepSpeed (collective)."""
    for members in _by_group(p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE):
        if modifier_rank is None:
            for p in members:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            continue
        for p in members:
            if p.data.numel() != p.ds_numel:
                raise ValueError(
                    f"a parameter of shape {tuple(p.ds_shape)} was given {p.data.numel()} "
                    "elements inside GatheredParameters: change its values, not its size"
                )
        group = members[0].ds_group
        flat = torch.cat([p.data.reshape(-1) for p in members])
        world, _ = _group_world_rank(group)
        if world > 1:
            src = modifier_rank if group is None else dist.get_global_rank(group, modifier_rank)
            broadcast(flat, src=src, group=group)
        for p, whole in zip(members, flat.split([p.ds_numel for p in members])):
            _keep_slice(p, whole)


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


def materialize(params: Iterable[torch.Tensor], zero3: bool = False) -> None:
    """Turn `zero.Init` parameters into ordinary whole ones on every rank (collective): for those
    the engine does not shard (frozen ones, or an engine without an optimizer). Under ZeRO-3
    (`zero3`) every one of `params` then reads as a whole ZeRO-3 parameter (`ds_status`
    AVAILABLE, `ds_shape`, `ds_numel`), as DeepSpeed's are, for the libraries that check."""
    params = list(params)
    sharded = [p for p in params if is_init_sharded(p)]
    gather(sharded)
    for p in sharded:
        for name in ("ds_tensor", "ds_status"):
            p.__dict__.pop(name, None)
    for p in params if zero3 else ():
        p.ds_status, p.ds_shape, p.ds_numel = ZeroParamStatus.AVAILABLE, p.shape, p.numel()
