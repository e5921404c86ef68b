"""LAMB with the semantics of DeepSpeed's FusedLamb kernel, in plain torch.

For each tensor, with raw (not bias-corrected) moments m and v:

    update = m / (sqrt(v) + eps) + weight_decay * p        (sqrt(v + eps) with eps_inside_sqrt)
    coeff  = clamp(||p|| / ||update||, min_coeff, max_coeff), or 1 if either norm is 0
    p     -= step_size * coeff * update,   step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)

Bias correction enters only through the step size (plain `lr` without it), exactly as in the kernel.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lamb", "lamb_step_size", "lamb_update"]


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments (LAMB, arXiv:1904.00962) with a per-tensor, clamped trust ratio."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio applied to each updated tensor in the last step, in update order."""
        return [coeff.item() for coeff in self.lamb_coeffs]

    def needs_whole_tensors(self, group: dict[str, Any]) -> bool:
        """True: each tensor's trust ratio needs the whole tensor's norms, so ZeRO must hand
        `step()` whole parameters rather than flat shards."""
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = []
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(
                        step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )
                state["step"] += 1
                states.append(state)
            sizes = [lamb_step_size(group, s["step"], s["step"]) for s in states]
            self.lamb_coeffs.extend(
                lamb_update(group, params, [p.grad for p in params], states, sizes)
            )
        return loss


def lamb_step_size(group: dict[str, Any], step: int, variance_steps: int) -> float:
    """lr * sqrt(1 - beta2^variance_steps) / (1 - beta1^step), or lr without bias correction.
    `variance_steps`: the updates the second moment has had (fewer than `step` once frozen)."""
    if not group["bias_correction"]:
        return group["lr"]
    beta1, beta2 = group["betas"]
    return group["lr"] * math.sqrt(1.0 - beta2**variance_steps) / (1.0 - beta1**step)


def lamb_update(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, Any]],
    step_sizes: list[float],
) -> list[torch.Tensor]:
    """Update each state's `exp_avg` / `exp_avg_sq` from `grads` and apply one LAMB step of
    `step_sizes` to `params`, with `group`'s betas, eps, weight decay and coefficient bounds.
    Returns each tensor's trust ratio (0-dim tensors, no host sync), in the order given."""
    # foreach kernels need one device and dtype per list, so batch tensors by both.
    batches: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, p in enumerate(params):
        batches[(p.device, p.dtype)].append(index)
    coeffs: list[torch.Tensor] = [torch.ones(())] * len(params)
    for indices in batches.values():
        batch = _foreach_update(
            group,
            [params[i] for i in indices],
            [grads[i] for i in indices],
            [states[i] for i in indices],
            [step_sizes[i] for i in indices],
        )
        for i, coeff in zip(indices, batch):
            coeffs[i] = coeff
    return coeffs


def _foreach_update(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, Any]],
    step_sizes: list[float],
) -> tuple[torch.Tensor, ...]:
    beta1, beta2 = group["betas"]
    exp_avgs = [state["exp_avg"] for state in states]
    exp_avg_sqs = [state["exp_avg_sq"] for state in states]
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

    if group["eps_inside_sqrt"]:
        denoms = torch._foreach_sqrt(torch._foreach_add(exp_avg_sqs, group["eps"]))
    else:
        denoms = torch._foreach_add(torch._foreach_sqrt(exp_avg_sqs), group["eps"])
    updates = torch._foreach_div(exp_avgs, denoms)
    if group["weight_decay"] != 0:
        torch._foreach_add_(updates, params, alpha=group["weight_decay"])

    weight_norms = torch.stack(torch._foreach_norm(params))
    update_norms = torch.stack(torch._foreach_norm(updates))
    ratio = (weight_norms / update_norms).clamp(group["min_coeff"], group["max_coeff"])
    both_nonzero = (weight_norms != 0) & (update_norms != 0)
    coeffs = torch.where(both_nonzero, ratio, torch.ones_like(ratio))

    scales = -coeffs * torch.tensor(step_sizes, dtype=coeffs.dtype, device=coeffs.device)
    torch._foreach_mul_(updates, list(scales.unbind()))
    torch._foreach_add_(params, updates)
    return coeffs.unbind()
