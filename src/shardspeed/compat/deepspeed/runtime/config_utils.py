"""DeepSpeed's `deepspeed.runtime.config_utils`: the base of config sections is the config room's."""

from shardspeed.config.base import StrictModel as DeepSpeedConfigModel

__all__ = ["DeepSpeedConfigModel"]
