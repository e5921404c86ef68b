"""DeepSpeed's `deepspeed.runtime.zero.offload_config`: the offload sections, their devices, and
the state kinds of `engine.offload_states(include=...)` (both enums live in the zero room)."""

from __future__ import annotations

from shardspeed.config.schema import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig
from shardspeed.config.schema import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig
from shardspeed.zero.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
