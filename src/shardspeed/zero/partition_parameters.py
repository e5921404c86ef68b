"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters`: the names libraries import from it.

`Init` and `GatheredParameters` are the zero room's own; `zero_wrapper_for_fp_tensor_constructor`
is DeepSpeed's helper that makes a tensor constructor build on the training device in a given
floating dtype. transformers swaps it (keeping `torch.arange` out of the dtype change) around
`zero.Init`; shardspeed's `Init` patches no tensor constructors, since it slices parameters once
each module is built, so the swap has nothing to undo and the helper serves callers who use it.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import Any

import torch

from ..accelerator import get_accelerator
from .init import Init, ZeroParamStatus, single_rank_group_problem
from .partitioned import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]


def _contradicting_single_rank_pg_error(
    dp_world_size: int, explicit_process_group: Any, env: dict[str, str | None]
) -> str | None:
    """DeepSpeed's private name for the check `zero.Init` makes on its process group."""
    return single_rank_group_problem(dp_world_size, explicit_process_group, env)


# The constructors as torch defines them (DeepSpeed keeps these before patching any).
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


class ZeroParamType(enum.Enum):
    """DeepSpeed's kinds of ZeRO-3 parameter."""

    NORMAL = 1  # whole on every rank
    PARTITIONED = 2  # sliced over the data-parallel group
    REMOTE = 3  # sliced and held off the device


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor],
    target_fp_dtype: torch.dtype,
    target_device: torch.device | str | None = None,
) -> Callable[..., torch.Tensor]:
    """`fn` that builds on `target_device` (default: this rank's accelerator device) unless given a
    device, and casts floating results to `target_fp_dtype`."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = torch.device(
                target_device
                or get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0")))
            )
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped
