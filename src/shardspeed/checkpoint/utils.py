"""DeepSpeed's `deepspeed.checkpoint.utils` helpers that libraries call (accelerate's state dicts,
scripts that find a DeepSpeed checkpoint's files)."""

from __future__ import annotations

from typing import Any

import torch

from .deepspeed import get_model_ckpt_name_for_rank

__all__ = ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """`item` with every tensor in it (through lists, tuples and dicts) detached and copied to
    `device`: a copy that owns its storage, so saving it never writes the whole flat buffer a
    parameter is a view of."""
    if torch.is_tensor(item):
        return item.detach().to(device, copy=True)
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # a namedtuple takes its fields apart
        return type(item)(*(clone_tensors_for_torch_save(v, device) for v in item))
    if isinstance(item, list | tuple):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
