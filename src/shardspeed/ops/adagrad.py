"""`deepspeed.ops.adagrad` drop-in: DeepSpeedCPUAdagrad, DeepSpeed's signature on torch's Adagrad."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.ops.adam import check_fp32_states

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's DeepSpeedCPUAdagrad constructor on `torch.optim.Adagrad` (any device)."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdagrad does not support the AMSGrad variant.")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        check_fp32_states("DeepSpeedCPUAdagrad", self, fp32_optimizer_states)
        self.fp32_optimizer_states = fp32_optimizer_states
