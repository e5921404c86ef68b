"""DeepSpeed's `deepspeed.accelerator`: the device a process trains on (see real_accelerator.py)."""

from .real_accelerator import (
    Accelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
