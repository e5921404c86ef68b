"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2`` import path: its ZeRO-2 memory estimators and
the optimizer class name, for ``isinstance`` checks."""

from .estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)
from .optimizer import DeepSpeedWrapperClass


class DeepSpeedZeroOptimizer(metaclass=DeepSpeedWrapperClass):
    """`engine.optimizer` at ZeRO stages 1 and 2 (a ZeroOptimizer)."""


__all__ = [
    "DeepSpeedZeroOptimizer",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
]
