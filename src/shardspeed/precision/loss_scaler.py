"""fp16 loss scaling with DeepSpeed's rules: a fixed scale, or one that shrinks on overflow and grows
after a run of clean steps.

The scale is a Python float on the host. The engine decides once per optimizer step whether any
gradient overflowed and calls `update(overflow)` with that one bool, so the scaler never touches a
tensor and never forces a device sync of its own.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch.distributed as dist

logger = logging.getLogger("shardspeed")


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed while the dynamic loss scale was already at `min_loss_scale`."""


def _on_first_rank() -> bool:
    # Every rank sees the same overflow decision, so only rank 0 reports it, as DeepSpeed does.
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _fmt(scale: float) -> str:
    """A scale as users read it: `65536` rather than `65536.0`, but `0.25` kept exact."""
    return str(int(scale)) if float(scale).is_integer() else repr(float(scale))


def _positive_finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class LossScaler:
    """Base of the loss scalers: holds the current scale; `update` is called once per optimizer step."""

    dynamic: bool = False

    def __init__(self, scale: float):
        self._scale = scale

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (and gradients divided by after)."""
        return self._scale

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step whose gradients did (`True`) or did not overflow."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain numbers and bools, so it can be stored as JSON."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        raise NotImplementedError

    def _kind_matches(self, state: dict[str, Any]) -> bool:
        # A checkpoint written with the other kind of scaler means the fp16 config changed between
        # runs; the new config is what the user asked for, so keep it and say so.
        if bool(state.get("dynamic")) == self.dynamic:
            return True
        saved, now = ("dynamic", "static") if state.get("dynamic") else ("static", "dynamic")
        logger.warning(
            "checkpoint holds a %s loss scaler but fp16.loss_scale now selects a %s one; "
            "keeping the configured scaler and ignoring the saved loss-scale state",
            saved,
            now,
        )
        return False


class StaticLossScaler(LossScaler):
    """A loss scale that never changes (`fp16.loss_scale` > 0)."""

    dynamic = False

    def __init__(self, scale: float):
        super().__init__(_positive_finite("loss scale", scale))

    def update(self, overflow: bool) -> None:
        """Leave the scale as it is; an overflow only gets reported, as DeepSpeed does."""
        if overflow and _on_first_rank():
            logger.warning(
                "[shardspeed] OVERFLOW! Skipping step. Gradients are non-finite, "
                "weights were not updated (static loss scale %s).",
                _fmt(self._scale),
            )

    def state_dict(self) -> dict[str, Any]:
        """`{"dynamic": False, "cur_scale": scale}`."""
        return {"dynamic": False, "cur_scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check the kind only: a static scale is configuration, so the current config's value wins."""
        self._kind_matches(state)


class DynamicLossScaler(LossScaler):
    """A loss scale that follows DeepSpeed's dynamic rules (`fp16.loss_scale` = 0).

    On an overflow the scale is divided by `scale_factor` (not below `min_scale`), unless hysteresis
    still has credit: with `delayed_shift` = n, the first n-1 overflows only use up credit. After
    `scale_window` clean steps counted from the step after the last overflow, the scale is multiplied
    by `scale_factor`. Credit is refilled at each growth, or on every clean step when
    `consecutive_hysteresis` is set.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ):
        super().__init__(_positive_finite("initial loss scale", init_scale))
        self.min_scale = _positive_finite("min_loss_scale", min_scale)
        if self._scale < self.min_scale:
            raise ValueError(
                f"initial loss scale {_fmt(self._scale)} is below min_loss_scale "
                f"{_fmt(self.min_scale)}; raise fp16.initial_scale_power or lower fp16.min_loss_scale"
            )
        self.scale_factor = _positive_finite("scale_factor", scale_factor)
        if self.scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}")
        self.scale_window = _positive_int("loss_scale_window", scale_window)
        self.delayed_shift = _positive_int("hysteresis", delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        # Steps seen so far (overflowing ones included) and the step of the last overflow; -1 makes
        # the very first step look like the step right after an overflow.
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def update(self, overflow: bool) -> None:
        """Apply one step's outcome; raises `LossScaleAtMinimumError` if it must go below the minimum."""
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
                logger.debug("consecutive hysteresis: credit restored to %d", self.delayed_shift)
            # Clean steps since the last overflow, not counting the first one after it; this is
            # DeepSpeed's count, so growth first happens on the (scale_window + 1)-th clean step.
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self._scale *= self.scale_factor
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift > 1 and self.cur_hysteresis > 1:
            if _on_first_rank():
                logger.info(
                    "[shardspeed] OVERFLOW! Skipping step. Attempted loss scale: %s, but hysteresis "
                    "is %d. Reducing hysteresis to %d",
                    _fmt(self._scale),
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
            self.cur_hysteresis -= 1
            return
        if self._scale == self.min_scale and self.raise_error_at_min_scale:
            raise LossScaleAtMinimumError(
                f"Current loss scale already at minimum ({_fmt(self.min_scale)}) - cannot decrease "
                "scale anymore, stopping. Gradients keep overflowing in fp16: look for inf/nan in the "
                "data or model, lower the learning rate, raise fp16.hysteresis, lower "
                "fp16.min_loss_scale, or train in bf16 instead."
            )
        reduced = max(self._scale / self.scale_factor, self.min_scale)
        if _on_first_rank():
            logger.info(
                "[shardspeed] OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s",
                _fmt(self._scale),
                _fmt(reduced),
            )
        self._scale = reduced

    def state_dict(self) -> dict[str, Any]:
        """The running state and, for reference, the settings it ran with."""
        return {
            "dynamic": True,
            "cur_scale": self._scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "min_scale": self.min_scale,
            "delayed_shift": self.delayed_shift,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "raise_error_at_min_scale": self.raise_error_at_min_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the running state; the settings stay as configured now, so a resumed run can
        change e.g. `loss_scale_window`."""
        if not self._kind_matches(state):
            return
        self._scale = max(float(state["cur_scale"]), self.min_scale)
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        # Saved credit can exceed a newly lowered `hysteresis`; never hold more than one refill.
        self.cur_hysteresis = min(int(state["cur_hysteresis"]), self.delayed_shift)


def build_loss_scaler(
    loss_scale: float,
    initial_scale_power: int,
    loss_scale_window: int,
    hysteresis: int,
    consecutive_hysteresis: bool,
    min_loss_scale: float,
) -> LossScaler:
    """The scaler the `fp16` config section asks for: `loss_scale` 0 means dynamic, > 0 static."""
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float):
        raise TypeError(f"fp16.loss_scale must be a number, got {loss_scale!r}")
    if not math.isfinite(loss_scale) or loss_scale < 0:
        raise ValueError(
            f"fp16.loss_scale must be a finite number >= 0 (0 selects dynamic scaling), got {loss_scale!r}"
        )
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**initial_scale_power,
        scale_window=loss_scale_window,
        min_scale=min_loss_scale,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
    )
