"""The stores the ZeRO optimizer composes, each chosen once from the plan and the config.

- gradients: `FlatGradients` (the full buffer: stages 0 and 1) or `ShardGradients` (only this
  rank's shard, added to as each bucket is reduced: stages 2 and 3);
- parameters: `ReplicatedParams` (the whole model in one buffer on every rank, shards all-gathered
  after a step) or `ShardedParams` (stage 3: only this rank's shard, units gathered on use);
- masters, the fp32 tensors the torch optimizer steps: `AliasedMasters` (fp32 model, same device:
  the model's own values), `CopiedMasters` (an fp32 copy; in host memory when the optimizer is
  offloaded, gradients then staged by `HostStep` into a pinned buffer) or `SwappedMasters`
  (stage 3's NVMe shard);
- optimizer states: `MemoryStates`, or `SwappedStates` (offload.py) for NVMe.

`build_stores` makes the choice; the optimizer's step calls the same methods whatever was chosen.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_gather, all_gather_into_tensor, broadcast, get_rank
from ..config.errors import ConfigError
from .accounting import same_memory
from .init import full_value, is_init_sharded
from .offload import OffloadOptions, SwappedStates
from .partitioned import (
    MemoryShard,
    QuantizedShard,
    ShardedParameters,
    Stage3Options,
    SwappedShard,
)
from .plan import Place, ShardPlan, build_plan
from .swap import NvmeSwapper

Hook = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class GatherOptions:
    """How updated shards return to every rank: all-gather in chunks, or one broadcast per owner."""

    bucket_elements: int = 500_000_000
    all_gather: bool = True


# -- gradients ------------------------------------------------------------------------------------


class FlatGradients:
    """The full gradient buffer (model layout); with `alias`, each parameter's `.grad` is a view
    into it, so backward accumulates in place."""

    reduces_every_micro_step = False
    shard = None

    def __init__(
        self, plan: ShardPlan, dtype: torch.dtype, device: torch.device, alias: bool
    ) -> None:
        self.plan, self.alias = plan, alias
        self.flat = torch.zeros(plan.layout.total, dtype=dtype, device=device)
        self.views = plan.layout.views(self.flat)
        if alias:
            for p, view in zip(plan.params, self.views):
                p.grad = view
        ranges = plan.shard_ranges
        adjacent = all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        # The owned gradients as one view when they are adjacent (one rank's shards are the whole
        # buffer), kept so that the masters' gradients stay attached to it across steps.
        self._owned = self.flat[ranges[0][0] : ranges[-1][1]] if adjacent else None

    def hook(self, index: int, ready: Any, done: Callable[[int], None] | None) -> Hook:
        """Parameter `index`'s post-accumulate-grad hook: fold the gradient into the buffer and
        tell `ready` (the reducer, or whoever tracks arrivals; None: nobody)."""
        del done  # parameters stay whole here
        store, tracker, view = weakref.ref(self), _weak(ready), self.views[index]

        def fold(param: torch.Tensor) -> None:
            grads, arrivals = store(), tracker()
            if grads is None:
                return
            grad = param.grad
            if not same_memory(grad, view):
                # Mixed precision, or someone set .grad to None: fold it into the flat buffer.
                view.add_(grad)
                param.grad = view if grads.alias else None
            if arrivals is not None:
                arrivals.mark_ready(index)

        return fold

    def owned(self) -> torch.Tensor:
        """This rank's gradients (owned coordinates) in fp32."""
        if self._owned is not None:
            owned = self._owned
        else:
            owned = torch.cat([self.flat[s:e] for s, e in self.plan.shard_ranges])
        return owned if owned.dtype == torch.float32 else owned.float()

    def holds(self, grads: torch.Tensor) -> bool:
        """Whether `grads` is this store's own buffer (not a temporary copy)."""
        return grads is self._owned

    def piece(self, k: int) -> torch.Tensor:
        """Master `k`'s gradient, a flat view."""
        master = self.plan.masters[k]
        return self.flat.narrow(0, master.start, master.numel)

    def buffer(self) -> torch.Tensor:
        return self.flat


class ShardGradients:
    """Only this rank's shard of the gradients: each bucket is reduced every micro-step and the
    rank adds its own part here, so the full gradient never exists."""

    reduces_every_micro_step = True  # there is nowhere to keep unreduced gradients
    flat = None

    def __init__(self, plan: ShardPlan, dtype: torch.dtype, device: torch.device) -> None:
        self.plan = plan
        self.shard = torch.zeros(plan.layout.shard_numel(), dtype=dtype, device=device)
        self._pieces = plan.master_views(self.shard)

    def hook(self, index: int, reducer: Any, done: Callable[[int], None] | None) -> Hook:
        """Parameter `index`'s post-accumulate-grad hook: hand the gradient to `reducer`'s bucket
        and tell `done` (stage 3's units) that it has arrived."""
        reducers, finished = _weak(reducer), _weak(done)

        def to_bucket(param: torch.Tensor) -> None:
            reducer, done = reducers(), finished()
            if reducer is None:
                return
            # Copied, not added: the bucket's pooled buffer holds an earlier bucket's values.
            reducer.gradient_slot(index).copy_(param.grad)
            param.grad = None
            reducer.mark_ready(index)
            if done is not None:
                done(index)

        return to_bucket

    def add_reduced(self, offset: int, reduced: torch.Tensor) -> None:
        self.shard[offset : offset + reduced.numel()].add_(reduced)

    def owned(self) -> torch.Tensor:
        return self.shard if self.shard.dtype == torch.float32 else self.shard.float()

    def holds(self, grads: torch.Tensor) -> bool:
        return grads is self.shard

    def piece(self, k: int) -> torch.Tensor:
        return self._pieces[k].reshape(-1)

    def buffer(self) -> torch.Tensor:
        return self.shard


def _weak(target: Any) -> Callable[[], Any]:
    """A weak reference to `target` (None: to nothing). Tensor hooks live in C++, where Python's
    garbage collector cannot see them: a hook holding the optimizer's parts would keep them (and
    their buffers and swap files) alive for ever."""
    if target is None:
        return lambda: None
    return weakref.WeakMethod(target) if inspect.ismethod(target) else weakref.ref(target)


class GradientArrivals:
    """Which parameters got a gradient this micro-step, where no reducer watches (one rank, and
    unused parameters are to be an error)."""

    def __init__(self, count: int) -> None:
        self.seen = bytearray(count)
        self.active = False

    def mark_ready(self, index: int) -> None:
        self.seen[index] = 1

    def reset(self, segment: int | None = None) -> None:
        del segment
        self.seen = bytearray(len(self.seen))

    def finish(self) -> list[int]:
        return [i for i, seen in enumerate(self.seen) if not seen]


# -- parameters -----------------------------------------------------------------------------------


def whole_values(
    plan: ShardPlan, start: int, end: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[start, end) of the flat layout filled with the parameters' values: each region as its
    group's first rank has it (the data-parallel group's, or the expert-data group's)."""
    buffer = torch.zeros(end - start, dtype=dtype, device=device)
    init_sharded = False
    for p, offset, numel in zip(plan.params, plan.layout.offsets, plan.layout.numels):
        if start <= offset < end:
            init_sharded |= is_init_sharded(p)
            buffer[offset - start : offset - start + numel].copy_(full_value(p).reshape(-1))
    if init_sharded:  # zero.Init made them equal already
        return buffer
    for lo, hi, place in plan.place_runs(start, end):
        group, _, world = plan.places[place]
        if world > 1:
            piece = buffer[lo - start : hi - start]
            broadcast(piece, src=group_rank_to_global(group, 0), group=group)
    return buffer


class ReplicatedParams:
    """The whole model in one buffer on every rank, every parameter a view into it; after a step
    each rank's updated shards are all-gathered."""

    sharded_params = None
    gradient_done = None
    swapped_shard = None

    def __init__(
        self, plan: ShardPlan, gather: GatherOptions, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.plan, self.gather = plan, gather
        self.flat = whole_values(plan, 0, plan.layout.total, dtype, device)
        for p, view in zip(plan.params, plan.layout.views(self.flat)):
            p.data = view
            p.__dict__.pop("ds_tensor", None)

    def own_pieces(self) -> list[torch.Tensor]:
        return [self.flat[s:e] for s, e in self.plan.shard_ranges]

    def follow(self, master_flat: torch.Tensor | None) -> None:
        del master_flat  # nothing writes the model's values behind the masters' back here

    def publish(self, master_flat: torch.Tensor | None) -> None:
        """Copy the masters (unless they are the model's values) in and gather the shards."""
        plan = self.plan
        if master_flat is not None:
            for (s, e), master in zip(plan.shard_ranges, master_flat.split(plan.shard_sizes())):
                self.flat[s:e].copy_(master)
        run: list[int] = []
        for r, place in enumerate(plan.region_place):
            if run and plan.region_place[run[-1]] != place:
                self._gather_regions(run)
                run = []
            if plan.layout.shard_size(r) and plan.layout.shards[r] > 1:
                run.append(r)
        self._gather_regions(run)

    def _gather_regions(self, regions: list[int]) -> None:
        """All-gather consecutive `regions` of one place: one collective for all of them when
        their shards fit in one gather bucket."""
        if not regions:
            return
        plan, layout = self.plan, self.plan.layout
        group, _, world = plan.places[plan.region_place[regions[0]]]
        sizes = [layout.shard_size(r) for r in regions]
        one_by_one = len(regions) == 1 or sum(sizes) > self.gather.bucket_elements
        if one_by_one or not self.gather.all_gather:
            for r in regions:
                self._gather_region(r)
            return
        # The regions' shards are apart in the buffer: gather them as one, then put each
        # rank's pieces in place.
        mine = torch.cat([self.flat[slice(*plan.shard_ranges[r])] for r in regions])
        rows = torch.empty(world, mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_into_tensor(rows.view(-1), mine, group=group)
        layout.place_gathered(rows, regions, self.flat)

    def _gather_region(self, index: int) -> None:
        start, end = self.plan.layout.groups[index]
        region = self.flat[start:end]
        group, rank, world = self.plan.places[self.plan.region_place[index]]
        size = region.numel() // world
        shards = list(region.split(size))
        if not self.gather.all_gather:
            for owner, shard in enumerate(shards):
                broadcast(shard, group_rank_to_global(group, owner), group=group)
            return
        chunk = min(size, self.gather.bucket_elements)
        for lo in range(0, size, chunk):
            hi = min(lo + chunk, size)
            # gloo gathers through a buffer of its own and NCCL in place: the input can be the
            # output's own slot, with no copy.
            mine = shards[rank][lo:hi]
            if hi - lo == size:
                all_gather_into_tensor(region, mine, group=group)
            else:
                all_gather([s[lo:hi] for s in shards], mine, group=group)

    def release_all(self) -> None:
        """Nothing is gathered on demand here."""

    def tensors(self) -> list[torch.Tensor]:
        return []

    def device_tensors(self) -> list[torch.Tensor]:
        """What this store keeps on the training device (for `offload_states`)."""
        return [self.flat]

    def close(self) -> None:
        """No files to close."""


class ShardedParams:
    """Stage 3: only this rank's shard of the model's buffer, in device memory, host memory
    (`offload_param` cpu) or swap files (`offload_param` nvme); built one unit at a time, so the
    whole model never exists here. Units are gathered on use (`ShardedParameters`)."""

    def __init__(
        self,
        plan: ShardPlan,
        offload: OffloadOptions,
        stage3: Stage3Options | None,
        dtype: torch.dtype,
        device: torch.device,
        trained: bool = True,
    ) -> None:
        """`trained` false: no optimizer steps these parameters (`shard_untrained`)."""
        self.plan = plan
        self.swapper: NvmeSwapper | None = None
        self.shard_offloaded = offload.param_device != "none"  # in host memory or swap files
        store = self._shard_store(plan.shard_sizes(), offload, dtype, device)
        for regions in plan.unit_regions:
            start, end = plan.layout.groups[regions[0]][0], plan.layout.groups[regions[-1]][1]
            buffer = whole_values(plan, start, end, dtype, device)
            for r in regions:
                s, e = plan.shard_ranges[r]
                store.write(r, buffer[s - start : e - start])
                for p in plan.region_params[r]:
                    # zero.Init's slice now lives in the store: free it unit by unit, so the rank
                    # never holds its share of the model twice.
                    p.__dict__.pop("ds_tensor", None)
        if not trained and stage3 is not None and stage3.quantized_untrained:
            assert isinstance(store, MemoryShard), "untrained shards are never swapped"
            store = QuantizedShard(store, plan.unit_regions)
        self.sharded_params = ShardedParameters(
            list(plan.units),
            plan.layout,
            list(plan.unit_regions),
            store,
            list(plan.params),
            [place.group for place in plan.places],
            stage3,
            device,
            trained=trained,
        )
        self.gradient_done = self.sharded_params.gradient_done

    def _shard_store(
        self, sizes: list[int], offload: OffloadOptions, dtype: torch.dtype, device: torch.device
    ) -> MemoryShard | SwappedShard:
        where = offload.param_device
        if where == "nvme":
            assert dtype == torch.float32 and offload.device == "nvme", (
                "initialize refuses NVMe parameters without fp32 and NVMe optimizer states"
            )
            self.swapper = NvmeSwapper(offload.param_nvme_path, get_rank(), offload.aio)
            return SwappedShard(self.swapper, sizes, dtype)
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        shard_device = host_memory(device) if where == "cpu" else device
        pin = shard_device != device and offload.pin_memory and torch.cuda.is_available()
        flat = torch.empty(offsets[-1], dtype=dtype, device=shard_device, pin_memory=pin)
        return MemoryShard(flat, offsets)

    @property
    def swapped_shard(self) -> SwappedShard | None:
        store = self.sharded_params.store
        return store if isinstance(store, SwappedShard) else None

    def own_pieces(self) -> list[torch.Tensor]:
        return [self.sharded_params.store.piece(r) for r in range(len(self.plan.shard_ranges))]

    def follow(self, master_flat: torch.Tensor | None) -> None:
        """GatheredParameters(modifier_rank=...) changes the shard: the fp32 copy follows."""
        if master_flat is not None:
            shard = self.sharded_params.store.flat
            self.sharded_params.after_write = lambda: master_flat.copy_(shard)

    def publish(self, master_flat: torch.Tensor | None) -> None:
        if master_flat is not None:
            self.sharded_params.store.flat.copy_(master_flat)
        self.sharded_params.refresh_persistent()  # the other units gather on their next use

    def release_all(self) -> None:
        self.sharded_params.release_all()  # units whose parameters got no gradient

    def tensors(self) -> list[torch.Tensor]:
        sharded = self.sharded_params
        return [*sharded.store.tensors(), *sharded.buffers.values(), *sharded.secondaries()]

    def device_tensors(self) -> list[torch.Tensor]:
        """The gathered units, and the shard unless `offload_param` keeps it off the device."""
        shard = [] if self.shard_offloaded else self.sharded_params.store.tensors()
        return [*shard, *self.sharded_params.buffers.values()]

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()


def shard_untrained(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    data: Place,
    stage3: Stage3Options | None,
    offload: OffloadOptions,
    device: torch.device,
) -> list[ShardedParams]:
    """Stage 3 for `params`, parameters of `module` that no optimizer steps (frozen ones; every
    one in an engine built without an optimizer): sharded over `data` and gathered on use as the
    trained ones are, with no masters and no gradients. DeepSpeed partitions them too, so a
    frozen base model takes 1/N of each rank's memory, and code that checks `ds_status` or
    shapes sees what it sees there. A shard is one flat tensor: one set per dtype. Swap files
    hold fp32 shards beside their optimizer states, so under NVMe parameter offload these
    shards stay in host memory."""
    if offload.param_device == "nvme":
        offload = replace(offload, param_device="cpu")
    order = {p: i for i, p in enumerate(module.parameters())}
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in sorted(params, key=order.__getitem__, reverse=True):
        by_dtype.setdefault(p.dtype, []).append(p)
    return [
        ShardedParams(
            build_plan(module, [members], stage=3, data=data, stage3=stage3),
            offload,
            stage3,
            dtype,
            device,
            trained=False,
        )
        for dtype, members in by_dtype.items()
    ]


def host_memory(device: torch.device) -> torch.device:
    """Where offloaded state lives beside `device`: host memory; on the meta device (a dry run,
    `shardspeed.planning`) the meta device too, no bytes taken (the accounting counts it as host
    memory through `ZeroOptimizer.host_tensors`)."""
    return device if device.type == "meta" else torch.device("cpu")


# -- masters --------------------------------------------------------------------------------------


class AliasedMasters:
    """The model is fp32 and where the step runs: its own values are the masters (at stage 0 the
    parameters themselves, from stage 1 on Parameters over this rank's shards)."""

    master_flat: torch.Tensor | None = None

    def __init__(self, masters: list[nn.Parameter]) -> None:
        self.masters = masters

    def value(self, k: int) -> torch.Tensor:
        return self.masters[k].detach().reshape(-1)

    def store(self, k: int, value: torch.Tensor) -> None:
        """Nothing to do: `value` is the master itself."""


class CopiedMasters(AliasedMasters):
    """An fp32 copy of this rank's part of the model in one flat tensor: on the device (mixed
    precision) or in (pinned, where a GPU exists) host memory (`offload_optimizer`)."""

    def __init__(
        self, plan: ShardPlan, own: list[torch.Tensor], device: torch.device, pin: bool
    ) -> None:
        pin = pin and device.type == "cpu" and torch.cuda.is_available()
        numel = sum(v.numel() for v in own)
        flat = torch.empty(numel, dtype=torch.float32, device=device, pin_memory=pin)
        flat.copy_(torch.cat(own))
        super().__init__([nn.Parameter(v) for v in plan.master_views(flat)])
        self.master_flat = flat


class SwappedMasters(AliasedMasters):
    """Stage 3's shard in swap files is itself the fp32 masters: in memory only around their own
    step (`SwappedStates` reads and writes them)."""

    def __init__(self, shard: SwappedShard, count: int) -> None:
        super().__init__([nn.Parameter(torch.empty(0)) for _ in range(count)])
        self.shard = shard

    def value(self, k: int) -> torch.Tensor:
        return self.shard.piece(k)

    def store(self, k: int, value: torch.Tensor) -> None:
        self.shard.write(k, value)


class DeviceStep:
    """The step runs where the gradients are: they are used as they are."""

    def receive(self, grads: torch.Tensor) -> torch.Tensor:
        return grads


class HostStep:
    """The step runs in host memory, the gradients elsewhere: they are staged into one
    persistent (pinned) host buffer first."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffer: torch.Tensor | None = None

    def receive(self, grads: torch.Tensor) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.empty(grads.numel(), dtype=torch.float32, pin_memory=self.pin)
        self._buffer.copy_(grads, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the CPU step reads the buffer next
        return self._buffer


class MemoryStates:
    """The torch optimizer's states in memory: one step over all masters."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: list[nn.Parameter],
        views: Callable[[torch.Tensor], list[torch.Tensor]],
    ) -> None:
        self.optimizer, self.masters, self.views = optimizer, masters, views
        self._attached: torch.Tensor | None = None

    def step(self, grads: torch.Tensor, keep: bool) -> None:
        """Step on `grads` (aligned with the masters); with `keep`, `grads` is a persistent
        buffer, whose views stay the masters' gradients."""
        if grads is not self._attached:
            for master, view in zip(self.masters, self.views(grads)):
                master.grad = view
        self.optimizer.step()
        if keep:
            self._attached = grads
        else:
            self._attached = None
            for master in self.masters:
                master.grad = None  # a temporary fp32 copy: let it go now

    def state_of(self, k: int) -> dict[str, Any]:
        return dict(self.optimizer.state.get(self.masters[k], {}))

    def load(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def close(self) -> None:
        """Nothing on disk."""


# -- choosing -------------------------------------------------------------------------------------


@dataclass
class Stores:
    grads: FlatGradients | ShardGradients
    params: ReplicatedParams | ShardedParams
    masters: AliasedMasters
    staging: DeviceStep | HostStep
    states: MemoryStates | SwappedStates


def build_stores(
    plan: ShardPlan,
    optimizer: torch.optim.Optimizer,
    gather: GatherOptions,
    offload: OffloadOptions,
    stage3: Stage3Options | None,
    grad_dtype: torch.dtype,
) -> Stores:
    """Pick each store for `plan` and the config, and point `optimizer` at the masters."""
    model_dtype, device = plan.params[0].dtype, plan.params[0].device
    if plan.stage == 3:
        params: ReplicatedParams | ShardedParams = ShardedParams(
            plan, offload, stage3, model_dtype, device
        )
    else:
        params = ReplicatedParams(plan, gather, model_dtype, device)
    grads = (
        ShardGradients(plan, grad_dtype, device)
        if plan.stage >= 2
        else FlatGradients(plan, grad_dtype, device, alias=grad_dtype == model_dtype)
    )
    # Offloaded masters live in host memory; without a GPU that is where the model is anyway.
    step_device = host_memory(device) if offload.enabled else device
    masters = _masters(plan, params, step_device, offload.pin_memory)
    _point_optimizer(optimizer, plan, masters.masters)
    params.follow(masters.master_flat)
    if offload.device == "nvme":
        states: MemoryStates | SwappedStates = SwappedStates(
            optimizer,
            masters.masters,
            [plan.master_numel(k) for k in range(len(masters.masters))],
            offload,
            get_rank(),
            masters.shard if isinstance(masters, SwappedMasters) else None,
        )
        states.check_space()
    else:
        states = MemoryStates(optimizer, masters.masters, plan.master_views)
    staging = HostStep(offload.pin_memory) if step_device != device else DeviceStep()
    return Stores(grads, params, masters, staging, states)


def _masters(
    plan: ShardPlan, params: ReplicatedParams | ShardedParams, device: torch.device, pin: bool
) -> AliasedMasters:
    """The masters on `device`: the swapped shard, the model's own fp32 values, or a copy."""
    if params.swapped_shard is not None:
        if any(plan.region_whole):
            raise ConfigError(
                "'zero_optimization.offload_param.device' nvme keeps parameter shards as flat "
                "swap files, and this optimizer needs whole tensors (Lamb, Muon, Adafactor, ...): "
                "offload parameters to 'cpu', or use an element-wise optimizer"
            )
        return SwappedMasters(params.swapped_shard, len(plan.shard_ranges))
    own = params.own_pieces()
    if plan.params[0].dtype != torch.float32 or own[0].device != device:
        return CopiedMasters(plan, own, device, pin)
    if not plan.sharded:
        return AliasedMasters(list(plan.params))
    return AliasedMasters(
        [
            nn.Parameter(
                own[m.region]
                .narrow(0, m.start - plan.shard_ranges[m.region][0], m.numel)
                .view(m.shape)
            )
            for m in plan.masters
        ]
    )


def _point_optimizer(
    optimizer: torch.optim.Optimizer, plan: ShardPlan, masters: list[nn.Parameter]
) -> None:
    """Point the optimizer's groups at the masters (frozen parameters stay where they are): at
    stage 0 each parameter's own, from stage 1 on each group's shards."""
    if optimizer.state:
        raise ValueError(
            "the optimizer already has state (was it stepped before initialize()?): build it fresh"
        )
    if not plan.sharded:
        by_param = dict(zip(plan.params, masters))
        for group in optimizer.param_groups:
            group["params"] = [by_param.get(p, p) for p in group["params"]]
        return
    by_group: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for master, where in zip(masters, plan.masters):
        by_group[plan.region_group[where.region]].append(master)
    for group, shard in zip(optimizer.param_groups, by_group):
        group["params"] = shard


def group_rank_to_global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
