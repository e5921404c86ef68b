"""The hook points at which the training engine calls what watches it.

Observers (the flops profiler, the autotuning meter, the monitors, the step report, hybrid
generation's copy) are built once from the config and called by the engine at these fixed points
only, in the order they were built. Each hook does nothing unless a subclass overrides it; an
observer reads what it needs from the engine it is given.
"""

from __future__ import annotations

import contextlib
from typing import Any


class StepObserver:
    """Base of everything the engine calls at its fixed points (see the module docstring)."""

    def forward(self, engine: Any) -> contextlib.AbstractContextManager[None]:
        """A context around the module's forward call."""
        return contextlib.nullcontext()

    def after_backward(self, engine: Any, loss: Any) -> None:
        """After a micro-step's backward; `loss` is the loss as backpropagated (divided by the
        accumulation steps), before the loss scale."""

    def after_step(self, engine: Any) -> None:
        """After every optimizer step at an accumulation boundary, applied or skipped; the
        engine's counters already count it."""

    def after_load(self, engine: Any) -> None:
        """After a checkpoint was loaded into the engine (the weights changed)."""

    def close(self) -> None:
        """Release what the observer holds outside Python's objects (files, runs)."""


class EngineComponent(StepObserver):
    """A part of the engine built for one feature (the pipeline schedule, hybrid generation):
    an observer that also answers the names in `surface` on the engine (`engine.train_batch`,
    `engine.generate`, ...), and that may replace some of the engine's own calls."""

    surface: tuple[str, ...] = ()

    def refusal(self, call: str) -> Exception | None:
        """The error to raise when the user calls the engine's `call` ("forward", "backward",
        "step", "save_16bit_model") which this component replaces; None lets the call run."""
        return None
