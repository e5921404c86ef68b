"""The runtime room: the engine and data loading."""

from ..optim import lr_schedules  # DeepSpeed's deepspeed.runtime.lr_schedules, as an attribute
from .dataloader import DistributedDataLoader
from .engine import DeepSpeedEngine, ShardSpeedEngine

__all__ = ["DeepSpeedEngine", "DistributedDataLoader", "ShardSpeedEngine", "lr_schedules"]
