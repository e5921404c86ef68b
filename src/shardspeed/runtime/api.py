"""`initialize`: config source -> process group -> topology -> validated config -> engine.

The one module above every room: it chooses the engine's parts (a pipeline schedule for a
`PipelineModule`, hybrid generation when `hybrid_engine.enabled`), so that the engine itself
(`runtime.engine`) never imports `pipe` or `inference`, and they never import the runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import alias, checkpointing, comm, shardspeed_version
from ..alias import DEEPSPEED_VERSION
from ..comm import groups, init_distributed
from ..compat.deepspeed import git_version_info
from ..config import (
    ConfigError,
    RunFacts,
    ShardSpeedConfig,
    load_config,
    non_default_settings,
    read_config_source,
    refuse_combinations,
    tuning_report,
)
from ..config.schema import SequenceParallelConfig
from ..moe.auto_ep import apply_expert_parallel
from ..moe.layer import MoE
from ..pipe import PipelineModule
from ..pipe.engine import PipelineSchedule, check_config
from .engine import ShardSpeedEngine
from .sequence_parallel import parallel_state_sp
from .sequence_parallel.plan import SequencePlan, use_plan
from .sequence_parallel.tiled import tile_mlps

logger = logging.getLogger("shardspeed")


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
    source = _config_source(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    pipelined = isinstance(model, PipelineModule)
    if pipelined and mpu is not None:
        raise ValueError("a PipelineModule brings its own topology: do not pass mpu as well")
    config_dict = source if isinstance(source, dict) else read_config_source(source)
    run_config, topology, autotp_size = _configure(
        model, mpu, _with_sequence_mpu(_with_mesh_param(config_dict, mesh_param), mpu)
    )
    # The combination rules that need the model, before anything (tensor-parallel splitting
    # included) touches it.
    refuse_combinations(
        run_config,
        RunFacts(
            pipeline_module=pipelined,
            pipeline_stages=topology.num_stages,
            tensor_parallel_size=topology.tp_world_size,
            autotp_size=autotp_size,
            moe_ep_sizes=tuple(m.ep_size for m in model.modules() if isinstance(m, MoE)),
            zero_group_size=topology.get_sequence_data_parallel_world_size(),
        ),
    )
    _sequence_memory(model, run_config.sequence_parallel)
    if topology.tp_world_size > 1 and not pipelined and mpu is None:
        from ..tensor_parallel.from_config import apply_autotp
        from ..zero.init import materialize

        # A model built under zero.Init is whole again first: AutoTP slices whole weights (ZeRO
        # 3 then partitions each rank's slices).
        materialize(model.parameters())
        apply_autotp(model, topology.tp_group, run_config.tensor_parallel)
    _expert_parallel(model, run_config, topology)
    _log_run(run_config, topology)
    engine = ShardSpeedEngine(
        model,
        run_config,
        topology,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        config_dict=config_dict,
        components=_components(model, run_config),
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _expert_parallel(model: nn.Module, config: ShardSpeedConfig, topology: Any) -> None:
    """The `expert_parallel` section applied: the model's MoE blocks' experts spread over the
    mesh's expert groups (moe/auto_ep.py)."""
    section = config.expert_parallel
    if not section.enabled:
        return
    folded = topology.tp_world_size > 1  # AutoTP: experts spread over the tensor peers too
    # Sequence ranks hold different tokens for the MLPs, and tensor-parallel peers each take a
    # share of theirs: experts spread over both.
    ranks = topology.get_sequence_data_parallel_world_size() * topology.tp_world_size
    if ranks % section.autoep_size:
        what = "data-parallel" + (" x tensor-parallel" if folded else "")
        raise ConfigError(
            f"'expert_parallel.autoep_size' is {section.autoep_size}, which does not divide "
            f"the {ranks} {what} ranks experts spread over: use a divisor of it"
        )
    groups = topology.expert_groups(
        section.autoep_size,
        config.use_data_before_expert_parallelism,
        over_sequence=True,
        over_tensor=folded,
    )
    apply_expert_parallel(model, section, groups, token_peers=topology.tp_group if folded else None)


def _configure(
    model: nn.Module, mpu: Any, config_dict: dict[str, Any]
) -> tuple[ShardSpeedConfig, comm.Topology, int]:
    """The validated config, the topology it was resolved for, and the automatic
    tensor-parallel size asked for."""
    pipelined = isinstance(model, PipelineModule)
    topology: comm.Topology | None = None
    autotp_size = 0

    def data_parallel_size(config: Any) -> int:
        nonlocal topology, autotp_size
        autotp_size = _tensor_parallel_size(model, config)
        # A PipelineModule brings its topology; asking for automatic tensor or sequence
        # parallelism as well is refused with the other combinations.
        try:
            topology = (
                model.topo
                if pipelined
                else comm.Topology.build(mpu, autotp_size, config.sequence_parallel_size)
            )
        except ValueError as error:  # sizes that do not fit the world, named by their keys
            raise ConfigError(str(error)) from None
        if config.data_parallel_size not in (None, topology.dp_world_size):
            raise ConfigError(
                f"'data_parallel_size' is {config.data_parallel_size}, but the world of "
                f"{topology.world_size} ranks with 'sequence_parallel_size' "
                f"{topology.sp_world_size} has {topology.dp_world_size} data-parallel ranks: "
                "correct it or leave it out"
            )
        return topology.dp_world_size

    run_config = load_config(config_dict, data_parallel_size)
    comm.use_collective_timeout(run_config.comms_timeout_s, run_config.comms_same_call_check)
    groups.use_topology(topology)
    use_plan(SequencePlan.from_config(run_config))
    return run_config, topology, autotp_size


def _with_mesh_param(config_dict: dict[str, Any], mesh_param: Any) -> dict[str, Any]:
    """The config with DeepSpeed's `mesh_param=(data, sequence)` written in as
    'sequence_parallel_size' and 'data_parallel_size' (checked against the world with the
    rest), refusing a config that says otherwise."""
    if mesh_param is None:
        return config_dict
    if (
        not isinstance(mesh_param, (tuple, list))
        or len(mesh_param) != 2
        or not all(isinstance(size, int) and size >= 1 for size in mesh_param)
    ):
        raise ConfigError(
            f"mesh_param must be (data-parallel size, sequence-parallel size), two positive "
            f"integers, got {mesh_param!r}"
        )
    merged = dict(config_dict)
    for key, size in zip(("data_parallel_size", "sequence_parallel_size"), mesh_param):
        if merged.get(key, size) != size:
            raise ConfigError(
                f"mesh_param={tuple(mesh_param)} but the config says '{key}': {merged[key]}: "
                "make them agree or give one of the two"
            )
        merged[key] = size
    return merged


def _with_sequence_mpu(config_dict: dict[str, Any], mpu: Any) -> dict[str, Any]:
    """With the mpu that `UlyssesSPAttentionHF.register_with_transformers` returns: the config
    with its sequence-parallel size written in (refusing one that says otherwise). How the loss
    is spread over the sequence ranks is read from the loss at the first step."""
    if mpu is not parallel_state_sp:
        return config_dict
    size = mpu.get_sequence_parallel_world_size()
    merged = dict(config_dict)
    if merged.get("sequence_parallel_size", size) != size:
        raise ConfigError(
            f"register_with_transformers set up sequence parallelism over {size} ranks, but the "
            f"config says 'sequence_parallel_size': {merged['sequence_parallel_size']}: make "
            "them agree or leave the key out"
        )
    merged["sequence_parallel_size"] = size
    return merged


def _sequence_memory(model: nn.Module, section: SequenceParallelConfig) -> None:
    """ALST's memory settings of the config's `sequence_parallel` section, applied to the model:
    tiled MLPs, and a Hugging Face model's gradient checkpointing routed through ours (whose
    settings keep checkpoints in host memory; the engine turns that on)."""
    if not section.enabled:
        return
    if section.tiling.enabled and tile_mlps(model, section.tiling.chunk_size) == 0:
        raise ConfigError(
            "'sequence_parallel.tiling.enabled' tiles the submodules named 'mlp' (as Hugging "
            "Face decoder layers name their MLP), and this model has none: wrap its MLP in "
            "TiledMLP in the model code, or leave tiling off"
        )
    if section.memory_optimizations.enabled:
        checkpointing.route_gradient_checkpointing(model)


def _components(model: nn.Module, run_config: ShardSpeedConfig) -> list[Callable[[Any], Any]]:
    """The parts the engine is given for this model and config."""
    parts: list[Callable[[Any], Any]] = []
    if isinstance(model, PipelineModule):
        check_config(model, run_config)
        parts.append(PipelineSchedule)
    if run_config.hybrid_engine.enabled:
        from ..inference.hybrid import HybridGeneration  # loads generation only when asked for

        parts.append(HybridGeneration)
    return parts


def _log_run(run_config: ShardSpeedConfig, topology: comm.Topology) -> None:
    logger.info(
        "shardspeed %s%s",
        shardspeed_version,
        f" standing in for deepspeed {DEEPSPEED_VERSION}" if alias.is_installed() else "",
    )
    # DeepSpeed's own line at initialize (transformers' and accelerate's tests look for it).
    logger.info(
        "DeepSpeed info: version=%s, git-hash=%s, git-branch=%s",
        DEEPSPEED_VERSION,
        git_version_info.git_hash,
        git_version_info.git_branch,
    )
    logger.info(
        "world size %d (data %d x pipeline %d x tensor %d x sequence %d), batch %d = micro %d "
        "x accumulation %d x %d ranks",
        topology.world_size,
        topology.dp_world_size,
        topology.num_stages,
        topology.tp_world_size,
        topology.sp_world_size,
        run_config.train_batch_size,
        run_config.train_micro_batch_size_per_gpu,
        run_config.gradient_accumulation_steps,
        topology.dp_world_size,
    )
    for line in non_default_settings(run_config):
        logger.info("config: %s", line)
    for line in tuning_report(run_config):
        logger.info("config: %s", line)


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


def tp_model_init(
    model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any
) -> nn.Module:
    """DeepSpeed's AutoTP entry point: records `tp_size` for `initialize`, which splits the model
    over tensor-parallel groups of that size (as DeepSpeed 0.19.8 does: the split happens there).
    `dtype` must agree with the config's precision. `config` (a dict or JSON path, as transformers
    passes the run's config) may repeat `tensor_parallel.autotp_size`; the config given to
    `initialize` is the one that configures the run, as in DeepSpeed."""
    if kwargs:
        raise ValueError(
            f"tp_model_init({', '.join(sorted(kwargs))}=...) is not supported: give the "
            "'tensor_parallel' section to initialize()"
        )
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")
    if config is not None:
        section = read_config_source(config).get("tensor_parallel") or {}
        size = section.get("autotp_size", tp_size) if isinstance(section, dict) else tp_size
        if size not in (0, tp_size):
            raise ConfigError(
                f"tp_model_init(tp_size={tp_size}) but its config says "
                f"'tensor_parallel.autotp_size': {size}: make them agree"
            )
    model._shardspeed_tp_init = (tp_size, dtype)
    return model


_PRECISION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _tensor_parallel_size(model: nn.Module, config: Any) -> int:
    """`tensor_parallel.autotp_size`, or what `tp_model_init` recorded; they must agree."""
    size = config.tensor_parallel.autotp_size
    recorded = getattr(model, "_shardspeed_tp_init", None)
    if recorded is None:
        return size
    tp_size, dtype = recorded
    if size not in (0, tp_size):
        raise ConfigError(
            f"tensor_parallel.autotp_size is {size} but tp_model_init() asked for {tp_size}"
        )
    if dtype != _PRECISION_DTYPES[config.precision]:
        raise ConfigError(
            f"tp_model_init(dtype={dtype}) but the config trains in {config.precision}: set the "
            "fp16 / bf16 section to match"
        )
    return tp_size
