"""Where a model's experts live, as the moe room tells the engine and the shard plan.

An expert-parallel MoE layer (ep_size > 1) holds 1/ep of its experts on each rank: it is
connected to its expert and expert-data groups from the mesh; each expert tensor gets a
checkpoint name carrying its global expert index (the name it has at ep_size 1) and a first
holder (the rank that writes it); its trainable weights go to the ZeRO optimizer as
`ExpertParameters`, averaged over their expert-data group instead of the data group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import Topology, all_reduce
from ..config.errors import ConfigError
from ..zero.plan import ExpertParameters
from .expert_parallel import ExpertParallel, expert_tensors, home_order
from .gating import imbalance
from .layer import MoE
from .rebalance import move_experts


@dataclass(frozen=True)
class ExpertPlacement:
    """The model's MoE layers by module name, its expert tensors' checkpoint names (module name
    -> (global name, first holder)), the expert weights the optimizer averages apart, and the
    fused expert tensors of Hugging Face blocks held as pieces: name -> (pieces, this rank's,
    the group holding them, what puts their gathered runs in the experts' own order), each piece
    a run of experts on the first dimension (in order while the experts are home: `at_home`)."""

    layers: dict[str, MoE]
    tensor_names: dict[str, tuple[str, bool]]
    parameters: list[ExpertParameters]
    splits: dict[str, tuple[int, int, Any, Any]]
    routed: dict[str, Any]  # what reports its routing (`expert_load()`): layers, HF experts

    @contextlib.contextmanager
    def at_home(self, optimizer: Any) -> Iterator[None]:
        """Every moved experts module's experts back in their own places (collective), then,
        on leaving, where they were: a checkpoint's pieces are runs of experts in order."""
        moved = [(m, m.expert_slots.clone()) for m in self._modules() if m.slot_of() is not None]
        for module, _ in moved:
            move_experts(module, _home(module), optimizer)
        try:
            yield
        finally:
            for module, slots in moved:
                move_experts(module, slots, optimizer)

    def go_home(self, optimizer: Any) -> None:
        """Every moved experts module's experts back in their own places, to stay (before a
        load, which writes them in order)."""
        for module in self._modules():
            if module.slot_of() is not None:
                move_experts(module, _home(module), optimizer)

    def _modules(self) -> list[ExpertParallel]:
        """The Hugging Face blocks' expert-parallel experts modules."""
        return [m for m in self.routed.values() if isinstance(m, ExpertParallel)]

    @property
    def ep_sizes(self) -> tuple[int, ...]:
        """The expert-parallel size of every MoE layer (the config's section says its own)."""
        return tuple(m.ep_size for m in self.layers.values())


def _home(module: ExpertParallel) -> torch.Tensor:
    """The placement with every expert in its own slot."""
    slots = module.expert_slots
    return torch.arange(slots.numel(), device=slots.device)


def place_experts(
    module: nn.Module, topology: Topology, data_before_expert: bool
) -> ExpertPlacement:
    """Connect each expert-parallel layer of `module` to its groups and describe the result
    (Hugging Face experts made expert-parallel by `auto_ep` are connected already)."""
    layers = {n: m for n, m in module.named_modules() if isinstance(m, MoE)}
    for size in sorted({m.ep_size for m in layers.values() if m.ep_size > 1}):
        if topology.dp_world_size % size:
            raise ConfigError(
                f"an MoE layer has ep_size {size}, which does not divide the data-parallel "
                f"size {topology.dp_world_size}"
            )
        groups = topology.expert_groups(size, data_before_expert)
        for layer in layers.values():
            if layer.ep_size == size:
                layer.set_expert_groups(groups)
    names = _expert_tensor_names(layers)
    parallel = {n: m for n, m in module.named_modules() if isinstance(m, ExpertParallel)}
    sharded = {n: m for n, m in parallel.items() if _spread(m)}
    return ExpertPlacement(
        layers,
        names,
        _expert_parameters(layers, names) + _sharded_expert_parameters(sharded),
        {
            f"{prefix}.{name}" if prefix else name: (
                m.expert_shard.groups.ep_size,
                m.expert_shard.groups.ep_rank,
                m.expert_shard.groups.ep_group,
                functools.partial(home_order, m),
            )
            for prefix, m in sharded.items()
            for name, _ in expert_tensors(m)
        },
        {**layers, **parallel},
    )


def _spread(experts: ExpertParallel) -> bool:
    return experts.expert_shard.groups.ep_size > 1


def _sharded_expert_parameters(sharded: dict[str, ExpertParallel]) -> list[ExpertParameters]:
    """Each Hugging Face experts module's trainable pieces, averaged over its expert-data group
    under their own names (a piece is saved as such and joined by the checkpoint)."""
    out = []
    for prefix, experts in sharded.items():
        groups = experts.expert_shard.groups
        named = [
            (f"{prefix}.{n}" if prefix else n, p)
            for n, p in expert_tensors(experts)
            if p.requires_grad
        ]
        if named:
            out.append(
                ExpertParameters(
                    tuple(p for _, p in named),
                    tuple(n for n, _ in named),
                    groups.expert_data_group,
                    groups.expert_data_rank,
                    groups.expert_data_size,
                )
            )
    return out


def _expert_tensor_names(layers: dict[str, MoE]) -> dict[str, tuple[str, bool]]:
    names = {}
    for prefix, layer in layers.items():
        if layer.ep_size == 1:
            continue  # every rank holds every expert, under its own name
        first = layer.deepspeed_moe.groups.expert_data_rank == 0
        stem = ".".join(filter(None, (prefix, "deepspeed_moe.experts.deepspeed_experts")))
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for name, _ in [*expert.named_parameters(), *expert.named_buffers()]:
                global_name = f"{stem}.{layer.global_expert_index(i)}.{name}"
                names[f"{stem}.{i}.{name}"] = (global_name, first)
    return names


def _expert_parameters(
    layers: dict[str, MoE], names: dict[str, tuple[str, bool]]
) -> list[ExpertParameters]:
    out = []
    for prefix, layer in layers.items():
        if layer.ep_size == 1:
            continue  # every rank holds every expert: averaged with the rest
        groups = layer.deepspeed_moe.groups
        named = [
            (names[f"{prefix}.{n}" if prefix else n][0], p)
            for n, p in layer.deepspeed_moe.experts.named_parameters(prefix="deepspeed_moe.experts")
            if p.requires_grad
        ]
        out.append(
            ExpertParameters(
                tuple(p for _, p in named),
                tuple(n for n, _ in named),
                groups.expert_data_group,
                groups.expert_data_rank,
                groups.expert_data_size,
            )
        )
    return out


def expert_load(layers: dict[str, Any], group: Any = None, world: int = 1) -> dict[str, Any]:
    """Per layer (an `MoE`, or a Hugging Face block's expert-parallel experts), its last
    forward's routing (see `MOELayer.expert_load`); summed over `group`
    when it has more than one rank (collective: one small all-reduce per layer)."""
    report = {}
    for name, layer in layers.items():
        load = layer.expert_load()
        if load and world > 1:
            dropped = load["dropped"].expand_as(load["exp_counts"])
            counts = torch.stack([load["exp_counts"], load["tokens_per_expert"], dropped])
            all_reduce(counts, group=group)
            load = {
                "exp_counts": counts[0],
                "tokens_per_expert": counts[1],
                "dropped": counts[2, 0],
                "imbalance": imbalance(counts[1]),
                **({"rows_computed": load["rows_computed"]} if "rows_computed" in load else {}),
            }
        report[name] = load
    return report
