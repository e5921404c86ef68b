"""Names DeepSpeed's `deepspeed.utils` has beyond shardspeed.utils."""

from .init_on_device import OnDevice

__all__ = ["OnDevice"]
