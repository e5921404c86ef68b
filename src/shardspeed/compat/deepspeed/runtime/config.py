"""DeepSpeed's `deepspeed.runtime.config`: `DeepSpeedConfig`, the parsed config object.

It is shardspeed's validated config (the config room's `load_config`) under the attribute names
DeepSpeed's object has. Every section and top-level key is an attribute of the same name; the
names DeepSpeed spells differently (`zero_config`, `bfloat16_enabled`, ...) are properties.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from shardspeed.config import ConfigError, ShardSpeedConfig, load_config, resolve_batch
from shardspeed.config.loader import read_config_source

from .constants import GRADIENT_CLIPPING_DEFAULT

# DeepSpeed's optimizer type names (config "type", compared lower-case).
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
ADAGRAD_OPTIMIZER = "adagrad"
LION_OPTIMIZER = "lion"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    LION_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    MUON_OPTIMIZER,
]


class DeepSpeedConfigError(ConfigError):
    """DeepSpeed's name for a config that cannot be run."""


def get_gradient_clipping(param_dict: dict[str, Any]) -> float:
    """`gradient_clipping` as written, else its default."""
    return param_dict.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)


class DeepSpeedConfig:
    """The validated config of `config` (a dict, a JSON path or base64 JSON), for `mpu`'s ranks.

    The data-parallel size comes from `mpu` when given, else from the default process group.
    `_configure_train_batch_size()` resolves the batch triple again from the three attributes, raising
    AssertionError when they do not fit (DeepSpeed's contract for that method).
    """

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        self._param_dict = read_config_source(config)
        if mpu is not None:
            self.world_size = mpu.get_data_parallel_world_size()
        elif dist.is_initialized():
            self.world_size = dist.get_world_size()
        else:
            self.world_size = 1
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.run_config: ShardSpeedConfig = load_config(self._param_dict, self.world_size)
        self.train_batch_size = self.run_config.train_batch_size
        self.train_micro_batch_size_per_gpu = self.run_config.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = self.run_config.gradient_accumulation_steps

    def __getattr__(self, name: str) -> Any:
        if name != "run_config" and name in ShardSpeedConfig.model_fields:
            return getattr(self.run_config, name)
        raise AttributeError(f"'DeepSpeedConfig' object has no attribute {name!r}")

    def _configure_train_batch_size(self) -> None:
        try:
            triple = resolve_batch(
                self.train_batch_size,
                self.train_micro_batch_size_per_gpu,
                self.gradient_accumulation_steps,
                self.world_size,
            )
        except ConfigError as error:
            raise AssertionError(str(error)) from None
        (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        ) = triple

    @property
    def zero_config(self) -> Any:
        return self.run_config.zero_optimization

    @property
    def zero_optimization_stage(self) -> int:
        return self.run_config.zero_optimization.stage

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization_stage > 0

    @property
    def fp16_enabled(self) -> bool:
        return self.run_config.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.run_config.bf16.enabled

    bf16_enabled = bfloat16_enabled

    @property
    def float16_config(self) -> Any:
        return self.run_config.fp16

    @property
    def bfloat16_config(self) -> Any:
        return self.run_config.bf16

    @property
    def optimizer_name(self) -> str | None:
        section = self.run_config.optimizer
        return None if section is None else section.type.lower()

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        section = self.run_config.optimizer
        return None if section is None else dict(section.params)

    @property
    def scheduler_name(self) -> str | None:
        section = self.run_config.scheduler
        return None if section is None else section.type

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        section = self.run_config.scheduler
        return None if section is None else dict(section.params)

    @property
    def monitor_config(self) -> Any:
        return self.run_config

    @property
    def pipeline(self) -> dict[str, Any]:
        return self.run_config.pipeline.model_dump()

    @property
    def checkpoint_config(self) -> Any:
        return self.run_config.checkpoint

    @property
    def activation_checkpointing_config(self) -> Any:
        return self.run_config.activation_checkpointing

    @property
    def flops_profiler_config(self) -> Any:
        return self.run_config.flops_profiler

    @property
    def comms_config(self) -> Any:
        return self.run_config.comms_logger

    @property
    def grad_accum_dtype(self) -> str | None:
        return self.run_config.data_types.grad_accum_dtype
