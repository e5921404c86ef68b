"""DeepSpeed's `deepspeed.moe.utils`: telling expert parameters from shared ones, and splitting
optimizer param groups so that each holds one kind.

shardspeed's optimizer does not need the split (it lays expert weights out by themselves
whatever the param groups), but scripts written for DeepSpeed call it, and a param group per
kind lets a script give experts their own hyperparameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layer import MoE

# DeepSpeed's default cap on one expert param group's elements (a fused-kernel limit there).
DEFAULT_MAX_GROUP_SIZE = 178956971


def has_moe_layers(module: nn.Module) -> tuple[bool, int]:
    """(whether `module` holds an MoE layer, the first one's num_experts, or 0)."""
    for m in module.modules():
        if isinstance(m, MoE):
            return True, m.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert parameter: marked `allreduce = False` by the MoE layer."""
    return getattr(param, "allreduce", True) is False


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients (in each parameter's dtype) of shared and of expert parameters that have one."""
    shared = [p.grad.to(p.dtype) for p in group if p.grad is not None and not is_moe_param(p)]
    expert = [p.grad.to(p.dtype) for p in group if p.grad is not None and is_moe_param(p)]
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """Move expert parameters out of each param group into groups of their own, one per
    (original group, expert group name), with the original's hyperparameters plus
    `moe: True` and `name: <expert group name>`; with `max_group_size`, each such group is cut
    into pieces of at most that many elements. The shared groups keep their other parameters.

    Each group needs a `name`, as in DeepSpeed (it keys the expert groups made from it).
    """
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups must be a dict, list or tuple, not {type(param_groups)}")
    for i, group in enumerate(param_groups):
        if "name" not in group:
            raise ValueError(
                f"param group {i} has no 'name': each group needs one to key its expert groups"
            )
    expert_names = sorted(
        {p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)}
    )
    expert_groups: list[dict[str, Any]] = []
    for group in param_groups:
        params = list(group["params"])
        for name in expert_names:
            members = [p for p in params if is_moe_param(p) and p.group_name == name]
            template = {**group, "name": name, "moe": True}
            if max_group_size is None:
                expert_groups.append({**template, "params": members})
                continue
            for piece in _pieces(members, max_group_size):
                expert_groups.append({**template, "params": piece})
        group["params"] = [p for p in params if not is_moe_param(p)]
    return param_groups + expert_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """Param groups for a model with MoE layers: a plain parameter list becomes a shared group
    ("dense-params") and expert groups; groups given as dicts are split unless one is an expert
    group already."""
    if not isinstance(model_parameters, list) or not model_parameters:
        raise ValueError("model_parameters must be a non-empty list")
    if all(isinstance(p, nn.Parameter) for p in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if all(isinstance(p, dict) for p in model_parameters):
        if any("moe" in group for group in model_parameters):
            return model_parameters  # split already
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    raise TypeError("model_parameters must be all parameters or all param-group dicts")


def _pieces(params: list[nn.Parameter], limit: int | float) -> list[list[nn.Parameter]]:
    """Consecutive runs of whole parameters of at most `limit` elements (a bigger one alone)."""
    pieces: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        numel = getattr(p, "ds_numel", p.numel())
        if not pieces or size + numel > limit:
            pieces.append([])
            size = 0
        pieces[-1].append(p)
        size += numel
    return pieces
