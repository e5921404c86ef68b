"""1-bit Adam and 0/1 Adam: Adam variants that average momenta through 1-bit messages.

Both start as Adam on averaged gradients and then stop the engine from averaging gradients: each
rank hands the optimizer its local gradient, and the optimizer exchanges what it needs through
`compressed_allreduce` (`shardspeed.comm.compressed`), 1/32 of fp32's bytes per phase.

- `OneBitAdam` (arXiv:2102.02888): after `freeze_step` steps the variance is frozen and every step
  all-reduces the momentum, updated from the local gradient, in 1 bit.
- `ZeroOneAdam` (arXiv:2202.06009): updates the variance at exponentially spaced steps only
  (gradients in between are all-reduced in 1 bit), freezes it after `var_freeze_step`, and then
  takes local steps, synchronising the ranks' progress in 1 bit every `local_step_interval` steps.

The engine's side of the contract is `CompressedOptimizer`: `set_process_group(group)` once, then
before every backward `communicates_gradients()`; while it is true the gradients handed to `step()`
must be this rank's own, not averaged. Every rank must step the same parameters (all with a
gradient, or none) in the same order: the compressed exchanges are collectives.

Where these differ from DeepSpeed 0.19.8's, see docs/compression.md: bias correction is applied when
asked for (DeepSpeed ignores the flag), the first step moves the parameters (DeepSpeed's first
call only allocates buffers), `max_grad_norm` clips, and ZeroOneAdam's ranks agree bit for bit
after each synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..comm.comm import get_world_size
from ..comm.compressed import compressed_allreduce, error_buffers

__all__ = ["CompressedOptimizer", "OneBitAdam", "ZeroOneAdam"]

# torch.distributed carries the 1-bit messages; these are DeepSpeed's names for it.
_BACKENDS = ("nccl", "gloo")


class CompressedOptimizer(torch.optim.Optimizer):
    """An optimizer that does its own data-parallel communication for part of training.

    The engine calls `set_process_group(group)` with the data-parallel group (None: the default
    group) and, before each backward, asks `communicates_gradients()`: while true it must not
    average gradients. Compression errors are per rank and stay out of `state_dict()` (as in
    DeepSpeed they restart at zero after a load).
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        amsgrad: bool,
        cuda_aware: bool,
        comm_backend_name: str,
        **hyperparameters: Any,
    ) -> None:
        """`hyperparameters` (lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay,
        max_grad_norm) become every param group's defaults."""
        name = type(self).__name__
        defaults = {**hyperparameters, "betas": tuple(hyperparameters["betas"])}
        if amsgrad:
            raise ValueError(f"{name} does not support amsgrad (the AMSGrad variant)")
        if comm_backend_name not in _BACKENDS:
            raise ValueError(
                f"{name}: comm_backend_name {comm_backend_name!r} is not available; shardspeed "
                "sends the 1-bit messages through torch.distributed: use 'nccl' (CUDA) or "
                "'gloo' (CPU), which both mean the process group the engine runs on"
            )
        _check_hyperparameters(name, defaults)
        super().__init__(params, defaults)
        if cuda_aware:
            where = {p.device.type for group in self.param_groups for p in group["params"]}
            if where != {"cuda"}:
                raise ValueError(
                    f"{name}: cuda_aware=True needs every parameter on a CUDA device (found "
                    f"{sorted(where)}); it names CUDA-aware MPI, which shardspeed does not use: "
                    "leave it false"
                )
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        self.process_group: Any = None
        # Error feedback buffers, per param group and exchanged size.
        self._errors: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        # The most steps any parameter has taken: asked before every backward, so kept up to date
        # by step() and load_state_dict() rather than read off every parameter's state each time.
        self._steps = 0

    def set_process_group(self, group: Any) -> None:
        """Average over `group` (the data-parallel group; None is the default group)."""
        self.process_group = group
        self._errors.clear()

    def communicates_gradients(self) -> bool:
        """Whether the next `step()` takes local gradients (so the engine must not average them)."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, keeping each group's current `exp_avg_mask` (DeepSpeed's rule: masks belong to the
        training phase, not the checkpoint) and restarting the compression errors at zero."""
        masks = [group.get("exp_avg_mask") for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, mask in zip(self.param_groups, masks):
            group.pop("exp_avg_mask", None)
            if mask is not None:
                group["exp_avg_mask"] = mask
        self._errors.clear()
        self._steps = max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)

    def _world_size(self) -> int:
        return get_world_size(self.process_group)

    def _average_group(
        self, index: int, tensors: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        """Average a param group's tensors (momenta, gradients or progress) in place over the
        ranks as one flat 1-bit exchange, with error feedback kept per group and size; then apply
        the group's `exp_avg_mask` to each: 1 bit cannot say 0, so entries that must stay zero
        would otherwise keep collecting error."""
        world = self._world_size()
        if world > 1:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            key = ("group", index, flat.numel())
            if key not in self._errors:
                self._errors[key] = error_buffers(flat.numel(), world, flat.device)
            compressed_allreduce(flat, *self._errors[key], group=self.process_group)
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(piece.view_as(t))
        if "exp_avg_mask" in group:
            if group["exp_avg_mask"].device != tensors[0].device:
                group["exp_avg_mask"] = group["exp_avg_mask"].to(tensors[0].device)
            for t in tensors:
                t.mul_(group["exp_avg_mask"])

    def _reset_group_errors(self, index: int) -> None:
        for key, errors in self._errors.items():
            if key[:2] == ("group", index):
                for error in errors:
                    error.zero_()

    @staticmethod
    def _gradients(group: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, gradient) of the group's parameters that have one, clipped to the group's
        `max_grad_norm` (the norm of this rank's gradients; no host sync)."""
        pairs = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("1-bit optimizers do not support sparse gradients")
            pairs.append((p, p.grad))
        if group["max_grad_norm"] > 0 and pairs:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for _, g in pairs])
            )
            coef = (group["max_grad_norm"] / (norm + 1e-6)).clamp(max=1.0)
            pairs = [(p, g * coef) for p, g in pairs]
        return pairs

    @staticmethod
    def _denominator(v: torch.Tensor, group: dict[str, Any], v_steps: int) -> torch.Tensor:
        """sqrt of the (bias-corrected) variance, plus eps outside or inside the root."""
        correction = 1.0 - group["betas"][1] ** v_steps if group["bias_correction"] else 1.0
        if group["eps_inside_sqrt"]:
            return (v / correction).add_(group["eps"]).sqrt_()
        return (v.sqrt() / math.sqrt(correction)).add_(group["eps"])

    @staticmethod
    def _step_size(group: dict[str, Any], step: int) -> float:
        if not group["bias_correction"]:
            return group["lr"]
        return group["lr"] / (1.0 - group["betas"][0] ** step)


class OneBitAdam(CompressedOptimizer):
    """1-bit Adam: Adam for `freeze_step` steps, then a frozen variance and a 1-bit momentum.

    Steps 1 to `freeze_step` (the warm-up) are Adam on averaged gradients. From step
    `freeze_step` + 1 on, the gradient is the rank's own: the momentum is updated from it, averaged
    with `compressed_allreduce` (error feedback keeps the averages unbiased over time), and the
    update divides by the variance as it was at `freeze_step`. Weight decay is decoupled
    (`p -= lr * weight_decay * p`), as in DeepSpeed's update.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        if freeze_step < 1:
            raise ValueError(
                f"freeze_step must be >= 1 (the variance needs averaged gradients), got "
                f"{freeze_step}"
            )
        self.freeze_step = freeze_step
        super().__init__(
            params,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )

    def communicates_gradients(self) -> bool:
        return self._steps >= self.freeze_step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update: Adam on averaged gradients in the warm-up, 1-bit momentum after it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.communicates_gradients()
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            updates = []
            for p, grad in self._gradients(group):
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                self._steps = max(self._steps, state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                if not compressing:
                    v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                updates.append((p, m, v, int(state["step"])))
            if compressing and updates:
                # The whole group's momentum in one 1-bit exchange (as DeepSpeed flattens it):
                # two collectives a step, not two per parameter.
                self._average_group(index, [m for _, m, _, _ in updates], group)
            for p, m, v, step in updates:
                denom = self._denominator(v, group, min(step, self.freeze_step))
                if group["weight_decay"]:
                    p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m, denom, value=-self._step_size(group, step))
        return loss


class ZeroOneAdam(CompressedOptimizer):
    """0/1 Adam: a lazily updated variance, then local steps synchronised in 1 bit.

    Up to `var_freeze_step` steps, the variance is updated only on steps that are multiples of an
    interval that starts at 1 and doubles after every `var_update_scaler` updates; on those steps
    the gradient is averaged by the engine, on the others it is the rank's own and is averaged
    here in 1 bit (it still feeds the momentum). After `var_freeze_step` the variance is frozen and
    each rank steps on its own momentum; every `local_step_interval` steps (1 at first, doubling
    after every `local_step_scaler` steps, at most `local_step_clipper`) the ranks average their
    progress since the last synchronisation in 1 bit and restart from the same parameters, with the
    momentum rebuilt from that average.
    """

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
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        for key, value in (
            ("var_freeze_step", var_freeze_step),
            ("var_update_scaler", var_update_scaler),
            ("local_step_scaler", local_step_scaler),
            ("local_step_clipper", local_step_clipper),
        ):
            if value < 1:
                raise ValueError(f"ZeroOneAdam: {key} must be >= 1, got {value}")
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        super().__init__(
            params,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )

    def communicates_gradients(self) -> bool:
        state = next((s for s in self.state.values() if "step" in s), None)
        if state is None:
            return False
        steps = int(state["step"])
        return steps >= self.var_freeze_step or (steps + 1) % state["var_interval"] != 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update (see the class docstring for which steps communicate what)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            variance, local = [], []
            for p, grad in self._gradients(group):
                state = self.state[p]
                if not state:
                    state.update(
                        step=0,
                        exp_avg=torch.zeros_like(p),
                        exp_avg_sq=torch.zeros_like(p),
                        var_steps=0,  # variance updates so far (its bias correction)
                        var_interval=1,
                        var_counter=0,
                        local_step_interval=1,
                        local_step_counter=0,
                    )
                state["step"] += 1
                self._steps = max(self._steps, state["step"])
                phase = variance if state["step"] <= self.var_freeze_step else local
                phase.append((p, grad, state))
            # Each phase's exchanges for the whole group go as one flat 1-bit all-reduce.
            self._lazy_variance_steps(index, group, variance)
            self._local_steps(index, group, local)
        return loss

    def _lazy_variance_steps(
        self, index: int, group: dict[str, Any], steps: list[tuple[torch.Tensor, ...]]
    ) -> None:
        beta1, beta2 = group["betas"]
        # On a variance step the engine averaged the gradient; otherwise it is the rank's own.
        own = [(p, g.clone(), s) for p, g, s in steps if s["step"] % s["var_interval"]]
        if own:
            self._average_group(index, [g for _, g, _ in own], group)
        averaged = {p: g for p, g, _ in own}
        for p, grad, state in steps:
            step, m, v = int(state["step"]), state["exp_avg"], state["exp_avg_sq"]
            if p in averaged:
                grad = averaged[p]
            else:
                v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                state["var_steps"] += 1
                state["var_counter"] += 1
                if state["var_counter"] == self.var_update_scaler:
                    state["var_counter"] = 0
                    state["var_interval"] *= 2
            m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            denom = self._denominator(v, group, int(state["var_steps"]))
            if group["weight_decay"]:
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
            p.addcdiv_(m, denom, value=-self._step_size(group, step))

    def _local_steps(
        self, index: int, group: dict[str, Any], steps: list[tuple[torch.Tensor, ...]]
    ) -> None:
        beta1 = group["betas"][0]
        starting = [(p, state) for p, _, state in steps if "synced_params" not in state]
        if starting:
            # First local step: the ranks' parameters are equal; the errors so far were of
            # gradients, from now on they are of parameter progress.
            self._reset_group_errors(index)
            for p, state in starting:
                state["synced_params"] = p.detach().clone()
                state["synced_lr_sum"] = 0.0
        syncing = []
        for p, grad, state in steps:
            step, m, v = int(state["step"]), state["exp_avg"], state["exp_avg_sq"]
            m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            denom = self._denominator(v, group, int(state["var_steps"]))
            step_size = self._step_size(group, step)
            if group["weight_decay"]:
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
            p.addcdiv_(m, denom, value=-step_size)
            state["synced_lr_sum"] = float(state["synced_lr_sum"]) + step_size
            if step % state["local_step_interval"] == 0:
                syncing.append((p, state, denom))
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(
                    self.local_step_clipper, state["local_step_interval"] * 2
                )
        if not syncing:
            return
        # Progress since the last sync, in momentum units, averaged over the ranks; every rank
        # then starts again from the same parameters and momentum.
        progress = [(p - s["synced_params"]).mul_(denom) for p, s, denom in syncing]
        self._average_group(index, progress, group)
        for (p, state, denom), moved in zip(syncing, progress):
            anchor = state["synced_params"]
            state["exp_avg"].copy_(moved).div_(-state["synced_lr_sum"])
            p.copy_(anchor).addcdiv_(moved, denom)
            anchor.copy_(p)
            state["synced_lr_sum"] = 0.0


def _check_hyperparameters(name: str, defaults: dict[str, Any]) -> None:
    if defaults["lr"] < 0:
        raise ValueError(f"{name}: lr must be >= 0, got {defaults['lr']}")
    if len(defaults["betas"]) != 2 or not all(0.0 <= b < 1.0 for b in defaults["betas"]):
        raise ValueError(f"{name}: betas must be two values in [0, 1), got {defaults['betas']}")
    if defaults["eps"] < 0:
        raise ValueError(f"{name}: eps must be >= 0, got {defaults['eps']}")
    if defaults["weight_decay"] < 0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {defaults['weight_decay']}")
    if defaults["max_grad_norm"] < 0:
        raise ValueError(f"{name}: max_grad_norm must be >= 0, got {defaults['max_grad_norm']}")
