"""DeepSpeed's learning-rate schedules (0.19.8 formulas), with DeepSpeed's scheduler API.

These are not `torch.optim.lr_scheduler.LRScheduler` subclasses: like DeepSpeed's, each one is stepped
once per optimizer step, counts in `last_batch_iteration` (-1 before the first step), writes the lr of
every param group on construction when starting afresh, and checkpoints only `last_batch_iteration`.
Learning rates may be given once for all param groups or as a list with one value per group.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "VALID_LR_SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]

# DeepSpeed's schedule type names (accelerate hands a client scheduler of one of these types to
# initialize instead of wrapping it).
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# The `scheduler.params` key names of each schedule (DeepSpeed's names), so that callers building a
# config spell them the one way the schedules and `shardspeed.config.scheduler` accept.
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MOMENTUM = "cycle_momentum"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"
LAST_BATCH_ITERATION = "last_batch_iteration"

# The values `warmup_type` takes.
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

logger = logging.getLogger("shardspeed")

PerGroup = float | Sequence[float]


def _param_groups_owner(optimizer: Any) -> Any:
    """The object whose `param_groups` the schedule drives: the optimizer or the one it wraps."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and wraps none")


def _per_group(value: PerGroup, groups: int, name: str) -> list[float]:
    if isinstance(value, list | tuple):
        if len(value) != groups:
            raise ValueError(
                f"{name}: expected {groups} values (one per param group), got {len(value)}"
            )
        return list(value)
    return [value] * groups


def _set_lrs(param_groups: list[dict], lrs: Sequence[Any]) -> list[Any]:
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            # A tensor lr (fused/capturable optimizers) must keep its identity, so fill it in place.
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _warmup_fraction(iteration: int, num_steps: int, warmup_type: str) -> float:
    """How far warmup has progressed at `iteration` (0 at the start, reaching 1 at `num_steps`)."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> str:
    """Refuse a warmup length or curve the schedules cannot use; return the curve."""
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int):
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
    # DeepSpeed falls back to "log" with a warning; an unknown type is always a typo, so refuse it.
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    return warmup_type


class _Schedule:
    """The shared DeepSpeed scheduler API; subclasses supply `get_lr`."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _param_groups_owner(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[Any] | None = None

    def _start(self) -> None:
        # Only a fresh start writes the lr: a resumed schedule leaves the groups as loaded.
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list[float]:
        """The lr of each param group at `last_batch_iteration`."""
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: the next one) and write the new lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer.param_groups, self.get_lr())

    def get_last_lr(self) -> list[Any]:
        """The lrs last written to the optimizer."""
        if self._last_lr is None:
            raise RuntimeError("no learning rate has been set yet: call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        """The schedule's position, DeepSpeed's checkpoint format."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore the position; the lrs themselves come back with the optimizer state."""
        self.last_batch_iteration = state_dict["last_batch_iteration"]


class WarmupLR(_Schedule):
    """Raise the lr from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold it.

    `warmup_max_lr=None` uses each param group's lr. The log curve is min + (max-min)·ln(i+1)/ln(N);
    linear is min + (max-min)·i/N, for step index i < N (N is at least 2).
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in groups]
        self.min_lrs = _per_group(warmup_min_lr, len(groups), "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, len(groups), "warmup_max_lr")
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        # ln(1) would divide by zero in the log curve, so one warmup step counts as two.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self._start()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type
            )
        return 1.0

    def get_lr(self) -> list[float]:
        """The lr of each param group at `last_batch_iteration` (the min lr before the first step)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then a linear decay that reaches 0 at `total_num_steps` and stays there."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                warmup_num_steps,
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        span = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, remaining / span)


class WarmupCosineLR(_Schedule):
    """Scale each group's own lr by a ratio: warm up from `warmup_min_ratio` to 1, then follow a
    half cosine down to `cos_min_ratio` at `total_num_steps` and stay there. The lr is 0 until the
    first step."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                warmup_num_steps,
            )
        # The ratios apply to the lrs the groups had at construction, before this schedule wrote any.
        self.org_lrs = [
            group["lr"].clone() if torch.is_tensor(group["lr"]) else group["lr"]
            for group in self.optimizer.param_groups
        ]
        self._start()

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's original lr at `last_batch_iteration`."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type
            )
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so that steps past the end stay at the floor instead of climbing back up.
        progress = min(1.0, done / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """The lr of each param group at `last_batch_iteration`."""
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """The 1cycle policy: the lr climbs from `cycle_min_lr` to `cycle_max_lr` over
    `cycle_first_step_size` steps and falls back over `cycle_second_step_size` (default: the same),
    optionally in stairs; afterwards it decays as min_lr / (1 + decay_lr_rate·k/decay_step_size).

    With `cycle_momentum`, momentum moves the opposite way between `cycle_max_mom` and `cycle_min_mom`
    and grows as max_mom·(1 + decay_mom_rate·k/decay_step_size) afterwards. It drives `betas[0]` of
    Adam-like groups (keeping each group's own `betas[1]`) or `momentum` of SGD-like groups.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: PerGroup,
        cycle_max_lr: PerGroup,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: PerGroup = 0.8,
        cycle_max_mom: PerGroup = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be >= 0, got {cycle_second_step_size}")
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate

        groups = self.optimizer.param_groups
        self.min_lrs = _per_group(cycle_min_lr, len(groups), "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, len(groups), "cycle_max_lr")
        self._momentum_key = self._find_momentum_key() if cycle_momentum else None
        self.cycle_momentum = self._momentum_key is not None
        if self.cycle_momentum:
            self.min_moms = _per_group(cycle_min_mom, len(groups), "cycle_min_mom")
            self.max_moms = _per_group(cycle_max_mom, len(groups), "cycle_max_mom")
            if last_batch_iteration == -1:
                # As in DeepSpeed, a fresh cycle starts at the *minimum* momentum; the first step
                # then moves it next to the maximum, where the cycle formula begins.
                self._set_momenta(self.min_moms)
        self._start()

    def _find_momentum_key(self) -> str | None:
        defaults = self.optimizer.defaults
        if "betas" in defaults:
            return "betas"
        if "momentum" in defaults:
            return "momentum"
        logger.warning(
            "OneCycle: cycle_momentum is off because %s has neither betas nor momentum",
            type(self.optimizer).__name__,
        )
        return None

    def _set_momenta(self, momenta: list[float]) -> None:
        for group, momentum in zip(self.optimizer.param_groups, momenta):
            if self._momentum_key == "betas":
                group["betas"] = (momentum, group["betas"][1])
            else:
                group["momentum"] = momentum

    def _scale_factor(self) -> float:
        """Position within the cycle as a fraction of the amplitude: 0 at the ends, 1 at the peak."""
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # Stairs are counted from the integer offset in the cycle: flooring the float scale
            # could fall a whole stair short at a boundary that should land exactly on one.
            offset = iteration % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        """The lr of each param group at `last_batch_iteration`."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval()
        return [low / factor for low in self.min_lrs]

    def _momenta(self) -> list[float]:
        """The cycled momentum (betas[0] or `momentum`) of each param group at `last_batch_iteration`."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval()
        return [high * factor for high in self.max_moms]

    def get_mom(self) -> list[Any] | None:
        """Each param group's momentum at `last_batch_iteration` in the optimizer's own form: a
        `(beta0, beta1)` pair for Adam-like groups (as DeepSpeed returns it; beta1 is the group's),
        a number for SGD-like groups; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        momenta = self._momenta()
        if self._momentum_key == "betas":
            return [
                (momentum, group["betas"][1])
                for group, momentum in zip(self.optimizer.param_groups, momenta)
            ]
        return momenta

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or to `last_batch_iteration`) and write the lrs and momenta."""
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._set_momenta(self._momenta())


class LRRangeTest(_Schedule):
    """The LR range test: lr = min_lr·(1 + step_rate·(i+1)/step_size) at step index i, with the
    fraction floored when `lr_range_test_staircase`."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: PerGroup = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        if (
            isinstance(lr_range_test_step_size, bool)
            or not isinstance(lr_range_test_step_size, int)
            or lr_range_test_step_size <= 0
        ):
            raise ValueError(
                f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}"
            )
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        self.min_lr = _per_group(lr_range_test_min_lr, len(groups), "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def get_lr(self) -> list[float]:
        """The lr of each param group at `last_batch_iteration`."""
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1.0 + self.step_rate * interval) for low in self.min_lr]
