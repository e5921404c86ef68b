"""Autotuning: pick the ZeRO stage, micro-batch size and accumulation steps by measured trials.

:mod:`.planner` estimates memory and step time to prune and order candidates; :mod:`.tuner` runs the
trials (``shardspeed --autotuning tune|run``). The tuner is imported on first use: it is also run as
``python -m shardspeed.autotuning.tuner`` for its bandwidth probe, which must not find it imported.
"""

from __future__ import annotations

from typing import Any

from .planner import Candidate, Estimate, Measurement, Plan, Planner, enumerate_candidates

__all__ = [
    "Autotuner",
    "Candidate",
    "Estimate",
    "Measurement",
    "Plan",
    "Planner",
    "enumerate_candidates",
    "run_autotuning",
]


def __getattr__(name: str) -> Any:
    if name in ("Autotuner", "run_autotuning"):
        from . import tuner

        return getattr(tuner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
