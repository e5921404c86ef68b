"""Stage 0: every rank holds everything; gradients are averaged, then each rank steps the same update.

`FlatOptimizer` wraps any torch optimizer. It lays the trainable parameters out in one flat buffer
of the model's dtype and their gradients in one flat buffer, keeps fp32 master weights when the
model is fp16 or bf16, averages gradients with a `GradientReducer`, and at the accumulation
boundary unscales, checks for overflow, clips and steps, all on whole buffers. The torch optimizer
still sees one tensor per parameter (views into the master buffer), so per-tensor algorithms such
as LAMB keep their meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import broadcast
from ..precision import LossScaler, StaticLossScaler
from .flat import FlatLayout
from .reducer import GradientReducer


class NonFiniteGradientError(FloatingPointError):
    """A gradient became inf or NaN where no loss scale can recover (fp32, or bf16 by default)."""


@dataclass(frozen=True)
class ReduceOptions:
    """How gradients are averaged: bucket size in elements, dtype on the wire, and scaling."""

    bucket_elements: int
    comm_dtype: torch.dtype | None = None
    prescale_gradients: bool = False
    predivide_factor: float = 1.0
    overlap: bool = True


class FlatOptimizer:
    """The engine's optimizer at stage 0 (see module docstring). `step()` returns whether it applied."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_scaler: LossScaler | None = None,
        gradient_clipping: float = 0.0,
        skip_nonfinite: bool = False,
        dp_group: Any = None,
        dp_world_size: int = 1,
        reduce: ReduceOptions,
    ) -> None:
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler or StaticLossScaler(1.0)
        self.gradient_clipping = gradient_clipping
        self.skip_nonfinite = skip_nonfinite
        self.global_grad_norm: float | None = None

        params = _managed_parameters(module, optimizer)
        names = {p: n for n, p in module.named_parameters()}
        self.param_names = [names[p] for p in params]
        self.params = params
        model_dtype = params[0].dtype
        device = params[0].device
        if any(p.dtype != model_dtype or p.device != device for p in params):
            raise ValueError("all trainable parameters must share one dtype and device")
        self.layout = FlatLayout.of(params)

        # Model weights: one buffer, every parameter a view into it, identical on every rank.
        self.model_flat = self.layout.flatten(params, model_dtype, device)
        if dp_world_size > 1:
            broadcast(self.model_flat, src=_global_rank_of_group_root(dp_group), group=dp_group)
        for p, view in zip(params, self.layout.views(self.model_flat)):
            p.data = view

        # Gradients accumulate in fp32 unless the model is fp16 (DeepSpeed keeps fp16 gradients).
        grad_dtype = torch.float16 if model_dtype == torch.float16 else torch.float32
        self.grad_flat = torch.zeros(self.layout.total, dtype=grad_dtype, device=device)
        self._grad_views = self.layout.views(self.grad_flat)
        self._grads_alias_params = grad_dtype == model_dtype

        # Master weights: the model itself in fp32, else an fp32 copy the optimizer steps on.
        if model_dtype == torch.float32:
            self.master_flat = self.model_flat
            self.master_params = params
            self.master_grad_flat = self.grad_flat
        else:
            self.master_flat = self.model_flat.float()
            self.master_params = [
                nn.Parameter(view) for view in self.layout.views(self.master_flat)
            ]
            self.master_grad_flat = (
                self.grad_flat
                if grad_dtype == torch.float32
                else torch.zeros_like(self.master_flat)
            )
            _swap_optimizer_params(optimizer, dict(zip(params, self.master_params)))
        for master, view in zip(self.master_params, self.layout.views(self.master_grad_flat)):
            master.grad = view
        if self._grads_alias_params:
            for p, view in zip(params, self._grad_views):
                p.grad = view

        self.reducer: GradientReducer | None = None
        if dp_world_size > 1:
            ranges = [(o, o + n) for o, n in zip(self.layout.offsets, self.layout.numels)]
            pre, post = _reduce_scales(reduce, dp_world_size)
            self.reducer = GradientReducer(
                self.grad_flat,
                ranges,
                reduce.bucket_elements,
                dp_group,
                reduce.comm_dtype or grad_dtype,
                pre,
                post,
                overlap=reduce.overlap,
            )
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)
        ]

    # -- backward ---------------------------------------------------------------------------------

    def _make_hook(self, index: int):
        view = self._grad_views[index]

        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad.data_ptr() != view.data_ptr():
                # Mixed precision, or someone set .grad to None: fold it into the flat buffer.
                view.add_(grad)
                param.grad = view if self._grads_alias_params else None
            if self.reducer is not None:
                self.reducer.mark_ready(index)

        return hook

    def start_micro_step(self, reduce_gradients: bool) -> None:
        """Say before backward whether this micro-step's gradients are to be averaged."""
        if self.reducer is not None:
            self.reducer.reset()
            self.reducer.active = reduce_gradients

    def finish_reduction(self) -> None:
        """Complete the averaging that backward started (idempotent)."""
        if self.reducer is not None:
            self.reducer.finish()

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    # -- step -----------------------------------------------------------------------------------

    def step(self) -> bool:
        """Unscale, check, clip and apply the averaged gradients; False when the step was skipped."""
        self.finish_reduction()
        grads = self.master_grad_flat
        if grads is not self.grad_flat:
            grads.copy_(self.grad_flat)
        scale = self.loss_scaler.loss_scale
        # The one host sync of a step: whether to apply it depends on this norm.
        scaled_norm = torch.linalg.vector_norm(grads).item()
        overflow = not math.isfinite(scaled_norm)
        if overflow and not (self.loss_scaler.dynamic or self.skip_nonfinite):
            self.global_grad_norm = scaled_norm
            raise NonFiniteGradientError(self._nonfinite_message())
        if overflow:
            self.global_grad_norm = scaled_norm
            self.loss_scaler.update(True)
            self.zero_grad()
            return False
        norm = scaled_norm / scale
        self.global_grad_norm = norm
        factor = 1.0 / scale
        if self.gradient_clipping > 0:
            clip_coef = self.gradient_clipping / (norm + 1e-6)
            if clip_coef < 1.0:
                factor *= clip_coef
        if factor != 1.0:
            grads.mul_(factor)
        self.optimizer.step()
        if self.master_flat is not self.model_flat:
            self.model_flat.copy_(self.master_flat)
        self.loss_scaler.update(False)
        self.zero_grad()
        return True

    def _nonfinite_message(self) -> str:
        for name, view in zip(self.param_names, self._grad_views):
            if not torch.isfinite(view).all():
                return (
                    f"non-finite gradient (inf or NaN) in parameter '{name}'; the weights were not "
                    "updated. fp32 and bf16 have no loss scale to recover with: check the data, the "
                    "loss and the learning rate (or set bf16.check_grad_overflow to skip such steps)"
                )
        return "non-finite gradient norm; the weights were not updated"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (they stay allocated: parameters keep views into them)."""
        del set_to_none
        self.grad_flat.zero_()
        if self.master_grad_flat is not self.grad_flat:
            self.master_grad_flat.zero_()

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
        return f"FlatOptimizer({type(self.optimizer).__name__}, {self.layout.total} elements)"


def _managed_parameters(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters in reverse model order (roughly the order backward produces them)."""
    # Frozen parameters get no gradient; the optimizer may list them but they stay out of the buffers.
    in_optimizer = {
        p for group in optimizer.param_groups for p in group["params"] if p.requires_grad
    }
    ordered = [p for p in module.parameters() if p in in_optimizer]
    if len(ordered) != len(in_optimizer):
        raise ValueError(
            "the optimizer holds parameters that are not in the model passed to initialize(); "
            "build the optimizer from model.parameters()"
        )
    if not ordered:
        raise ValueError("the optimizer has no parameters")
    return list(reversed(ordered))


def _swap_optimizer_params(optimizer: torch.optim.Optimizer, mapping: dict) -> None:
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(p, p) for p in group["params"]]
    for old, new in mapping.items():
        if old in optimizer.state:
            optimizer.state[new] = optimizer.state.pop(old)


def _reduce_scales(reduce: ReduceOptions, world: int) -> tuple[float, float]:
    """(before, after) factors of the sum, following DeepSpeed's prescale/predivide rules."""
    if reduce.prescale_gradients:
        return 1.0 / world, 1.0
    return 1.0 / reduce.predivide_factor, reduce.predivide_factor / world


def _global_rank_of_group_root(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)
