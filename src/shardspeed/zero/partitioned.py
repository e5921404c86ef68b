"""ZeRO stage 3's parameters: each rank keeps 1/N of them, units are gathered just in time.

A unit is a set of parameters gathered and released together: one per child of every (outermost)
`nn.ModuleList` (a transformer block, typically), one for the rest of the model, and one
persistent unit that is never released: parameters below `stage3_param_persistence_threshold` and
parameters shared between units (a tied embedding and head). Each unit's parameters form their own
regions of the flat layout, so gathering a unit is one all-gather of equal shards per param group.

A unit is gathered before its forward and again before its backward (a hook on its outputs), and
released after its forward and once all its parameters have their gradients. While a unit computes,
the next one (in the order units ran in the first forward; reversed in backward) is gathered in the
background when it holds at most `stage3_prefetch_bucket_size` elements.
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
        prefetch_elements: int = 50_000_000,
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
        # Prefetch follows the order units ran in the first forward (recorded once).
        self.prefetch_elements = prefetch_elements
        self.order: list[int] = []
        self._seen_order: list[int] = []
        self._recording = True
        self._in_flight: dict[int, tuple[torch.Tensor, list]] = {}
        self.peak_gathered_bytes = 0
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
        if u not in self._in_flight:
            self._launch(u)
        buffer, works = self._in_flight.pop(u)
        for work in works:
            work.wait()
        self.buffers[u] = buffer
        self._note_live()
        start, _ = self.span(u)
        for p in self.units[u].params:
            i = self.index[p]
            offset = self.layout.offsets[i] - start
            p.data = buffer.narrow(0, offset, self.layout.numels[i]).view(self.layout.shapes[i])

    def _launch(self, u: int) -> None:
        start, end = self.span(u)
        buffer = torch.empty(end - start, dtype=self.shard.dtype, device=self.shard.device)
        works = []
        for r in self.unit_regions[u]:
            r_start, r_end = self.layout.groups[r]
            size = (r_end - r_start) // self.layout.shards
            if size:
                mine = self.shard[self.shard_offsets[r] : self.shard_offsets[r] + size]
                out = buffer[r_start - start : r_end - start]
                works.append(all_gather_into_tensor(out, mine, group=self.group, async_op=True))
        self._in_flight[u] = (buffer, works)
        self._note_live()

    def _note_live(self) -> None:
        buffers = [*self.buffers.values(), *(b for b, _ in self._in_flight.values())]
        live = sum(b.numel() * b.element_size() for b in buffers)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    def prefetch(self, u: int | None) -> None:
        """Start gathering unit `u` in the background, if it is small enough to be worth it."""
        if u is None or u in self.buffers or u in self._in_flight:
            return
        start, end = self.span(u)
        if end - start <= self.prefetch_elements:
            self._launch(u)

    def _neighbour(self, u: int, step: int) -> int | None:
        """The unit that ran just after (step 1) or before (step -1) `u` in the last forward."""
        if u not in self.order:
            return None
        i = self.order.index(u) + step
        return self.order[i] if 0 <= i < len(self.order) else None

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
        """End of a step's backward: drop every non-persistent copy, prefetched ones included."""
        for u in list(self._in_flight):
            self.gather(u)
        for u in range(len(self.units)):
            self.release(u)
        if self._recording:
            self.order, self._recording = self._seen_order, False

    def _pre_forward(self, u: int) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if self._recording and u not in self._seen_order:
                self._seen_order.append(u)
            self.gather(u)
            self.prefetch(self._neighbour(u, 1))

        return hook

    def _pre_backward(self, u: int) -> None:
        self.gather(u)
        self.prefetch(self._neighbour(u, -1))

    def _post_forward(self, u: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensors = [
                t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                # Before this unit's backward runs, its parameters must be whole again.
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grad: self._pre_backward(u), mode="any"
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
