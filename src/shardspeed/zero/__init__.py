"""The zero room: flat buffers, gradient reduction and the ZeRO optimizer (stages 0 to 3)."""

from .estimate import model_state_bytes
from .flat import FlatLayout
from .init import Init, ZeroParamStatus
from .offload import OffloadOptions
from .optimizer import NonFiniteGradientError, ReduceOptions, ZeroOptimizer
from .partitioned import (
    GatheredParameters,
    Stage3Options,
    register_external_parameter,
    unregister_external_parameter,
)
from .plan import ExpertParameters, ShardPlan, TiedParameters
from .reducer import GradientReducer
from .stores import GatherOptions
from .swap import AioOptions

__all__ = [
    "AioOptions",
    "ExpertParameters",
    "FlatLayout",
    "GatherOptions",
    "GatheredParameters",
    "GradientReducer",
    "Init",
    "NonFiniteGradientError",
    "OffloadOptions",
    "ReduceOptions",
    "ShardPlan",
    "Stage3Options",
    "TiedParameters",
    "ZeroOptimizer",
    "ZeroParamStatus",
    "model_state_bytes",
    "register_external_parameter",
    "unregister_external_parameter",
]
