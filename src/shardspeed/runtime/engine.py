"""The engine: DeepSpeed's `DeepSpeedEngine` surface, orchestrating rooms that own the algorithms.

Flow: config (validated) -> topology -> model placed and cast to its dtype -> optimizer built and
wrapped (flat buffers, reduction, precision) -> scheduler -> data loader. Then per micro-step:
forward -> backward (loss scaled, divided by accumulation steps; reduction overlaps backward on the
boundary micro-step) -> step (acts only at the accumulation boundary).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .. import checkpointing
from ..accelerator import get_accelerator
from ..autotuning.metric import AutotuningMeter
from ..checkpoint import load_engine, save_engine
from ..checkpoint import lock as checkpoint_lock
from ..checkpoint.sixteen_bit import consolidated_state_dict, save_16bit_model, stream_weights
from ..checkpoint.values import all_gather_json
from ..comm import Topology, configure_comms_logger, get_local_rank, mark_step
from ..common.observer import EngineComponent, StepObserver
from ..config import (
    RunFacts,
    ShardSpeedConfig,
    optimizer_params,
    refuse_combinations,
    scheduler_params,
)
from ..config.errors import ConfigError
from ..moe.balance import LoadBalancer
from ..moe.expert_parallel import ExpertParallel
from ..moe.placement import expert_load, place_experts
from ..monitor import MonitorMaster, NullRecorder, TraceRecorder, merge_gathered
from ..monitor.step import (
    CommSummary,
    MonitorWriter,
    PhaseClock,
    StepReport,
    UnusedCheckpointing,
)
from ..optim import build_optimizer, build_scheduler
from ..optim.lion import Lion
from ..optim.onebit import CompressedOptimizer
from ..precision import build_loss_scaler
from ..profiling.flops_profiler import FlopsProfiler
from ..profiling.flops_profiler.observer import ProfiledStep
from ..zero import (
    GatherOptions,
    OffloadOptions,
    ReduceOptions,
    Stage3Options,
    TiedParameters,
    ZeroOptimizer,
)
from ..zero.accounting import memory_breakdown
from ..zero.init import materialize
from ..zero.partitioned import ShardedParameters
from ..zero.plan import Place, replica_ties
from ..zero.stores import ShardedParams, shard_untrained
from .dataloader import DistributedDataLoader
from .sequence_parallel.ulysses_sp import SequenceLoss

logger = logging.getLogger("shardspeed")

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Optimizers whose update of an element depends only on that element: safe on flat ZeRO shards.
_ELEMENTWISE_OPTIMIZERS = (
    Lion,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
)


# Optimizers whose update of an element depends on its whole tensor (a trust ratio, factored
# moments), by class name: transformers' and torch's Adafactor, DeepSpeed's FusedLamb, apex's
# FusedLAMB, bitsandbytes' LAMB and LARS, torch-optimizer's Lamb and Lars. shardspeed's own say
# so with `needs_whole_tensors`.
_PER_TENSOR_OPTIMIZERS = frozenset(
    {"Adafactor", "FusedLamb", "FusedLAMB", "LAMB", "LARS", "Lamb", "Lars"}
)


def _whole_tensor_groups(
    optimizer: torch.optim.Optimizer, allow_untested: bool
) -> tuple[bool, ...]:
    """For each param group, whether ZeRO steps it on whole tensors rather than flat shards.

    An optimizer may say so per group (`needs_whole_tensors(group)`: Muon's matrices, not its
    AdamW half). Known element-wise optimizers take flat shards, known per-tensor ones whole
    tensors. Any other gets whole tensors, which is right for every optimizer, unless
    'zero_allow_untested_optimizer' declares it element-wise (DeepSpeed's flat layout).
    """
    groups = optimizer.param_groups
    ask = getattr(optimizer, "needs_whole_tensors", None)
    if callable(ask):
        return tuple(bool(ask(group)) for group in groups)
    if isinstance(optimizer, _ELEMENTWISE_OPTIMIZERS):
        whole = False
    elif type(optimizer).__name__ in _PER_TENSOR_OPTIMIZERS:
        whole = True
    else:
        whole = not allow_untested
    return (whole,) * len(groups)


class ShardSpeedEngine(nn.Module):
    """What `shardspeed.initialize` returns first; wraps the user's model as `engine.module`."""

    def __init__(
        self,
        model: nn.Module,
        config: ShardSpeedConfig,
        topology: Topology,
        optimizer: torch.optim.Optimizer | Callable | None = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Callable | None = None,
        config_dict: dict[str, Any] | None = None,
        components: Sequence[Callable[[ShardSpeedEngine], EngineComponent]] = (),
    ) -> None:
        """`components` build the parts a feature adds (a pipeline schedule, hybrid generation)
        from the finished engine; they are called, and observe its steps, after the others."""
        super().__init__()
        # `config` is DeepSpeed's: the dict the run was configured with, as given (libraries read
        # it with .get()); `run_config` is the validated, resolved config the engine runs by.
        self.run_config = config
        self.config = (
            config_dict if config_dict is not None else config.model_dump(exclude_defaults=True)
        )
        self.topology = topology
        self.device = _device()
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._first_micro_step = 0
        self._step_applied = False
        self._in_no_sync = False
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._is_compiled = False
        self.comm_summary: dict[str, Any] = {}  # the last step's collectives, when logging

        self.dtype = _DTYPES[config.precision]
        model.to(device=self.device)
        _cast_module(model, self.dtype, _DTYPES.get(config.data_types.buffer_dtype))
        self.module = model
        self.experts = place_experts(model, topology, config.use_data_before_expert_parallelism)
        self.moe_layers = self.experts.layers
        self.expert_tensor_names = self.experts.tensor_names

        self.basic_optimizer = _client_optimizer(optimizer, model_parameters, model, config)
        if self.basic_optimizer is not None:
            check_param_groups(self.basic_optimizer.param_groups)
        self.optimizer = self._wrap_optimizer(self.basic_optimizer)
        self.untrained_shards, self.parameter_shards = _stage3_shards(self)
        # Under sequence parallelism the first loss tells how gradients must be reduced.
        self._sequence_loss = (
            SequenceLoss(config.sequence_parallel.loss, topology, self.optimizer)
            if self.optimizer is not None and topology.sp_world_size > 1
            else None
        )
        self.lr_scheduler = _client_scheduler(lr_scheduler, config, self.basic_optimizer)
        if training_data is not None:
            check_training_data(training_data, self.train_batch_size())
        self.training_dataloader = (
            self.deepspeed_io(training_data, collate_fn=collate_fn)
            if training_data is not None
            else None
        )
        # Phases are traced once `start_trace()` is called; timed with `wall_clock_breakdown`.
        self.clock = PhaseClock(config.wall_clock_breakdown, self.device.type == "cuda")
        # The flops profiler measures one step (`profile_step`) on rank 0, as DeepSpeed does.
        self.flops_profiler = (
            FlopsProfiler(model, self, config.flops_profiler.recompute_fwd_factor)
            if config.flops_profiler.enabled and topology.rank == 0
            else None
        )
        self.components = [build(self) for build in components]
        self.observers: list[StepObserver] = [*_observers(self), *self.components]
        self._surface = {name: part for part in self.components for name in part.surface}
        if config.compile.compiles:
            self.compile()
        whole = self.optimizer.plan.whole_tensor_summary() if self.optimizer else None
        if whole is not None and topology.rank == 0:
            logger.info("ZeRO: %s", whole)
        if config.dump_state and topology.rank == 0:
            logger.info("engine state: %s", _state_summary(self))

    # -- construction -------------------------------------------------------------------------

    def _wrap_optimizer(self, basic: torch.optim.Optimizer | None) -> ZeroOptimizer | None:
        if basic is None:
            return None  # an engine for evaluation only (`_shard_untrained` takes its weights)
        config = self.run_config
        zero = config.zero_optimization
        if isinstance(basic, CompressedOptimizer):
            self._connect_compressed(basic)
        fp16 = config.fp16
        scaler = (
            build_loss_scaler(
                fp16.loss_scale,
                fp16.initial_scale_power,
                fp16.loss_scale_window,
                fp16.hysteresis,
                fp16.consecutive_hysteresis,
                fp16.min_loss_scale,
            )
            if fp16.enabled
            else None
        )
        reduce = ReduceOptions(
            bucket_elements=zero.reduce_bucket_size,
            comm_dtype=_DTYPES[config.communication_data_type]
            if config.communication_data_type
            else None,
            prescale_gradients=config.prescale_gradients,
            predivide_factor=config.gradient_predivide_factor,
            overlap=zero.overlap_comm is not False,
            reduce_scatter=zero.reduce_scatter,
            average=config.gradient_allreduce_op == "mean",
            # A replicated loss (every sequence rank holds the whole one) averages like replicas.
            sequence_parallel=1
            if config.sequence_parallel.loss == "replicated"
            else self.topology.sp_world_size,
            quantized_gradients=zero.zero_quantized_gradients,
        )
        gather = GatherOptions(
            bucket_elements=zero.allgather_bucket_size,
            all_gather=zero.allgather_partitions and not config.disable_allgather,
        )
        return ZeroOptimizer(
            self.module,
            basic,
            stage=zero.stage,
            loss_scaler=scaler,
            gradient_clipping=config.gradient_clipping,
            skip_nonfinite=bool(config.bf16.check_grad_overflow),
            # Every sequence rank holds the whole model: ZeRO shards over data x sequence ranks.
            dp_group=self.topology.get_sequence_data_parallel_group(),
            dp_rank=self.topology.get_sequence_data_parallel_rank(),
            dp_world_size=self.topology.get_sequence_data_parallel_world_size(),
            reduce=reduce,
            gather=gather,
            ignore_unused_parameters=zero.ignore_unused_parameters,
            stage3=Stage3Options.from_config(zero, self._hpz_group(zero.zero_hpz_partition_size)),
            offload=OffloadOptions.from_config(config),
            grad_dtype=_DTYPES.get(config.data_types.grad_accum_dtype),
            whole_groups=_whole_tensor_groups(basic, config.zero_allow_untested_optimizer),
            **self._sharding_layout(),
        )

    def _hpz_group(self, size: int) -> Any:
        """The group of ZeRO++'s hierarchical partitioning (None when it is off)."""
        return self.topology.hpz_group(size)[0] if size > 1 else None

    def _connect_compressed(self, basic: CompressedOptimizer) -> None:
        """Check a compressing optimizer's combination with the mesh and hand it the group it
        exchanges over; at ZeRO 1-3 (OneBitLamb only) it exchanges nothing (`local`)."""
        config = self.run_config
        zero = config.zero_optimization
        topo = self.topology
        refuse_combinations(
            config,
            RunFacts(
                pipeline_stages=topo.num_stages,
                tensor_parallel_size=topo.tp_world_size,
                moe_ep_sizes=self.experts.ep_sizes,
                compressed_optimizer=type(basic).__name__,
            ),
        )
        local = zero.stage >= 1
        basic.set_process_group(topo.dp_group, local=local)
        if local and topo.rank == 0:
            logger.warning(
                "%s at ZeRO stage %d: each tensor is stepped whole on its owner with "
                "single-process arithmetic on gradients that ZeRO averages uncompressed; its "
                "1-bit exchange runs with 'zero_optimization.stage' 0 only",
                type(basic).__name__,
                zero.stage,
            )

    def _sharding_layout(self) -> dict[str, Any]:
        """What the optimizer needs to know beyond the data-parallel group: the parameters copied
        on other ranks (pipeline ties; under tensor parallelism the replicated parameters, and
        sequence-parallel ones whose gradients are partial), and the group over which gradients
        together make the model's norm."""
        topo = self.topology
        # Experts spread over tensor-parallel peers too (folding) differ between them.
        spread = {p for part in self.experts.parameters for p in part.params}
        ties = replica_ties(
            (p for p in self.module.parameters() if p not in spread),
            self._stage_ties(),
            topo.tp_group,
            topo.tp_rank,
            topo.tp_world_size,
        )
        parallel = topo.tp_world_size > 1 or topo.num_stages > 1
        return {
            "ties": ties,
            "norm_group": topo.mp_group if parallel else None,
            "experts": self.experts.parameters,
            "segments": _pipeline_part(self.module, "chunk_parameters", ()),
        }

    def _stage_ties(self) -> list[TiedParameters]:
        """Weights tied across pipeline stages (a PipelineModule has them)."""
        return _pipeline_part(self.module, "tied_parameters", [])

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: Any = None,
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable | None = None,
        num_local_io_workers: int | None = None,
    ) -> DistributedDataLoader:
        """A loader giving each data-parallel rank its own micro-batches, as DeepSpeed's does.
        Under sequence parallelism each rank of a sequence group has its own too: wrapped in
        `UlyssesSPDataLoaderAdapter`, the group then trains on each of them in turn."""
        del route
        topo = self.topology
        return DistributedDataLoader(
            dataset,
            batch_size or self.train_micro_batch_size_per_gpu(),
            topo.get_sequence_data_parallel_rank(),
            topo.get_sequence_data_parallel_world_size(),
            collate_fn=collate_fn,
            drop_last=self.run_config.dataloader_drop_last,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.device.type == "cuda",
            sampler=data_sampler,
        )

    # -- attribute pass-through, as DeepSpeed's engine does ------------------------------------

    def __getattr__(self, name: str) -> Any:
        """What a component adds (`train_batch`, `generate`, ...), else the module's attribute."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            part = self.__dict__.get("_surface", {}).get(name)
            if part is not None:
                return getattr(part, name)
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    # -- the training step ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_replaced(self, "forward")
        if self.run_config.fp16.enabled and self.run_config.fp16.auto_cast:
            args, kwargs = _cast_floating((args, kwargs), torch.float16)
        for shards in self.parameter_shards:
            shards.begin_pass(torch.is_grad_enabled())
        with contextlib.ExitStack() as observed:
            for observer in self.observers:
                observed.enter_context(observer.forward(self))
            with self.clock.phase("forward"):
                return self.module(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate `loss` (divided by the accumulation steps); returns that divided loss."""
        _refuse_replaced(self, "backward")
        require_optimizer(self, "backward()")
        if loss.numel() != 1:
            raise ValueError(f"backward() needs a scalar loss, got shape {tuple(loss.shape)}")
        # The one place the optimizer learns whether this micro-step's gradients are averaged:
        # just before autograd runs, after whatever changed the window (boundary, no_sync,
        # batch size). 1-bit / 0-1 Adam past its warm-up averages its own momentum instead.
        if self._sequence_loss is not None and self._sequence_loss.settle(loss):
            self._sequence_loss = None
        basic = self.basic_optimizer
        local = isinstance(basic, CompressedOptimizer) and basic.communicates_gradients()
        reduces = self.is_gradient_accumulation_boundary() and not self._in_no_sync and not local
        self.optimizer.start_micro_step(reduces)
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        scale = self.optimizer.loss_scale
        with self.clock.phase("backward"):
            (loss.float() * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            with self.clock.phase("reduce"):
                self.optimizer.finish_reduction()  # a no-op on micro-steps that do not reduce
            for store in self.untrained_shards:
                store.release_all()  # units whose modules' inputs needed no gradient
        for observer in self.observers:
            observer.after_backward(self, loss)
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Count the micro-step; at the accumulation boundary apply the update and step the LR."""
        _refuse_replaced(self, "step")
        if self._in_no_sync:
            raise RuntimeError("step() inside no_sync() is not allowed: leave the context first")
        require_optimizer(self, "step()")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._apply_step(lr_kwargs)
        self.micro_steps += 1

    def _apply_step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """The boundary's work: the optimizer step, the LR schedule, the counters, the observers."""
        with self.clock.phase("step"):
            self._step_applied = self.optimizer.step()
        if self._step_applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        mark_step()  # steps that repeat their collectives let the same-call check step aside
        for observer in self.observers:
            observer.after_step(self)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step ends an accumulation window: every `gradient_accumulation_steps`
        micro-steps, or what `set_gradient_accumulation_boundary` last said."""
        if self._boundary_override is not None:
            return self._boundary_override
        micro_step = self.micro_steps - self._first_micro_step
        return (micro_step + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Let the caller decide where accumulation windows end (accelerate does): from now on,
        until changed again, the micro-step is a boundary exactly when `is_boundary` is true, so
        gradients are averaged in that backward and `step()` applies the update. Call it before the
        micro-step's backward; the counter of `gradient_accumulation_steps` no longer decides."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary must be a bool, not {type(is_boundary).__name__}")
        self._boundary_override = is_boundary

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without averaging them (as torch DDP's no_sync)."""
        if self._in_no_sync:
            raise RuntimeError("no_sync() is already active: it cannot be nested")
        if self.zero_optimization_stage() >= 2:
            raise RuntimeError(
                "no_sync() is not available with ZeRO stage 2: each rank keeps only its shard of "
                "the gradients, so they must be reduced every micro-step"
            )
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # -- reporting ------------------------------------------------------------------------------

    def start_trace(self) -> None:
        """Record this rank's forward, backward, reduction and optimizer spans (and a pipeline's
        instructions) from now on, for `save_trace`."""
        self.clock.tracer = TraceRecorder(self.global_rank)

    def save_trace(self, path: str) -> str | None:
        """Stop recording and write every rank's spans as one Chrome trace (Perfetto,
        chrome://tracing): a track group per rank. Collective; rank 0 writes `path` and gets it
        back, the others None."""
        gathered = all_gather_json(self.clock.tracer.events())
        self.clock.tracer = NullRecorder()
        if self.global_rank != 0:
            return None
        return merge_gathered(gathered, path)

    # -- DeepSpeed's accessors (the one-line readers are generated from `_ACCESSORS`) -----------

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (the micro batch stays)."""
        micro = self.train_micro_batch_size_per_gpu()
        per_step = micro * self.dp_world_size
        if train_batch_size <= 0 or train_batch_size % per_step:
            raise ValueError(
                f"train_batch_size {train_batch_size} must be a positive multiple of micro batch x "
                f"data-parallel size = {per_step}"
            )
        _resize_batch(self, train_batch_size, micro)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch (the accumulation steps stay, so the global batch follows)."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro batch size must be positive, got {micro_batch_size}")
        gas = self.gradient_accumulation_steps()
        _resize_batch(self, micro_batch_size * gas * self.dp_world_size, micro_batch_size)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict in its training dtype on rank 0 (None on the others), the
        stage-3 parameters gathered: DeepSpeed's name, which transformers and accelerate call
        (collective)."""
        state = consolidated_state_dict(self, exclude_frozen_parameters)
        return state if self.global_rank == 0 else None

    def _consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """`_zero3_consolidated_16bit_state_dict` at stage 3 (collective), as DeepSpeed's engine
        dispatches. DeepSpeed also consolidates tensor-parallel pieces here; shardspeed does that
        from a checkpoint (`shardspeed-ckpt consolidate`), not from a live engine."""
        if self.zero_optimization_stage() == 3 and self.topology.tp_world_size == 1:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.topology.tp_world_size > 1:
            raise ValueError(
                "consolidating tensor-parallel pieces from a live engine is not supported: save a "
                "checkpoint and consolidate it with `shardspeed-ckpt consolidate`"
            )
        raise ValueError(
            "consolidated_16bit_state_dict is only applicable where weights are partitioned "
            "(ZeRO stage 3); use engine.module.state_dict() at stage "
            f"{self.zero_optimization_stage()}"
        )

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
    ) -> None:
        """`torch.compile` the wrapped module in place (DeepSpeed's `engine.compile`, as accelerate
        calls it; the config's `compile` section calls it at `initialize`). Without arguments the
        section's backend and kwargs apply. `schedule` names DeepSpeed's DeepCompile passes, which
        shardspeed lacks. Stage 3 is refused: its gather hooks run inside the module's call and
        cannot be traced."""
        if schedule is not None:
            raise ValueError(
                "engine.compile(schedule=...) selects DeepSpeed's DeepCompile passes, which "
                "shardspeed does not have; call compile() without it"
            )
        if self.optimizer is not None:  # without one nothing is sharded
            refuse_combinations(self.run_config, RunFacts(compiling=True))
        if self.is_compiled:
            return
        section = self.run_config.compile
        kwargs = dict(section.kwargs if compile_kwargs is None else compile_kwargs)
        self.module.compile(backend=backend or section.backend, **kwargs)
        self._is_compiled = True

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write the whole model in its training dtype to one safetensors file (rank 0 writes;
        collective). See `checkpoint.sixteen_bit.save_16bit_model`."""
        _refuse_replaced(self, "save_16bit_model")
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save everything needed to continue training, as `deepspeed`'s engine does.

        Collective. The tag defaults to `global_step<N>`; `latest` names it once the tag is
        complete. `client_state` may hold JSON values and tensors. See docs/checkpoint-format.md.
        """
        require_optimizer(self, "save_checkpoint()")
        with self.experts.at_home(self.optimizer):  # pieces are runs of experts in order
            return save_engine(
                self, save_dir, tag, client_state or {}, save_latest, exclude_frozen_parameters
            )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint written at any world size and ZeRO stage: (path, client_state).

        Collective. Without a tag, reads `latest`; with no `latest`, loads nothing and returns
        (None, None), as DeepSpeed does.
        """
        if custom_load_fn is not None:
            raise ValueError(
                "load_checkpoint(custom_load_fn=...) is not supported: checkpoints are read by shardspeed's format only"
            )
        require_optimizer(self, "load_checkpoint()")
        self.experts.go_home(self.optimizer)  # what is loaded is in the experts' own order
        loaded = load_engine(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )
        for observer in self.observers:
            observer.after_load(self)
        return loaded

    def destroy(self) -> None:
        """Release what the engine holds outside Python's objects: gradient hooks, swap files,
        monitor files, checkpoint directory locks."""
        if self.optimizer is not None:
            self.optimizer.close()
        for observer in self.observers:
            observer.close()
        checkpoint_lock.release_all()

    def consolidated_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The module's state dict with every parameter whole (collective at stage 3)."""
        return consolidated_state_dict(self, exclude_frozen_parameters)

    def stream_weights(
        self, bucket_bytes: int | None = None, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The current weights, whole, a bucket of at most `bucket_bytes` at a time, in `dtype`:
        to push them to a generator after a step without a second whole copy (collective; see
        `checkpoint.sixteen_bit.stream_weights`)."""
        return stream_weights(self, bucket_bytes, dtype)

    def expert_load(self, over_data_parallel: bool = False) -> dict[str, dict[str, Any]]:
        """Per MoE layer or Hugging Face MoE block's experts (by module name), its last forward's
        routing: tokens asked of each of its experts (`exp_counts`), tokens each got
        (`tokens_per_expert`), tokens dropped, and the imbalance (busiest expert's tokens over
        the mean). This rank's tokens, or with `over_data_parallel` summed over the ranks
        holding different tokens, data x sequence parallel (collective)."""
        routed = self.experts.routed
        if not over_data_parallel:
            return expert_load(routed)
        topology = self.topology
        return expert_load(
            routed,
            topology.get_sequence_data_parallel_group(),
            topology.get_sequence_data_parallel_world_size(),
        )


def _client_optimizer(
    client: Any, model_parameters: Any, module: nn.Module, config: ShardSpeedConfig
) -> torch.optim.Optimizer | None:
    """The torch optimizer: the client's object, built by the client's callable, or from the
    config's `optimizer` section (None without either)."""
    params = model_parameters if model_parameters is not None else module.parameters()
    if client is not None and config.optimizer is not None:
        raise ConfigError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' "
            "section: remove one (DeepSpeed silently prefers the client optimizer)"
        )
    if isinstance(client, torch.optim.Optimizer):
        return client
    if callable(client):
        return client(params)
    if client is not None:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable, not {client!r}")
    if config.optimizer is None:
        return None
    name, params_model = optimizer_params(config)
    # The module too: Muon marks its parameters (which get Muon, which AdamW) from it.
    return build_optimizer(name, params_model, params, module)


def _client_scheduler(
    client: Any, config: ShardSpeedConfig, basic_optimizer: torch.optim.Optimizer | None
) -> Any:
    """The LR schedule: the client's object, built by the client's callable, or from the
    config's `scheduler` section (None without either, or without an optimizer)."""
    if client is not None and config.scheduler is not None:
        raise ConfigError(
            "an lr_scheduler was passed to initialize() and the config has a 'scheduler' "
            "section: remove one"
        )
    if client is not None:
        if callable(client) and not hasattr(client, "step"):
            return client(basic_optimizer)
        return client
    if config.scheduler is None:
        return None
    if basic_optimizer is None:
        # DeepSpeed builds no scheduler without an optimizer either; transformers leaves the
        # section in the config it reuses for evaluation.
        logger.warning(
            "the config's 'scheduler' section is not used: there is no optimizer (no "
            "'optimizer' section and none passed to initialize), so nothing is scheduled"
        )
        return None
    name, params_model = scheduler_params(config)
    return build_scheduler(name, params_model, basic_optimizer)


def _stage3_shards(
    engine: ShardSpeedEngine,
) -> tuple[list[ShardedParams], list[ShardedParameters]]:
    """(the stores of the parameters no optimizer steps, every set of stage-3 shards: the
    optimizer's, then theirs), both empty below stage 3."""
    untrained = _shard_untrained(engine)
    trained = engine.optimizer.sharded_params if engine.optimizer is not None else None
    every = [*([trained] if trained is not None else []), *(s.sharded_params for s in untrained)]
    return untrained, every


def _shard_untrained(engine: ShardSpeedEngine) -> list[ShardedParams]:
    """The parameters no optimizer steps (frozen ones; all of them in an engine without an
    optimizer): at stage 3 sharded as the trained ones are (`zero.stores.shard_untrained`),
    experts' and non-floating ones excepted; below stage 3 whole, zero.Init's slices made whole
    again."""
    zero = engine.run_config.zero_optimization
    managed = set(engine.optimizer.params) if engine.optimizer is not None else set()
    untrained = [p for p in engine.module.parameters() if p not in managed]
    experts = {p for part in engine.experts.parameters for p in part.params}
    sharded = (
        [p for p in untrained if p.is_floating_point() and p not in experts]
        if zero.stage == 3
        else []
    )
    kept = set(sharded)
    materialize((p for p in untrained if p not in kept), zero.stage == 3)
    if not sharded:
        return []
    topo = engine.topology
    data = Place(
        topo.get_sequence_data_parallel_group(),
        topo.get_sequence_data_parallel_rank(),
        topo.get_sequence_data_parallel_world_size(),
    )
    stage3 = Stage3Options.from_config(zero, engine._hpz_group(zero.zero_hpz_partition_size))
    offload = OffloadOptions.from_config(engine.run_config)
    return shard_untrained(engine.module, sharded, data, stage3, offload, engine.device)


def _observers(engine: ShardSpeedEngine) -> list[StepObserver]:
    """What the config asks to watch the steps, in the order they run after a step: the step's
    collectives first (the monitors write them), the autotuning meter late (it may end the
    process)."""
    config, rank = engine.run_config, engine.topology.rank
    observers: list[StepObserver] = []
    comms_logger = configure_comms_logger(config.comms_logger)
    if comms_logger.enabled:
        observers.append(CommSummary(comms_logger))
    if engine.flops_profiler is not None:
        observers.append(ProfiledStep(engine.flops_profiler, config.flops_profiler))
    observers.append(StepReport(config, engine.clock))
    section = config.expert_parallel
    if section.enabled and (
        section.load_balance_coeff or section.hot_expert_replicas or section.rebalance_interval
    ):
        blocks = [m for m in engine.experts.routed.values() if isinstance(m, ExpertParallel)]
        # Sequence ranks route different tokens: the load is theirs together, so every rank
        # moves its bias and picks its hot experts alike.
        group = engine.topology.get_sequence_data_parallel_group()
        observers.append(
            LoadBalancer(
                blocks,
                group,
                section.load_balance_coeff,
                [m.routing_bias for m in blocks if hasattr(m, "routing_bias")],
                section.hot_expert_replicas,
                section.rebalance_interval,
            )
        )
    # Monitors write on rank 0; `enabled` is the same on every rank, so what it gates may
    # include collectives.
    monitor = MonitorMaster(config.tensorboard, config.csv_monitor, config.wandb, rank)
    if monitor.enabled:
        observers.append(MonitorWriter(monitor))
    tuning = config.autotuning
    if tuning.enabled and tuning.metric_path:  # a trial: measure, write the metric file, stop
        mp_size = engine.topology.tp_world_size * engine.topology.num_stages
        observers.append(
            AutotuningMeter(
                tuning.metric_path,
                tuning.start_profile_step,
                tuning.end_profile_step,
                config.train_batch_size,
                mp_size,
                engine.device,
            )
        )
    # The activation_checkpointing section acts here (DeepSpeed needs the script to call
    # checkpointing.configure); a default section leaves a script's own configure() alone.
    section, asked_by = config.activation_checkpointing, "activation_checkpointing"
    if config.sequence_parallel.enabled and config.sequence_parallel.memory_optimizations.enabled:
        section = section.model_copy(update={"cpu_checkpointing": True})
        asked_by = "sequence_parallel.memory_optimizations.enabled"
    if section != type(section)():
        checkpointing.configure_from_config(section, engine.topology)
        observers.append(UnusedCheckpointing(checkpointing.calls, asked_by))
    return observers


def _state_summary(engine: ShardSpeedEngine) -> str:
    """DeepSpeed's `dump_state`: the resolved config and how the engine is laid out."""
    return (
        f"config={engine.run_config.model_dump(exclude_defaults=True)}, "
        f"topology={engine.topology}, optimizer={engine.optimizer!r}, "
        f"scheduler={type(engine.lr_scheduler).__name__}, "
        f"moe_layers={sorted(engine.moe_layers)}, memory={engine.memory_breakdown()}"
    )


_ALWAYS = object()  # an accessor that answers without an optimizer too

# DeepSpeed's one-line accessors, generated below: name -> (what it reads from the engine, a
# dotted path or a function; whether it is a property; its answer when there is no optimizer).
_ACCESSORS: dict[str, tuple[str | Callable[[Any], Any], bool, Any]] = {
    "global_rank": ("topology.rank", True, _ALWAYS),
    "world_size": ("topology.world_size", True, _ALWAYS),
    "dp_world_size": ("topology.dp_world_size", True, _ALWAYS),
    "mp_world_size": ("topology.tp_world_size", True, _ALWAYS),
    "sequence_parallel_size": ("topology.sp_world_size", True, _ALWAYS),
    "seq_dp_world_size": (
        lambda engine: engine.topology.get_sequence_data_parallel_world_size(),
        True,
        _ALWAYS,
    ),
    "get_sequence_parallel_group": (
        lambda engine: engine.topology.get_sequence_parallel_group(),
        False,
        _ALWAYS,
    ),
    "local_rank": (lambda engine: get_local_rank(), True, _ALWAYS),
    "is_compiled": ("_is_compiled", True, _ALWAYS),
    "loss_scale": ("optimizer.loss_scale", True, 1.0),
    "train_batch_size": ("run_config.train_batch_size", False, _ALWAYS),
    "train_micro_batch_size_per_gpu": ("run_config.train_micro_batch_size_per_gpu", False, _ALWAYS),
    "gradient_accumulation_steps": ("run_config.gradient_accumulation_steps", False, _ALWAYS),
    "gradient_clipping": ("run_config.gradient_clipping", False, _ALWAYS),
    "zero_optimization_stage": ("run_config.zero_optimization.stage", False, _ALWAYS),
    "fp16_enabled": ("run_config.fp16.enabled", False, _ALWAYS),
    "bfloat16_enabled": ("run_config.bf16.enabled", False, _ALWAYS),
    "zero_gather_16bit_weights_on_model_save": (
        "run_config.zero_optimization.stage3_gather_16bit_weights_on_model_save",
        False,
        _ALWAYS,
    ),
    "get_global_grad_norm": ("optimizer.global_grad_norm", False, None),
    "was_step_applied": ("_step_applied", False, _ALWAYS),
    # Bytes this rank holds, by kind and by where they live (`zero.accounting`).
    "memory_breakdown": (
        lambda engine: memory_breakdown(
            engine.optimizer, engine.module, engine.device, engine.untrained_shards
        ),
        False,
        _ALWAYS,
    ),
    "get_lr": (lambda engine: [g["lr"] for g in engine.basic_optimizer.param_groups], False, None),
    # The `betas` pair for Adam-like optimizers, `momentum` for SGD-like ones, as DeepSpeed.
    "get_mom": (
        lambda engine: [
            g["betas"] if "betas" in g else g.get("momentum")
            for g in engine.basic_optimizer.param_groups
        ],
        False,
        None,
    ),
    # DeepSpeed's state offload, answered by the ZeRO optimizer (zero/offload_states.py): each
    # reads as the optimizer's method. Without an optimizer nothing is gathered on demand.
    "offload_states": (lambda engine: _optimizer_method(engine, "offload_states"), True, _ALWAYS),
    "reload_states": (lambda engine: _optimizer_method(engine, "reload_states"), True, _ALWAYS),
    "empty_partition_cache": ("optimizer.empty_partition_cache", True, lambda: None),
}


def _accessor(name: str, reads: str | Callable[[Any], Any], is_property: bool, default: Any) -> Any:
    read = operator.attrgetter(reads) if isinstance(reads, str) else reads

    def accessor(engine: ShardSpeedEngine) -> Any:
        if default is not _ALWAYS and engine.optimizer is None:
            return default
        return read(engine)

    accessor.__name__ = accessor.__qualname__ = name
    accessor.__doc__ = f"DeepSpeed's `{name}`: `{reads}`." if isinstance(reads, str) else None
    return property(accessor) if is_property else accessor


for _name, _spec in _ACCESSORS.items():
    setattr(ShardSpeedEngine, _name, _accessor(_name, *_spec))


def _resize_batch(engine: ShardSpeedEngine, train_batch_size: int, micro_batch_size: int) -> None:
    """Give the engine a new batch triple; boundaries count from here with the new steps."""
    if (engine.micro_steps - engine._first_micro_step) % engine.gradient_accumulation_steps():
        raise RuntimeError("change the batch size only at an accumulation boundary")
    engine.run_config = engine.run_config.model_copy(
        update={
            "train_batch_size": train_batch_size,
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": train_batch_size
            // (micro_batch_size * engine.dp_world_size),
        }
    )
    engine._first_micro_step = engine.micro_steps


def _pipeline_part(module: nn.Module, name: str, default: Any) -> Any:
    """What a `PipelineModule` says about its stage's parameters (its chunks, its tied
    weights), asked by name: the runtime does not import the pipe room."""
    ask = getattr(module, name, None)
    return ask() if callable(ask) else default


def _optimizer_method(engine: ShardSpeedEngine, name: str) -> Callable[..., Any]:
    require_optimizer(engine, f"{name}()")
    return getattr(engine.optimizer, name)


def require_optimizer(engine: ShardSpeedEngine, what: str) -> None:
    if engine.optimizer is None:
        raise RuntimeError(f"{what} needs an optimizer: pass one or add an 'optimizer' section")


def _refuse_replaced(engine: ShardSpeedEngine, call: str) -> None:
    """Raise where a component (a pipeline's schedule) replaces the engine's `call`."""
    for component in engine.components:
        error = component.refusal(call)
        if error is not None:
            raise error


# DeepSpeed's name for the engine class (accelerate, TRL and user code test `isinstance` against it).
DeepSpeedEngine = ShardSpeedEngine


# Param-group settings torch's optimizers read as numbers; a string there fails only inside the
# first step's kernel, far from the group that carries it.
_NUMERIC_GROUP_KEYS = ("lr", "weight_decay", "eps", "momentum", "dampening", "alpha", "lr_decay")


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.dtype.is_complex
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_param_groups(groups: list[dict[str, Any]]) -> None:
    """Refuse a param group whose numeric settings are not numbers, naming the group and key."""
    for index, group in enumerate(groups):
        for key in _NUMERIC_GROUP_KEYS:
            value = group.get(key)
            # Adafactor's eps is a pair (of which transformers' and torch's first may be None).
            pair = key == "eps" and isinstance(value, (tuple, list)) and len(value) == 2
            if pair and all(v is None or _is_number(v) for v in value):
                continue
            if key in group and not _is_number(value):
                raise ValueError(
                    f"optimizer param group {index}: '{key}' is {group[key]!r} "
                    f"({type(group[key]).__name__}); it must be a number"
                )
        betas = group.get("betas")
        if betas is not None and not (
            isinstance(betas, (tuple, list)) and len(betas) == 2 and all(map(_is_number, betas))
        ):
            raise ValueError(
                f"optimizer param group {index}: 'betas' is {betas!r}; it must be two numbers"
            )


def check_training_data(dataset: Any, train_batch_size: int) -> None:
    """Refuse a training set with no samples, or fewer than one global batch: the loader would
    end at once (a resume loop then spins) or train on one padded, partial step."""
    try:
        size = len(dataset)
    except TypeError:
        return  # an iterable dataset: its length is not known in advance
    if size == 0:
        raise ValueError(
            "training_data has no samples: pass a dataset with at least one global batch "
            f"(train_batch_size = {train_batch_size})"
        )
    if size < train_batch_size:
        raise ValueError(
            f"training_data has {size} samples, fewer than one global batch (train_batch_size = "
            f"{train_batch_size}): use more data or a smaller train_batch_size"
        )


def _cast_module(
    model: nn.Module, param_dtype: torch.dtype, buffer_dtype: torch.dtype | None
) -> None:
    """Give the floating-point parameters `param_dtype`; buffers keep theirs unless `buffer_dtype`
    is set (an fp32 rotary `inv_freq` stays fp32 in a bf16 model, as DeepSpeed keeps it)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != param_dtype:
                p.data = p.data.to(param_dtype)
        if buffer_dtype is None:
            return
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point():
                    setattr(module, name, buffer.to(buffer_dtype))


def _device() -> torch.device:
    """The local GPU when the accelerator is CUDA and the process group can carry CUDA tensors
    (NCCL); a gloo group (a CPU job, or the CPU test harness on a GPU machine) trains on the CPU.
    On torch's fake process group (a dry run, `shardspeed.planning`) nothing is computed or moved:
    the meta device holds every tensor as a shape."""
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    if backend == "fake":
        return torch.device("meta")
    gloo = backend == "gloo"
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda" and not gloo:
        return accelerator.device(get_local_rank())
    return torch.device("cpu")


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, tuple | list):
        return type(tree)(_cast_floating(item, dtype) for item in tree)
    if isinstance(tree, dict):
        return {key: _cast_floating(value, dtype) for key, value in tree.items()}
    return tree
