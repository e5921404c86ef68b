"""The engine's optimizer for ZeRO stages 0, 1 and 2, over flat buffers.

Every stage lays the trainable parameters out in one flat buffer of the model's dtype (parameters
are views into it), group by group, and averages gradients with a `GradientReducer` launched from
post-accumulate-grad hooks. What differs is what a rank keeps:

- stage 0: everything. The torch optimizer sees one fp32 master tensor per parameter, so per-tensor
  algorithms (LAMB) keep their meaning.
- stage 1: the full gradient buffer, but fp32 master weights and optimizer state only for its shard
  (a contiguous 1/N of every param group). Gradients are reduced to their owners at the boundary.
- stage 2: as stage 1, and gradients too only for its shard: each bucket is reduced every micro-step
  and its buffer goes back to the reducer's small pool once the rank has added its own part to its
  shard accumulator.

Expert weights of a mixture of experts under expert parallelism (`ExpertParameters`) differ between
the ranks of the data-parallel group: each is laid out in regions of its own, reduced and sharded
over the ranks holding the same experts only (the expert-data group), while its gradient is still
divided by the whole data-parallel size, since the all-to-all already brought every rank's tokens
to it.

At the boundary, `step()` unscales, checks for overflow (the norm is summed across shards, so every
rank agrees), clips by the global norm, runs the torch optimizer on the master tensors (one flat
tensor per group for stages 1 and 2), copies masters back to the model's dtype and, for stages 1 and
2, all-gathers the updated shards.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_gather, all_gather_into_tensor, all_reduce, broadcast, get_rank
from ..precision import LossScaler, StaticLossScaler
from .flat import FlatLayout, logical_shape
from .init import full_value, is_init_sharded, materialize
from .offload import OffloadOptions, SwappedStates
from .partitioned import (
    MemoryShard,
    ShardedParameters,
    Stage3Options,
    SwappedShard,
    Unit,
    plan_units,
)
from .reducer import GradientReducer
from .swap import NvmeSwapper


class NonFiniteGradientError(FloatingPointError):
    """A gradient became inf or NaN where no loss scale can recover (fp32, or bf16 by default)."""


@dataclass(frozen=True)
class ReduceOptions:
    """How gradients are averaged: bucket size in elements, dtype on the wire, and scaling.

    `reduce_scatter` (ZeRO stages 1 and 2) sends each gradient piece only to the rank that owns it;
    false all-reduces whole buckets instead.
    """

    bucket_elements: int
    comm_dtype: torch.dtype | None = None
    prescale_gradients: bool = False
    predivide_factor: float = 1.0
    overlap: bool = True
    reduce_scatter: bool = True
    average: bool = True  # false: DeepSpeed's gradient_allreduce_op "sum"


@dataclass(frozen=True)
class GatherOptions:
    """How updated shards return to every rank: all-gather in chunks, or one broadcast per owner."""

    bucket_elements: int = 500_000_000
    all_gather: bool = True


@dataclass(frozen=True)
class TiedParameters:
    """Weights that ranks outside the data-parallel group hold copies of: a pipeline's embedding
    reused as its head, or a layer norm replicated across tensor-parallel ranks.

    With `summed`, each copy's gradient is partial and they are summed over `group` before the
    step (the tied embedding; a norm under sequence parallelism); otherwise every copy already has
    the whole gradient. Only copies with `counted` add to the gradient norm, so each weight counts
    once in the model's norm.
    """

    params: tuple[nn.Parameter, ...]
    group: Any
    counted: bool
    summed: bool = True


@dataclass(frozen=True)
class ExpertParameters:
    """One mixture-of-experts layer's local experts under expert parallelism: held alike by the
    `world_size` ranks of `group` (the expert-data group; this rank is `rank` there) and by no
    other rank of the data-parallel group. `names` are what checkpoints call them: the global
    expert index, the same at every expert-parallel size."""

    params: tuple[nn.Parameter, ...]
    names: tuple[str, ...]
    group: Any
    rank: int
    world_size: int


class ZeroOptimizer:
    """Wraps a torch optimizer for ZeRO stage 0, 1 or 2 (see module docstring).

    For a pipeline stage: `segments` are the parameter sets that separate backward passes visit
    (a rank's model chunks), each laid out contiguously with buckets of its own; `ties` are
    weights shared with other stages; `norm_group` joins the ranks whose gradients together make
    the model's (the stages), for the global norm. `experts` are expert-parallel weights (see the
    module docstring).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int = 0,
        loss_scaler: LossScaler | None = None,
        gradient_clipping: float = 0.0,
        skip_nonfinite: bool = False,
        dp_group: Any = None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        reduce: ReduceOptions,
        gather: GatherOptions | None = None,
        ignore_unused_parameters: bool = True,
        stage3: Stage3Options | None = None,
        offload: OffloadOptions | None = None,
        segments: Sequence[Sequence[nn.Parameter]] = (),
        ties: Sequence[TiedParameters] = (),
        norm_group: Any = None,
        experts: Sequence[ExpertParameters] = (),
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        # One rank has nothing to shard: stage 2 then behaves as stage 1 (same bytes, no copies),
        # and so does stage 3 unless its parameters are to live off the device (offload_param).
        offloads_params = offload is not None and offload.param_device != "none"
        keep = dp_world_size > 1 or (stage == 3 and offloads_params)
        self.stage = stage if keep else min(stage, 1)
        self.configured_stage = stage
        self.loss_scaler = loss_scaler or StaticLossScaler(1.0)
        self.gradient_clipping = gradient_clipping
        self.skip_nonfinite = skip_nonfinite
        self.ignore_unused_parameters = ignore_unused_parameters
        self.global_grad_norm: float | None = None
        self.dp_group, self.dp_rank, self.dp_world_size = dp_group, dp_rank, dp_world_size
        self.gather = gather or GatherOptions()

        self.norm_group = norm_group
        groups = _managed_groups(module, optimizer)
        managed = {p for group in groups for p in group}
        # zero.Init sliced every parameter; those the optimizer does not train stay whole.
        materialize(p for p in module.parameters() if p not in managed)
        assert not (experts and stage == 3), "initialize refuses expert parallelism at ZeRO stage 3"
        # Where each region lives: 0 is the data-parallel group, i + 1 the group of experts[i].
        self._places = [(dp_group, dp_rank, dp_world_size)] + [
            (e.group, e.rank, e.world_size) for e in experts
        ]
        # A region is what the optimizer steps as one tensor: the part of a param group inside
        # one block. Blocks are stage 3's gather units, or a pipeline stage's tied weights and
        # chunks; otherwise there is one block and a region is a param group.
        units: list[Unit] = []
        if self.stage == 3:
            assert not (segments or ties), "initialize refuses ZeRO stage 3 with a pipeline"
            units = plan_units(module, [p for g in groups for p in g], stage3 or Stage3Options())
            blocks, block_segment = [u.params for u in units], [0] * len(units)
            block_tie: list[int | None] = [None] * len(units)
            block_place = [0] * len(units)
        else:
            order = {p: i for i, p in enumerate(module.parameters())}
            blocks, block_segment, block_tie, block_place = _blocks(
                groups, segments, ties, experts, order
            )
        regions, self.region_group, block_regions = _regions(groups, blocks)
        self.offload = offload or OffloadOptions()
        if self.stage >= 1:
            # sub_group_size: no master tensor (what the optimizer steps, and offload swaps) is
            # larger than this, whole parameters permitting.
            regions, self.region_group, block_regions = _split_regions(
                regions, self.region_group, block_regions, self.offload.sub_group_size
            )
        unit_regions = block_regions if units else []
        self.region_place = [0] * len(regions)
        for span, place in zip(block_regions, block_place):
            for r in span:
                self.region_place[r] = place
        self.params = [p for region in regions for p in region]
        self._param_place = [
            self.region_place[r] for r, region in enumerate(regions) for _ in region
        ]
        self._param_region = [r for r, region in enumerate(regions) for _ in region]
        self.param_index = {p: i for i, p in enumerate(self.params)}
        names = {p: n for n, p in module.named_parameters()}
        names.update((p, n) for e in experts for p, n in zip(e.params, e.names))
        self.param_names = [names[p] for p in self.params]
        model_dtype, device = self.params[0].dtype, self.params[0].device
        if any(p.dtype != model_dtype or p.device != device for p in self.params):
            raise ValueError("all trainable parameters must share one dtype and device")
        self.layout = FlatLayout.of(
            regions,
            [self._places[p][2] for p in self.region_place] if self.stage >= 1 else 1,
        )
        region_params = regions
        self.shard_ranges = [
            self.layout.shard(r, self._places[p][1] if self.stage >= 1 else 0)
            for r, p in enumerate(self.region_place)
        ]
        first_param = [0]
        for region in regions:
            first_param.append(first_param[-1] + len(region))
        self._segment_starts = tuple(
            first_param[block_regions[block_segment.index(s)].start]
            for s in range(max(block_segment) + 1)
        )
        # Where each tie's gradients sit in this rank's owned gradients (the same elements on
        # every rank of the tie: its block is laid out alike there), and the spans the norm counts.
        self._ties = [
            (self._owned_span(block_regions[b]), ties[t])
            for b, t in enumerate(block_tie)
            if t is not None
        ]
        uncounted = sorted(span for span, tie in self._ties if not tie.counted)
        total = self.layout.total if self.stage == 0 else self.layout.shard_numel()
        self._norm_spans = self._weighted_spans(
            _complement(uncounted, total), block_regions, block_place
        )
        # Expert weights make the norm a sum over the data-parallel group even unsharded.
        self._norm_over_dp = self.stage >= 1 or bool(experts)

        # Model weights: one buffer, every parameter a view into it, identical on every rank.
        # At stage 3 only this rank's shard of that buffer is kept (built one unit at a time, so
        # the whole model never exists here); units are gathered on use.
        self.sharded_params: ShardedParameters | None = None
        self.model_flat: torch.Tensor | None = None
        if self.stage == 3:
            sizes = [e - s for s, e in self.shard_ranges]
            store = self._shard_store(sizes, model_dtype, device)
            for regions in unit_regions:
                start, end = self.layout.groups[regions[0]][0], self.layout.groups[regions[-1]][1]
                buffer = self._whole(start, end, model_dtype, device)
                for r in regions:
                    s, e = self.shard_ranges[r]
                    store.write(r, buffer[s - start : e - start])
                    for p in region_params[r]:
                        # zero.Init's slice now lives in the store: free it unit by unit, so the
                        # rank never holds its share of the model twice.
                        p.__dict__.pop("ds_tensor", None)
            self.sharded_params = ShardedParameters(
                units, self.layout, unit_regions, store, self.params, dp_group, stage3, device
            )
            self.sharded_params.refresh_persistent()
        else:
            # Stage 3 on one rank runs unsharded (see above): zero.Init's slices are then whole.
            if stage != 3 and any(is_init_sharded(p) for p in self.params):
                raise ValueError(
                    "the model was built under zero.Init, which shards parameters for ZeRO stage "
                    f"3, but the config asks for stage {stage}"
                )
            self.model_flat = self._whole(0, self.layout.total, model_dtype, device)
            for p, view in zip(self.params, self.layout.views(self.model_flat)):
                p.data = view
                p.__dict__.pop("ds_tensor", None)

        # Gradients accumulate in fp32 unless the model is fp16 (DeepSpeed keeps fp16 gradients),
        # or in what `data_types.grad_accum_dtype` says.
        default_grad_dtype = torch.float16 if model_dtype == torch.float16 else torch.float32
        self.model_dtype = model_dtype
        self.grad_dtype = grad_dtype or default_grad_dtype
        self.requested_grad_dtype = grad_dtype
        self._grads_alias_params = self.grad_dtype == model_dtype
        self.grad_flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if self.stage <= 1:
            self.grad_flat = torch.zeros(self.layout.total, dtype=self.grad_dtype, device=device)
            self._grad_views = self.layout.views(self.grad_flat)
            if self._grads_alias_params:
                for p, view in zip(self.params, self._grad_views):
                    p.grad = view
        else:
            self.grad_shard = torch.zeros(
                self.layout.shard_numel(), dtype=self.grad_dtype, device=device
            )

        self._attached: torch.Tensor | None = None
        # Offloaded masters live in host memory; without a GPU that is where the model is anyway.
        self.master_device = torch.device("cpu") if self.offload.enabled else device
        self._build_masters(model_dtype)
        self.swapped: SwappedStates | None = None
        if self.offload.device == "nvme":
            store = self.sharded_params.store if self.sharded_params is not None else None
            self.swapped = SwappedStates(
                self.optimizer,
                self.masters,
                [e - s for s, e in self.shard_ranges]
                if self.stage >= 1
                else [m.numel() for m in self.masters],
                self.offload,
                get_rank(),
                store if isinstance(store, SwappedShard) else None,
            )
            self.swapped.check_space()
        if self.sharded_params is not None and self.master_flat is not None:
            # GatheredParameters(modifier_rank=...) changed the shard: the fp32 master follows.
            self.sharded_params.after_write = lambda: self.master_flat.copy_(
                self.sharded_params.store.flat
            )
        # deepspeed.utils.safe_get_full_* find the optimizer from the parameter.
        for p in self.params:
            p._shardspeed_optimizer = weakref.ref(self)
        # Stages 2 and 3 take gradients through the reducer's buckets even on one rank.
        sharded_grads = dp_world_size > 1 or self.stage >= 2
        self.reducer = self._build_reducer(reduce, device) if sharded_grads else None
        # Without a reducer nothing else sees which parameters got a gradient; only track it when
        # the config asks for unused parameters to be an error.
        self._got_grad: list[bool] | None = (
            [False] * len(self.params)
            if self.reducer is None and not ignore_unused_parameters
            else None
        )
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]

    # -- construction -----------------------------------------------------------------------------

    def _owned_span(self, regions: range) -> tuple[int, int]:
        """[start, end) of consecutive `regions` in this rank's owned gradients (`_owned_grads`):
        the whole layout at stage 0, the concatenated shards otherwise."""
        if self.stage == 0:
            return self.layout.groups[regions.start][0], self.layout.groups[regions.stop - 1][1]
        sizes = [e - s for s, e in self.shard_ranges]
        start = sum(sizes[: regions.start])
        return start, start + sum(sizes[regions.start : regions.stop])

    def _weighted_spans(
        self,
        counted: list[tuple[int, int]],
        block_regions: list[range],
        block_place: list[int],
    ) -> list[tuple[int, int, float]]:
        """The counted spans of the owned gradients, each with the weight its squares carry in
        the norm's sum over the data-parallel group: 1 for shards; unsharded (stage 0) with
        expert weights, 1 / the number of ranks holding the same copy."""
        unsharded = self.stage == 0 and len(self._places) > 1
        weights = [1.0 / world if unsharded else 1.0 for _, _, world in self._places]
        placed = [
            (*self._owned_span(span), place)
            for span, place in zip(block_regions, block_place)
            if len(span)
        ]
        spans = []
        for start, end in counted:
            for a, b, place in placed:
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    spans.append((lo, hi, weights[place]))
        return _merged(spans)

    def _whole(
        self, start: int, end: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """[start, end) of the flat layout filled with the parameters' values: each region as its
        group's first rank has it (the data-parallel group's, or the expert-data group's)."""
        buffer = torch.zeros(end - start, dtype=dtype, device=device)
        init_sharded = False
        for p, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels):
            if start <= offset < end:
                init_sharded |= is_init_sharded(p)
                buffer[offset - start : offset - start + numel].copy_(full_value(p).reshape(-1))
        if init_sharded:  # zero.Init made them equal already
            return buffer
        for lo, hi, place in self._place_runs(start, end):
            group, _, world = self._places[place]
            if world > 1:
                piece = buffer[lo - start : hi - start]
                broadcast(piece, src=_group_rank_to_global(group, 0), group=group)
        return buffer

    def _place_runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """[start, end) of the layout cut into runs of regions held by the same group: (run
        start, run end, place)."""
        runs: list[tuple[int, int, int]] = []
        for (r_start, r_end), place in zip(self.layout.groups, self.region_place):
            lo, hi = max(r_start, start), min(r_end, end)
            if lo >= hi:
                continue
            if runs and runs[-1][2] == place and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], hi, place)
            else:
                runs.append((lo, hi, place))
        return runs

    def _shard_store(
        self, sizes: list[int], dtype: torch.dtype, device: torch.device
    ) -> MemoryShard | SwappedShard:
        """Where stage 3 keeps this rank's shard: device memory, host memory (`offload_param`
        cpu, pinned where a GPU exists) or swap files (`offload_param` nvme)."""
        where = self.offload.param_device
        if where == "nvme":
            assert dtype == torch.float32 and self.offload.device == "nvme", (
                "initialize refuses NVMe parameters without fp32 and NVMe optimizer states"
            )
            self._param_swapper = NvmeSwapper(
                self.offload.param_nvme_path, get_rank(), self.offload.aio
            )
            return SwappedShard(self._param_swapper, sizes, dtype)
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        shard_device = torch.device("cpu") if where == "cpu" else device
        pin = shard_device != device and self.offload.pin_memory and torch.cuda.is_available()
        flat = torch.empty(offsets[-1], dtype=dtype, device=shard_device, pin_memory=pin)
        return MemoryShard(flat, offsets)

    def _build_masters(self, model_dtype: torch.dtype) -> None:
        """fp32 master tensors the torch optimizer steps on, and where they sit."""
        fp32 = model_dtype == torch.float32
        if self.stage == 0:
            self.master_flat = self.model_flat if fp32 else self.model_flat.float()
            self.masters = (
                self.params
                if fp32
                else [nn.Parameter(v) for v in self.layout.views(self.master_flat)]
            )
            if not fp32:
                _swap_params(self.optimizer, dict(zip(self.params, self.masters)), per_param=True)
            return
        # Stages 1 to 3: this rank's shard of every region. In fp32 the shard of the model buffer
        # is itself the master copy, so there is no second one.
        if self.sharded_params is not None and isinstance(self.sharded_params.store, SwappedShard):
            # The masters are the swapped shard: in memory only around their own step.
            self.master_flat = None
            self.masters = [nn.Parameter(torch.empty(0)) for _ in self.shard_ranges]
            by_group = [[] for _ in self.optimizer.param_groups]
            for master, group in zip(self.masters, self.region_group):
                by_group[group].append(master)
            _swap_params(self.optimizer, by_group, per_param=False)
            return
        own = (
            [self.sharded_params.store.piece(r) for r in range(len(self.shard_ranges))]
            if self.sharded_params is not None
            else [self.model_flat[s:e] for s, e in self.shard_ranges]
        )
        if fp32 and self.master_device == own[0].device:
            self.master_flat = None
            self.masters = [nn.Parameter(v) for v in own]
        else:
            pin = (
                self.offload.pin_memory
                and self.master_device.type == "cpu"
                and torch.cuda.is_available()
            )
            self.master_flat = torch.empty(
                sum(v.numel() for v in own),
                dtype=torch.float32,
                device=self.master_device,
                pin_memory=pin,
            )
            self.master_flat.copy_(torch.cat(own))
            self.masters = [nn.Parameter(v) for v in self._split_shard(self.master_flat)]
        by_group: list[list[nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        for master, group in zip(self.masters, self.region_group):
            by_group[group].append(master)
        _swap_params(self.optimizer, by_group, per_param=False)

    def _split_shard(self, shard: torch.Tensor) -> list[torch.Tensor]:
        return list(shard.split([e - s for s, e in self.shard_ranges]))

    def _build_reducer(self, options: ReduceOptions, device: torch.device) -> GradientReducer:
        pre, post = _reduce_scales(options, self.dp_world_size)
        sharded = self.stage >= 1 and options.reduce_scatter
        return GradientReducer(
            self.layout,
            options.bucket_elements,
            self.dp_group,
            self.grad_dtype,
            options.comm_dtype or self.grad_dtype,
            pre,
            post,
            collective="reduce" if sharded else "all_reduce",
            grads=self.grad_flat,
            device=device,
            on_reduced=self._add_own_part if self.stage >= 2 else None,
            overlap=options.overlap,
            # Stage 2 must not hold every bucket at once: that would be the full gradient again.
            max_in_flight=2 if self.stage >= 2 else None,
            segment_starts=self._segment_starts,
            region_groups=tuple(self._places[p][0] for p in self.region_place)
            if len(self._places) > 1
            else (),
            region_ranks=tuple(
                self._places[p][1] if self.stage >= 1 else 0 for p in self.region_place
            ),
        )

    # -- backward ---------------------------------------------------------------------------------

    def _make_hook(self, index: int):
        # Tensor hooks live in C++, where Python's garbage collector cannot see them: a hook holding
        # the optimizer would keep it (and its buffers and swap files) alive for ever.
        owner = weakref.ref(self)
        if self.stage >= 2:

            def sharded_hook(param: torch.Tensor) -> None:
                zopt = owner()
                if zopt is None:
                    return
                # Copied, not added: the bucket's pooled buffer holds an earlier bucket's values.
                zopt.reducer.gradient_slot(index).copy_(param.grad)
                param.grad = None
                zopt.reducer.mark_ready(index)
                if zopt.sharded_params is not None:
                    zopt.sharded_params.gradient_done(index)

            return sharded_hook
        view = self._grad_views[index]

        def hook(param: torch.Tensor) -> None:
            zopt = owner()
            if zopt is None:
                return
            grad = param.grad
            if grad.data_ptr() != view.data_ptr():
                # Mixed precision, or someone set .grad to None: fold it into the flat buffer.
                view.add_(grad)
                param.grad = view if zopt._grads_alias_params else None
            if zopt.reducer is not None:
                zopt.reducer.mark_ready(index)
            elif zopt._got_grad is not None:
                zopt._got_grad[index] = True

        return hook

    def close(self) -> None:
        """Remove the gradient hooks and the offload swap files (the engine's `destroy()`)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.swapped is not None:
            self.swapped.close()
        if getattr(self, "_param_swapper", None) is not None:
            self._param_swapper.close()

    def _add_own_part(self, offset: int, reduced: torch.Tensor) -> None:
        self.grad_shard[offset : offset + reduced.numel()].add_(reduced)

    def start_micro_step(self, reduce_gradients: bool, segment: int | None = None) -> None:
        """Say before backward whether this micro-step's gradients are to be averaged, and, for a
        backward that visits one segment only (a pipeline chunk), which.

        Stage 2 reduces every micro-step: it has nowhere to keep unreduced gradients.
        """
        if self.reducer is not None:
            self.reducer.reset(segment)
            self.reducer.active = reduce_gradients or self.stage >= 2
        elif self._got_grad is not None:
            self._got_grad = [False] * len(self.params)
        if self.sharded_params is not None:
            self.sharded_params.start_backward_accounting()

    def finish_reduction(self) -> None:
        """Complete the averaging that backward started (idempotent)."""
        if self.sharded_params is not None:
            self.sharded_params.release_all()  # units whose parameters got no gradient
        if self.reducer is not None:
            unused = self.reducer.finish()
        elif self._got_grad is not None:
            unused = [i for i, seen in enumerate(self._got_grad) if not seen]
        else:
            return
        if unused and not self.ignore_unused_parameters:
            names = ", ".join(self.param_names[i] for i in unused[:5])
            raise RuntimeError(
                f"parameters received no gradient: {names}{' ...' if len(unused) > 5 else ''}; "
                "set zero_optimization.ignore_unused_parameters true if that is intended"
            )

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    # -- step -----------------------------------------------------------------------------------

    def _owned_grads(self) -> torch.Tensor:
        """This rank's reduced gradients as one fp32 tensor aligned with its master tensors."""
        if self.stage == 0:
            owned = self.grad_flat
        elif self.stage == 1:
            ranges = self.shard_ranges
            adjacent = all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            # One rank's shards are the whole buffer: a view, not a copy.
            owned = (
                self.grad_flat[ranges[0][0] : ranges[-1][1]]
                if adjacent
                else torch.cat([self.grad_flat[s:e] for s, e in ranges])
            )
        else:
            owned = self.grad_shard
        return owned if owned.dtype == torch.float32 else owned.float()

    def _attach(self, grads: torch.Tensor) -> None:
        if grads is self._attached:
            return  # the persistent fp32 buffer: its views are already the masters' gradients
        views = self.layout.views(grads) if self.stage == 0 else self._split_shard(grads)
        for master, view in zip(self.masters, views):
            master.grad = view
        if grads is self.grad_flat or grads is self.grad_shard:
            self._attached = grads

    def step(self) -> bool:
        """Unscale, check, clip and apply the averaged gradients; False when the step was skipped."""
        self.finish_reduction()
        grads = self._owned_grads()
        for (start, end), tie in self._ties:
            if end > start and tie.summed:
                all_reduce(grads[start:end], group=tie.group)  # the copies' gradients, summed
        scale = self.loss_scaler.loss_scale
        # The one host sync of a step: whether to apply it depends on this norm.
        scaled_norm = self._global_norm(grads).item()
        overflow = not math.isfinite(scaled_norm)
        self.global_grad_norm = scaled_norm / scale
        if overflow:
            if not (self.loss_scaler.dynamic or self.skip_nonfinite):
                raise NonFiniteGradientError(self._nonfinite_message(grads))
            self.loss_scaler.update(True)
            self.zero_grad()
            return False
        factor = 1.0 / scale
        if self.gradient_clipping > 0:
            clip_coef = self.gradient_clipping / (self.global_grad_norm + 1e-6)
            if clip_coef < 1.0:
                factor *= clip_coef
        if grads.device != self.master_device:
            grads = self._host_grads(grads)
        if factor != 1.0:
            grads.mul_(factor)
        if self.swapped is not None:
            self.swapped.step(self._split_shard(grads))  # each master's gradient, in turn
        else:
            self._attach(grads)
            self.optimizer.step()
            if grads is not self._attached:
                for master in self.masters:
                    master.grad = None  # a temporary fp32 copy: let it go now
        self.publish()
        self.loss_scaler.update(False)
        self.zero_grad()
        return True

    def _host_grads(self, grads: torch.Tensor) -> torch.Tensor:
        """The gradients copied into a persistent (pinned) host buffer, for an offloaded step."""
        if getattr(self, "_host_buffer", None) is None:
            self._host_buffer = torch.empty(
                grads.numel(), dtype=torch.float32, pin_memory=self.offload.pin_memory
            )
        self._host_buffer.copy_(grads, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the CPU step reads the buffer next
        return self._host_buffer

    def _global_norm(self, grads: torch.Tensor) -> torch.Tensor:
        """The norm of the whole model's gradient: shards summed over the data-parallel group,
        stages over `norm_group`, each tied weight counted once."""
        if len(self._norm_spans) == 1 and self._norm_spans[0][2] == 1.0:
            start, end, _ = self._norm_spans[0]
            squares = torch.linalg.vector_norm(grads[start:end]).square().reshape(1)
        else:
            squares = sum(
                (
                    torch.linalg.vector_norm(grads[a:b]).square() * weight
                    for a, b, weight in self._norm_spans
                ),
                torch.zeros((), device=grads.device),
            ).reshape(1)
        if self._norm_over_dp:
            all_reduce(squares, group=self.dp_group)
        elif self.dp_world_size > 1 and _communicates_itself(self.optimizer):
            # Gradients are this rank's own (1-bit Adam past warm-up): agree on the largest
            # norm, so every rank takes the same overflow and clipping decisions.
            all_reduce(squares, op=dist.ReduceOp.MAX, group=self.dp_group)
        if self.norm_group is not None:
            all_reduce(squares, group=self.norm_group)
        return squares.sqrt()

    def publish(self) -> None:
        """Write the masters back into the model's buffer, on every rank (after a step or a load)."""
        if self.stage == 0:
            if self.master_flat is not self.model_flat:
                self.model_flat.copy_(self.master_flat)
            return
        if self.sharded_params is not None:
            if self.master_flat is not None:
                self.sharded_params.store.flat.copy_(self.master_flat)
            self.sharded_params.refresh_persistent()  # the other units gather on their next use
            return
        if self.master_flat is not None:
            for (s, e), master in zip(self.shard_ranges, self._split_shard(self.master_flat)):
                self.model_flat[s:e].copy_(master)
        regions = range(len(self.layout.groups))
        for place, run in itertools.groupby(regions, key=self.region_place.__getitem__):
            self._gather_regions([r for r in run if self.layout.shard_size(r)], place)

    def _gather_regions(self, regions: list[int], place: int) -> None:
        """All-gather consecutive `regions`, held by the ranks of `place`, of the model buffer: one
        collective for all of them when their shards fit in one gather bucket."""
        group, _, world = self._places[place]
        if world == 1 or not regions:
            return
        sizes = [self.layout.shard_size(r) for r in regions]
        one_by_one = len(regions) == 1 or sum(sizes) > self.gather.bucket_elements
        if one_by_one or not self.gather.all_gather:
            for r in regions:
                self._gather_group(r)
            return
        # The regions' shards are apart in the buffer: gather them as one, then put each
        # rank's pieces in place.
        mine = torch.cat([self.model_flat[slice(*self.shard_ranges[r])] for r in regions])
        rows = torch.empty(world, mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_into_tensor(rows.view(-1), mine, group=group)
        self.layout.place_gathered(rows, regions, self.model_flat)

    def _gather_group(self, index: int) -> None:
        start, end = self.layout.groups[index]
        region = self.model_flat[start:end]
        group, rank, world = self._places[self.region_place[index]]
        size = region.numel() // world
        shards = list(region.split(size))
        if not self.gather.all_gather:
            for owner, shard in enumerate(shards):
                broadcast(shard, _group_rank_to_global(group, owner), group=group)
            return
        chunk = min(size, self.gather.bucket_elements)
        for lo in range(0, size, chunk):
            hi = min(lo + chunk, size)
            # gloo gathers through a buffer of its own and NCCL in place: the input can
            # be the output's own slot, with no copy.
            mine = shards[rank][lo:hi]
            if hi - lo == size:
                all_gather_into_tensor(region, mine, group=group)
            else:
                all_gather([s[lo:hi] for s in shards], mine, group=group)

    def _nonfinite_message(self, grads: torch.Tensor) -> str:
        flat_index = self._first_nonfinite_flat_index(grads)
        name = "?"
        for param_name, offset, numel in zip(
            self.param_names, self.layout.offsets, self.layout.numels
        ):
            if offset <= flat_index < offset + numel:
                name = param_name
        return (
            f"non-finite gradient (inf or NaN) in parameter '{name}'; the weights were not "
            "updated. fp32 and bf16 have no loss scale to recover with: check the data, the "
            "loss and the learning rate (or set bf16.check_grad_overflow to skip such steps)"
        )

    def _first_nonfinite_flat_index(self, grads: torch.Tensor) -> int:
        bad = (~torch.isfinite(grads)).nonzero()
        local = self.layout.total
        if bad.numel():
            position = int(bad[0, 0])
            if self.stage == 0:
                local = position
            else:
                for s, e in self.shard_ranges:
                    if position < e - s:
                        local = s + position
                        break
                    position -= e - s
        if self.stage == 0:
            return local
        found = torch.tensor([local], dtype=torch.int64, device=grads.device)
        all_reduce(found, op=dist.ReduceOp.MIN, group=self.dp_group)
        return int(found)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (they stay allocated: parameters keep views into them)."""
        del set_to_none
        (self.grad_flat if self.grad_flat is not None else self.grad_shard).zero_()

    # -- checkpoints ----------------------------------------------------------------------------

    def master_pieces(self) -> list[list[tuple[str, int, int, int]]]:
        """For each master tensor, the parameter elements it holds, padding left out.

        Each entry is (parameter name, first element in the flattened parameter, offset in the
        master, length). Every optimizer state of a master's size maps the same way.
        """
        if self.stage == 0:
            return [[(name, 0, 0, n)] for name, n in zip(self.param_names, self.layout.numels)]
        pieces: list[list[tuple[str, int, int, int]]] = []
        for s, e in self.shard_ranges:
            own = []
            for name, offset, numel in zip(
                self.param_names, self.layout.offsets, self.layout.numels
            ):
                lo, hi = max(s, offset), min(e, offset + numel)
                if lo < hi:
                    own.append((name, lo - offset, lo - s, hi - lo))
            pieces.append(own)
        return pieces

    def fragments(self, i: int) -> list[tuple[int, int, int, int]]:
        """Where this rank holds parameter `i`'s master values: (master, first element in the
        flattened parameter, offset in the master, length). Stage 0 holds each whole; otherwise
        the part inside this rank's shard of the parameter's region, if any."""
        if self.stage == 0:
            return [(i, 0, 0, self.layout.numels[i])]
        r = self._param_region[i]
        offset, numel = self.layout.offsets[i], self.layout.numels[i]
        s, e = self.shard_ranges[r]
        lo, hi = max(s, offset), min(e, offset + numel)
        return [(r, lo - offset, lo - s, hi - lo)] if lo < hi else []

    def fragment_group(self, i: int) -> tuple[Any, int]:
        """(group, size) over which parameter `i`'s fragments together make it whole; size 1
        when this rank holds it whole."""
        if self.stage == 0:
            return None, 1
        group, _, world = self._places[self._param_place[i]]
        return group, world

    def gradient_piece(self, k: int) -> torch.Tensor:
        """Master `k`'s gradient as this rank holds it (reduced once the boundary's backward has
        finished), a flat tensor aligned with `fragments`."""
        if self.stage == 0:
            return self._grad_views[k].reshape(-1)
        if self.stage == 1:
            s, e = self.shard_ranges[k]
            return self.grad_flat[s:e]
        sizes = [e - s for s, e in self.shard_ranges]
        start = sum(sizes[:k])
        return self.grad_shard[start : start + sizes[k]]

    def writes_master(self, k: int, first_replica: bool) -> bool:
        """Whether this rank writes master `k` to a checkpoint: sharded, every rank its own;
        unsharded, one copy each (`first_replica` says whether this rank is the first holder of
        the data-parallel group's weights; expert weights' first holder is their group's rank 0)."""
        if self.stage >= 1:
            return True
        place = self._param_place[k]
        return first_replica if place == 0 else self._places[place][1] == 0

    def master_numel(self, k: int) -> int:
        """Elements of master `k` (also while it is swapped out)."""
        if self.stage == 0:
            return self.masters[k].numel()
        s, e = self.shard_ranges[k]
        return e - s

    def master_value(self, k: int) -> torch.Tensor:
        """Master `k` as a flat tensor (read from its swap file under parameter offload to NVMe)."""
        store = self.sharded_params.store if self.sharded_params is not None else None
        if isinstance(store, SwappedShard):
            return store.piece(k)
        return self.masters[k].detach().reshape(-1)

    @contextlib.contextmanager
    def writable_master(self, k: int) -> Iterator[torch.Tensor]:
        """Master `k` as a flat tensor to write into (a load); stored back when swapped."""
        value = self.master_value(k)
        yield value
        store = self.sharded_params.store if self.sharded_params is not None else None
        if isinstance(store, SwappedShard):
            store.write(k, value)

    def state_of(self, k: int) -> dict[str, Any]:
        """Master `k`'s optimizer state, swapped-out states read back (for a checkpoint)."""
        if self.swapped is not None:
            return self.swapped.materialized(k)
        return dict(self.optimizer.state.get(self.masters[k], {}))

    def load_optimizer_state(self, state_dict: dict[str, Any]) -> None:
        """`optimizer.load_state_dict` over the masters; offloaded states then go to their files."""
        self.optimizer.load_state_dict(state_dict)
        if self.swapped is not None:
            self.swapped.adopt_loaded()

    # -- accounting -------------------------------------------------------------------------------

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors behind each kind of model state this rank holds (storages may be shared)."""
        grads = [self.grad_flat if self.grad_flat is not None else self.grad_shard]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        states = [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        params = list(self.module.parameters())
        if self.sharded_params is not None:
            params += [*self.sharded_params.store.tensors(), *self.sharded_params.buffers.values()]
        return {
            "parameters": params,
            "gradients": grads,
            "master_weights": list(self.masters),
            "optimizer_states": states,
        }

    # -- the torch optimizer's face, for scripts that touch engine.optimizer --------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage {self.stage}, {type(self.optimizer).__name__}, "
            f"{self.layout.total} elements)"
        )


def _managed_groups(
    module: nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[nn.Parameter]]:
    """Each optimizer group's trainable parameters, in reverse model order (roughly backward order).

    Frozen parameters get no gradient; the optimizer may list them but they stay out of the buffers.
    """
    order = {p: i for i, p in enumerate(module.parameters())}
    groups, seen = [], set()
    for group in optimizer.param_groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        missing = [p for p in trainable if p not in order]
        if missing:
            raise ValueError(
                "the optimizer holds parameters that are not in the model passed to initialize(); "
                "build the optimizer from model.parameters()"
            )
        if seen.intersection(trainable):
            raise ValueError("a parameter appears in two optimizer param groups")
        seen.update(trainable)
        groups.append(sorted(trainable, key=order.__getitem__, reverse=True))
    if not seen:
        raise ValueError("the optimizer has no trainable parameters")
    return groups


def _swap_params(optimizer: torch.optim.Optimizer, masters: Any, per_param: bool) -> None:
    """Point the optimizer's groups at the master tensors (frozen parameters stay where they are).

    `masters` maps each parameter to its master (stage 0), or lists each group's flat shard.
    """
    if optimizer.state:
        raise ValueError(
            "the optimizer already has state (was it stepped before initialize()?): build it fresh"
        )
    if per_param:
        for group in optimizer.param_groups:
            group["params"] = [masters.get(p, p) for p in group["params"]]
    else:
        for group, shard in zip(optimizer.param_groups, masters):
            group["params"] = shard


def _regions(
    groups: list[list[nn.Parameter]], blocks: list[list[nn.Parameter]]
) -> tuple[list[list[nn.Parameter]], list[int], list[range]]:
    """(regions, each region's param group, each block's regions): block-major, a region per
    param group in each block."""
    regions, region_group, block_regions = [], [], []
    for block in blocks:
        first = len(regions)
        members = set(block)
        for g, group in enumerate(groups):
            regions.append([p for p in group if p in members])
            region_group.append(g)
        block_regions.append(range(first, len(regions)))
    assert sum(map(len, regions)) == sum(map(len, groups))
    return regions, region_group, block_regions


def _blocks(
    groups: list[list[nn.Parameter]],
    segments: Sequence[Sequence[nn.Parameter]],
    ties: Sequence[TiedParameters],
    experts: Sequence[ExpertParameters] = (),
    model_order: dict[nn.Parameter, int] | None = None,
) -> tuple[list[list[nn.Parameter]], list[int], list[int | None], list[int]]:
    """(blocks, each block's segment, each block's tie, each block's place): for every segment
    its tied weights, one block per tie, then the rest of it, cut where it passes between the
    data-parallel group's weights and an expert layer's (place 0, or i + 1 for `experts[i]`),
    so that blocks keep roughly backward order. Without segments, all parameters are one
    segment."""
    managed = [p for group in groups for p in group]
    managed_set = set(managed)
    segments = [[p for p in s if p in managed_set] for s in segments] or [managed]
    seen = [p for s in segments for p in s]
    if len(seen) != len(set(seen)) or set(seen) != managed_set:
        raise ValueError("segments must hold every parameter the optimizer steps exactly once")
    tie_of = {p: t for t, tie in enumerate(ties) for p in tie.params}
    place_of = {p: i + 1 for i, e in enumerate(experts) for p in e.params}
    if set(place_of) - managed_set:
        raise ValueError("expert parameters must be trainable parameters the optimizer steps")
    if set(place_of) & set(tie_of):
        raise ValueError("expert parameters cannot also be tied or replicated weights")
    blocks, block_segment, block_tie, block_place = [], [], [], []
    for s, segment in enumerate(segments):
        members = set(segment)
        for t, tie in enumerate(ties):
            tied = [p for p in tie.params if p in members]
            if tied:
                blocks.append(tied)
                block_segment.append(s)
                block_tie.append(t)
                block_place.append(0)
        rest = [p for p in segment if p not in tie_of]
        if experts:
            rest.sort(key=lambda p: -model_order[p])
        runs: list[list[nn.Parameter]] = []
        for p in rest:
            if not runs or place_of.get(p, 0) != place_of.get(runs[-1][0], 0):
                runs.append([])
            runs[-1].append(p)
        for run in runs or [[]]:
            blocks.append(run)
            block_segment.append(s)
            block_tie.append(None)
            block_place.append(place_of.get(run[0], 0) if run else 0)
    return blocks, block_segment, block_tie, block_place


def _merged(spans: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """Sorted spans with adjacent ones of equal weight joined."""
    out: list[tuple[int, int, float]] = []
    for a, b, w in sorted(spans):
        if out and out[-1][1] == a and out[-1][2] == w:
            out[-1] = (out[-1][0], b, w)
        else:
            out.append((a, b, w))
    return out


def _complement(spans: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The parts of [0, total) outside the sorted, disjoint `spans`."""
    out, cursor = [], 0
    for start, end in spans:
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < total:
        out.append((cursor, total))
    return out


def _split_regions(
    regions: list[list[nn.Parameter]],
    region_group: list[int],
    block_regions: list[range],
    limit: int,
) -> tuple[list[list[nn.Parameter]], list[int], list[range]]:
    """Split each region into runs of whole parameters holding at most `limit` elements each."""
    out, out_group, out_blocks = [], [], []
    for span in block_regions:
        first = len(out)
        for r in span:
            run, size = [], 0
            for p in regions[r]:
                numel = logical_shape(p).numel()
                if run and size + numel > limit:
                    out.append(run)
                    out_group.append(region_group[r])
                    run, size = [], 0
                run.append(p)
                size += numel
            out.append(run)
            out_group.append(region_group[r])
        out_blocks.append(range(first, len(out)))
    return out, out_group, out_blocks


def _reduce_scales(reduce: ReduceOptions, world: int) -> tuple[float, float]:
    """(before, after) factors of the sum, following DeepSpeed's prescale/predivide rules."""
    if not reduce.average:
        return 1.0, 1.0
    if reduce.prescale_gradients:
        return 1.0 / world, 1.0
    return 1.0 / reduce.predivide_factor, reduce.predivide_factor / world


def _communicates_itself(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer averages its own (compressed) state instead of gradients now."""
    check = getattr(optimizer, "communicates_gradients", None)
    return bool(check()) if callable(check) else False


def _group_rank_to_global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def deepspeed_wrapper(optimizer: ZeroOptimizer) -> str | None:
    """The optimizer wrapper DeepSpeed 0.19.8 builds for this stage and precision (None: it keeps
    the torch optimizer unwrapped), where shardspeed builds a ZeroOptimizer for all of them."""
    stage = optimizer.configured_stage
    # DeepSpeed accumulates in the model's dtype unless `data_types.grad_accum_dtype` says otherwise.
    model = optimizer.model_dtype
    grads = optimizer.requested_grad_dtype or model
    bf16_with_fp32_grads = model == torch.bfloat16 and grads == torch.float32
    if bf16_with_fp32_grads and (stage == 0 or (stage == 1 and not optimizer.offload.enabled)):
        return "BF16_Optimizer"
    if stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if stage >= 1:
        return "DeepSpeedZeroOptimizer"
    if model == torch.float32:
        return None
    fused = type(optimizer.optimizer).__name__ == "FusedAdam"
    return "FP16_Optimizer" if fused else "FP16_UnfusedOptimizer"


class DeepSpeedWrapperClass(type):
    """The metaclass of DeepSpeed's optimizer wrapper names (`DeepSpeedZeroOptimizer`, ...): an
    instance is a ZeroOptimizer for which DeepSpeed would have built that wrapper."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, ZeroOptimizer) and deepspeed_wrapper(instance) == cls.__name__

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{cls.__name__} is DeepSpeed's name for the optimizer that initialize() builds; "
            "shardspeed builds it as a ZeroOptimizer: call initialize() and use engine.optimizer"
        )
