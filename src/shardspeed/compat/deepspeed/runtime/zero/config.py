"""DeepSpeed's `deepspeed.runtime.zero.config`: the `zero_optimization` section's model and stages."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from shardspeed.config import load_config
from shardspeed.config.loader import STAGE3_UNPREFIXED
from shardspeed.config.schema import ZeroConfig

from .offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)


class DeepSpeedZeroConfig:
    """A `zero_optimization` section validated as `initialize` validates it (old spellings
    accepted with a warning, unknown keys refused), read under DeepSpeed's attribute names too:
    the stage-3 keys without their `stage3_` prefix (`gather_16bit_weights_on_model_save`, ...)."""

    def __init__(self, **section: Any) -> None:
        config = load_config({"train_batch_size": 1, "zero_optimization": section}, 1)
        self.section: ZeroConfig = config.zero_optimization

    def __getattr__(self, name: str) -> Any:
        if name == "section":
            raise AttributeError(name)
        if name in STAGE3_UNPREFIXED:
            name = f"stage3_{name}"
        return getattr(self.section, name)


class ZeroStageEnum(IntEnum):
    """The value of `zero_optimization.stage`, by what each stage partitions."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "ZeroStageEnum",
]
