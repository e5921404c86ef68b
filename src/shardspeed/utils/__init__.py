"""DeepSpeed's `deepspeed.utils`: the names users and libraries call, over the rooms that own them
(`shardspeed.common` for the small helpers, `comm.groups`, the `safe_*` accessors of
`zero.tensor_fragment`, `zero_to_fp32` over `checkpoint`). It sits above those rooms; no room
imports it. Importing the package loads no torch: the names that need it load on first use."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..common.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

# DeepSpeed's `deepspeed.utils.logger`: shardspeed's logger (transformers sets its level).
logger = logging.getLogger("shardspeed")

# Loaded on first use: name -> (module, attribute; None for the module itself); and every `safe_*`
# accessor from zero/tensor_fragment.py.
_LAZY: dict[str, tuple[str, str | None]] = {
    "groups": ("shardspeed.comm.groups", None),
    "RepeatingLoader": ("shardspeed.runtime.dataloader", "RepeatingLoader"),
    "OnDevice": ("shardspeed.utils.init_on_device", "OnDevice"),
}
_ACCESSORS = "shardspeed.zero.tensor_fragment"

__all__ = [
    "get_z3_leaf_modules",
    "log_dist",
    "logger",
    "set_log_level_from_string",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """DeepSpeed's `log_dist`: log `message` on the given ranks (`[-1]`: every rank; none given:
    rank 0 of a distributed job, or the one process of a job without one)."""
    dist = sys.modules.get("torch.distributed")
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else int(os.environ.get("RANK", "0"))
    chosen = list(ranks or [0])
    if chosen[0] == -1 or rank in chosen:
        # Marked, so the rank-0 filter of shardspeed's handler lets the chosen ranks through.
        logger.log(level, "[Rank %d] %s", rank, message, extra={"shardspeed_any_rank": True})


def set_log_level_from_string(level: str, custom_logger: logging.Logger | None = None) -> None:
    """Set `custom_logger` (default: shardspeed's) and its handlers to `level` ("info", "debug", ...)."""
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(
            f"unknown log level {level!r}: use debug, info, warning, error or critical"
        )
    target = logger if custom_logger is None else custom_logger
    target.setLevel(number)
    for handler in target.handlers:
        handler.setLevel(number)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = importlib.import_module(module)
        value = value if attribute is None else getattr(value, attribute)
    elif name.startswith("safe_"):
        value = getattr(importlib.import_module(_ACCESSORS), name, None)
        if value is None:
            raise AttributeError(f"module 'shardspeed.utils' has no attribute {name!r}")
    else:
        raise AttributeError(f"module 'shardspeed.utils' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    accessors = importlib.import_module(_ACCESSORS).__all__
    return sorted({*globals(), *_LAZY, *accessors})
