"""The config room: DeepSpeed's JSON schema as strict pydantic models, parsed and checked once."""

from .batch import resolve_batch
from .errors import ConfigError
from .loader import (
    load_config,
    non_default_settings,
    optimizer_params,
    read_config_source,
    scheduler_params,
    tuning_report,
)
from .rules import RULES, RunFacts, combination_problems, refuse_combinations
from .schema import ShardSpeedConfig

__all__ = [
    "RULES",
    "ConfigError",
    "RunFacts",
    "ShardSpeedConfig",
    "combination_problems",
    "load_config",
    "non_default_settings",
    "optimizer_params",
    "read_config_source",
    "refuse_combinations",
    "resolve_batch",
    "scheduler_params",
    "tuning_report",
]
