"""`deepspeed.ops.lamb` drop-in: FusedLamb, DeepSpeed's LAMB signature on shardspeed's `Lamb`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardspeed.optim.lamb import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    """DeepSpeed's FusedLamb constructor; the update is `shardspeed.optim.Lamb`'s (same semantics)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        # DeepSpeed's FusedLamb clips only with grad norms passed to step() by its fp16 wrapper.
        if max_grad_norm > 0:
            raise ValueError(
                "FusedLamb: max_grad_norm is not supported; clip gradients before step() "
                "(torch.nn.utils.clip_grad_norm_, or the config's gradient_clipping)"
            )
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
