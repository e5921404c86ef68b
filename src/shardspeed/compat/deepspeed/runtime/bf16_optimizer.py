"""DeepSpeed's `deepspeed.runtime.bf16_optimizer`: the class name of `engine.optimizer` for bf16
models with fp32 gradient accumulation at ZeRO stages 0 and 1 (a ZeroOptimizer here)."""

from shardspeed.zero.optimizer import DeepSpeedWrapperClass


class BF16_Optimizer(metaclass=DeepSpeedWrapperClass):
    """`engine.optimizer` for bf16 with fp32 gradients at stage 0 or 1."""


__all__ = ["BF16_Optimizer"]
