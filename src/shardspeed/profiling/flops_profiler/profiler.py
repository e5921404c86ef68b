"""DeepSpeed's flops profiler (`deepspeed.profiling.flops_profiler`) on torch's own FLOP counter.

DeepSpeed swaps `torch.nn.functional` and a few tensor methods for counting wrappers while it
profiles. Here `torch.utils.flop_counter.FlopCounterMode` counts instead: a dispatcher-level mode
that sees every matmul, convolution and attention kernel whatever Python called it (a custom
module's `x @ w`, `torch.einsum`, SDPA, an already imported `F.linear`), in forward and backward,
and whose module tracker attributes each forward FLOP to the modules running it.

FLOP conventions (see docs/profiling.md):

- a multiply-add is 2 FLOPs = 1 MAC, as in DeepSpeed: (m x k) @ (k x n) is 2mnk FLOPs, so
  `nn.Linear` costs 2 * rows * in * out. Bias adds are not counted (torch's `addmm` formula and
  DeepSpeed's `F.linear` formula both leave them out);
- attention is q @ k^T plus scores @ v over every (batch, head): 2 * b * h * s_q * s_k * (d + d_v),
  with no discount for a causal mask (as DeepSpeed); its fused backward is torch's
  2 * b * h * s_q * s_k * (3d + 2d_v) (the scores are recomputed);
- only those matmul-like ops are counted, so MACs = FLOPs / 2 exactly. DeepSpeed also adds a few
  FLOPs per element for norms, activations, softmax and `torch.add`/`torch.mul` (with 0 MACs): its
  MACs match ours, its FLOPs are a little higher.

The profiled window runs from `start_profile()` to `stop_profile()`; FLOPs counted while autograd
runs a backward graph (which includes an activation-checkpointing recompute) are backward FLOPs.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from torch.utils.hooks import RemovableHandle

__all__ = [
    "PEAK_FLOPS_ENV",
    "FlopsProfiler",
    "ModuleProfile",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]

PEAK_FLOPS_ENV = "SHARDSPEED_PEAK_FLOPS"
DEFAULT_PRECISION = 2

_FORWARD = "forward"
_BACKWARD = "backward"
_EVERYWHERE = "Global"  # FlopCounterMode's name for all it counted, inside modules or not
_LINE = "{:<72} {}"
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""), (1e-3, "m"), (1e-6, "u"))


def _in_backward() -> bool:
    """Whether autograd is running a backward graph (ModuleTracker.is_bw's test)."""
    return torch._C._current_graph_task_id() != -1


@cache
def _warm_up_dispatch() -> None:
    """Run one op under a counter: the first in a process pays one-off imports (about a second),
    which must not land in the first profile's latency."""
    with FlopCounterMode(display=False):
        torch.ones(1).mul(2)


def _attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_, **__) -> int:
    """CPU flash attention, which torch's registry lacks: q @ k^T and scores @ v."""
    pairs = math.prod(query.shape[:-2])
    s_q, d = query.shape[-2:]
    return 2 * pairs * s_q * key.shape[-2] * (d + value.shape[-1])


def _attention_backward_flops(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_, **__
) -> int:
    """Its backward, counted as torch counts the CUDA kernels' (scores recomputed, then the
    gradients of scores, v, q and k)."""
    pairs = math.prod(query.shape[:-2])
    s_q, d = query.shape[-2:]
    return 2 * pairs * s_q * key.shape[-2] * (3 * d + 2 * value.shape[-1])


_EXTRA_FORMULAS: dict[Any, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


def _numel(param: torch.Tensor) -> int:
    """A parameter's full size, also when ZeRO-3 keeps only a shard of it (`ds_numel`)."""
    return int(getattr(param, "ds_numel", param.numel()))


def _peak_flops(peak_flops: float | None) -> float | None:
    """The device's peak FLOP/s: the argument, else `SHARDSPEED_PEAK_FLOPS`, else unknown."""
    source = "peak_flops"
    if peak_flops is None:
        text = os.environ.get(PEAK_FLOPS_ENV, "").strip()
        if not text:
            return None
        source = PEAK_FLOPS_ENV
        try:
            peak_flops = float(text)
        except ValueError:
            raise ValueError(
                f"{PEAK_FLOPS_ENV}={text!r} is not a FLOP/s number (e.g. 989e12)"
            ) from None
    if not peak_flops > 0 or math.isinf(peak_flops):
        raise ValueError(f"{source} must be a positive FLOP/s number, got {peak_flops!r}")
    return peak_flops


def number_to_string(
    num: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """`num` with a metric prefix (T, G, M, K, m, u), DeepSpeed's format: 1.5e9 -> '1.5 G'."""
    if units is None:
        magnitude, units = next(((m, u) for m, u in _PREFIXES if num >= m), _PREFIXES[-1])
        if num == 0:
            magnitude, units = 1.0, ""
    else:
        magnitude = next((m for m, u in _PREFIXES if u == units), 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(
    macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(
    flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """FLOP/s (DeepSpeed writes them 'FLOPS')."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(
    params: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """Parameter counts say B (billions) where the other numbers say G."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(
    seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


def _percent(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, DEFAULT_PRECISION) if whole else 0:g}%"


@dataclass(frozen=True)
class ModuleProfile:
    """One module's forward in the profiled window: its parameters, the FLOPs run inside it (its
    submodules' included) and its latency, in seconds."""

    name: str
    params: int
    flops: int
    duration: float

    @property
    def macs(self) -> int:
        return self.flops // 2

    @property
    def flops_per_second(self) -> float:
        return self.flops / self.duration if self.duration else 0.0


class FlopsProfiler:
    """Parameters, FLOPs, MACs and forward latency of each module of `model` over one window.

    Standalone, as with DeepSpeed::

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(batch)
        loss.backward()  # optional: with it inside the window, backward FLOPs are measured
        prof.stop_profile()
        prof.print_model_profile(profile_step=step)
        prof.end_profile()

    `recompute_fwd_factor` (the share of the forward that activation checkpointing recomputes)
    enters only the estimate (3 + factor) * forward used when the backward was not measured; a
    measured backward already contains the recompute. `peak_flops` (or `SHARDSPEED_PEAK_FLOPS`)
    turns achieved FLOP/s into MFU. `ds_engine`, when given, supplies the header's sizes:
    `world_size`, `dp_world_size`, `train_micro_batch_size_per_gpu()` and `mp_world_size`
    (1 when absent).
    """

    def __init__(
        self,
        model: nn.Module,
        ds_engine: Any = None,
        recompute_fwd_factor: float = 0.0,
        peak_flops: float | None = None,
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.peak_flops = _peak_flops(peak_flops)
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._handles: list[RemovableHandle] = []
        self._ignored: set[nn.Module] = set()
        self._on_cuda = False
        self._root_name: str | None = None
        self._parents_in_root: set[str] = set()
        self.reset_profile()

    # -- the window ---------------------------------------------------------------------------

    def start_profile(self, ignore_list: Iterable[type[nn.Module]] | None = None) -> None:
        """Count and time from here. Modules of the types in `ignore_list` (and what they contain)
        are not profiled on their own, as in DeepSpeed: no timing, no line of their own; their
        FLOPs count in their parent's."""
        self.stop_profile()
        _warm_up_dispatch()
        self.reset_profile()
        ignored_types = tuple(ignore_list or ())
        self._ignored = {
            inner
            for module in self.model.modules()
            if isinstance(module, ignored_types)
            for inner in module.modules()
        }
        self._on_cuda = any(t.is_cuda for t in (*self.model.parameters(), *self.model.buffers()))
        for module in self.model.modules():
            if module not in self._ignored:
                self._handles.append(module.register_forward_pre_hook(self._start_timer))
                self._handles.append(module.register_forward_hook(self._stop_timer))
        self._handles.append(self.model.register_forward_pre_hook(self._root_entered))
        self._handles.append(self.model.register_forward_hook(self._root_left))
        formulas = {**flop_registry, **_EXTRA_FORMULAS}
        self._counter = FlopCounterMode(
            display=False,
            custom_mapping={op: self._phase_aware(formula) for op, formula in formulas.items()},
        )
        self._root_name = None
        self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting and timing; the numbers stay readable until `end_profile()`. Called right
        after the forward it measures the forward only (DeepSpeed's engine); called after
        `backward()` it also measures the backward and its latency (from the model's forward
        end to here)."""
        if self._counter is None:
            return
        self._synchronize()
        if self._seen_backward and self._fwd_end is not None:
            self._bwd_duration = time.perf_counter() - self._fwd_end
        self._flush()
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def end_profile(self) -> None:
        """Stop and forget the profile."""
        if not self.started:
            return
        self.stop_profile()
        self.reset_profile()
        self._ignored = set()
        self.started = False

    def reset_profile(self) -> None:
        """Zero the counts and timings (the window, if open, stays open)."""
        self._flops: dict[str, Counter[str]] = {_FORWARD: Counter(), _BACKWARD: Counter()}
        self._phase = _FORWARD
        self._seen_backward = False
        self._last_counts = self._counter_totals()
        self._durations: dict[nn.Module, float] = {}
        self._starts: dict[nn.Module, list[float]] = {}
        self._fwd_end: float | None = None
        self._bwd_duration: float | None = None

    # -- counting and timing ------------------------------------------------------------------

    def _phase_aware(self, formula: Callable[..., int]) -> Callable[..., int]:
        """`formula`, noting first whether forward or backward runs the op being counted."""

        def count(*args: Any, **kwargs: Any) -> int:
            phase = _BACKWARD if _in_backward() else _FORWARD
            if phase != self._phase:
                self._flush()
                self._phase = phase
                self._seen_backward |= phase == _BACKWARD
            return formula(*args, **kwargs)

        count._get_raw = True  # type: ignore[attr-defined]  # the counter passes the tensors on
        return count

    def _counter_totals(self) -> dict[str, int]:
        if self._counter is None:
            return {}
        return {name: sum(ops.values()) for name, ops in self._counter.get_flop_counts().items()}

    def _flush(self) -> None:
        """Credit what the counter added since the last flush to the phase that ran it."""
        totals = self._counter_totals()
        for name, flops in totals.items():
            self._flops[self._phase][name] += flops - self._last_counts.get(name, 0)
        self._last_counts = totals

    def _synchronize(self) -> None:
        if self._on_cuda:
            torch.cuda.synchronize()

    def _start_timer(self, module: nn.Module, _args: Any) -> None:
        if _in_backward():  # an activation-checkpointing recompute is backward time
            return
        self._synchronize()
        self._starts.setdefault(module, []).append(time.perf_counter())

    def _stop_timer(self, module: nn.Module, _args: Any, _output: Any) -> None:
        starts = self._starts.get(module)
        if not starts or _in_backward():
            return
        self._synchronize()
        elapsed = time.perf_counter() - starts.pop()
        self._durations[module] = self._durations.get(module, 0.0) + elapsed

    def _root_entered(self, _module: nn.Module, _args: Any) -> None:
        # Global hooks (the counter's module tracker) run before a module's own ones, so the
        # model's name in the tracker is among the parents now and gone in `_root_left`.
        if self._counter is not None and not _in_backward():
            self._parents_in_root = set(self._counter.mod_tracker.parents)

    def _root_left(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._counter is None or _in_backward():
            return
        left = self._parents_in_root - self._counter.mod_tracker.parents
        if self._root_name is None and len(left) == 1:
            self._root_name = left.pop()
        self._synchronize()
        self._fwd_end = time.perf_counter()

    # -- reading the profile ------------------------------------------------------------------

    def _tracker_keys(self) -> dict[nn.Module, list[str]]:
        """The counter's names for each module (a shared module has several paths, one of which
        the tracker uses). The tracker names modules by path from the first module it saw enter:
        the model itself (its class name) or a wrapper around it (`_root_left` learnt the name)."""
        if self._counter is not None:
            self._flush()
        root = self._root_name or type(self.model).__name__
        keys: dict[nn.Module, list[str]] = {}
        for path, module in self.model.named_modules(remove_duplicate=False):
            keys.setdefault(module, []).append(f"{root}.{path}" if path else root)
        return keys

    def _profiles(self) -> dict[nn.Module, ModuleProfile]:
        """Every profiled module's numbers, in `named_modules()` order."""
        keys = self._tracker_keys()

        @cache
        def duration(module: nn.Module) -> float:
            # A container that is never called (ModuleList) takes its children's time.
            own = self._durations.get(module, 0.0)
            return own or sum(duration(c) for c in module.children() if c not in self._ignored)

        return {
            module: ModuleProfile(
                name=path,
                params=sum(_numel(p) for p in module.parameters()),
                flops=sum(self._flops[_FORWARD][key] for key in keys[module]),
                duration=duration(module),
            )
            for path, module in self.model.named_modules()
            if module not in self._ignored
        }

    def module_profile(self, module: nn.Module) -> ModuleProfile:
        """The numbers of one (not ignored) submodule of the model."""
        try:
            return self._profiles()[module]
        except KeyError:
            raise ValueError(
                f"{type(module).__name__} is not a profiled module of the model"
            ) from None

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the model (DeepSpeed's number)."""
        flops = self.module_profile(self.model).flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self.module_profile(self.model).macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self.module_profile(self.model).params
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """The model's forward latency, in seconds."""
        seconds = self.module_profile(self.model).duration
        return duration_to_string(seconds) if as_string else seconds

    def get_total_bwd_flops(self, as_string: bool = False) -> int | str | None:
        """All the backward FLOPs of the window (activation-checkpointing recompute included),
        None unless a backward ran in it. Not the model's share: torch's module tracker misses
        the backward of a model that returns the loss itself, and of some modules."""
        if not self._seen_backward:
            return None
        if self._counter is not None:
            self._flush()
        flops = self._flops[_BACKWARD][_EVERYWHERE]
        return number_to_string(flops) if as_string else flops

    def get_total_bwd_duration(self, as_string: bool = False) -> float | str | None:
        """From the end of the model's forward to `stop_profile()`, when the window held a backward."""
        seconds = self._bwd_duration
        return duration_to_string(seconds) if as_string and seconds is not None else seconds

    def get_total_fwd_bwd_flops(self, as_string: bool = False) -> int | str:
        """Forward plus backward FLOPs: measured, or estimated as DeepSpeed does (the backward
        twice the forward, plus `recompute_fwd_factor` times the forward)."""
        flops = self._fwd_bwd_flops(self.get_total_flops(), self.get_total_bwd_flops())
        return number_to_string(flops) if as_string else flops

    def _fwd_bwd_flops(self, fwd: int, bwd: int | None) -> int:
        if bwd is not None:
            return fwd + bwd
        return round((3 + self.recompute_fwd_factor) * fwd)

    # -- printing -----------------------------------------------------------------------------

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """Print (or write to `output_file`) the summary, the top `top_modules` module classes per
        depth and, if `detailed`, the module tree; both stop at `module_depth` (-1: all)."""
        if not self.started:
            return
        profiles = self._profiles()
        lines = [
            "",
            "-------------------------- shardspeed Flops Profiler --------------------------",
            f"Profile Summary at step {profile_step}:",
            "Notations: params (parameters), MACs (multiply-accumulates), flops (floating-point",
            "operations, 2 per MAC: matmuls, convolutions and attention, as counted by",
            "torch.utils.flop_counter), FLOPS (flops per second), MFU (FLOPS / device peak)",
            "",
            *self._summary(profiles[self.model], self.get_total_bwd_flops()),
            "",
            "----------------------------- Aggregated Profile per GPU -----------------------------",
            *self._aggregated(profiles, module_depth, top_modules),
        ]
        if detailed:
            lines += [
                "",
                "------------------------------ Detailed Profile per GPU ------------------------------",
                "Each module profile is listed after its name in the following order:",
                "params, percentage of total params, MACs, percentage of total MACs, fwd latency,",
                "percentage of total fwd latency, fwd FLOPS",
                "Note: a parent's MACs and latency exceed its children's by what it computes itself",
                "(and by ignored children); latency includes the profiler's per-op overhead.",
                "",
                *self._tree(profiles, module_depth),
            ]
        lines.append(
            "------------------------------------------------------------------------------"
        )
        text = "\n".join(lines)
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
        else:
            print(text)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the aggregated part of the profile only."""
        if self.started:
            print("\n".join(self._aggregated(self._profiles(), module_depth, top_modules)))

    def _summary(self, total: ModuleProfile, bwd_flops: int | None) -> list[str]:
        engine = self.ds_engine
        mp_size = getattr(engine, "mp_world_size", 1) if engine is not None else 1
        lines = []
        if engine is not None:
            lines += [
                _LINE.format("world size:", engine.world_size),
                _LINE.format("data parallel size:", engine.dp_world_size),
                _LINE.format("model parallel size:", mp_size),
                _LINE.format("batch size per GPU:", engine.train_micro_batch_size_per_gpu()),
            ]
        fwd_rate = total.flops_per_second
        lines += [
            _LINE.format("params per GPU:", params_to_string(total.params)),
            _LINE.format(
                "params of model = params per GPU * mp_size:",
                params_to_string(total.params * mp_size),
            ),
            _LINE.format("fwd MACs per GPU:", macs_to_string(total.macs)),
            _LINE.format("fwd flops per GPU:", number_to_string(total.flops)),
            _LINE.format(
                "fwd flops of model = fwd flops per GPU * mp_size:",
                number_to_string(total.flops * mp_size),
            ),
            _LINE.format("fwd latency:", duration_to_string(total.duration)),
            _LINE.format(
                "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:", flops_to_string(fwd_rate)
            ),
            _LINE.format("fwd MFU = fwd FLOPS per GPU / peak FLOPS:", self._mfu(fwd_rate)),
        ]
        fwd_bwd = self._fwd_bwd_flops(total.flops, bwd_flops)
        if bwd_flops is None:
            factor = 3 + self.recompute_fwd_factor
            label = f"fwd+bwd flops per GPU = {factor:g} * fwd flops per GPU (estimate):"
            return [*lines, _LINE.format(label, number_to_string(fwd_bwd))]
        lines += [
            _LINE.format("bwd MACs per GPU (measured):", macs_to_string(bwd_flops // 2)),
            _LINE.format("bwd flops per GPU (measured):", number_to_string(bwd_flops)),
            _LINE.format("fwd+bwd flops per GPU:", number_to_string(fwd_bwd)),
        ]
        if not self._bwd_duration:  # printed before stop_profile()
            return lines
        fwd_bwd_rate = fwd_bwd / (total.duration + self._bwd_duration)
        return [
            *lines,
            _LINE.format("bwd latency:", duration_to_string(self._bwd_duration)),
            _LINE.format(
                "bwd FLOPS per GPU = bwd flops per GPU / bwd latency:",
                flops_to_string(bwd_flops / self._bwd_duration),
            ),
            _LINE.format(
                "fwd+bwd FLOPS per GPU = fwd+bwd flops per GPU / (fwd+bwd latency):",
                flops_to_string(fwd_bwd_rate),
            ),
            _LINE.format(
                "fwd+bwd MFU = fwd+bwd FLOPS per GPU / peak FLOPS:", self._mfu(fwd_bwd_rate)
            ),
        ]

    def _mfu(self, flops_per_second: float) -> str:
        if self.peak_flops is None:
            return f"n/a (peak unknown: pass peak_flops or set {PEAK_FLOPS_ENV})"
        return (
            f"{100 * flops_per_second / self.peak_flops:.2f}% of {flops_to_string(self.peak_flops)}"
        )

    def _aggregated(
        self, profiles: Mapping[nn.Module, ModuleProfile], module_depth: int, top_modules: int
    ) -> list[str]:
        """DeepSpeed's aggregated profile: per depth, module classes summed, top ones by each
        of params, MACs and latency."""
        by_depth: list[dict[str, list[float]]] = []

        def walk(module: nn.Module, depth: int) -> None:
            if module in self._ignored:
                return
            if depth == len(by_depth):
                by_depth.append({})
            profile = profiles[module]
            sums = by_depth[depth].setdefault(type(module).__name__, [0, 0, 0.0])
            sums[0] += profile.params
            sums[1] += profile.macs
            sums[2] += profile.duration
            for child in module.children():
                walk(child, depth + 1)

        walk(self.model, 0)
        last = len(by_depth) - 1 if module_depth < 0 else min(module_depth, len(by_depth) - 1)
        lines = [
            f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"
        ]
        for depth in range(last + 1):
            lines.append(f"depth {depth}:")
            for label, index, fmt in (
                ("params     ", 0, params_to_string),
                ("MACs       ", 1, macs_to_string),
                ("fwd latency", 2, duration_to_string),
            ):
                ranked = sorted(
                    by_depth[depth].items(), key=lambda item: item[1][index], reverse=True
                )
                top = {name: fmt(sums[index]) for name, sums in ranked[:top_modules]}
                lines.append(f"    {label} - {top}")
        return lines

    def _tree(self, profiles: Mapping[nn.Module, ModuleProfile], module_depth: int) -> list[str]:
        total = profiles[self.model]
        lines: list[str] = []

        def walk(module: nn.Module, label: str, depth: int) -> None:
            if 0 <= module_depth < depth:
                return
            indent = "  " * depth
            if module in self._ignored:
                lines.append(f"{indent}{label}: ignored (counted in its parent)")
                return
            p = profiles[module]
            items = [
                f"{params_to_string(p.params)} = {_percent(p.params, total.params)} Params",
                f"{macs_to_string(p.macs)} = {_percent(p.macs, total.macs)} MACs",
                f"{duration_to_string(p.duration)} = {_percent(p.duration, total.duration)} latency",
                flops_to_string(p.flops_per_second),
            ]
            if module.extra_repr():
                items.append(module.extra_repr())
            lines.append(f"{indent}{label}: {', '.join(items)}")
            for name, child in module.named_children():
                walk(child, f"({name}) {type(child).__name__}", depth + 1)

        walk(self.model, type(self.model).__name__, 0)
        return lines


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | os.PathLike[str] | None = None,
    ignore_modules: Iterable[type[nn.Module]] | None = None,
    mode: str = "forward",
    peak_flops: float | None = None,
) -> tuple[int | str, int | str, int | str]:
    """Forward FLOPs, MACs and parameters of `model` on one input (DeepSpeed's function).

    The input is a tensor of ones of `input_shape` (the parameters' dtype and device), else
    `args`/`kwargs`. `warm_up` unprofiled calls come first; `mode` 'generate' profiles
    `model.generate(...)` instead of `model(...)`. The model runs in eval mode (and goes back to
    train mode if it was in it).
    """
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"input_shape must be a non-empty tuple, got {input_shape!r}")
        param = next(model.parameters(), None)
        dtype = param.dtype if param is not None else None
        device = param.device if param is not None else None
        args = (torch.ones(input_shape, dtype=dtype, device=device),)
    kwargs = dict(kwargs or {})
    if not args and not kwargs:
        raise ValueError("give input_shape, or args and/or kwargs")
    run = model.generate if mode == "generate" else model
    was_training = model.training
    model.eval()
    prof = FlopsProfiler(model, peak_flops=peak_flops)
    try:
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            run(*args, **kwargs)
        finally:
            prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(
                profile_step=warm_up,
                module_depth=module_depth,
                top_modules=top_modules,
                detailed=detailed,
                output_file=output_file,
            )
    finally:
        prof.end_profile()
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
