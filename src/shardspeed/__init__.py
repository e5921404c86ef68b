"""shardspeed: DeepSpeed's API on plain PyTorch. `import shardspeed as deepspeed` and keep your script."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from torch import nn
from tqdm import tqdm

from . import comm
from .comm import init_distributed
from .config import ConfigError, ShardSpeedConfig, load_config, non_default_settings
from .runtime import ShardSpeedEngine

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "ShardSpeedConfig",
    "ShardSpeedEngine",
    "__version__",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
]


class _RankZeroOnly(logging.Filter):
    """Every rank validates the same config; say things once (errors still come from every rank)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or comm.get_rank() == 0


class _ProgressBarSafeHandler(logging.StreamHandler):
    """Writes through tqdm, so log lines land above a running progress bar instead of inside it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def _setup_logging() -> None:
    logger = logging.getLogger("shardspeed")
    if logger.handlers:
        return
    handler = _ProgressBarSafeHandler()
    handler.setFormatter(logging.Formatter("[shardspeed] %(levelname)s %(message)s"))
    handler.addFilter(_RankZeroOnly())
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("SHARDSPEED_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


_setup_logging()


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's flags: --deepspeed, --deepspeed_config (and the deprecated --deepscale*)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable shardspeed")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[ShardSpeedEngine, Any, Any, Any]:
    """Build the engine, as `deepspeed.initialize`: returns (engine, optimizer, dataloader, scheduler)."""
    if model is None:
        raise ValueError("initialize() needs a model")
    if mesh_param is not None:
        raise ConfigError("mesh_param is not supported yet (issue 8: 3D topologies)")
    source = _config_source(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    topology = comm.Topology.build(mpu)
    run_config = load_config(source, topology.dp_world_size)
    logger = logging.getLogger("shardspeed")
    logger.info(
        "world size %d (data parallel %d), batch %d = micro %d x accumulation %d x %d ranks",
        topology.world_size,
        topology.dp_world_size,
        run_config.train_batch_size,
        run_config.train_micro_batch_size_per_gpu,
        run_config.gradient_accumulation_steps,
        topology.dp_world_size,
    )
    for line in non_default_settings(run_config):
        logger.info("config: %s", line)
    engine = ShardSpeedEngine(
        model,
        run_config,
        topology,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """Exactly one of config=, config_params= or args.deepspeed_config must name the config."""
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(
            args, "deepscale_config", None
        )
    given = {
        name: value
        for name, value in (
            ("config", config),
            ("config_params", config_params),
            ("args.deepspeed_config", from_args),
        )
        if value is not None
    }
    if not given:
        raise ConfigError(
            "no config given: pass config= (a dict or a JSON path) or --deepspeed_config on the "
            "command line (with add_config_arguments(parser))"
        )
    if len(given) > 1:
        raise ConfigError(f"the config is given twice ({' and '.join(given)}): keep one")
    return next(iter(given.values()))
