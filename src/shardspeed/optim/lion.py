"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), DeepSpeed's `Lion` type.

Per element: c = beta1 * m + (1 - beta1) * g; p <- p * (1 - lr * wd) - lr * sign(c);
m <- beta2 * m + (1 - beta2) * g. Every element's update depends on that element alone, so it runs
unchanged on ZeRO's flat shards. The update is applied to all of a group's tensors at once with
torch's foreach kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion with decoupled weight decay; one momentum buffer (`exp_avg`) per parameter."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moments = []
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                moments.append(state["exp_avg"])
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            if decay:
                torch._foreach_mul_(params, 1.0 - lr * decay)
            update = torch._foreach_mul(moments, beta1)
            torch._foreach_add_(update, grads, alpha=1.0 - beta1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-lr)
            torch._foreach_mul_(moments, beta2)
            torch._foreach_add_(moments, grads, alpha=1.0 - beta2)
        return loss
