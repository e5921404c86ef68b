"""Plans for clusters checked on one machine: `dry_run` runs the real `initialize` and training
steps as chosen ranks of the full world on torch's fake process group with meta tensors, and
reports each rank's memory and each step's collectives (docs/planning.md)."""

from ..autotuning.systems import GPUS, SYSTEMS, Cluster
from .dry_run import MEMORY_KINDS, Collective, DryRun, RankPlan, dry_run, measure_rank, train_step
from .models import PRESETS, build_model

__all__ = [
    "GPUS",
    "MEMORY_KINDS",
    "PRESETS",
    "SYSTEMS",
    "Cluster",
    "Collective",
    "DryRun",
    "RankPlan",
    "build_model",
    "dry_run",
    "measure_rank",
    "train_step",
]
