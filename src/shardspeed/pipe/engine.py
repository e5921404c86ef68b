"""The engine's part for a `PipelineModule`: runs a schedule's instruction list on this rank.

`initialize` gives the engine of a `PipelineModule` a `PipelineSchedule`, and the engine answers
DeepSpeed's pipeline calls (`train_batch`, `eval_batch`, `is_first_stage`, ...) from it, refusing
its own forward/backward/step; `PipelineEngine` is DeepSpeed's class name for such an engine
(an `isinstance` view). `train_batch` pulls `gradient_accumulation_steps` micro-batches and executes the instructions
`schedule.train_schedule` gives this rank: loads, forward and backward passes of its chunks, and
batches of point-to-point transfers (consecutive transfer instructions go out together). Gradients
accumulate in the optimizer's flat buffers; each chunk's last backward of the step averages them
over the stage's data-parallel group while backward runs (every backward at ZeRO stage 2), and the
step sums tied weights' gradients across stages and takes the norm over all stages. The returned
loss is the mean over micro-batches and data-parallel replicas, on every stage.

The idle time of each stage (the bubble) is measured every step: the part of the schedule's wall
time not spent in forward or backward passes, next to the theory (p-1)/(v*m+p-1).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import all_gather, all_reduce, broadcast
from ..common.observer import EngineComponent
from ..common.views import InstanceView
from ..config.errors import ConfigError
from .module import PipelineModule
from .p2p import StageLink, Transfer, metas_of
from .schedule import (
    BackwardPass,
    ForwardPass,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
    bubble_fraction,
    inference_schedule,
    is_communication,
    train_schedule,
)

logger = logging.getLogger("shardspeed")


class PipelineError(RuntimeError):
    """A call that a pipelined engine does not offer (forward/backward/step: use train_batch)."""


@dataclass
class _Pass:
    """What one train_batch or eval_batch keeps between instructions, by (micro-batch, chunk)."""

    data: Iterator | None
    inputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    output_grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    labels: dict[int, Any] = field(default_factory=dict)
    results: list[Any] = field(default_factory=list)  # last stage: each micro-batch's loss/output
    busy: float = 0.0  # seconds in forward and backward passes


class PipelineEngine(metaclass=InstanceView):
    """DeepSpeed's `PipelineEngine`: an engine that holds a `PipelineSchedule`."""

    built_by = "initialize() builds for a PipelineModule"

    @staticmethod
    def describes(instance: object) -> bool:
        parts = getattr(instance, "components", ())
        return any(isinstance(part, PipelineSchedule) for part in parts)


class PipelineSchedule(EngineComponent):
    """The engine's pipeline part: `train_batch`, `eval_batch`, stage queries, the bubble."""

    surface = (
        "train_batch",
        "eval_batch",
        "is_first_stage",
        "is_last_stage",
        "set_dataiterator",
        "set_dataloader",
        "bubble_report",
        "num_stages",
        "stage_id",
        "chunks",
        "bubble",
        "peak_live_micro_batches",
        "agg_train_loss",
        "data_iterator",
    )

    def __init__(self, engine: Any) -> None:
        """`engine`: the training engine (`runtime`) this schedule drives; not imported here, so
        that the runtime room may hold pipeline parts without a cycle."""
        model, topology = engine.module, engine.topology
        if not isinstance(model, PipelineModule):
            raise TypeError("a PipelineSchedule needs the engine of a PipelineModule")
        self.engine = engine
        self.num_stages, self.stage_id = topology.num_stages, topology.stage
        self.chunks = model.virtual_stages
        self.schedule = engine.run_config.pipeline.schedule
        self.link = StageLink(engine.device, model.dynamic_shape)
        self.data_iterator: Iterator | None = None
        self.agg_train_loss: torch.Tensor | None = None
        # (measured idle fraction over this stage's own window, theory) of the last step, and
        # (busy, elapsed) seconds behind it; bubble_report() has the pipeline-wide figures.
        self.bubble: tuple[float, float] | None = None
        self._times = (float("nan"), float("nan"))
        # The most micro-batches whose activations this rank held at once (forward done,
        # backward not yet), in the last train_batch: what the schedule costs in memory.
        self.peak_live_micro_batches = 0
        self._lists: dict[tuple[str, int], list[Instruction]] = {}

    def refusal(self, call: str) -> Exception | None:
        if call == "save_16bit_model":
            return PipelineError(
                "save_16bit_model() is not available for pipelines yet: save_checkpoint(), then "
                "`shardspeed-ckpt consolidate` writes the whole model as safetensors"
            )
        return PipelineError("Only train_batch() is accessible in pipeline mode (and eval_batch())")

    # -- DeepSpeed's surface ----------------------------------------------------------------------

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator of (inputs, labels) micro-batches the first and last stages read."""
        self.data_iterator = iterator

    def set_dataloader(self, loader: Iterable) -> None:
        self.data_iterator = _repeat(loader)

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches; the mean loss."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() needs autograd: do not call it under no_grad()")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        engine = self.engine
        if engine.optimizer is None:
            raise PipelineError(
                "train_batch() needs an optimizer: pass one to initialize() or add an "
                "'optimizer' section"
            )
        engine.module.train()
        m = engine.gradient_accumulation_steps()
        run = _Pass(self._data())
        start = time.perf_counter()
        instructions = self._instructions("train", m)
        last_backward = {
            i.chunk: i.micro_batch for i in instructions if isinstance(i, BackwardPass)
        }
        self.peak_live_micro_batches = 0
        for batch in _batches(instructions):
            if isinstance(batch[0], OptimizerStep):
                engine._apply_step()
                engine.micro_steps += m
            elif isinstance(batch[0], ReduceGrads):
                with engine.clock.phase("reduce"):
                    engine.optimizer.finish_reduction()
                elapsed = time.perf_counter() - start
                self._times = (run.busy, elapsed)
                self.bubble = (1.0 - run.busy / elapsed, bubble_fraction(*self._shape(m)))
            else:
                # The schedule's timeline: one span per instruction (or batched transfer).
                with engine.clock.tracer.span(_trace_name(batch), "pipeline"):
                    self._execute(batch, run, m, last_backward)
        self.agg_train_loss = self._mean_over_replicas(run.results, m)
        self._report_bubble()
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Iterator,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward passes only over `num_micro_batches` (default: the accumulation steps).

        Returns the loss (averaged over micro-batches and replicas with `reduce_output="avg"`,
        each micro-batch's with None), on every stage with `bcast_loss`, else on the last; with
        `return_logits` also the last stage's outputs, micro-batches concatenated (None
        elsewhere).
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output must be 'avg' or None, got {reduce_output!r}")
        m = num_micro_batches or self.engine.gradient_accumulation_steps()
        module = self.engine.module
        module.eval()
        run = _Pass(data_iter)
        logits: list[Any] = []
        with torch.no_grad():
            for batch in _batches(self._instructions("eval", m)):
                self._execute(batch, run, m, {}, compute_loss=compute_loss, logits=logits)
        module.train()
        if compute_loss and reduce_output == "avg" and bcast_loss:
            output = self._mean_over_replicas(run.results, m)
        elif compute_loss and reduce_output == "avg":
            output = self._mean_over_replicas(run.results, m, broadcast_result=False)
        else:
            output = run.results if self.is_last_stage() else None
        if not return_logits:
            return output
        joined = torch.cat([_first(x) for x in logits]) if logits else None
        return output, joined

    def bubble_report(self) -> list[dict[str, float]]:
        """Every stage's idle fraction in the last train_batch over the pipeline's window (the
        longest stage's schedule time), with the theory. Collective: every rank calls it; one
        entry per stage, from data-parallel replica 0 (tensor rank 0).

        `engine.bubble` is this rank's over its own window, which is the pipeline's on the first
        stage only: the others reach the end of their lists before the first stage's last
        backward ends, and wait for it in the step that follows.
        """
        busy, elapsed = self._times
        theory = self.bubble[1] if self.bubble is not None else float("nan")
        topo = self.engine.topology
        mine = torch.tensor([self.stage_id, topo.dp_rank, topo.tp_rank, busy, elapsed, theory])
        everyone = [torch.zeros(6) for _ in range(topo.world_size)]
        all_gather(everyone, mine)
        first = [e.tolist() for e in everyone if e[1] == 0 and e[2] == 0]
        window = max(e[4] for e in first)
        return [
            {"stage": int(s), "measured": 1.0 - b / window, "theory": t}
            for s, _, _, b, _, t in sorted(first)
        ]

    # -- running instructions ---------------------------------------------------------------------

    def _instructions(self, kind: str, m: int) -> list[Instruction]:
        key = (kind, m)
        if key not in self._lists:
            p, _, v = self._shape(m)
            if kind == "train":
                lists = train_schedule(self.schedule, p, m, v)
            else:
                lists = inference_schedule(p, m, v)
            self._lists[key] = lists[self.stage_id]
        return self._lists[key]

    def _shape(self, m: int) -> tuple[int, int, int]:
        return self.num_stages, m, self.chunks

    def _data(self) -> Iterator | None:
        loader = self.engine.training_dataloader
        if self.data_iterator is None and loader is not None:
            self.data_iterator = _repeat(loader)
        return self.data_iterator

    def _virtual(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage_id

    def _is_last_virtual(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.num_stages * self.chunks - 1

    def _execute(
        self,
        batch: list[Instruction],
        run: _Pass,
        m: int,
        last_backward: dict[int, int],
        compute_loss: bool = True,
        logits: list[Any] | None = None,
    ) -> None:
        first = batch[0]
        if is_communication(first):
            self._communicate(batch, run)
        elif isinstance(first, LoadMicroBatch):
            self._load(first.micro_batch, run)
        elif isinstance(first, ForwardPass):
            start = self._clock()
            self._forward(first, run, compute_loss, logits)
            run.busy += self._clock() - start
        elif isinstance(first, BackwardPass):
            start = self._clock()
            self._backward(first, run, m, last_backward[first.chunk] == first.micro_batch)
            run.busy += self._clock() - start
        else:
            raise PipelineError(f"unknown instruction {first}")

    def _clock(self) -> float:
        """Host time; on CUDA after the device caught up, with `wall_clock_breakdown` only (a
        sync per pass would cost the overlap the pipeline exists for)."""
        engine = self.engine
        if engine.device.type == "cuda" and engine.run_config.wall_clock_breakdown:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _load(self, micro_batch: int, run: _Pass) -> None:
        if run.data is None:
            raise PipelineError(
                "no data: pass data_iter to train_batch()/eval_batch(), call "
                "set_dataiterator(), or give training_data to initialize()"
            )
        item = next(run.data)
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise PipelineError(
                "a pipeline's data iterator must yield (inputs, labels) pairs, got "
                f"{type(item).__name__}"
            )
        inputs, labels = (_to_device(x, self.engine.device) for x in item)
        if self.stage_id == 0:
            run.inputs[(micro_batch, 0)] = inputs
        if self._stage_holds_last():
            run.labels[micro_batch] = labels

    def _stage_holds_last(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _forward(
        self, instr: ForwardPass, run: _Pass, compute_loss: bool, logits: list[Any] | None
    ) -> None:
        key = (instr.micro_batch, instr.chunk)
        inputs = run.inputs[key]
        output = self.engine.module(inputs, chunk=instr.chunk)
        if not self._is_last_virtual(instr.chunk):
            run.outputs[key] = output
            if torch.is_grad_enabled():
                self._count_live(run)
            else:
                run.inputs.pop(key)
            return
        labels = run.labels.pop(instr.micro_batch)
        if logits is not None:
            logits.append(output)
        loss_fn = self.engine.module.loss_fn
        result = loss_fn(output, labels) if (compute_loss and loss_fn is not None) else output
        if torch.is_grad_enabled():
            run.outputs[key] = result
            self._count_live(run)
        else:
            run.inputs.pop(key)
        run.results.append(result.detach() if isinstance(result, torch.Tensor) else result)

    def _count_live(self, run: _Pass) -> None:
        self.peak_live_micro_batches = max(self.peak_live_micro_batches, len(run.outputs))

    def _backward(self, instr: BackwardPass, run: _Pass, m: int, reduces: bool) -> None:
        key = (instr.micro_batch, instr.chunk)
        zopt = self.engine.optimizer
        zopt.start_micro_step(reduces, segment=instr.chunk if self.chunks > 1 else None)
        output = run.outputs.pop(key)
        if self._is_last_virtual(instr.chunk):
            if output.numel() != 1:
                raise PipelineError(
                    f"the last stage's loss must be a scalar, got shape {tuple(output.shape)}: "
                    "give PipelineModule a loss_fn"
                )
            scale = zopt.loss_scale / m  # the mean over micro-batches, times the loss scale
            (output.float() * scale).backward()
        else:
            sent = [t for t in _tensors(output) if t.requires_grad and t.is_floating_point()]
            torch.autograd.backward(sent, list(run.output_grads.pop(key)))
        inputs = run.inputs.pop(key)
        if self._virtual(instr.chunk) > 0:
            run.input_grads[key] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in _tensors(inputs)
                if t.requires_grad
            )
        zopt.finish_reduction()

    def _communicate(self, batch: list[Instruction], run: _Pass) -> None:
        transfers = []
        p = self.num_stages
        for instr in batch:
            key = (instr.micro_batch, instr.chunk)
            peer = self.engine.topology.stage_rank(instr.peer)
            if isinstance(instr, SendActivation):
                # Kept for backward when training; sent and done with when evaluating.
                output = run.outputs[key] if torch.is_grad_enabled() else run.outputs.pop(key)
                transfers.append(Transfer(True, peer, instr.chunk, _tensors(output)))
            elif isinstance(instr, RecvActivation):
                sender_chunk = (self._virtual(instr.chunk) - 1) // p
                transfers.append(Transfer(False, peer, sender_chunk))
            elif isinstance(instr, SendGrad):
                transfers.append(Transfer(True, peer, None, run.input_grads.pop(key)))
            elif isinstance(instr, RecvGrad):
                metas = [m for m in metas_of(_tensors(run.outputs[key])) if m.requires_grad]
                transfers.append(Transfer(False, peer, None, metas=metas))
        self.link.exchange(transfers)
        for instr, t in zip(batch, transfers):
            key = (instr.micro_batch, instr.chunk)
            if isinstance(instr, RecvActivation):
                received = tuple(
                    r.requires_grad_() if m.requires_grad and torch.is_grad_enabled() else r
                    for r, m in zip(t.received, t.metas)
                )
                run.inputs[key] = received[0] if len(received) == 1 else received
            elif isinstance(instr, RecvGrad):
                run.output_grads[key] = t.received

    # -- results ----------------------------------------------------------------------------------

    def _mean_over_replicas(
        self, results: list[Any], m: int, broadcast_result: bool = True
    ) -> torch.Tensor | None:
        """The mean of the last stage's per-micro-batch losses over micro-batches and replicas;
        then sent to every stage."""
        topo = self.engine.topology
        if self.is_last_stage():
            total = torch.stack([r.float().reshape(()) for r in results]).sum() / m
            if topo.dp_world_size > 1:
                all_reduce(total, group=topo.dp_group)
                total /= topo.dp_world_size
        else:
            total = torch.zeros((), device=self.engine.device)
        if self.num_stages > 1 and broadcast_result:
            last = topo.stage_rank(self.num_stages - 1)
            broadcast(total, src=last, group=topo.pipe_group)
        elif not self.is_last_stage():
            return None
        return total

    def _report_bubble(self) -> None:
        engine = self.engine
        every = engine.run_config.steps_per_print
        if not every or engine.global_steps % every or engine.global_rank != 0 or not self.bubble:
            return
        measured, theory = self.bubble
        logger.info(
            "pipeline stage 0 idle %.1f%% of the step (theory %.1f%%)", measured * 100, theory * 100
        )


def check_config(model: PipelineModule, config: Any) -> None:
    """The `pipeline` section against the module it configures, before the engine is built;
    refuse what does not match. (Which other features combine with a pipeline, `initialize`
    asks `config.rules`.)"""
    pipe = config.pipeline
    if pipe.stages != "auto" and pipe.stages != model.num_stages:
        raise ConfigError(
            f"pipeline.stages is {pipe.stages} but the PipelineModule has {model.num_stages} "
            "stages: set it to 'auto' or match the module"
        )
    if pipe.partition != "best" and pipe.partition.lower() != model.partition_method.lower():
        raise ConfigError(
            f"pipeline.partition is {pipe.partition!r} but the PipelineModule was partitioned by "
            f"{model.partition_method!r}: set 'best' (the module decides) or match it"
        )
    if pipe.seed_layers and not model.seed_layers:
        raise ConfigError(
            "pipeline.seed_layers is true but the PipelineModule was built without seed_layers: "
            "layers are built in the module's constructor, so pass seed_layers=True there"
        )
    interval = pipe.activation_checkpoint_interval
    if interval and model.activation_checkpoint_interval not in (0, interval):
        raise ConfigError(
            f"pipeline.activation_checkpoint_interval is {interval} but the PipelineModule has "
            f"{model.activation_checkpoint_interval}: set one of them"
        )
    if interval:
        model.set_checkpoint_interval(interval)
    explicit = [k for k in ("pipe_partitioned", "grad_partitioned") if k in pipe.model_fields_set]
    if model.topo.tp_world_size > 1 and any(getattr(pipe, k) for k in explicit):
        raise ConfigError(
            f"pipeline.{explicit[0]} true: splitting the tensors sent between stages across "
            "tensor-parallel ranks is not implemented (each rank sends its whole tensor); set it "
            "false or leave it out"
        )
    interleaved = pipe.schedule == "interleaved_1f1b"
    if interleaved != (model.virtual_stages > 1):
        raise ConfigError(
            f"pipeline.schedule is {pipe.schedule!r} and the PipelineModule has "
            f"virtual_stages={model.virtual_stages}: 'interleaved_1f1b' needs a module built "
            "with virtual_stages > 1, and such a module needs that schedule"
        )


def _batches(instructions: list[Instruction]) -> Iterator[list[Instruction]]:
    """Consecutive transfer instructions as one batch; every other instruction on its own."""
    pending: list[Instruction] = []
    for instr in instructions:
        if is_communication(instr):
            pending.append(instr)
            continue
        if pending:
            yield pending
            pending = []
        yield [instr]
    if pending:
        yield pending


def _repeat(loader: Iterable) -> Iterator:
    while True:
        yield from loader


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    items = value if isinstance(value, tuple | list) else (value,)
    if not all(isinstance(t, torch.Tensor) for t in items):
        kinds = [type(t).__name__ for t in items]
        raise PipelineError(f"stages pass tensors or tuples of tensors to each other, got {kinds}")
    return tuple(items)


def _first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, tuple | list) else value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _trace_name(batch: list[Instruction]) -> str:
    """A span's name: the instruction kind, its micro-batch and chunk where it has them."""
    first = batch[0]
    name = type(first).__name__
    micro = getattr(first, "micro_batch", None)
    if micro is not None:
        name += f" m{micro}"
    if len(batch) > 1:
        name += f" (+{len(batch) - 1})"
    return name
