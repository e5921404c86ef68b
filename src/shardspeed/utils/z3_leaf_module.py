"""DeepSpeed's `deepspeed.utils.z3_leaf_module` (re-exported from `shardspeed.common`)."""

from ..common.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
