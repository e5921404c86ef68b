"""Optimizers and DeepSpeed-style LR schedules, and the factories that build them from config."""

from shardspeed.optim.factory import build_optimizer, build_scheduler
from shardspeed.optim.lamb import Lamb
from shardspeed.optim.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

__all__ = [
    "LRRangeTest",
    "Lamb",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
]
