"""1-bit Adam, 0/1 Adam and 1-bit LAMB: optimizers that average momenta through 1-bit messages.

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
after each synchronisation. OneBitLamb's differences are listed there too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..comm.comm import get_world_size
from ..comm.compressed import compressed_allreduce, error_buffers
from .lamb import lamb_step_size, lamb_update

__all__ = ["CompressedOptimizer", "OneBitAdam", "OneBitLamb", "ZeroOneAdam"]

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
        self.local = False
        # Error feedback buffers, per param group and exchanged size.
        self._errors: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        # The most steps any parameter has taken: asked before every backward, so kept up to date
        # by step() and load_state_dict() rather than read off every parameter's state each time.
        self._steps = 0

    def set_process_group(self, group: Any, local: bool = False) -> None:
        """Average over `group` (the data-parallel group; None is the default group). `local`:
        exchange nothing (ZeRO reduces the gradients and steps each tensor on its owner): the
        optimizer's arithmetic is then that of one process on the averaged gradients."""
        self.process_group = group
        self.local = local
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
        return 1 if self.local else get_world_size(self.process_group)

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


class OneBitLamb(CompressedOptimizer):
    """1-bit LAMB: LAMB for `freeze_step` steps, then frozen variance, 1-bit momentum and a
    frozen, rescaled trust ratio.

    Steps 1 to `freeze_step` are shardspeed's `Lamb` on averaged gradients; each tensor's trust
    ratio, when not exactly 1, feeds an average `lamb_coeff_freeze` (weight `coeff_beta`). From
    step `freeze_step` + 1 each rank's momentum is updated from its own gradient and averaged in
    1 bit, with every tensor's momentum first scaled to the same RMS (`scaling_coeff`, fixed at
    the first compressed step) so that one sign scale suits the whole flat group. The update
    m / (sqrt(v) + eps) (+ weight_decay * p) divides by the variance frozen at `freeze_step`, and
    its trust ratio is `lamb_coeff_freeze` times a factor: the largest ratio of the frozen
    denominator to one built from a fresh variance (updated with the gradients the averaged
    momenta imply), pulled toward 1 by the weight decay's share of the update, bounded by
    `factor_min` / `factor_max` and moved at most `factor_threshold` (relative) per step.
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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        problems = [
            (freeze_step >= 1, f"freeze_step must be >= 1, got {freeze_step}"),
            (
                0 <= min_coeff <= max_coeff,
                f"need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}",
            ),
            (0 <= coeff_beta < 1, f"coeff_beta must lie in [0, 1), got {coeff_beta}"),
            (
                0 < factor_min <= factor_max,
                f"need 0 < factor_min <= factor_max, got {factor_min}, {factor_max}",
            ),
            (factor_threshold >= 0, f"factor_threshold must be >= 0, got {factor_threshold}"),
        ]
        for ok, message in problems:
            if not ok:
                raise ValueError(f"OneBitLamb: {message}")
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
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
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        self.lamb_coeffs: list[torch.Tensor] = []

    def communicates_gradients(self) -> bool:
        return self._steps >= self.freeze_step and not self.local

    def needs_whole_tensors(self, group: dict[str, Any]) -> bool:
        """True: trust ratios and momentum scales are per whole tensor."""
        return True

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio applied to each updated tensor in the last step, in update order."""
        return [float(coeff) for coeff in self.lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update: LAMB on averaged gradients in the warm-up, 1-bit momentum after it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self._steps >= self.freeze_step  # the frozen phase, exchanged or local
        if compressing:
            self._scale_momenta_once()
        self.lamb_coeffs = []
        for index, group in enumerate(self.param_groups):
            pairs = self._gradients(group)
            for p, _ in pairs:
                state = self.state[p]
                if not state:
                    state.update(
                        step=0,
                        exp_avg=torch.zeros_like(p),
                        exp_avg_sq=torch.zeros_like(p),
                        # The warm-up's average trust ratio, and the last compressed step's
                        # factor on it (0-dim tensors: no host syncs).
                        lamb_coeff_freeze=torch.zeros((), device=p.device),
                        last_factor=torch.ones((), device=p.device),
                    )
                state["step"] += 1
                self._steps = max(self._steps, state["step"])
            if compressing and pairs:
                self._compressed_step(index, group, pairs)
            elif pairs:
                self._warm_up_step(group, pairs)
        return loss

    def _warm_up_step(
        self, group: dict[str, Any], pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        states = [self.state[p] for p, _ in pairs]
        sizes = [lamb_step_size(group, s["step"], s["step"]) for s in states]
        coeffs = lamb_update(group, [p for p, _ in pairs], [g for _, g in pairs], states, sizes)
        for state, coeff in zip(states, coeffs):
            frozen = state["lamb_coeff_freeze"]
            # As DeepSpeed: a ratio of exactly 1 (a zero norm, or bounds that force it) is not
            # averaged in.
            averaged = self.coeff_beta * frozen + (1.0 - self.coeff_beta) * coeff
            frozen.copy_(torch.where(coeff != 1.0, averaged, frozen))
        self.lamb_coeffs.extend(coeffs)

    def _scale_momenta_once(self) -> None:
        """At the first compressed step: each tensor's factor to the mean RMS of all momenta."""
        states = [self.state[p] for g in self.param_groups for p in g["params"]]
        states = [s for s in states if "exp_avg" in s]
        if not states or "scaling_coeff" in states[0]:
            return
        rms = torch.stack(
            [
                torch.linalg.vector_norm(s["exp_avg"]) / math.sqrt(s["exp_avg"].numel())
                for s in states
            ]
        )
        coeffs = torch.where(rms > 0, rms.mean() / rms, torch.ones_like(rms))
        for state, coeff in zip(states, coeffs.unbind()):
            state["scaling_coeff"] = coeff

    def _compressed_step(
        self, index: int, group: dict[str, Any], pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p, _ in pairs]
        previous = [s["exp_avg"].clone() for s in states]
        for (_, grad), state in zip(pairs, states):
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
            state["exp_avg"].mul_(state["scaling_coeff"])
            # The variance stopped at freeze_step; this copy goes on from the averaged momenta.
            state.setdefault("exp_avg_sq_fresh", state["exp_avg_sq"].clone())
        self._average_group(index, [s["exp_avg"] for s in states], group)
        for (p, _), state, last in zip(pairs, states, previous):
            m = state["exp_avg"].div_(state["scaling_coeff"])
            implied = (m - beta1 * last) / (1.0 - beta1)
            fresh = state["exp_avg_sq_fresh"]
            fresh.mul_(beta2).addcmul_(implied, implied, value=1.0 - beta2)
            denom = _lamb_denominator(state["exp_avg_sq"], group)
            update = m / denom
            factor = (denom / _lamb_denominator(fresh, group)).max()
            if group["weight_decay"] > 0:
                plain = torch.linalg.vector_norm(update)
                update.add_(p, alpha=group["weight_decay"])
                share = (plain / torch.linalg.vector_norm(update)).clamp(max=1.0)
                factor = factor * share + (1.0 - share)
            last_factor = state["last_factor"]
            factor = factor.clamp(self.factor_min, self.factor_max)
            factor = torch.minimum(
                torch.maximum(factor, last_factor * (1.0 - self.factor_threshold)),
                last_factor * (1.0 + self.factor_threshold),
            )
            last_factor.copy_(factor)
            coeff = state["lamb_coeff_freeze"] * factor
            step = int(state["step"])
            size = lamb_step_size(group, step, min(step, self.freeze_step))
            p.sub_(update.mul_(coeff * size))
            self.lamb_coeffs.append(coeff)


def _lamb_denominator(v: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """sqrt(v) + eps, or sqrt(v + eps) with eps_inside_sqrt (raw moments, as LAMB's)."""
    if group["eps_inside_sqrt"]:
        return (v + group["eps"]).sqrt_()
    return v.sqrt().add_(group["eps"])


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
