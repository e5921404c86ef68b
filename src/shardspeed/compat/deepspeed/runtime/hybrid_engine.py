"""DeepSpeed's `deepspeed.runtime.hybrid_engine`: the class name of an engine that also
generates (`hybrid_engine.enabled`), an `isinstance` view over the engine from `inference`."""

from shardspeed.inference.hybrid import DeepSpeedHybridEngine

__all__ = ["DeepSpeedHybridEngine"]
