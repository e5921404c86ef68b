"""The `scheduler.params` section: one strict model per DeepSpeed LR schedule (0.19.8 keys and defaults).

Learning rates and momenta may be one number for every param group or a list with one value per group,
as DeepSpeed's schedules allow. Every schedule also takes `last_batch_iteration` (-1 starts afresh).
Every key is honoured, so no model restricts `implemented`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from shardspeed.config.base import Int, NonNegativeInt, PositiveInt, StrictModel

__all__ = [
    "SCHEDULER_PARAMS",
    "LRRangeTestParams",
    "OneCycleParams",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
]

NonNegFloat = Annotated[float, Field(ge=0.0)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0)]
Momentum = Annotated[float, Field(ge=0.0, lt=1.0)]
PerGroupLr = NonNegFloat | Annotated[list[NonNegFloat], Field(min_length=1)]
PerGroupMomentum = Momentum | Annotated[list[Momentum], Field(min_length=1)]
LastBatch = Annotated[Int, Field(ge=-1)]
WarmupType = Literal["log", "linear"]


class WarmupLRParams(StrictModel):
    """WarmupLR: rise from `warmup_min_lr` to `warmup_max_lr` (None: the optimizer's lr), then hold."""

    warmup_min_lr: PerGroupLr = 0.0
    warmup_max_lr: PerGroupLr | None = None
    warmup_num_steps: NonNegativeInt = 1000  # 0 accepted here, as DeepSpeed's config does
    warmup_type: WarmupType = "log"
    last_batch_iteration: LastBatch = -1


class WarmupDecayLRParams(StrictModel):
    """WarmupDecayLR: WarmupLR's warmup, then a linear decay to 0 at `total_num_steps`."""

    total_num_steps: PositiveInt
    warmup_min_lr: PerGroupLr = 0.0
    warmup_max_lr: PerGroupLr | None = 0.001
    warmup_num_steps: NonNegativeInt = 1000  # 0 accepted here, as DeepSpeed's config does
    warmup_type: WarmupType = "log"
    last_batch_iteration: LastBatch = -1


class WarmupCosineLRParams(StrictModel):
    """WarmupCosineLR: ratios of the optimizer's lr; warm up to 1, then cosine down to `cos_min_ratio`."""

    total_num_steps: PositiveInt
    warmup_min_ratio: Ratio = 0.0
    warmup_num_steps: NonNegativeInt = 1000  # 0 accepted here, as DeepSpeed's config does
    cos_min_ratio: Ratio = 0.0001
    warmup_type: WarmupType = "log"
    last_batch_iteration: LastBatch = -1


class OneCycleParams(StrictModel):
    """OneCycle: one triangular lr cycle (momentum moving the other way), then optional decay."""

    cycle_min_lr: PerGroupLr
    cycle_max_lr: PerGroupLr
    decay_lr_rate: NonNegFloat = 0.0
    cycle_first_step_size: PositiveInt = 2000
    cycle_second_step_size: NonNegativeInt | None = None
    cycle_first_stair_count: NonNegativeInt = 0
    cycle_second_stair_count: NonNegativeInt | None = None
    decay_step_size: NonNegativeInt = 0
    cycle_momentum: bool = True
    cycle_min_mom: PerGroupMomentum = 0.8
    cycle_max_mom: PerGroupMomentum = 0.9
    decay_mom_rate: NonNegFloat = 0.0
    last_batch_iteration: LastBatch = -1


class LRRangeTestParams(StrictModel):
    """LRRangeTest: grow the lr from `lr_range_test_min_lr` by `step_rate` every `step_size` steps."""

    lr_range_test_min_lr: PerGroupLr = 1e-3
    lr_range_test_step_size: PositiveInt = 2000
    lr_range_test_step_rate: NonNegFloat = 1.0
    lr_range_test_staircase: bool = False
    last_batch_iteration: LastBatch = -1


# Keyed by DeepSpeed's exact (case-sensitive) scheduler type names.
SCHEDULER_PARAMS: dict[str, type[StrictModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}
