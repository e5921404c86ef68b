"""DeepSpeed's `deepspeed.utils.torch`: torch version checks and gradient hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from packaging import version


def required_torch_version(
    min_version: float | str | None = None, max_version: float | str | None = None
) -> bool:
    """Whether the running torch is at least `min_version` and at most `max_version`."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version needs min_version or max_version")
    running = version.parse(torch.__version__.split("+")[0])
    if min_version is not None and version.parse(str(min_version)) > running:
        return False
    return max_version is None or version.parse(str(max_version)) >= running


def register_grad_hook(param: torch.nn.Parameter, hook: Callable[[torch.Tensor], Any]) -> Any:
    """Run `hook(param)` once the parameter's gradient for this backward is accumulated."""
    return param.register_post_accumulate_grad_hook(hook)


def jit_script_compat(fn: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed compiles small helpers with this; shardspeed runs them as they are."""
    return fn
