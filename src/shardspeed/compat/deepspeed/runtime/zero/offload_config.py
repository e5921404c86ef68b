"""DeepSpeed's `deepspeed.runtime.zero.offload_config`: the offload sections and their devices."""

from __future__ import annotations

from enum import Enum

from shardspeed.config.schema import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig
from shardspeed.config.schema import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig


class OffloadDeviceEnum(str, Enum):
    """`offload_optimizer.device` / `offload_param.device`; members compare equal to the strings."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"

    def __str__(self) -> str:
        return self.value


__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
]
