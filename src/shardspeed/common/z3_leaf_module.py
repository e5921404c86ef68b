"""Flag modules as ZeRO-3 leaves, as `deepspeed.utils.set_z3_leaf_modules` does.

A leaf module is gathered whole before its forward and becomes a gather unit of its own (see
`shardspeed.zero.partitioned`). The flag is DeepSpeed's attribute, so models prepared for either
library work with both. `zero_optimization.leaf_module` in the config does the same by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher imports this package and must not pay for torch
    from torch import nn

LEAF_FLAG = "_z3_leaf"


def _matches(module: nn.Module, classes: list[type | str]) -> bool:
    cls = type(module)
    names = (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    return any(
        (isinstance(c, type) and isinstance(module, c)) or (isinstance(c, str) and c in names)
        for c in classes
    )


def _flag(
    model: nn.Module, classes: list[type | str], value: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    hits = [m for m in model.modules() if _matches(m, classes)]
    if not hits and raise_if_not_found:
        raise ValueError(f"no module of the classes {classes} in the model")
    for m in hits:
        setattr(m, LEAF_FLAG, value)
    return hits


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag every module of these classes (types, class names or qualified names) as a leaf."""
    return _flag(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Remove the leaf flag from every module of these classes."""
    return _flag(model, leaf_module_classes, False, raise_if_not_found)


def _flag_named(
    model: nn.Module,
    wanted: list[str],
    matches: Callable[[str, str], bool],
    flag: bool,
    raise_if_not_found: bool,
) -> tuple[list[nn.Module], list[str]]:
    hits: dict[int, nn.Module] = {}
    missing = []
    for pattern in wanted:
        found = [m for name, m in model.named_modules() if matches(name, pattern)]
        if not found:
            missing.append(pattern)
        for m in found:
            setattr(m, LEAF_FLAG, flag)
            hits.setdefault(id(m), m)
    if missing and raise_if_not_found:
        raise ValueError(f"no module of the model is named {missing} (see model.named_modules())")
    return list(hits.values()), missing


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: list[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag on the modules with these `named_modules()` names; returns (modules, missing)."""
    return _flag_named(model, module_names, str.__eq__, flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(
    model: nn.Module,
    module_name_suffixes: list[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag on the modules whose names end with one of these suffixes, as the
    `leaf_module.name_suffixes` config key matches them; returns (modules, missing suffixes)."""
    return _flag_named(model, module_name_suffixes, str.endswith, flag, raise_if_not_found)


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is flagged as a leaf."""
    return bool(getattr(model, LEAF_FLAG, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` flagged as a leaf."""
    return [m for m in model.modules() if z3_leaf_module(m)]
