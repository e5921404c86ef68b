"""The bytes a rank holds for its model state, by kind and by where they live."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_KINDS = ("parameters", "gradients", "master_weights", "optimizer_states", "buffers")


def memory_breakdown(optimizer: Any, module: nn.Module, device: torch.device) -> dict[str, int]:
    """Bytes this rank holds, by kind, each storage counted once (views share their storage).

    `optimizer` is the engine's ZeroOptimizer (None: the module's parameters only). `on_device`,
    `on_cpu` and `on_nvme` split the same bytes by where they live (swap files counted at their
    size on disk); "device" is `device`'s memory (host memory when there is no accelerator). At
    stage 3 `gathered_peak` adds the most bytes of gathered parameters alive at one time.
    """
    held = (
        optimizer.held_tensors()
        if optimizer is not None
        else {"parameters": list(module.parameters())}
    )
    held["buffers"] = list(module.buffers())
    seen: set[tuple] = set()
    sizes = {}
    where = {"device": 0, "cpu": 0, "nvme": 0}
    accelerator = device.type != "cpu"
    for kind in _KINDS:
        total = 0
        for tensor in held.get(kind, []):
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), tensor.device)
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
                place = "cpu" if accelerator and tensor.device.type == "cpu" else "device"
                where[place] += storage.nbytes()
        sizes[kind] = total
    swapped = getattr(optimizer, "swapped", None)
    if swapped is not None:
        where["nvme"] = swapped.bytes_on_disk()
    sizes["total"] = sum(sizes.values())
    sizes.update({f"on_{k}": v for k, v in where.items()})
    sharded = getattr(optimizer, "sharded_params", None)
    if sharded is not None:
        # The most bytes of whole (gathered) parameters alive at once so far, which comes on
        # top of what is held between steps.
        sizes["gathered_peak"] = sharded.peak_gathered_bytes
    return sizes
