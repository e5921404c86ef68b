"""DeepSpeed's module layout under the alias: what running DeepSpeed's own unit tests taught.

The layout modules (shardspeed.compat.deepspeed) are adapters over the rooms; these tests check
that each answers as DeepSpeed's module does for what scripts and DeepSpeed's tests use, and that
the rooms' additions behave.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

from reference_training import GLOBAL_BATCH, config, make_model
from shardspeed.compat.deepspeed.ops import op_builder
from shardspeed.compat.deepspeed.runtime.config import DeepSpeedConfig
from shardspeed.compat.deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from shardspeed.compat.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from shardspeed.compat.deepspeed.utils.torch import required_torch_version
from shardspeed.config import ConfigError
from shardspeed.runtime.dataloader import RepeatingLoader
from shardspeed.utils import (
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    z3_leaf_module,
)
from shardspeed.zero.init import Init, single_rank_group_problem

# Every module below is imported under the alias in one fresh process: a name that the layout
# lost shows up as an ImportError naming it.
_ALIAS_IMPORTS = """
import shardspeed.compat
shardspeed.compat.install()
import deepspeed
from deepspeed import OnDevice, get_accelerator, log_dist, logger, DeepSpeedConfig
from deepspeed.git_version_info import torch_info, version
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
from deepspeed.runtime.config import ADAM_OPTIMIZER, get_gradient_clipping
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
from deepspeed.runtime.precision_config import get_bfloat16_config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.runtime.zero.partition_parameters import _contradicting_single_rank_pg_error
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid
from deepspeed.runtime.pipe.schedule import TrainSchedule
from deepspeed.runtime.lr_schedules import WARMUP_MIN_LR, LR_RANGE_TEST_MIN_LR, CYCLE_MIN_LR
from deepspeed.runtime import lr_schedules, zero
from deepspeed.utils import RepeatingLoader, set_log_level_from_string, groups
from deepspeed.utils import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix
from deepspeed.utils.torch import required_torch_version
from deepspeed.utils.timer import trim_mean
from deepspeed.utils.numa import parse_range_list
from deepspeed.launcher.runner import parse_resource_filter
import deepspeed.comm as dist
assert callable(dist.destroy_process_group)
assert deepspeed.__git_hash__ and deepspeed.__git_branch__
assert deepspeed.runtime.zero is deepspeed.runtime.zero
print("ok")
"""


def test_deepspeed_layout_imports_under_the_alias() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ALIAS_IMPORTS], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr


def test_op_builders_say_what_runs_without_compiling() -> None:
    assert op_builder.CPUAdamBuilder().is_compatible()
    assert op_builder.FusedAdamBuilder().is_compatible()
    missing = [b for b in op_builder.ALL_OPS.values() if not b.is_compatible()]
    assert missing, "every DeepSpeed op cannot be provided: some builders must say no"
    with pytest.raises(RuntimeError, match="does not provide this op"):
        missing[0].load()


def test_zero_config_reads_deepspeeds_names_and_stays_strict() -> None:
    old = DeepSpeedZeroConfig(stage=3, stage3_gather_fp16_weights_on_model_save=True)
    assert old.gather_16bit_weights_on_model_save is True
    assert old.stage == ZeroStageEnum.weights
    assert DeepSpeedZeroConfig().leaf_module.classes == DeepSpeedZeroConfig().leaf_module.classes
    with pytest.raises(ConfigError, match="stagee"):
        DeepSpeedZeroConfig(stagee=2)
    # The enum members are the strings the config takes.
    offloaded = DeepSpeedZeroConfig(stage=2, offload_optimizer={"device": OffloadDeviceEnum.cpu})
    assert offloaded.offload_optimizer.device == "cpu"


def test_deepspeed_config_resolves_the_batch_triple() -> None:
    parsed = DeepSpeedConfig(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    )
    assert parsed.train_batch_size == 6
    parsed.train_batch_size = 7
    with pytest.raises(AssertionError):
        parsed._configure_train_batch_size()


def test_repeating_loader_starts_again() -> None:
    assert [x for _, x in zip(range(5), RepeatingLoader([1, 2]))] == [1, 2, 1, 2, 1]


def test_required_torch_version() -> None:
    assert required_torch_version(min_version=1.8)
    assert not required_torch_version(max_version=1.0)


def test_leaf_modules_by_name_and_suffix() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    found, missing = set_z3_leaf_modules_by_name(model, ["1", "nope"], raise_if_not_found=False)
    assert found == [model[1]] and missing == ["nope"] and z3_leaf_module(model[1])
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    found, missing = set_z3_leaf_modules_by_suffix(model, ["0"])
    assert {id(m) for m in found} == {id(model[0]), id(model[1][0])} and not missing


def test_zero_init_refuses_a_one_rank_group_under_a_multi_process_launcher() -> None:
    problem = single_rank_group_problem(1, None, {"WORLD_SIZE": "8"})
    assert problem is not None and "WORLD_SIZE=8" in problem and "init_distributed" in problem
    assert single_rank_group_problem(1, None, {"WORLD_SIZE": "1"}) is None
    assert single_rank_group_problem(1, object(), {"WORLD_SIZE": "8"}) is None
    assert single_rank_group_problem(8, None, {"WORLD_SIZE": "8"}) is None
    assert single_rank_group_problem(1, None, {"WORLD_SIZE": "eight"}) is None


def test_disabled_zero_init_accepts_any_stage() -> None:
    # DeepSpeed's scripts write `zero.Init(enabled=stage == 3, config_dict_or_path=cfg)`.
    with Init(enabled=False, config_dict_or_path={"zero_optimization": {"stage": 0}}):
        layer = nn.Linear(2, 2)
    assert layer.weight.numel() == 4


def test_see_memory_usage_reports_only_when_forced(caplog: pytest.LogCaptureFixture) -> None:
    from shardspeed.compat.deepspeed.runtime.utils import see_memory_usage

    with caplog.at_level(logging.INFO, logger="shardspeed"):
        see_memory_usage("quiet")
        see_memory_usage("after forward", force=True)
    assert "quiet" not in caplog.text and "after forward" in caplog.text


def _wrapper_names() -> dict[str, list[str]]:
    from shardspeed.compat.deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from shardspeed.compat.deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from shardspeed.runtime.api import initialize
    from shardspeed.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from shardspeed.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    classes = [
        DeepSpeedZeroOptimizer,
        DeepSpeedZeroOptimizer_Stage3,
        BF16_Optimizer,
        FP16_UnfusedOptimizer,
    ]
    seen = {}
    for name, extra in (
        ("fp32-0", {}),
        ("fp32-2", {"zero_optimization": {"stage": 2}}),
        ("fp32-3", {"zero_optimization": {"stage": 3}}),
        ("bf16-0", {"bf16": {"enabled": True}}),
        (
            "bf16-0-fp32grads",
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
        ),
        ("bf16-1", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}),
        (
            "bf16-1-fp32grads",
            {
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 1},
                "data_types": {"grad_accum_dtype": "fp32"},
            },
        ),
        (
            "bf16-0-bf16grads",
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
        ),
    ):
        _, optimizer, _, _ = initialize(model=make_model(), config=config(GLOBAL_BATCH, **extra))
        seen[name] = [c.__name__ for c in classes if isinstance(optimizer, c)]
    return seen


def test_optimizer_class_names_follow_deepspeeds_choice() -> None:
    # One rank: stage 3 runs as stage 1 here, yet DeepSpeed's class is the configured stage's.
    assert _wrapper_names() == {
        "fp32-0": [],
        "fp32-2": ["DeepSpeedZeroOptimizer"],
        "fp32-3": ["DeepSpeedZeroOptimizer_Stage3"],
        "bf16-0": ["FP16_UnfusedOptimizer"],
        "bf16-0-fp32grads": ["BF16_Optimizer"],
        "bf16-1": ["DeepSpeedZeroOptimizer"],
        "bf16-1-fp32grads": ["BF16_Optimizer"],
        "bf16-0-bf16grads": ["FP16_UnfusedOptimizer"],
    }


def test_wrapper_names_are_not_constructible() -> None:
    from shardspeed.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    with pytest.raises(TypeError, match="initialize"):
        DeepSpeedZeroOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))


class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.register_buffer("inv_freq", torch.full((4,), 1.0 / 3.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.proj(x) * self.inv_freq.to(x.dtype), y)


@pytest.mark.parametrize("buffer_dtype", [None, "bf16"])
def test_bf16_casts_parameters_and_keeps_buffers(buffer_dtype: str | None) -> None:
    from shardspeed.runtime.api import initialize

    extra = {"bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}}
    if buffer_dtype:
        extra["data_types"]["buffer_dtype"] = buffer_dtype
    engine, _, _, _ = initialize(model=_Rotary(), config=config(GLOBAL_BATCH, **extra))
    assert engine.module.proj.weight.dtype == torch.bfloat16
    expected = torch.bfloat16 if buffer_dtype else torch.float32
    assert engine.module.inv_freq.dtype == expected


def test_param_dtype_must_match_the_precision() -> None:
    from shardspeed.runtime.api import initialize

    extra = {"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}}
    with pytest.raises(ConfigError, match=r"data_types\.param_dtype"):
        initialize(model=_Rotary(), config=config(GLOBAL_BATCH, **extra))


def test_engine_get_mom_reports_betas_pairs_and_momentum() -> None:
    from shardspeed.runtime.api import initialize

    engine, _, _, _ = initialize(model=make_model(), config=config(GLOBAL_BATCH))
    assert engine.get_mom() == [(0.9, 0.999)]
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5}}}
    engine, _, _, _ = initialize(model=make_model(), config={**config(GLOBAL_BATCH), **sgd})
    assert engine.get_mom() == [0.5]


def test_bad_inputs_are_refused_at_initialize() -> None:
    from shardspeed.runtime.api import initialize

    model = make_model()
    groups = [{"params": list(model.parameters()), "lr": "0.01"}]
    with pytest.raises(ValueError, match=r"param group 0: 'lr' is '0\.01' \(str\)"):
        no_section = {k: v for k, v in config(GLOBAL_BATCH).items() if k != "optimizer"}
        initialize(model=model, optimizer=torch.optim.AdamW(groups), config=no_section)
    data = [(torch.zeros(8), torch.zeros(4))] * (GLOBAL_BATCH - 1)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        initialize(model=make_model(), training_data=data, config=config(GLOBAL_BATCH))
    with pytest.raises(ValueError, match="training_data has no samples"):
        initialize(model=make_model(), training_data=[], config=config(GLOBAL_BATCH))
