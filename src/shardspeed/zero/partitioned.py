"""ZeRO stage 3's parameters: each rank keeps 1/N of them, units are gathered just in time.

A unit is a set of parameters gathered and released together: one per child of every (outermost)
`nn.ModuleList` (a transformer block, typically), one for the rest of the model, and one
persistent unit that is never released: parameters below `stage3_param_persistence_threshold` and
parameters shared between units (a tied embedding and head). Each unit's parameters form their own
regions of the flat layout, so gathering a unit is one all-gather of equal shards per param group.

A unit is gathered before its forward and again before its backward (a hook on its outputs), and
released after its forward and once all its parameters have their gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from ..comm import all_gather_into_tensor, broadcast, get_rank
from .flat import FlatLayout, logical_shape

# The attribute naming the ShardedParameters that owns a parameter (how GatheredParameters finds
# what to gather; tensors cannot be dictionary keys by value).
_OWNER = "_shardspeed_shards"


@dataclass
class Unit:
    """Parameters gathered together; `modules` are where its forward hooks go (none if persistent)."""

    params: list[nn.Parameter]
    modules: list[nn.Module] = field(default_factory=list)
    persistent: bool = False


def plan_units(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    persistence_threshold: int,
    model_persistence_threshold: int,
) -> list[Unit]:
    """Split `params` (the trainable ones) into units, persistent unit first."""
    roots: list[nn.Module] = []

    def walk(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, nn.ModuleList):
                roots.extend(child)
            else:
                walk(child)

    walk(module)
    unit_of_module = {}
    for index, root in enumerate(roots):
        for sub in root.modules():
            unit_of_module.setdefault(sub, index)
    rest = len(roots)
    homes: dict[nn.Parameter, set[int]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            homes.setdefault(p, set()).add(unit_of_module.get(sub, rest))
    managed = set(params)
    persistent, budget = [], model_persistence_threshold
    for p in params:
        numel = logical_shape(p).numel()
        if (len(homes[p]) > 1 or numel <= persistence_threshold) and numel <= budget:
            persistent.append(p)
            budget -= numel
    kept = set(persistent)
    units = [Unit(persistent, persistent=True)]
    for index, root in enumerate([*roots, module]):
        owned = [p for p in params if p not in kept and min(homes[p]) == index]
        units.append(Unit(owned, [root]))
    assert sum(len(u.params) for u in units) == len(managed)
    return [u for u in units if u.params or u.persistent]


class ShardedParameters:
    """Gathers and releases units of parameters kept as shards in `shard` (this rank's 1/N)."""

    def __init__(
        self,
        units: list[Unit],
        layout: FlatLayout,
        unit_regions: list[range],
        shard_offsets: list[int],
        shard: torch.Tensor,
        params: list[nn.Parameter],
        group: Any,
    ) -> None:
        self.units, self.layout, self.unit_regions = units, layout, unit_regions
        self.shard_offsets, self.shard, self.group = shard_offsets, shard, group
        self.index = {p: i for i, p in enumerate(params)}
        self.params = params
        self.buffers: dict[int, torch.Tensor] = {}
        self._empty = torch.empty(0, dtype=shard.dtype, device=shard.device)
        self._pending: list[int] = [len(u.params) for u in units]
        self.unit_of = [0] * len(params)
        for u, unit in enumerate(units):
            for p in unit.params:
                self.unit_of[self.index[p]] = u
        self.after_write: Callable[[], None] | None = None
        for p in params:
            setattr(p, _OWNER, self)
            p.data = self._empty  # the whole values now live only as shards (and units on demand)
        self._handles = []
        for u, unit in enumerate(units):
            for m in unit.modules:
                self._handles.append(m.register_forward_pre_hook(self._pre_forward(u)))
                self._handles.append(m.register_forward_hook(self._post_forward(u)))

    def span(self, u: int) -> tuple[int, int]:
        regions = self.unit_regions[u]
        return self.layout.groups[regions[0]][0], self.layout.groups[regions[-1]][1]

    def gather(self, u: int) -> None:
        """Make unit `u`'s parameters whole on every rank (a no-op if they already are)."""
        if u in self.buffers:
            return
        start, end = self.span(u)
        buffer = torch.empty(end - start, dtype=self.shard.dtype, device=self.shard.device)
        for r in self.unit_regions[u]:
            r_start, r_end = self.layout.groups[r]
            size = (r_end - r_start) // self.layout.shards
            if size:
                mine = self.shard[self.shard_offsets[r] : self.shard_offsets[r] + size]
                all_gather_into_tensor(
                    buffer[r_start - start : r_end - start], mine, group=self.group
                )
        self.buffers[u] = buffer
        for p in self.units[u].params:
            i = self.index[p]
            offset = self.layout.offsets[i] - start
            p.data = buffer.narrow(0, offset, self.layout.numels[i]).view(self.layout.shapes[i])

    def release(self, u: int) -> None:
        """Drop unit `u`'s whole copy (persistent units stay)."""
        if self.units[u].persistent or u not in self.buffers:
            return
        for p in self.units[u].params:
            p.data = self._empty
        del self.buffers[u]

    def refresh_persistent(self) -> None:
        """Re-gather the persistent unit after the shards changed (the optimizer stepped)."""
        for u, unit in enumerate(self.units):
            if unit.persistent:
                self.buffers.pop(u, None)
                self.gather(u)

    def start_backward_accounting(self) -> None:
        self._pending = [len(u.params) for u in self.units]

    def gradient_done(self, index: int) -> None:
        """Parameter `index` has its gradient: release its unit once all of them have."""
        u = self.unit_of[index]
        self._pending[u] -= 1
        if self._pending[u] == 0:
            self.release(u)

    def release_all(self) -> None:
        for u in range(len(self.units)):
            self.release(u)

    def _pre_forward(self, u: int) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self.gather(u)

        return hook

    def _post_forward(self, u: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensors = [
                t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                # Before this unit's backward runs, its parameters must be whole again.
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grad: self.gather(u), mode="any"
                )
            self.release(u)

        return hook

    def write_back(self, u: int) -> None:
        """Copy this rank's part of unit `u`'s (modified) whole copy back into its shard."""
        start, _ = self.span(u)
        buffer = self.buffers[u]
        rank = _group_rank(self.group)
        for r in self.unit_regions[u]:
            r_start, r_end = self.layout.groups[r]
            size = (r_end - r_start) // self.layout.shards
            mine = buffer[r_start - start + rank * size :][:size]
            self.shard[self.shard_offsets[r] : self.shard_offsets[r] + size].copy_(mine)
        if self.after_write is not None:
            self.after_write()


def _group_rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else get_rank()


class GatheredParameters:
    """Make ZeRO-3 parameters whole inside the block, as `deepspeed.zero.GatheredParameters`.

    With `modifier_rank`, that rank's changes are broadcast on exit and written back into every
    rank's shard (and fp32 master). Parameters that are not partitioned are left alone.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        del fwd_module  # parameters are gathered by unit, so no module needs to know about them
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.targets: dict[ShardedParameters, set[int]] = {}
        for p in params:
            owner = getattr(p, _OWNER, None)
            if owner is not None:
                self.targets.setdefault(owner, set()).add(owner.unit_of[owner.index[p]])
        self._opened: list[tuple[ShardedParameters, int]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for owner, units in self.targets.items():
            for u in sorted(units):
                if u not in owner.buffers:
                    self._opened.append((owner, u))
                owner.gather(u)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None and exc[0] is None:
            for owner, units in self.targets.items():
                for u in sorted(units):
                    src = self.modifier_rank
                    if owner.group is not None:
                        src = dist.get_global_rank(owner.group, src)
                    broadcast(owner.buffers[u], src=src, group=owner.group)
                    owner.write_back(u)
        for owner, u in self._opened:
            owner.release(u)
        self._opened = []
