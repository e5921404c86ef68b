"""DeepSpeed's `deepspeed.utils.timer` helpers that user code imports."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import mean


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """The mean of `data` without the `trim_percent` smallest and largest values."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be between 0 and 1, got {trim_percent}")
    if not data:
        return 0
    ordered = sorted(data)
    cut = round(len(ordered) * trim_percent)
    return mean(ordered[cut : len(ordered) - cut])
