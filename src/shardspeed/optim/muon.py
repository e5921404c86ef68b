"""Muon with an auxiliary AdamW: DeepSpeed 0.19.8's `"type": "Muon"`.

Muon (MomentUm Orthogonalized by Newton-Schulz) steps the hidden weight matrices: Nesterov
momentum, whose update is replaced by an approximately orthogonal matrix of the same shape (five
quintic Newton-Schulz iterations), scaled by sqrt(max(1, rows / cols)), with decoupled weight
decay. Everything else (embeddings, the output head, vectors) is stepped by AdamW. Each param group
says which with `use_muon`; `muon_param_groups` builds them as DeepSpeed's engine does, from the
`use_muon` mark `tag_muon_parameters` puts on each parameter.

The optimizer steps exactly the tensors it is given and never communicates: ZeRO places each
parameter of a `use_muon` group whole on one rank (`needs_whole_tensors`), while the AdamW half is
element-wise and may be given flat shards.

Newton-Schulz runs in DeepSpeed's dtypes on CUDA (bf16 for `ns_method` "standard", fp16 for
"gram") and in fp32 elsewhere; see docs/optimizers.md for this and the other differences.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["NS_METHODS", "Muon", "muon_param_groups", "tag_muon_parameters"]

NS_METHODS = ("gram", "standard")
# Which config keys reach each half (DeepSpeed's engine): Muon has a momentum and a Newton-Schulz
# method, the AdamW half betas and eps. `muon_lr` / `adam_lr` override `lr` for their half.
_MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_HALVES = ((True, "muon", _MUON_KEYS, "muon_lr"), (False, "adam", _ADAM_KEYS, "adam_lr"))
# A half's settings where neither the config nor the group names them (DeepSpeed's defaults).
_MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
_ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
# Names of parameters that stay on AdamW even when they are matrices.
_ADAM_NAMES = ("embed", "lm_head")

# The quintic's coefficients (chosen for a steep slope at zero, Keller Jordan's), its step count,
# and the guard added to the norm that brings the spectral norm under 1.
_A, _B, _C = 3.4445, -4.7750, 2.0315
_NS_STEPS = 5
_NORM_EPS = 1e-7
# Gram Newton-Schulz rebuilds X and its Gram matrix once, before this iteration, so that rounding
# in half precision does not accumulate through the whole product.
_GRAM_RESTART = 2


def tag_muon_parameters(module: torch.nn.Module) -> None:
    """Mark every parameter of `module` with `use_muon`, as DeepSpeed's `initialize` does: True
    for a matrix (its layer shape, `ds_shape` under `zero.Init`, has 2 or more dimensions) whose
    name contains neither "embed" nor "lm_head"; False otherwise."""
    for name, p in module.named_parameters():
        shape = getattr(p, "ds_shape", p.shape)
        p.use_muon = len(shape) >= 2 and not any(word in name.lower() for word in _ADAM_NAMES)


def muon_param_groups(
    model_parameters: Iterable[Any], settings: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Split each incoming param group (loose tensors form one) into a Muon and an AdamW half.

    `settings` are the config's values (`lr`, `muon_lr`, `adam_lr` and each half's keys). A half's
    setting is, most specific last: the config's shared value, then `muon_lr` / `adam_lr`, then
    the incoming group's own. Frozen parameters are left out; each half is named
    "[<group name or groupN>-]muon-params" / "...adam-params"."""
    groups: list[dict[str, Any]] = []
    loose: list[torch.Tensor] = []
    for item in model_parameters:
        if isinstance(item, dict):
            params = item["params"]
            groups.append({**item, "params": [params] if torch.is_tensor(params) else list(params)})
        else:
            loose.append(item)
    if loose or not groups:
        groups.append({"params": loose})
    untagged = sum(not hasattr(p, "use_muon") for group in groups for p in group["params"])
    if untagged:
        raise ValueError(
            f"Muon needs every parameter marked with use_muon, and {untagged} are not: initialize "
            "marks the model's own parameters, so pass only those (or set `p.use_muon` to True "
            "for hidden matrices, False for the rest)"
        )
    halves = []
    for index, group in enumerate(groups):
        own = {key: value for key, value in group.items() if key != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        prefix = own.get("name") or (f"group{index}" if len(groups) > 1 else None)
        for use_muon, label, keys, lr_key in _HALVES:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            chosen = {key: settings[key] for key in keys if key in settings}
            if lr_key in settings:
                chosen["lr"] = settings[lr_key]
            chosen.update({key: value for key, value in own.items() if key in keys})
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            halves.append({"params": half, "use_muon": use_muon, "name": name, **chosen})
    return halves


class Muon(torch.optim.Optimizer):
    """Muon for the `use_muon` param groups, AdamW (bias-corrected) for the others.

    A Muon group's settings: `lr` (0.02), `momentum` (0.95), `weight_decay` (0, decoupled),
    `ns_method` ("gram" or "standard"). An AdamW group's: `lr` (3e-4), `betas` ((0.9, 0.95)), `eps`
    (1e-10), `weight_decay` (0; decoupled, or added to the gradient with `adam_w_mode=False`).
    A parameter without a gradient is stepped with a zero one, as in DeepSpeed.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]], adam_w_mode: bool = True) -> None:
        groups = []
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("every Muon param group needs 'use_muon' (see muon_param_groups)")
            defaults = _MUON_DEFAULTS if group["use_muon"] else _ADAM_DEFAULTS
            groups.append(_checked({**defaults, **group}))
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode

    def needs_whole_tensors(self, group: dict[str, Any]) -> bool:
        """Whether `group`'s tensors must reach `step()` whole (the Muon half orthogonalises
        matrices) rather than as flat shards (the AdamW half is element-wise)."""
        return bool(group["use_muon"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adam_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        beta, lr = group["momentum"], group["lr"]
        for p in group["params"]:
            if p.dim() < 2:
                raise ValueError(
                    f"Muon: a use_muon param group holds a {p.dim()}-D tensor of {p.numel()} "
                    "elements; Newton-Schulz needs whole matrices: put vectors in a use_muon=False "
                    "group, and keep such groups' tensors whole under ZeRO"
                )
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            momentum = state["momentum_buffer"]
            momentum.lerp_(grad, 1.0 - beta)
            nesterov = grad.lerp(momentum, beta)
            update = _orthogonalise(nesterov, group["ns_method"])
            p.mul_(1.0 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr)

    def _adam_step(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            state = self.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            params.append(p)
            grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(int(state["step"]))
        if not params:
            return
        if decay and not self.adam_w_mode:
            grads = torch._foreach_add(grads, params, alpha=decay)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        # (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps), per tensor's step count.
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, [math.sqrt(1.0 - beta2**t) for t in steps])
        torch._foreach_add_(denoms, group["eps"])
        if decay and self.adam_w_mode:
            torch._foreach_mul_(params, 1.0 - lr * decay)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1.0 - beta1**t) for t in steps])


def _checked(group: dict[str, Any]) -> dict[str, Any]:
    bad = [key for key in ("lr", "weight_decay", "eps") if group.get(key, 0.0) < 0]
    if bad:
        raise ValueError(f"Muon param group {group.get('name', '')!r}: {bad[0]} must be >= 0")
    if group["use_muon"]:
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(
                f"Muon: ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}"
            )
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"Muon: momentum must lie in [0, 1), got {group['momentum']}")
    else:
        group["betas"] = tuple(group["betas"])
        if len(group["betas"]) != 2 or not all(0.0 <= b < 1.0 for b in group["betas"]):
            raise ValueError(f"Muon: betas must be two values in [0, 1), got {group['betas']}")
    return group


def _ns_dtype(method: str, device: torch.device) -> torch.dtype:
    # DeepSpeed's choice on CUDA (fp16 keeps more precision for the Gram form's restarts at the
    # cost of range, which the normalisation removes); fp32 elsewhere, where half-precision
    # matmuls buy little and would only loosen agreement with a plain reference.
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if method == "gram" else torch.bfloat16


def _orthogonalise(update: torch.Tensor, method: str) -> torch.Tensor:
    """Newton-Schulz's near-orthogonal matrix for `update`, times sqrt(max(1, rows / cols)).

    Convolution filters (4-D) are orthogonalised as (out, in * kh * kw) matrices; other tensors
    of 3 or more dimensions as a batch of their last two. As in DeepSpeed, the scale reads the
    tensor's last two dimensions."""
    shape = update.shape
    matrix = update.reshape(shape[0], -1) if update.dim() == 4 else update
    solve = _gram_newton_schulz if method == "gram" else _newton_schulz
    rows, cols = shape[-2], shape[-1]
    scale = math.sqrt(rows / cols) if rows > cols else 1.0
    return (solve(matrix, _ns_dtype(method, update.device)) * scale).reshape(shape).to(update.dtype)


def _wide_unit(g: torch.Tensor, dtype: torch.dtype, norm_dtype: torch.dtype) -> torch.Tensor:
    """`g` with rows <= columns (transposed if tall), divided by its Frobenius norm (so its
    spectral norm is at most 1), in `dtype`, the norm taken in `norm_dtype`."""
    x = g.to(norm_dtype)
    if g.size(-2) > g.size(-1):
        x = x.mT
    return (x / (x.norm(dim=(-2, -1), keepdim=True) + _NORM_EPS)).to(dtype)


def _quintic(x: torch.Tensor) -> torch.Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, five times."""
    for _ in range(_NS_STEPS):
        gram = x @ x.mT
        x = _A * x + (_B * gram + _C * gram @ gram) @ x
    return x


def _newton_schulz(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The quintic iteration on the wide orientation of `g`, in `dtype`."""
    x = _quintic(_wide_unit(g, dtype, dtype))
    return x.mT if g.size(-2) > g.size(-1) else x


def _gram_newton_schulz(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same iteration carried on the small Gram matrix R = X X^T: the iterate is Q X0 with Q
    a polynomial in R0, so Q <- (a I + Z) Q and R <- (a I + Z) R (a I + Z) with Z = b R + c R^2,
    and X is formed once at the end (and at the restart). Square matrices gain nothing from it
    and take the plain iteration."""
    # Normalise before any cast to fp16, whose range a loss-scaled gradient can exceed.
    x = _wide_unit(g, dtype, torch.float32 if g.dtype == torch.float16 else g.dtype)
    tall = g.size(-2) > g.size(-1)
    if x.size(-2) == x.size(-1):
        x = _quintic(x)
        return x.mT if tall else x
    gram = x @ x.mT
    q = None
    for i in range(_NS_STEPS):
        if i == _GRAM_RESTART:
            x = q @ x
            gram = x @ x.mT
            q = None
        z = _B * gram + _C * gram @ gram
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(_A)
        else:
            q = _A * q + z @ q
        if i < _NS_STEPS - 1 and i + 1 != _GRAM_RESTART:
            left = _A * gram + z @ gram
            gram = _A * left + z @ left
    x = q @ x
    return x.mT if tall else x
