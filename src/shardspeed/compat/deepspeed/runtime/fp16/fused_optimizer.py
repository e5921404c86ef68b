"""DeepSpeed's `deepspeed.runtime.fp16.fused_optimizer`: the class name of `engine.optimizer` for
fp16 at ZeRO stage 0 with a fused Adam (a ZeroOptimizer here)."""

from shardspeed.zero.optimizer import DeepSpeedWrapperClass


class FP16_Optimizer(metaclass=DeepSpeedWrapperClass):
    """`engine.optimizer` for fp16 at stage 0 with FusedAdam."""


__all__ = ["FP16_Optimizer"]
