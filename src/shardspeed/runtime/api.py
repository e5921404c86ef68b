"""`initialize`: config source -> process group -> topology -> validated config -> engine."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .. import comm
from ..comm import init_distributed
from ..config import ConfigError, load_config, non_default_settings
from ..pipe import PipelineEngine, PipelineModule
from .engine import ShardSpeedEngine


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
    pipelined = isinstance(model, PipelineModule)
    if pipelined and mpu is not None:
        raise ValueError("a PipelineModule brings its own topology: do not pass mpu as well")
    topology = model.topo if pipelined else comm.Topology.build(mpu)
    run_config = load_config(source, topology.dp_world_size)
    if not pipelined and run_config.pipeline != type(run_config.pipeline)():
        raise ConfigError(
            "the 'pipeline' section configures a PipelineModule (shardspeed.pipe), and the "
            f"model is a {type(model).__name__}: remove the section or build a PipelineModule"
        )
    logger = logging.getLogger("shardspeed")
    logger.info(
        "world size %d (data parallel %d, pipeline stages %d), batch %d = micro %d x accumulation %d x %d ranks",
        topology.world_size,
        topology.dp_world_size,
        topology.num_stages,
        run_config.train_batch_size,
        run_config.train_micro_batch_size_per_gpu,
        run_config.gradient_accumulation_steps,
        topology.dp_world_size,
    )
    for line in non_default_settings(run_config):
        logger.info("config: %s", line)
    engine_class = PipelineEngine if pipelined else ShardSpeedEngine
    engine = engine_class(
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
