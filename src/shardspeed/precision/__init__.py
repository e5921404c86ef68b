"""Mixed-precision support: fp16 loss scaling."""

from shardspeed.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    StaticLossScaler,
    build_loss_scaler,
)

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimumError",
    "LossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
]
