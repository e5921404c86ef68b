"""What a training run measures for the autotuner (the metric contract in docs/autotuning.md).

With `autotuning.enabled` and `autotuning.metric_path` set, the engine times optimizer steps
`start_profile_step` to `end_profile_step`, measures what one forward keeps for backward and the
peak memory, and rank 0 writes the metric file; then every rank stops (the trial is over).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..common.observer import StepObserver
from ..zero.accounting import saved_activation_bytes


def _rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _rss_bytes()


class AutotuningMeter(StepObserver):
    """Step timing and memory for one autotuning trial (see the module docstring); the engine
    calls it around each forward and after each optimizer step."""

    def __init__(
        self,
        metric_path: str,
        start: int,
        end: int,
        train_batch_size: int,
        mp_size: int,
        device: torch.device,
    ) -> None:
        self.metric_path = metric_path
        self.start, self.end = start, end
        self.train_batch_size = train_batch_size
        self.mp_size = mp_size
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.baseline_rss = _current_rss_bytes()
        self.local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.first_forward: float | None = None
        self.window_start: float | None = None
        self.activation_bytes: int | None = None

    def wants_activations(self, global_steps: int) -> bool:
        """Measure this forward's saved activations: the first micro-step of step `start`."""
        return self.activation_bytes is None and global_steps + 1 == self.start

    @contextmanager
    def forward(self, engine: Any) -> Iterator[None]:
        """Around a forward: note the first one's time, and count saved activations when due."""
        if self.first_forward is None:
            self.first_forward = time.perf_counter()
        if not self.wants_activations(engine.global_steps):
            yield
            return
        if self.cuda:
            before = torch.cuda.memory_allocated()
            yield
            self.activation_bytes = torch.cuda.memory_allocated() - before
            return
        with saved_activation_bytes(engine.module) as total:
            yield
        self.activation_bytes = total[0]

    def after_step(self, engine: Any) -> None:
        """After optimizer step `global_steps`: time the window; at its end write and stop."""
        global_steps = engine.global_steps
        if global_steps not in (self.start - 1, self.end):
            return
        if self.cuda:
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        now = time.perf_counter()
        if global_steps == self.start - 1:
            self.window_start = now
            return
        start = self.window_start if self.window_start is not None else self.first_forward
        step_time = (now - start) / (self.end - self.start + 1)
        self._write(step_time, engine.module)
        if dist.is_initialized():
            dist.barrier()
        sys.exit(0)  # the trial has what it came for

    def _write(self, step_time: float, model: nn.Module) -> None:
        peak = torch.cuda.max_memory_reserved() if self.cuda else _rss_bytes() - self.baseline_rss
        peak_tensor = torch.tensor([float(peak)], device="cuda" if self.cuda else "cpu")
        if dist.is_initialized():
            dist.all_reduce(peak_tensor, op=dist.ReduceOp.MAX)
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        if self.cuda:
            device_memory = torch.cuda.get_device_properties(
                torch.cuda.current_device()
            ).total_memory
        else:
            device_memory = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            device_memory //= max(1, self.local_ranks)
        num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        metrics: dict[str, Any] = {
            "throughput": self.train_batch_size / step_time,
            "latency": step_time,
            "step_time_s": step_time,
            "flops": None,
            "peak_memory_bytes": int(peak_tensor.item()),
            "activation_memory_bytes": self.activation_bytes,
            "device_memory_bytes": int(device_memory),
            "num_params": int(num_params) * self.mp_size,
        }
        partial = f"{self.metric_path}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.metric_path)), exist_ok=True)
        with open(partial, "w") as f:
            json.dump(metrics, f)
        os.replace(partial, self.metric_path)
