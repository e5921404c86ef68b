"""The engine's optimizer for ZeRO stages 0, 1 and 2, over flat buffers.

Every stage lays the trainable parameters out in one flat buffer of the model's dtype (parameters
are views into it), group by group, and averages gradients with a `GradientReducer` launched from
post-accumulate-grad hooks. What differs is what a rank keeps:

- stage 0: everything. The torch optimizer sees one fp32 master tensor per parameter.
- stage 1: the full gradient buffer, but fp32 master weights and optimizer state only for its shard
  (a contiguous 1/N of every param group, or, for param groups whose optimizer needs whole tensors
  (Lamb, Muon, Adafactor), the whole tensors in its bin). Gradients are reduced to their owners at
  the boundary.
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
tensor per group for stages 1 and 2, or the whole tensors of its bin), copies masters back to the model's dtype and, for stages 1 and
2, all-gathers the updated shards.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_reduce
from ..common.views import InstanceView
from ..precision import LossScaler, StaticLossScaler
from .hooks import ParameterOffload
from .init import is_init_sharded
from .offload import OffloadOptions, SwappedStates
from .offload_states import BACKWARD_NEEDS, OffloadStateTypeEnum, StateOffload
from .partitioned import Stage3Options
from .plan import ExpertParameters, Place, ShardPlan, TiedParameters, build_plan, managed_groups
from .reducer import GradientReducer, reduces_by_scatter
from .stores import GatherOptions, GradientArrivals, Stores, build_stores


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
    # Ranks of the group that split one sequence: their gradients are parts of one sample's, so
    # they are summed, and only the replicas averaged (the group's size over this), as DeepSpeed.
    sequence_parallel: int = 1
    # ZeRO++ qgZ: the reduce-scatter sends int4 blocks by all-to-all; owners sum them in fp32.
    quantized_gradients: bool = False


class _MasterShards:
    """One of DeepSpeed's optimizer attributes holding the fp32 master partitions, as ours (the
    masters this rank steps, views of one flat buffer): it exists at the ZeRO stages `stages`,
    as in DeepSpeed (transformers reads it to check the masters' dtype)."""

    def __init__(self, stages: tuple[int, ...]) -> None:
        self.stages = stages

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, optimizer: Any, owner: type | None = None) -> Any:
        if optimizer is None:
            return self
        if optimizer.configured_stage not in self.stages:
            stages = " and ".join(map(str, self.stages))
            raise AttributeError(f"'{self.name}' exists at ZeRO stage {stages} only")
        return list(optimizer.masters)


class ZeroOptimizer:
    """Wraps a torch optimizer for ZeRO stage 0, 1, 2 or 3 (see module docstring).

    For a pipeline stage: `segments` are the parameter sets that separate backward passes visit
    (a rank's model chunks), each laid out contiguously with buckets of its own; `ties` are
    weights shared with other stages; `norm_group` joins the ranks whose gradients together make
    the model's (the stages), for the global norm. `experts` are expert-parallel weights (see the
    module docstring). `whole_groups[g]`: param group `g` is stepped on whole tensors (its
    optimizer's update of an element depends on the whole tensor). Where bytes live is the
    `plan`'s; what holds them, the stores'.
    """

    # DeepSpeed's names for the fp32 master partitions (stages 1-2, and stage 3).
    single_partition_of_fp32_groups = _MasterShards((1, 2))
    fp32_partitioned_groups_flat = _MasterShards((3,))

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
        whole_groups: Sequence[bool] = (),
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self.offload = offload or OffloadOptions()
        self.configured_stage = stage
        self.loss_scaler = loss_scaler or StaticLossScaler(1.0)
        self.gradient_clipping, self.skip_nonfinite = gradient_clipping, skip_nonfinite
        self.ignore_unused_parameters = ignore_unused_parameters
        self.global_grad_norm: float | None = None
        self.dp_group, self.dp_rank, self.dp_world_size = dp_group, dp_rank, dp_world_size
        self.norm_group = norm_group
        self.plan = build_plan(
            module,
            managed_groups(module, optimizer),
            stage=_stage_run(stage, dp_world_size, self.offload),
            data=Place(dp_group, dp_rank, dp_world_size),
            segments=segments,
            ties=ties,
            experts=experts,
            stage3=stage3,
            sub_group_size=_largest_region(self.offload.sub_group_size, reduce, dp_group),
            whole_groups=whole_groups,
        )
        plan = self.plan
        self.stage, self.layout, self.params = plan.stage, plan.layout, list(plan.params)
        self.param_names = plan.param_names
        self.param_index = {p: i for i, p in enumerate(plan.params)}
        _check_params(plan, stage)
        self.model_dtype, self.requested_grad_dtype = plan.params[0].dtype, grad_dtype
        # Gradients accumulate in fp32 unless the model is fp16 (DeepSpeed keeps fp16 gradients),
        # or in what `data_types.grad_accum_dtype` says.
        fp16 = self.model_dtype == torch.float16
        self.grad_dtype = grad_dtype or (torch.float16 if fp16 else torch.float32)
        self.stores = stores = build_stores(
            plan, optimizer, gather or GatherOptions(), self.offload, stage3, self.grad_dtype
        )
        self.sharded_params = stores.params.sharded_params
        self._parameter_offload = (
            ParameterOffload(self.sharded_params, module) if self.sharded_params else None
        )
        self.grad_flat, self.grad_shard = stores.grads.flat, stores.grads.shard
        self.masters, self.master_flat = stores.masters.masters, stores.masters.master_flat
        self.swapped = stores.states if isinstance(stores.states, SwappedStates) else None
        # deepspeed.utils.safe_get_full_* find the optimizer from the parameter.
        for p in self.params:
            p._shardspeed_optimizer = weakref.ref(self)
        self._watch_gradients(reduce)
        # DeepSpeed's state offload (offload_states.py), under its names on its ZeRO optimizers.
        self.state_offload = StateOffload(
            module, optimizer, stores, self.reducer, masters_on_host=self.offload.enabled
        )
        self.offload_states = self.state_offload.offload_states
        self.reload_states = self.state_offload.reload_states
        self.empty_partition_cache = self.state_offload.empty_partition_cache

    def _watch_gradients(self, reduce: ReduceOptions) -> None:
        """The reducer, and the hooks that hand it (or the arrivals tracker) each gradient."""
        self.reduce_options = reduce
        # Stages 2 and 3 take gradients through the reducer's buckets even on one rank.
        sharded_grads = self.dp_world_size > 1 or self.stage >= 2
        self.reducer = _build_reducer(self.plan, self.stores, reduce) if sharded_grads else None
        # Without a reducer nothing else sees which parameters got a gradient; only track it when
        # the config asks for unused parameters to be an error.
        self._arrivals = self.reducer or (
            None if self.ignore_unused_parameters else GradientArrivals(len(self.params))
        )
        grads, done = self.stores.grads, self.stores.params.gradient_done
        self._hooks = [
            p.register_post_accumulate_grad_hook(grads.hook(i, self._arrivals, done))
            for i, p in enumerate(self.params)
        ]

    @property
    def parameter_offload(self) -> ParameterOffload:
        """DeepSpeed's stage-3 hook surface (zero/hooks.py); absent below stage 3, as there."""
        if self._parameter_offload is None:
            raise AttributeError("parameter_offload exists at ZeRO stage 3 only")
        return self._parameter_offload

    def close(self) -> None:
        """Remove the gradient hooks and the offload swap files (the engine's `destroy()`)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.stores.states.close()
        self.stores.params.close()

    def set_sequence_split(self, ranks: int) -> None:
        """Say how many ranks of the data group split one sequence (`ReduceOptions.
        sequence_parallel`: their gradients are summed, the rest averaged). For a setting learnt
        from the first loss: call it before that backward, while no reduction is in flight."""
        self.reduce_options = replace(self.reduce_options, sequence_parallel=ranks)
        if self.reducer is not None:
            data = self.plan.places[0]
            scales = _reduce_scales(self.reduce_options, data.world // ranks)
            self.reducer.pre_scale, self.reducer.post_scale = scales

    # -- backward ---------------------------------------------------------------------------------

    def start_micro_step(self, reduce_gradients: bool, segment: int | None = None) -> None:
        """Say before backward whether this micro-step's gradients are to be averaged, and, for a
        backward that visits one segment only (a pipeline chunk), which.

        A shard accumulator reduces every micro-step: it has nowhere to keep unreduced gradients.
        """
        self.state_offload.require("backward", BACKWARD_NEEDS)
        if self._arrivals is not None:
            self._arrivals.reset(segment)
            self._arrivals.active = reduce_gradients or self.stores.grads.reduces_every_micro_step
        if self.sharded_params is not None:
            self.sharded_params.start_backward_accounting()

    def finish_reduction(self) -> None:
        """Complete the averaging that backward started (idempotent)."""
        self.stores.params.release_all()
        if self._arrivals is None:
            return
        unused = self._arrivals.finish()
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

    def step(self) -> bool:
        """Unscale, check, clip and apply the averaged gradients; False when the step was skipped."""
        self.state_offload.require("step")
        self.finish_reduction()
        owned = self.stores.grads.owned()  # fp32, aligned with the masters
        for (start, end), tie in self.plan.ties:
            if end > start and tie.summed:
                all_reduce(owned[start:end], group=tie.group)  # the copies' gradients, summed
        scale = self.loss_scaler.loss_scale
        # The one host sync of a step: whether to apply it depends on this norm.
        norm = self._global_norm(owned)
        # On the meta device (a dry run) there are no values: the step goes on as a finite one.
        scaled_norm = 0.0 if norm.is_meta else norm.item()
        self.global_grad_norm = scaled_norm / scale
        if not math.isfinite(scaled_norm):
            if not (self.loss_scaler.dynamic or self.skip_nonfinite):
                raise NonFiniteGradientError(self._nonfinite_message(owned))
            # DeepSpeed reports an overflowed step's norm as inf, NaN included; callers such as
            # accelerate's clip_grad_norm_ path test for that value.
            self.global_grad_norm = math.inf
            self.loss_scaler.update(True)
            self.zero_grad()
            return False
        factor = 1.0 / scale
        if self.gradient_clipping > 0:
            factor *= min(1.0, self.gradient_clipping / (self.global_grad_norm + 1e-6))
        grads = self.stores.staging.receive(owned)
        if factor != 1.0:
            grads.mul_(factor)
        # A staged copy sits in a persistent buffer; otherwise only the store's own buffer is kept.
        self.stores.states.step(grads, keep=grads is not owned or self.stores.grads.holds(grads))
        self.publish()
        self.loss_scaler.update(False)
        self.zero_grad()
        return True

    def _global_norm(self, grads: torch.Tensor) -> torch.Tensor:
        """The norm of the whole model's gradient: shards summed over the data-parallel group,
        stages over `norm_group`, each tied weight counted once."""
        spans = self.plan.norm_spans
        if len(spans) == 1 and spans[0][2] == 1.0:
            start, end, _ = spans[0]
            squares = torch.linalg.vector_norm(grads[start:end]).square().reshape(1)
        else:
            squares = sum(
                (torch.linalg.vector_norm(grads[a:b]).square() * weight for a, b, weight in spans),
                torch.zeros((), device=grads.device),
            ).reshape(1)
        if self.plan.norm_over_dp:
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
        self.stores.params.publish(self.master_flat)

    def _nonfinite_message(self, grads: torch.Tensor) -> str:
        bad = (~torch.isfinite(grads)).nonzero()
        position = self.plan.flat_position(int(bad[0, 0])) if bad.numel() else self.layout.total
        if self.plan.sharded:  # the first bad element of the whole model, on every rank
            found = torch.tensor([position], dtype=torch.int64, device=grads.device)
            all_reduce(found, op=dist.ReduceOp.MIN, group=self.dp_group)
            position = int(found)
        return (
            f"non-finite gradient (inf or NaN) in parameter '{self.plan.param_at(position)}'; "
            "the weights were not updated. fp32 and bf16 have no loss scale to recover with: "
            "check the data, the loss and the learning rate (or set bf16.check_grad_overflow to "
            "skip such steps)"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (they stay allocated: parameters keep views into them)."""
        del set_to_none
        self.state_offload.require("zero_grad", (OffloadStateTypeEnum.lp_grads,))
        self.stores.grads.buffer().zero_()

    # -- checkpoints ----------------------------------------------------------------------------

    def master_pieces(self) -> list[list[tuple[str, int, int, int]]]:
        """For each master tensor, the parameter elements it holds, padding left out.

        Each entry is (parameter name, first element in the flattened parameter, offset in the
        master, length). Every optimizer state of a master's size maps the same way.
        """
        return self.plan.master_pieces()

    def fragments(self, i: int) -> list[tuple[int, int, int, int]]:
        """Where this rank holds parameter `i`'s master values: (master, first element in the
        flattened parameter, offset in the master, length). Stage 0 holds each whole; otherwise
        the part inside this rank's shard of the parameter's region, if any."""
        return self.plan.fragments(i)

    def fragment_group(self, i: int) -> tuple[Any, int]:
        """(group, size) over which parameter `i`'s fragments together make it whole; size 1
        when this rank holds it whole."""
        return self.plan.fragment_group(i)

    def gradient_piece(self, k: int) -> torch.Tensor:
        """Master `k`'s gradient as this rank holds it (reduced once the boundary's backward has
        finished), a flat tensor aligned with `fragments`."""
        return self.stores.grads.piece(k)

    def writes_master(self, k: int, first_replica: bool) -> bool:
        """Whether this rank writes master `k` to a checkpoint (see `ShardPlan.writes_master`)."""
        return self.plan.writes_master(k, first_replica)

    def master_numel(self, k: int) -> int:
        """Elements of master `k` (also while it is swapped out)."""
        return self.plan.master_numel(k)

    def master_value(self, k: int) -> torch.Tensor:
        """Master `k` as a flat tensor (read from its swap file under parameter offload to NVMe)."""
        return self.stores.masters.value(k)

    @contextlib.contextmanager
    def writable_master(self, k: int) -> Iterator[torch.Tensor]:
        """Master `k` as a flat tensor to write into (a load); stored back when swapped."""
        value = self.stores.masters.value(k)
        yield value
        self.stores.masters.store(k, value)

    def state_of(self, k: int) -> dict[str, Any]:
        """Master `k`'s optimizer state, swapped-out states read back (for a checkpoint)."""
        return self.stores.states.state_of(k)

    def load_optimizer_state(self, state_dict: dict[str, Any]) -> None:
        """`optimizer.load_state_dict` over the masters; offloaded states then go to their files."""
        self.stores.states.load(state_dict)

    # -- accounting -------------------------------------------------------------------------------

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors behind each kind of model state this rank holds (storages may be shared)."""
        grads = [self.stores.grads.buffer()]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        states = [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        return {
            "parameters": [*self.module.parameters(), *self.stores.params.tensors()],
            "gradients": grads,
            "master_weights": list(self.masters),
            "optimizer_states": states,
        }

    def host_tensors(self) -> list[torch.Tensor]:
        """What the config puts in host memory (`offload_optimizer`: masters and optimizer states;
        `offload_param` cpu: stage 3's shard), wherever it is now: a dry run keeps it on the meta
        device, and the accounting then counts it as host memory all the same."""
        held = self.held_tensors()
        host = [*held["master_weights"], *held["optimizer_states"]] if self.offload.enabled else []
        if self.offload.param_device == "cpu" and self.sharded_params is not None:
            host += self.sharded_params.store.tensors()
        return host

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


def _stage_run(stage: int, dp_world_size: int, offload: OffloadOptions) -> int:
    """The stage actually run. One rank has nothing to shard: stage 2 then behaves as stage 1
    (same bytes, no copies). Stage 3 stays stage 3, as DeepSpeed's does: its parameters read as
    partitioned (empty outside their unit's use, `ds_status` NOT_AVAILABLE) whatever the world
    size, which code that checks them (PEFT's save warning) relies on."""
    del offload
    keep = dp_world_size > 1 or stage == 3
    return stage if keep else min(stage, 1)


def _check_params(plan: ShardPlan, configured_stage: int) -> None:
    """Refuse trainable parameters of mixed dtype or device, and zero.Init's slices below stage 3
    (the parameters no optimizer steps are the engine's: `zero.stores.shard_untrained`)."""
    dtype, device = plan.params[0].dtype, plan.params[0].device
    if any(p.dtype != dtype or p.device != device for p in plan.params):
        raise ValueError("all trainable parameters must share one dtype and device")
    if plan.stage != 3 and any(map(is_init_sharded, plan.params)):
        raise ValueError(
            "the model was built under zero.Init, which shards parameters for ZeRO stage "
            f"3, but the config asks for stage {configured_stage}"
        )


def _largest_region(sub_group_size: int, reduce: ReduceOptions, group: Any) -> int:
    """The most elements a region (a run of parameters sharded over the group as one) may hold.
    Where gradients go out by reduce-scatter, at most a reduce bucket: a region is then one
    bucket, whose pieces line up with the shards, and one reduce-scatter. A region spread over
    several buckets would be sent as one reduce per owning rank of each bucket: thousands of
    calls a step on thousands of ranks."""
    if reduce.reduce_scatter and not reduce.quantized_gradients and reduces_by_scatter(group):
        return min(sub_group_size, max(reduce.bucket_elements, 1))
    return sub_group_size


def _build_reducer(plan: ShardPlan, stores: Stores, options: ReduceOptions) -> GradientReducer:
    """The reducer over the plan's layout: all-reduce, or reduce to the shards' owners; a shard
    accumulator takes each bucket's own part as it is reduced."""
    data = plan.places[0]
    pre, post = _reduce_scales(options, data.world // options.sequence_parallel)
    grads = stores.grads
    accumulates = grads.reduces_every_micro_step
    return GradientReducer(
        plan.layout,
        options.bucket_elements,
        data.group,
        grads.buffer().dtype,
        options.comm_dtype or grads.buffer().dtype,
        pre,
        post,
        collective="reduce" if plan.sharded and options.reduce_scatter else "all_reduce",
        quantized=options.quantized_gradients,
        grads=grads.flat,
        device=grads.buffer().device,
        on_reduced=grads.add_reduced if accumulates else None,
        overlap=options.overlap,
        # A shard accumulator must not hold every bucket at once: that is the full gradient again.
        max_in_flight=2 if accumulates else None,
        segment_starts=plan.segment_starts,
        region_groups=tuple(plan.places[p].group for p in plan.region_place)
        if len(plan.places) > 1
        else (),
        region_ranks=tuple(plan.places[p].rank if plan.sharded else 0 for p in plan.region_place),
    )


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


class DeepSpeedWrapperClass(InstanceView):
    """The metaclass of DeepSpeed's optimizer wrapper names (`DeepSpeedZeroOptimizer`, ...): an
    instance is a ZeroOptimizer for which DeepSpeed would have built that wrapper."""

    built_by = "initialize() builds as a ZeroOptimizer: call initialize() and use engine.optimizer"

    def describes(cls, instance: object) -> bool:
        return isinstance(instance, ZeroOptimizer) and deepspeed_wrapper(instance) == cls.__name__
