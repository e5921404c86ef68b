"""The runtime room: the engine and data loading."""

from .dataloader import DistributedDataLoader
from .engine import ShardSpeedEngine

__all__ = ["DistributedDataLoader", "ShardSpeedEngine"]
