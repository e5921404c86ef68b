"""`shardspeed.zero.Init`: build a model with each parameter kept as 1/N slices from the start.

Inside the context, when a module's (outermost) `__init__` returns, each of its own parameters is
made equal across ranks (rank 0's values), cut into N equal slices of its flattened values, and only
this rank's slice is kept (`p.ds_shard`; `p.ds_shape` and `p.ds_numel` keep the logical shape).
The parameter's own storage becomes empty. So a rank never holds more than (model / N) plus the
module being built. The stage-3 engine rebuilds its unit shards from these slices one unit at a
time (`full_value`), so the whole model never exists in one process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_gather_into_tensor, broadcast, init_distributed
from .offload import return_large_blocks_to_the_os


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
                f"zero.Init(remote_device={remote_device!r}) is not supported yet (issue 6, "
                "offload); leave it unset"
            )
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None:
            from ..config import read_config_source

            stage = read_config_source(source).get("zero_optimization", {}).get("stage", 0)
            if stage != 3:
                raise ValueError(
                    f"zero.Init shards parameters for ZeRO stage 3, but the config says stage {stage}"
                )
        self.enabled = enabled
        self.dtype = dtype
        self._patched: list[tuple[type, Callable]] = []
        if not enabled:
            return
        init_distributed()
        self.group = mpu.get_data_parallel_group() if mpu is not None else data_parallel_group
        self.world = dist.get_world_size(self.group)
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
            if hasattr(p, "ds_shard"):
                continue
            values = p.data if self.dtype is None else p.data.to(self.dtype)
            flat = values.reshape(-1).contiguous()
            if self.world > 1:
                broadcast(flat, src=self.root, group=self.group)
            chunk = -(-flat.numel() // self.world)
            padded = torch.zeros(chunk * self.world, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            p.ds_shape = values.shape
            p.ds_numel = values.numel()
            p.ds_shard = padded[self.rank * chunk : (self.rank + 1) * chunk].clone()
            p.ds_group = self.group
            p.data = torch.empty(0, dtype=flat.dtype, device=flat.device)


def full_value(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: its data, or for a `zero.Init` parameter its slices gathered."""
    if not hasattr(p, "ds_shard"):
        return p.data
    shard = p.ds_shard.to(device=p.device, dtype=p.dtype)
    world = dist.get_world_size(p.ds_group) if dist.is_initialized() else 1
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    if world > 1:
        all_gather_into_tensor(out, shard, group=p.ds_group)
    else:
        out.copy_(shard)
    return out[: p.ds_numel].view(p.ds_shape)


def is_init_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_shard")


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found
