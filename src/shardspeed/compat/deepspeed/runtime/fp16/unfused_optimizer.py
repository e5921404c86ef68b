"""DeepSpeed's `deepspeed.runtime.fp16.unfused_optimizer`: the class name of `engine.optimizer` for
16-bit models accumulating 16-bit gradients at ZeRO stage 0 with any other optimizer."""

from shardspeed.zero.optimizer import DeepSpeedWrapperClass


class FP16_UnfusedOptimizer(metaclass=DeepSpeedWrapperClass):
    """`engine.optimizer` for 16-bit gradients at stage 0 without FusedAdam."""


__all__ = ["FP16_UnfusedOptimizer"]
