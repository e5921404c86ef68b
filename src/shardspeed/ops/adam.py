"""`deepspeed.ops.adam` drop-ins: FusedAdam and DeepSpeedCPUAdam as thin layers over torch's Adam."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _refuse(name: str, bias_correction: bool, amsgrad: bool) -> None:
    # DeepSpeed's kernels raise for AMSGrad; torch's Adam cannot skip bias correction.
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant.")
    if not bias_correction:
        raise ValueError(
            f"{name}: bias_correction=False is not supported (torch's Adam always applies it)"
        )


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam signature on `torch.optim.Adam`; `adam_w_mode` selects decoupled decay.

    `set_grad_none` sets the default of `zero_grad(set_to_none=...)`, as in DeepSpeed.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _refuse("FusedAdam", bias_correction, amsgrad)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adam_w_mode,
        )
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients; by default free them (set_grad_none) or zero them in place."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's DeepSpeedCPUAdam signature on `torch.optim.Adam` (any device, no C++ extension).

    torch keeps Adam's moments in each parameter's dtype, so `fp32_optimizer_states=True` (the
    default) needs fp32 parameters, which is what ZeRO-Offload's master weights are.
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _refuse("DeepSpeedCPUAdam", bias_correction, amsgrad)
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adamw_mode,
        )
        check_fp32_states("DeepSpeedCPUAdam", self, fp32_optimizer_states)
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states


def check_fp32_states(name: str, optimizer: torch.optim.Optimizer, fp32_states: bool) -> None:
    """torch keeps optimizer states in each parameter's dtype: fp32 states need fp32 parameters
    (the DeepSpeedCPU* optimizers' `fp32_optimizer_states`, their default)."""
    if not fp32_states:
        return
    dtypes = {p.dtype for group in optimizer.param_groups for p in group["params"]}
    if dtypes - {torch.float32, torch.float64}:
        raise ValueError(
            f"{name}: fp32_optimizer_states=True needs fp32 parameters (got "
            f"{sorted(map(str, dtypes))}); pass fp32_optimizer_states=False to keep the states in "
            "the parameters' dtype"
        )
