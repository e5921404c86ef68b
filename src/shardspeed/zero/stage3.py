"""DeepSpeed's ``deepspeed.runtime.zero.stage3`` import path: its ZeRO-3 memory estimators and the
optimizer class name, for ``isinstance`` checks."""

from .estimate import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from .optimizer import DeepSpeedWrapperClass


class DeepSpeedZeroOptimizer_Stage3(metaclass=DeepSpeedWrapperClass):
    """`engine.optimizer` at ZeRO stage 3 (a ZeroOptimizer)."""


__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]
