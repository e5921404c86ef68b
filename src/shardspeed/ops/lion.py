"""`deepspeed.ops.lion` drop-ins: FusedLion and DeepSpeedCPULion, DeepSpeed's signatures on
shardspeed's `Lion` (any device, no C++ extension)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardspeed.ops.adam import check_fp32_states
from shardspeed.optim.lion import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(Lion):
    """DeepSpeed's FusedLion constructor; `set_grad_none` is the default of `zero_grad`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPULion(Lion):
    """DeepSpeed's DeepSpeedCPULion constructor. The momentum has each parameter's dtype, so
    `fp32_optimizer_states=True` (the default) needs fp32 parameters, as ZeRO-Offload's masters are."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        check_fp32_states("DeepSpeedCPULion", self, fp32_optimizer_states)
        self.fp32_optimizer_states = fp32_optimizer_states
