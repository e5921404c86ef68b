"""Build the optimizer and LR schedule that a config's `optimizer` and `scheduler` sections describe."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.config.base import StrictModel
from shardspeed.config.optimizer import OPTIMIZER_PARAMS, AdamParams, MuonParams
from shardspeed.config.scheduler import SCHEDULER_PARAMS
from shardspeed.optim.lamb import Lamb
from shardspeed.optim.lion import Lion
from shardspeed.optim.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)
from shardspeed.optim.muon import Muon, muon_param_groups, tag_muon_parameters
from shardspeed.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

__all__ = ["build_optimizer", "build_scheduler"]

_SCHEDULES: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}

# Devices where torch has fused (single-kernel) Adam/AdamW that we default to.
_FUSED_ADAM_DEVICES = frozenset({"cpu", "cuda"})


def _check_params(kind: str, name: str, params: StrictModel, table: dict) -> None:
    model = table.get(name)
    if model is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(table)}")
    if type(params) is not model:
        raise TypeError(f"{kind} {name!r} takes {model.__name__}, got {type(params).__name__}")
    # The config loader refuses these already; repeat it for direct callers so no value is ignored.
    for field, info in model.model_fields.items():
        reason = model.unsupported_reason(field)
        if reason is not None and getattr(params, field) != info.get_default():
            raise ValueError(f"{kind} {name!r}: '{field}' is not supported ({reason})")


def _materialise(model_parameters: Iterable[Any]) -> list[Any]:
    """What torch optimizers accept (tensors, (name, tensor) pairs or group dicts), with every
    iterator turned into a list, so the tensors can be inspected and still reach the optimizer."""
    out = []
    for item in model_parameters:
        if isinstance(item, dict):
            group = item["params"]
            item = {**item, "params": [group] if torch.is_tensor(group) else list(group)}
        out.append(item)
    return out


def _tensors(param_list: list[Any]) -> list[torch.Tensor]:
    found = []
    for item in param_list:
        for entry in item["params"] if isinstance(item, dict) else [item]:
            found.append(entry[1] if isinstance(entry, tuple) else entry)
    return found


def _fusable(tensors: list[torch.Tensor]) -> bool:
    # Fused kernels are torch's fastest Adam; they need floating tensors on a device that has them.
    # Otherwise torch's own default applies (foreach on accelerators, the per-tensor loop on CPU).
    return bool(tensors) and all(
        t.is_floating_point() and t.device.type in _FUSED_ADAM_DEVICES for t in tensors
    )


def _adam(params: AdamParams, param_list: list[Any]) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {
        "lr": params.lr,
        "betas": params.betas,
        "eps": params.eps,
        "weight_decay": params.effective_weight_decay(),
        "amsgrad": params.amsgrad,
    }
    if params.foreach is not None:
        kwargs["foreach"] = params.foreach
    elif _fusable(_tensors(param_list)):
        kwargs["fused"] = True
    optimizer_class = torch.optim.AdamW if params.decoupled() else torch.optim.Adam
    return optimizer_class(param_list, **kwargs)


_COMPRESSED = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OneBitLamb}


def build_optimizer(
    name: str,
    params: StrictModel,
    model_parameters: Iterable[Any],
    module: torch.nn.Module | None = None,
) -> torch.optim.Optimizer:
    """The optimizer for canonical `name` (see `canonical_optimizer_name`) with validated `params`.

    `Adam`/`AdamW` become `torch.optim.Adam` (L2 decay, only for type Adam with `adam_w_mode: false`)
    or `torch.optim.AdamW`, fused where torch supports it; `torch_adam` keeps DeepSpeed's meaning for
    the keys and defaults it allows, and both paths run torch's implementation. `Lamb` is shardspeed's
    FusedLamb-equivalent, `Lion` its FusedLion's; `SGD` and `Adagrad` are torch's own;
    `OneBitAdam`, `ZeroOneAdam` and `OneBitLamb` communicate their own (compressed) momentum after
    their warm-up (optim/onebit.py). `Muon` splits every param group into a Muon and an AdamW
    half by each parameter's `use_muon` mark, which it first sets on `module`'s parameters (as
    DeepSpeed's `initialize` does) when `module` is given.
    """
    _check_params("optimizer", name, params, OPTIMIZER_PARAMS)
    param_list = _materialise(model_parameters)
    if isinstance(params, AdamParams):
        return _adam(params, param_list)
    if name == "Lamb":
        return Lamb(param_list, **params.model_dump(exclude={"amsgrad"}))
    if name == "Lion":
        return Lion(param_list, **params.model_dump())
    if isinstance(params, MuonParams):
        if module is not None:
            tag_muon_parameters(module)
        groups = muon_param_groups(param_list, params.half_settings())
        return Muon(groups, adam_w_mode=params.adam_w_mode)
    if name in _COMPRESSED:
        return _COMPRESSED[name](param_list, **params.model_dump())
    optimizer_class = torch.optim.SGD if name == "SGD" else torch.optim.Adagrad
    return optimizer_class(param_list, **params.model_dump())


def build_scheduler(name: str, params: StrictModel, optimizer: Any) -> Any:
    """The DeepSpeed-style LR schedule `name` (exact DeepSpeed type name) driving `optimizer`."""
    _check_params("scheduler", name, params, SCHEDULER_PARAMS)
    return _SCHEDULES[name](optimizer, **params.model_dump())
