"""Small helpers shared by the rooms, and DeepSpeed's `deepspeed.utils` functions users call."""

from .z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

__all__ = ["get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module"]
