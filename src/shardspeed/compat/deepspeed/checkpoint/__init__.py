"""Modules of DeepSpeed's `deepspeed.checkpoint` that shardspeed.checkpoint has no module for, and
in `__all__` the names DeepSpeed's package exports that shardspeed.checkpoint lacks: the key-name
constants and the model-states file name. DeepSpeed's checkpoint reshaping classes
(`DeepSpeedCheckpoint`, `ZeROCheckpoint`) and `ds_to_universal` have no shardspeed counterpart.
"""

from shardspeed.checkpoint.deepspeed import get_model_ckpt_name_for_rank

from . import constants
from .constants import *  # noqa: F403  (DeepSpeed's package re-exports its constants the same way)

__all__ = [*constants.__all__, "get_model_ckpt_name_for_rank"]
