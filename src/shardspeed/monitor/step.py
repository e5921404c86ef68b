"""What the training engine reports about its steps.

`PhaseClock` times the engine's phases (forward, backward, reduction, optimizer step, a
pipeline's instructions): a span each in the trace once `start_trace()` was called, and with
`wall_clock_breakdown` their wall time. The observers here run after each optimizer step:
`StepReport` (the `steps_per_print` line, the phase times, memory), `CommSummary` (the step's
collectives, `engine.comm_summary`), `MonitorWriter` (the step's events to the configured
monitors) and `UnusedCheckpointing` (a warning when the `activation_checkpointing` section had
nothing to act on).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..common.observer import StepObserver
from .monitor import MonitorMaster, training_events
from .trace import NullRecorder, TraceRecorder

logger = logging.getLogger("shardspeed")

# Trace tracks of the timed phases; the rest are compute.
_TRACE_CATEGORIES = {"reduce": "communication", "step": "optimizer"}


def format_bytes(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def _sizes(breakdown: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in breakdown.items())


class PhaseClock:
    """Spans and (with `wall_clock`) summed wall time of the engine's phases; on CUDA the wall
    time waits for the device at both ends of a phase."""

    def __init__(self, wall_clock: bool, cuda: bool) -> None:
        self.wall_clock = wall_clock
        self.cuda = cuda
        self.tracer: TraceRecorder | NullRecorder = NullRecorder()
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        category = _TRACE_CATEGORIES.get(name, "compute")
        if not self.wall_clock:
            with self.tracer.span(name, category):
                yield
            return
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with self.tracer.span(name, category):
            yield
            if self.cuda:
                torch.cuda.synchronize()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start


class StepReport(StepObserver):
    """Every `steps_per_print` steps, rank 0 logs the step, skipped steps, learning rates,
    throughput (`timers.throughput`), loss scale (fp16), MoE imbalance, memory
    (`memory_breakdown`) and the mean phase times; after the first step, the memory held."""

    def __init__(self, config: Any, clock: PhaseClock) -> None:
        self.every = config.steps_per_print
        self.throughput = config.timers.throughput
        self.memory = config.memory_breakdown
        self.clock = clock
        self.last_clock: float | None = None

    def after_step(self, engine: Any) -> None:
        if engine.global_steps == 1:
            logger.info(
                "model state held per rank after the first step: %s",
                _sizes(engine.memory_breakdown()),
            )
        every = self.every
        if not every or engine.global_steps % every or engine.global_rank != 0:
            return
        lr = ", ".join(f"{v:.4e}" for v in engine.get_lr())
        line = f"step={engine.global_steps}, skipped={engine.skipped_steps}, lr=[{lr}]"
        if self.throughput.enabled:  # DeepSpeed's throughput timer: samples per second since last
            if self.throughput.synchronized and self.clock.cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self.last_clock is not None:
                rate = every * engine.train_batch_size() / (now - self.last_clock)
                line += f", samples/s={rate:.1f}"
            self.last_clock = now
        if engine.fp16_enabled():
            line += f", loss_scale={engine.loss_scale:g}"
        loads = [load["imbalance"] for load in engine.expert_load().values() if load]
        if loads:
            line += f", moe_imbalance_max={max(loads):.2f}"
        logger.info(line)
        if self.memory:
            logger.info("memory held: %s", _sizes(engine.memory_breakdown()))
        totals = self.clock.totals
        if totals:
            times = " | ".join(f"{k}: {v * 1000 / every:.2f} ms" for k, v in totals.items())
            logger.info("time per step (mean of %d): %s", every, times)
            totals.clear()


class CommSummary(StepObserver):
    """With the comms logger on: the step's collectives as `engine.comm_summary`."""

    def __init__(self, comms_logger: Any) -> None:
        self.comms_logger = comms_logger

    def after_step(self, engine: Any) -> None:
        engine.comm_summary = self.comms_logger.step_summary()


class MonitorWriter(StepObserver):
    """The step's metrics to the configured monitors (rank 0 writes); the loss is the mean over
    the accumulation window, kept on the device until the step."""

    def __init__(self, monitor: MonitorMaster) -> None:
        self.monitor = monitor
        self.window_loss: torch.Tensor | None = None
        self.last_clock: float | None = None

    def after_backward(self, engine: Any, loss: torch.Tensor) -> None:
        part = loss.detach().float()
        self.window_loss = part if self.window_loss is None else self.window_loss + part

    def after_step(self, engine: Any) -> None:
        now = time.perf_counter()
        rate = (
            engine.train_batch_size() / (now - self.last_clock)
            if self.last_clock is not None
            else None
        )
        self.last_clock = now
        loads = {n: load for n, load in engine.expert_load().items() if load}
        events = training_events(
            engine.global_steps,
            engine.global_samples,
            loss=self.window_loss,
            lr=engine.get_lr()[0] if engine.basic_optimizer is not None else None,
            loss_scale=engine.loss_scale if engine.fp16_enabled() else None,
            grad_norm=engine.get_global_grad_norm(),
            samples_per_sec=rate,
            memory=engine.memory_breakdown(),
            expert_load=loads or None,
            comm=engine.comm_summary,
        )
        self.monitor.write_events(events)
        self.window_loss = None

    def close(self) -> None:
        self.monitor.close()


class UnusedCheckpointing(StepObserver):
    """After the first step, warn when the config asked for activation checkpointing settings
    (`asked_by`: the section or key that did) but the model never called the checkpoint
    function (`calls` counts its calls)."""

    def __init__(
        self, calls: Callable[[], int], asked_by: str = "activation_checkpointing"
    ) -> None:
        self.calls = calls
        self.asked_by = asked_by
        self.at_start = calls()

    def after_step(self, engine: Any) -> None:
        if engine.global_steps == 1 and self.calls() == self.at_start:
            logger.warning(
                f"the config sets '{self.asked_by}', but the model never called "
                "shardspeed.checkpointing.checkpoint (deepspeed.checkpointing.checkpoint), nor "
                "Hugging Face gradient checkpointing enabled before initialize: nothing was "
                "checkpointed"
            )
