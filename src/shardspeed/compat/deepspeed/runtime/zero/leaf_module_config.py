"""DeepSpeed's `deepspeed.runtime.zero.leaf_module_config`: `zero_optimization.leaf_module`."""

from shardspeed.config.schema import DEFAULT_LEAF_MODULE_CLASSES
from shardspeed.config.schema import LeafModuleConfig as DeepSpeedZeroLeafModuleConfig

DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]
