"""The zero room: flat buffers, gradient reduction and the sharded optimizers (stage 0 today)."""

from .flat import FlatLayout
from .optimizer import FlatOptimizer, NonFiniteGradientError, ReduceOptions
from .reducer import GradientReducer

__all__ = [
    "FlatLayout",
    "FlatOptimizer",
    "GradientReducer",
    "NonFiniteGradientError",
    "ReduceOptions",
]
