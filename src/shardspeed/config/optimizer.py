"""The `optimizer.params` section: one strict model per optimizer type, with DeepSpeed 0.19.8's keys.

DeepSpeed builds its native optimizers (`Adam`, `AdamW`, `Lamb`, `Adagrad`) by passing `params` straight
to a constructor, and any other `type` (here `SGD`) to the `torch.optim` class of that exact name. The
models below name those constructors' keywords, defaults and valid ranges, so a typo or a bad value is
reported by key path before anything is built.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from shardspeed.config.base import StrictModel

__all__ = [
    "OPTIMIZER_PARAMS",
    "AdagradParams",
    "AdamParams",
    "AdamWParams",
    "LambParams",
    "MuonParams",
    "OneBitAdamParams",
    "OneBitLambParams",
    "SGDParams",
    "ZeroOneAdamParams",
    "canonical_optimizer_name",
]

_MAX_GRAD_NORM_HINT = {"max_grad_norm": "use the top-level 'gradient_clipping' key instead"}
# Only meaningful when autograd runs through the optimizer step, which the engine never does.
_DIFFERENTIABLE = "the engine never differentiates through the optimizer step"

NonNegFloat = Annotated[float, Field(ge=0.0)]
PosFloat = Annotated[float, Field(gt=0.0)]
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


def _list_to_tuple(value: Any) -> Any:
    # JSON has no tuples: `"betas": [0.9, 0.999]` arrives as a list, and strict mode refuses lists for
    # tuple fields, so convert before the (strict) tuple check runs.
    return tuple(value) if isinstance(value, list) else value


Betas = Annotated[tuple[Beta, Beta], BeforeValidator(_list_to_tuple)]


class AdamParams(StrictModel):
    """`Adam` params: DeepSpeed's FusedAdam keywords plus `adam_w_mode` and `torch_adam`.

    `"type": "Adam"` uses decoupled (AdamW) weight decay unless `adam_w_mode` is false, as in DeepSpeed.
    `weight_decay: None` means the default of the class DeepSpeed would build: 0.0 for FusedAdam and for
    `torch.optim.Adam`, torch's 0.01 for `torch.optim.AdamW` (`torch_adam: true` in AdamW mode).
    """

    lr: NonNegFloat = 1e-3
    bias_correction: bool = True
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat | None = None
    amsgrad: bool = False
    set_grad_none: bool = True
    adam_w_mode: bool = True
    torch_adam: bool = False
    foreach: bool | None = None
    fp32_optimizer_states: bool = True

    implemented: ClassVar[frozenset[str] | None] = frozenset(
        {"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam", "foreach"}
    )
    # The other keys accept only their defaults; these are the reasons the loader reports.
    not_supported_until: ClassVar[dict[str, str]] = {
        "bias_correction": "Adam without bias correction is not built: torch's Adam always "
        "applies it",
        "set_grad_none": "gradients are always released (set to None) after a step",
        "fp32_optimizer_states": "optimizer states follow the dtype of the master weights",
    }
    key_hints: ClassVar[dict[str, str]] = _MAX_GRAD_NORM_HINT

    @model_validator(mode="after")
    def _torch_only_keys(self) -> AdamParams:
        # DeepSpeed's fused and CPU Adam refuse AMSGrad and have no `foreach` keyword; only the
        # torch_adam path (torch.optim.Adam/AdamW) accepts them, so require it rather than widen the API.
        if self.amsgrad and not self.torch_adam:
            raise ValueError(
                "amsgrad=true needs torch_adam=true (DeepSpeed's FusedAdam has no AMSGrad)"
            )
        if self.foreach is not None and not self.torch_adam:
            raise ValueError("foreach is a torch.optim.Adam keyword: set torch_adam=true to use it")
        return self

    def decoupled(self) -> bool:
        """True when weight decay is decoupled (AdamW), False for L2-regularised Adam."""
        return self.adam_w_mode

    def effective_weight_decay(self) -> float:
        """The weight decay DeepSpeed would apply when `weight_decay` is not given."""
        if self.weight_decay is not None:
            return self.weight_decay
        return 0.01 if self.torch_adam and self.decoupled() else 0.0


class AdamWParams(AdamParams):
    """`AdamW` params: the same keys as `Adam`; weight decay is always decoupled."""

    def decoupled(self) -> bool:
        """Always True: DeepSpeed ignores `adam_w_mode` for type AdamW."""
        return True


class LambParams(StrictModel):
    """`Lamb` params: DeepSpeed's FusedLamb keywords (`max_grad_norm` is refused by DeepSpeed too)."""

    lr: NonNegFloat = 1e-3
    bias_correction: bool = True
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    eps_inside_sqrt: bool = False
    weight_decay: NonNegFloat = 0.0
    max_coeff: PosFloat = 10.0
    min_coeff: NonNegFloat = 0.01
    amsgrad: bool = False

    implemented: ClassVar[frozenset[str] | None] = frozenset(
        {
            "lr",
            "bias_correction",
            "betas",
            "eps",
            "eps_inside_sqrt",
            "weight_decay",
            "max_coeff",
            "min_coeff",
        }
    )
    not_supported_until: ClassVar[dict[str, str]] = {
        "amsgrad": "DeepSpeed's FusedLamb has no AMSGrad variant either"
    }
    key_hints: ClassVar[dict[str, str]] = _MAX_GRAD_NORM_HINT

    @model_validator(mode="after")
    def _coeff_order(self) -> LambParams:
        if self.min_coeff > self.max_coeff:
            raise ValueError(
                f"min_coeff ({self.min_coeff}) must not exceed max_coeff ({self.max_coeff})"
            )
        return self


class SGDParams(StrictModel):
    """`SGD` params: `torch.optim.SGD`'s keywords (DeepSpeed passes them to torch unchanged)."""

    lr: NonNegFloat = 1e-3
    momentum: NonNegFloat = 0.0
    dampening: float = 0.0
    weight_decay: NonNegFloat = 0.0
    nesterov: bool = False
    maximize: bool = False
    foreach: bool | None = None
    fused: bool | None = None
    differentiable: bool = False

    implemented: ClassVar[frozenset[str] | None] = frozenset(
        {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "fused"}
    )
    not_supported_until: ClassVar[dict[str, str]] = {"differentiable": _DIFFERENTIABLE}
    key_hints: ClassVar[dict[str, str]] = _MAX_GRAD_NORM_HINT

    @model_validator(mode="after")
    def _torch_rules(self) -> SGDParams:
        # torch raises these at construction; checking here names the config key instead.
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov=true needs momentum > 0 and dampening = 0")
        if self.foreach and self.fused:
            raise ValueError("foreach and fused cannot both be true")
        return self


class AdagradParams(StrictModel):
    """`Adagrad` params: `torch.optim.Adagrad`'s keywords, which DeepSpeed builds for type Adagrad."""

    lr: NonNegFloat = 1e-2
    lr_decay: NonNegFloat = 0.0
    weight_decay: NonNegFloat = 0.0
    initial_accumulator_value: NonNegFloat = 0.0
    eps: PosFloat = 1e-10
    maximize: bool = False
    foreach: bool | None = None
    fused: bool | None = None
    differentiable: bool = False

    implemented: ClassVar[frozenset[str] | None] = frozenset(
        {
            "lr",
            "lr_decay",
            "weight_decay",
            "initial_accumulator_value",
            "eps",
            "maximize",
            "foreach",
            "fused",
        }
    )
    not_supported_until: ClassVar[dict[str, str]] = {"differentiable": _DIFFERENTIABLE}
    key_hints: ClassVar[dict[str, str]] = _MAX_GRAD_NORM_HINT

    @model_validator(mode="after")
    def _torch_rules(self) -> AdagradParams:
        if self.foreach and self.fused:
            raise ValueError("foreach and fused cannot both be true")
        return self


class LionParams(StrictModel):
    """`Lion` params: DeepSpeed's FusedLion / DeepSpeedCPULion keywords."""

    lr: NonNegFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    weight_decay: NonNegFloat = 0.0

    implemented: ClassVar[frozenset[str] | None] = frozenset({"lr", "betas", "weight_decay"})
    key_hints: ClassVar[dict[str, str]] = _MAX_GRAD_NORM_HINT


class _CompressedParams(StrictModel):
    """Keys the 1-bit optimizers share (DeepSpeed's signatures; `max_grad_norm` is applied
    here where DeepSpeed ignores it; see docs/compression.md)."""

    lr: NonNegFloat = 1e-3
    bias_correction: bool = True
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    eps_inside_sqrt: bool = False
    weight_decay: NonNegFloat = 0.0
    max_grad_norm: NonNegFloat = 0.0
    cuda_aware: bool = False
    # Both mean the engine's torch.distributed group; DeepSpeed's MPI and compressed backends
    # are not offered.
    comm_backend_name: Literal["nccl", "gloo"] = "nccl"

    not_supported_until: ClassVar[dict[str, str]] = {
        "amsgrad": "the frozen variance of the 1-bit optimizers has no AMSGrad variant"
    }


class OneBitAdamParams(_CompressedParams):
    """`OneBitAdam` params: Adam until `freeze_step`, then the variance frozen and the momentum
    averaged by 1-bit compressed all-reduce with error feedback."""

    freeze_step: Annotated[int, Field(ge=1)] = 100000
    amsgrad: bool = False


class ZeroOneAdamParams(_CompressedParams):
    """`ZeroOneAdam` params: 0/1 Adam's variance-freezing and local-step schedule."""

    var_freeze_step: Annotated[int, Field(ge=1)] = 100000
    var_update_scaler: Annotated[int, Field(ge=1)] = 16
    local_step_scaler: Annotated[int, Field(ge=1)] = 32678
    local_step_clipper: Annotated[int, Field(ge=1)] = 16
    amsgrad: bool = False


class OneBitLambParams(_CompressedParams):
    """`OneBitLamb` params (DeepSpeed 0.19.7's): LAMB until `freeze_step`, then the variance
    frozen, the momentum averaged in 1 bit, and the trust ratio frozen (an average over the
    warm-up, `coeff_beta`) times a factor bounded by `factor_min`, `factor_max` and
    `factor_threshold`."""

    freeze_step: Annotated[int, Field(ge=1)] = 100000
    max_coeff: PosFloat = 10.0
    min_coeff: NonNegFloat = 0.01
    coeff_beta: Beta = 0.9
    factor_max: PosFloat = 4.0
    factor_min: PosFloat = 0.5
    factor_threshold: NonNegFloat = 0.1
    amsgrad: bool = False

    @model_validator(mode="after")
    def _bounds_order(self) -> OneBitLambParams:
        for low, high in (("min_coeff", "max_coeff"), ("factor_min", "factor_max")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"{low} ({getattr(self, low)}) must not exceed {high} ({getattr(self, high)})"
                )
        return self


class MuonParams(StrictModel):
    """`Muon` params (DeepSpeed 0.19.8's keys): Muon for hidden matrices, AdamW for the rest.

    `lr`, `weight_decay` reach both halves; `momentum`, `ns_method` the Muon half; `betas`, `eps`
    the AdamW half. `muon_lr` / `adam_lr` override `lr` for one half. Without any of them a half
    takes its own default lr: 0.02 for Muon, 3e-4 for AdamW.
    """

    lr: NonNegFloat | None = None
    muon_lr: NonNegFloat | None = None
    adam_lr: NonNegFloat | None = None
    momentum: Beta = 0.95
    weight_decay: NonNegFloat = 0.0
    ns_method: Literal["gram", "standard"] = "gram"
    betas: Betas = (0.9, 0.95)
    eps: PosFloat = 1e-10
    adam_w_mode: bool = True
    torch_adam: bool = False
    foreach: bool | None = None
    fp32_optimizer_states: bool = True
    per_head_muon: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        "fp32_optimizer_states": "optimizer states follow the dtype of the master weights",
        "per_head_muon": "per-head Newton-Schulz for attention projections is not built; "
        "each matrix is orthogonalised whole",
    }
    tuning_notes: ClassVar[dict[str, str]] = {
        "torch_adam": "the AdamW half always runs shardspeed's own update (the same arithmetic)",
        "foreach": "the AdamW half always runs as foreach kernels",
    }
    key_hints: ClassVar[dict[str, str]] = _MAX_GRAD_NORM_HINT

    def half_settings(self) -> dict[str, Any]:
        """The values `muon_param_groups` reads: every key that is set (no lr: each half's own)."""
        keys = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "ns_method", "betas", "eps")
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}


OPTIMIZER_PARAMS: dict[str, type[StrictModel]] = {
    "Adam": AdamParams,
    "AdamW": AdamWParams,
    "Lamb": LambParams,
    "Adagrad": AdagradParams,
    "Lion": LionParams,
    "SGD": SGDParams,
    "OneBitAdam": OneBitAdamParams,
    "ZeroOneAdam": ZeroOneAdamParams,
    "OneBitLamb": OneBitLambParams,
    "Muon": MuonParams,
}

# DeepSpeed lower-cases the type before comparing it with its native optimizer names; any other
# type is looked up in torch.optim by its exact, case-sensitive name.
_NATIVE = {
    name.lower(): name
    for name in (
        "Adam",
        "AdamW",
        "Lamb",
        "Adagrad",
        "Lion",
        "OneBitAdam",
        "ZeroOneAdam",
        "OneBitLamb",
        "Muon",
    )
}
_TORCH_NAMED = frozenset({"SGD"})


def canonical_optimizer_name(name: str) -> str | None:
    """The `OPTIMIZER_PARAMS` key for an `optimizer.type`, or None if the type is not supported."""
    if name.lower() in _NATIVE:
        return _NATIVE[name.lower()]
    return name if name in _TORCH_NAMED else None
