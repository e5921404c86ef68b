"""DeepSpeed's `deepspeed.runtime.zero.utils`: the names scripts catch or check against."""

# DeepSpeed raises its own exception class where the ZeRO optimizer cannot go on; shardspeed's zero
# room raises RuntimeError in those places (configuration mistakes are ConfigError, at initialize).
ZeRORuntimeException = RuntimeError

__all__ = ["ZeRORuntimeException"]
