"""DeepSpeed's `deepspeed.runtime.utils`: the memory report that user scripts sprinkle in, and
`move_to_device` (accelerate's sequence-parallel scripts import it)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.accelerator import get_accelerator
from shardspeed.utils import logger

_GIB = 1024**3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log `message` with the accelerator's allocated / peak / reserved memory and the host's
    memory in use, on rank 0, when `force` is true (DeepSpeed's calls leave it false), then
    reset the peak counter so that the next report shows the peak since this one."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    accelerator = get_accelerator()
    allocated = accelerator.memory_allocated() / _GIB
    peak = accelerator.max_memory_allocated() / _GIB
    reserved = accelerator.memory_reserved() / _GIB
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    free = os.sysconf("SC_AVPHYS_PAGES")
    host_used = (pages - free) * page_size / _GIB
    logger.info(
        "%s | allocated %.2f GiB, peak %.2f GiB, reserved %.2f GiB | host memory in use %.2f GiB",
        message,
        allocated,
        peak,
        reserved,
        host_used,
    )
    accelerator.reset_peak_memory_stats()


__all__ = ["see_memory_usage"]


def move_to_device(
    item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None
) -> Any:
    """`item` (a tensor, or lists, tuples and dicts of them, nested) on `device`, as DeepSpeed's:
    where `criterion_func(item)` holds, the tensor itself is moved (its `.data` replaced) and
    returned; containers are rebuilt; any other tensor is copied with `.to(device)`. Anything that
    is not a tensor or container comes back as it is."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if isinstance(item, torch.Tensor) else item
