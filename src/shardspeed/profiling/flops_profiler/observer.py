"""The `flops_profiler` config section at work in the engine: profile one training step."""

from __future__ import annotations

import contextlib
from typing import Any

from ...common.observer import StepObserver
from .profiler import FlopsProfiler


class ProfiledStep(StepObserver):
    """Profiles step `profile_step` (its first micro-step's forward and backward) with
    `profiler` and prints the report at the end of that step, as DeepSpeed's engine does."""

    def __init__(self, profiler: FlopsProfiler, section: Any) -> None:
        self.profiler = profiler
        self.section = section

    def forward(self, engine: Any) -> contextlib.AbstractContextManager[None]:
        if not self.profiler.started and engine.global_steps == self.section.profile_step:
            self.profiler.start_profile()
        return contextlib.nullcontext()

    def after_backward(self, engine: Any, loss: Any) -> None:
        if self.profiler.started:
            self.profiler.stop_profile()  # idempotent: later micro-steps of the step are not counted

    def after_step(self, engine: Any) -> None:
        if not self.profiler.started:
            return
        section = self.section
        self.profiler.print_model_profile(
            profile_step=section.profile_step,
            module_depth=section.module_depth,
            top_modules=section.top_modules,
            detailed=section.detailed,
            output_file=section.output_file,
        )
        self.profiler.end_profile()
