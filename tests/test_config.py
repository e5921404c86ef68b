"""The config room: every section, the batch arithmetic, and a corpus of bad configs."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import re

import pytest

from shardspeed.config import (
    RULES,
    ConfigError,
    RunFacts,
    ShardSpeedConfig,
    combination_problems,
    load_config,
    non_default_settings,
    refuse_combinations,
    resolve_batch,
)
from shardspeed.config.loader import optimizer_params, scheduler_params

BASE = {"train_micro_batch_size_per_gpu": 2}


def load(extra: dict, world: int = 1):
    return load_config({**BASE, **extra}, world)


# -- batch arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ((32, None, None), 1, (32, 32, 1)),  # only tbs: gas 1, micro = tbs / world
        ((32, None, None), 4, (32, 8, 1)),
        ((None, 4, None), 2, (8, 4, 1)),  # only micro: gas 1
        ((None, 4, 3), 2, (24, 4, 3)),
        ((32, 4, None), 2, (32, 4, 4)),  # gas derived
        ((32, None, 4), 2, (32, 4, 4)),  # micro derived
        ((16, 2, 2), 4, (16, 2, 2)),  # all three consistent
    ],
)
def test_batch_arithmetic(given, world, expected):
    assert resolve_batch(*given, world) == expected


def test_batch_mismatch_shows_the_equation():
    with pytest.raises(ConfigError, match=r"7\) != train_micro_batch_size_per_gpu \(2\) x .*= 2"):
        resolve_batch(7, 2, 1, 1)


def test_batch_not_divisible():
    with pytest.raises(ConfigError, match="cannot derive 'gradient_accumulation_steps'"):
        resolve_batch(10, 4, None, 1)


def test_batch_needs_a_size():
    with pytest.raises(ConfigError, match="set 'train_batch_size' or"):
        load_config({"gradient_accumulation_steps": 2}, 1)


def test_batch_uses_dp_world_size():
    config = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 4)
    assert config.gradient_accumulation_steps == 2


def test_auto_batch_resolved_when_determined():
    config = load_config(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        },
        2,
    )
    assert config.train_batch_size == 16


def test_auto_batch_refused_when_it_would_be_a_guess():
    with pytest.raises(ConfigError, match="'gradient_accumulation_steps' is \"auto\" but"):
        load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 1)


# -- sections and defaults --------------------------------------------------------------------


def test_defaults_follow_deepspeed_0_19_8():
    config = load({})
    assert config.gradient_clipping == 1.0
    assert config.steps_per_print is None
    assert config.fp16.initial_scale_power == 16
    assert config.fp16.loss_scale_window == 1000
    assert config.fp16.hysteresis == 2
    assert config.fp16.min_loss_scale == 1.0
    assert config.zero_optimization.stage == 0
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.precision == "fp32"


def test_every_in_scope_section_is_read():
    config = load(
        {
            "steps_per_print": 5,
            "wall_clock_breakdown": True,
            "gradient_clipping": 0.5,
            "prescale_gradients": True,
            "gradient_predivide_factor": 2.0,
            "communication_data_type": "bf16",
            "dataloader_drop_last": True,
            "optimizer": {"type": "adamw", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            "fp16": {
                "enabled": True,
                "auto_cast": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 100,
                "hysteresis": 3,
                "consecutive_hysteresis": True,
                "min_loss_scale": 0.5,
            },
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e7, "overlap_comm": False},
        }
    )
    assert config.precision == "fp16"
    assert config.fp16.hysteresis == 3 and config.fp16.consecutive_hysteresis
    assert config.zero_optimization.reduce_bucket_size == 50_000_000
    assert config.communication_data_type == "bf16"
    name, params = optimizer_params(config)
    assert name == "AdamW" and params.lr == 0.01 and tuple(params.betas) == (0.8, 0.9)
    name, params = scheduler_params(config)
    assert name == "WarmupLR" and params.warmup_num_steps == 10


def test_bf16_and_its_alias(caplog):
    assert load({"bf16": {"enabled": True}}).precision == "bf16"
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        assert load({"bfloat16": {"enabled": True}}).precision == "bf16"
    assert "'bfloat16' is deprecated: use 'bf16'" in caplog.text


def test_deprecated_zero_spellings_warn_and_map(caplog):
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        load(
            {
                "zero_optimization": {
                    "stage": 0,
                    "cpu_offload": True,
                    "prefetch_bucket_size": 1000,
                    "stage3_gather_fp16_weights_on_model_save": True,
                }
            }
        )
    assert "'zero_optimization.cpu_offload' is deprecated" in caplog.text
    assert "use 'zero_optimization.stage3_prefetch_bucket_size'" in caplog.text
    assert "use 'zero_optimization.stage3_gather_16bit_weights_on_model_save'" in caplog.text
    # The old flag maps to the modern block, which is then checked by its modern name.
    assert "'zero_optimization.offload_optimizer' = {'device': 'cpu'} only acts at ZeRO stage" in (
        caplog.text
    )
    zero = load(
        {
            "zero_optimization": {
                "stage": 3,
                "prefetch_bucket_size": 1000,
                "stage3_gather_fp16_weights_on_model_save": True,
            }
        }
    ).zero_optimization
    assert zero.stage3_prefetch_bucket_size == 1000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    # A disabled deprecated flag maps to nothing and is accepted.
    zero = load({"zero_optimization": {"cpu_offload": False}}).zero_optimization
    assert zero.offload_optimizer.device == "none"


def test_disabled_later_section_is_accepted():
    config = load({"tensorboard": {"enabled": False, "output_path": "x"}})
    assert not config.tensorboard.enabled and config.tensorboard.output_path == "x"


def test_config_from_json_file_and_base64(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    assert load_config(str(path), 2).train_micro_batch_size_per_gpu == 4
    encoded = base64.b64encode(json.dumps({"train_batch_size": 8}).encode()).decode()
    assert load_config(encoded, 1).train_micro_batch_size_per_gpu == 8


def test_duplicate_key_in_file_is_an_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}}')
    with pytest.raises(ConfigError, match="duplicate key 'enabled'"):
        load_config(str(path), 1)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such/ds_config.json", 1)


def test_non_default_settings_lists_changes():
    lines = non_default_settings(load({"gradient_clipping": 0.0, "fp16": {"enabled": True}}))
    assert "gradient_clipping = 0.0 (default 1.0)" in lines
    assert "fp16.enabled = True (default False)" in lines
    assert not any(line.startswith("bf16") for line in lines)


def test_auto_bucket_size_uses_default():
    assert (
        load(
            {"zero_optimization": {"reduce_bucket_size": "auto"}}
        ).zero_optimization.reduce_bucket_size
        == 500_000_000
    )


# -- the corpus of bad configs: each error names the key path -----------------------------------

BAD_CONFIGS = [
    ({"trian_batch_size": 4}, "unknown key 'trian_batch_size' (did you mean 'train_batch_size'?)"),
    (
        {"zero_optimization": {"stag": 0}},
        "unknown key 'zero_optimization.stag' (did you mean 'stage'?)",
    ),
    ({"zero_optimization": {"overlap_comms": True}}, "did you mean 'overlap_comm'?"),
    ({"bf16": {"enabeld": True}}, "unknown key 'bf16.enabeld' (did you mean 'enabled'?)"),
    ({"fp16": {"loss_scale_windows": 10}}, "'fp16.loss_scale_windows'"),
    ({"fp16": {"enabled": "yes"}}, "'fp16.enabled'"),
    ({"fp16": {"loss_scale": -1}}, "'fp16.loss_scale'"),
    ({"fp16": {"hysteresis": 0}}, "'fp16.hysteresis'"),
    ({"fp16": {"loss_scale_window": 1.5}}, "'fp16.loss_scale_window'"),
    ({"gradient_clipping": "abc"}, "'gradient_clipping'"),
    ({"gradient_clipping": -1.0}, "'gradient_clipping'"),
    ({"gradient_clipping": "auto"}, "'gradient_clipping' is \"auto\""),
    (
        {"optimizer": {"type": "Adam", "params": {"lr": "auto"}}},
        "'optimizer.params.lr' is \"auto\"",
    ),
    ({"zero_optimization": {"stage": 5}}, "'zero_optimization.stage'"),
    (
        {"zero_optimization": {"stage": 3, "leaf_module": {"names": "h", "classes": [1]}}},
        "'zero_optimization.leaf_module.classes[0]'",
    ),
    (
        {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 10}},
        "'zero_optimization.stage3_module_granularity_threshold' is not supported by shardspeed",
    ),
    (
        {
            "zero_optimization": {
                "stage": 1,
                "offload_optimizer": {"device": "cpu", "pipeline_read": True},
            }
        },
        "['pipeline_read'] act only with 'device' nvme",
    ),
    ({"zero_optimization": {"compute_grad_norm": False}}, "always computes the norm"),
    (
        {"zero_optimization": {"mics_shard_size": 2}},
        "'zero_optimization.mics_shard_size' is removed",
    ),
    ({"communication_data_type": "fp8"}, "'communication_data_type'"),
    ({"comms_timeout_s": 0}, "'comms_timeout_s': Input should be greater than 0"),
    ({"comms_timeout_s": "soon"}, "'comms_timeout_s': Input should be a valid number"),
    ({"comms_timeout_s": float("inf")}, "'comms_timeout_s': Input should be a finite number"),
    ({"steps_per_print": 0}, "'steps_per_print'"),
    ({"gradient_predivide_factor": 0}, "'gradient_predivide_factor'"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true: choose one"),
    (
        {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
        "both 'bfloat16' and its modern name 'bf16'",
    ),
    ({"amp": {"enabled": True}}, "'amp' is removed in DeepSpeed 0.19.8"),
    ({"elasticity": {"enabled": True}}, "'elasticity' is removed"),
    (
        {"activation_checkpointing": {"partition_activation": True}},
        "activation_checkpointing.partition_activation",
    ),
    (
        {"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}},
        "tensor_parallel.tp_overlap_comm",
    ),
    (
        {"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": ["x"]}]}}},
        "'tensor_parallel.partition_config.layer_specs[0].partition_type' is required",
    ),
    ({"pipeline": {"schedule": "zigzag"}}, "pipeline.schedule"),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
        "'device' nvme needs 'nvme_path'",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        "'zero_optimization.offload_param': 'device' nvme needs 'nvme_path'",
    ),
    (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
                "offload_optimizer": {"device": "cpu"},
            }
        },
        "'zero_optimization.offload_param.device' nvme needs an fp32 model and",
    ),
    (
        {"checkpoint": {"tag_validation": "Fial"}},
        "'checkpoint.tag_validation'",
    ),
    (
        {"checkpoint": {"use_node_local_storage": True}},
        "'checkpoint.use_node_local_storage' is not supported by shardspeed",
    ),
    ({"comet": {"enabled": True}}, "'comet'"),
    ({"hybrid_engine": {"enable_cuda_graph": True}}, "hybrid_engine.enable_cuda_graph"),
    ({"gradient_allreduce_op": "max"}, "'gradient_allreduce_op'"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "'fp16.fp16_master_weights_and_grads'"),
    ({"bf16": {"check_grad_overflow": False}}, "'bf16.check_grad_overflow'"),
    (
        {"optimizer": {"type": "AdamWW"}},
        "'optimizer.type': unknown type 'AdamWW' (did you mean 'AdamW'?)",
    ),
    (
        {"optimizer": {"type": "Adam", "params": {"wieght_decay": 0.1}}},
        "unknown key 'optimizer.params.wieght_decay' (did you mean 'weight_decay'?)",
    ),
    (
        {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
        "'optimizer.params.max_grad_norm' is not accepted here: use the top-level 'gradient_clipping'",
    ),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "'optimizer.params.betas"),
    ({"optimizer": {"type": "Adam", "params": {"lr": -1}}}, "'optimizer.params.lr'"),
    (
        {"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
        "'optimizer.params.bias_correction'",
    ),
    ({"optimizer": {"params": {"lr": 1}}}, "'optimizer.type' is required"),
    (
        {"optimizer": {"type": "Adam", "param": {}}},
        "unknown key 'optimizer.param' (did you mean 'params'?)",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
        "unknown key 'scheduler.params.warmup_num_step' (did you mean 'warmup_num_steps'?)",
    ),
    (
        {"scheduler": {"type": "WarmupDecayLR", "params": {}}},
        "'scheduler.params.total_num_steps' is required",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}},
        "'scheduler.params.warmup_type'",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}},
        "'scheduler.params.warmup_num_steps'",
    ),
    (
        {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}},
        "'scheduler.params.cycle_max_lr' is required",
    ),
    ({"scheduler": {"type": "Cosine"}}, "'scheduler.type': unknown type 'Cosine'"),
]


@pytest.mark.parametrize(
    ("extra", "expected"), BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))]
)
def test_bad_config_names_the_key(extra, expected):
    with pytest.raises(ConfigError) as err:
        load(extra)
    assert expected in str(err.value)


# -- keys real configs carry that change nothing: accepted, each with one warning ----------------

ACCEPTED_WITH_A_WARNING = [
    # A key that acts at other ZeRO stages only (configs are copied between stages).
    ({"zero_optimization": {"sub_group_size": 1000}}, "'zero_optimization.sub_group_size'"),
    (
        {"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 10}},
        "'zero_optimization.stage3_param_persistence_threshold' = 10 only acts at ZeRO stage 3; "
        "at stage 2 it changes nothing",
    ),
    (
        {"zero_optimization": {"stage": 3, "allgather_partitions": False}},
        "'zero_optimization.allgather_partitions' = False only acts at ZeRO stage 1 or 2",
    ),
    (
        {"zero_optimization": {"stage": 0, "reduce_scatter": False}},
        "'zero_optimization.reduce_scatter'",
    ),
    ({"disable_allgather": True}, "'disable_allgather' = True only acts at ZeRO stage 1 or 2"),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        "'zero_optimization.offload_optimizer'",
    ),
    ({"aio": {"block_size": 4096}}, "'aio' = {'block_size': 4096} only acts with an offload"),
    # DeepSpeed's rule for "auto" inside a section: the default; said aloud here.
    ({"fp16": {"enabled": "auto"}}, "'fp16.enabled' is \"auto\" and nothing filled it in"),
    # Listed keys that DeepSpeed ignores (config/ignored.py).
    ({"cuda_visible_devices": "0,1"}, "'cuda_visible_devices' is accepted and changes nothing"),
    ({"comms_config": {"verbose": False}}, "'comms_config' is accepted"),
    ({"monitor_config": {"enabled": True}}, "'monitor_config' is accepted"),
    ({"bf16": {"enabled": True, "loss_scale": 0}}, "'bf16.loss_scale' is accepted"),
    ({"bf16": {"enabled": True, "auto_cast": False}}, "'bf16.auto_cast' = False is accepted"),
    ({"fp16": {"enabled": True, "fp16": True}}, "'fp16.fp16' is accepted"),
]


@pytest.mark.parametrize(
    ("extra", "warning"),
    ACCEPTED_WITH_A_WARNING,
    ids=[str(i) for i in range(len(ACCEPTED_WITH_A_WARNING))],
)
def test_keys_that_change_nothing_are_accepted_with_a_warning(extra, warning, caplog):
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        load(extra)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum(warning in line for line in said) == 1, said


def test_comment_keys_are_accepted_and_named_once(caplog):
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        config = load(
            {
                "_comment": "copied from the docs",
                "zero_optimization": {"stage": 1, "_note": "x"},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            }
        )
    assert config.zero_optimization.stage == 1
    said = [r.getMessage() for r in caplog.records]
    assert "config comment keys, ignored: _comment, zero_optimization._note" in said
    # Not inside an optimizer's own keywords: there an underscore key is still an error.
    with pytest.raises(ConfigError, match=r"optimizer\.params\._lr"):
        load({"optimizer": {"type": "AdamW", "params": {"_lr": 1e-3}}})


def test_bf16_auto_cast_true_is_refused():
    with pytest.raises(ConfigError, match=r"'bf16\.auto_cast' = True is not offered"):
        load({"bf16": {"enabled": True, "auto_cast": True}})


def test_tuning_keys_are_honoured_and_reported():
    from shardspeed.config import tuning_report

    config = load(
        {
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {
                "stage": 2,
                "round_robin_gradients": True,
                "contiguous_gradients": False,
                "memory_efficient_linear": False,
                "reduce_bucket_size": 0,
                "sub_group_size": 0,
            },
            "activation_checkpointing": {
                "contiguous_memory_optimization": True,
                "number_checkpoints": 4,
            },
        }
    )
    report = tuning_report(config)
    for key in (
        "zero_force_ds_cpu_optimizer = False",
        "zero_optimization.round_robin_gradients = True",
        "zero_optimization.contiguous_gradients = False",
        "zero_optimization.memory_efficient_linear = False",
        "activation_checkpointing.contiguous_memory_optimization = True",
        "activation_checkpointing.number_checkpoints = 4",
    ):
        assert sum(line.startswith(key + ": ") for line in report) == 1, (key, report)
    assert config.zero_optimization.reduce_bucket_size == 0
    assert config.zero_optimization.sub_group_size == 0


def test_compile_timers_and_data_types_sections():
    config = load(
        {
            "compile": {"disable": False, "backend": "eager"},
            "timers": {"throughput": {"enabled": False}},
            "data_types": {"grad_accum_dtype": "fp32"},
        }
    )
    assert config.compile.compiles and config.compile.backend == "eager"
    assert not load({"compile": {"deepcompile": False}}).compile.compiles
    assert load({"compile": {"enabled": True}}).compile.compiles
    assert not config.timers.throughput.enabled
    assert config.data_types.grad_accum_dtype == "fp32"
    with pytest.raises(ConfigError, match="DeepCompile passes are not built"):
        load({"compile": {"deepcompile": True}})
    with pytest.raises(ConfigError, match=r"'data_types\.grad_accum_dtype'"):
        load({"data_types": {"grad_accum_dtype": "fp8"}})


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as err:
        load({"fp16": {"enabeld": True}, "zero_optimization": {"stag": 1}})
    assert len(err.value.problems) == 2


def test_error_lists_allowed_keys():
    with pytest.raises(ConfigError) as err:
        load({"fp16": {"xyz": 1}})
    assert "allowed keys: enabled, auto_cast, loss_scale" in str(err.value)


def test_input_dict_is_not_modified():
    raw = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bfloat16": {"enabled": True},
    }
    snapshot = json.loads(json.dumps(raw))
    load_config(raw, 1)
    assert raw == snapshot


def test_comms_timeout_is_unset_by_default_and_read_in_seconds():
    assert load({}).comms_timeout_s is None  # DEEPSPEED_TIMEOUT, else 10 minutes
    assert load({"comms_timeout_s": 90}).comms_timeout_s == 90.0
    assert "comms_timeout_s = 90.0 (default None)" in non_default_settings(
        load({"comms_timeout_s": 90})
    )


def test_config_keys_page_is_current():
    from pathlib import Path

    from shardspeed.config.report import render

    page = Path(__file__).resolve().parents[1] / "docs" / "config-keys.md"
    assert page.read_text() == render(), (
        "run: python -m shardspeed.config.report > docs/config-keys.md"
    )


def test_aio_thread_count_is_the_old_name_of_intra_op_parallelism(caplog):
    nvme = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        config = load({"zero_optimization": nvme, "aio": {"thread_count": 3}})
    assert config.aio.intra_op_parallelism == 3
    assert "'aio.thread_count' is deprecated: use 'aio.intra_op_parallelism'" in caplog.text
    with pytest.raises(ConfigError, match=r"both 'aio\.thread_count' and its modern name"):
        load({"zero_optimization": nvme, "aio": {"thread_count": 3, "intra_op_parallelism": 2}})


# -- the combination rules (config/rules.py) -----------------------------------------------------

# For every rule of the table: the config keys (over BASE) and the facts that make it refuse (None:
# the config alone does). A rule added to the table without a case here fails the first test.
RULE_TRIGGERS: dict[str, tuple[dict, RunFacts | None]] = {
    "one precision": ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, None),
    "param dtype is the precision": ({"data_types": {"param_dtype": "bf16"}}, None),
    "NVMe parameters are the fp32 masters": (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
                "offload_optimizer": {"device": "cpu"},
            }
        },
        None,
    ),
    "torch.compile without stage 3": (
        {"compile": {"enabled": True}, "zero_optimization": {"stage": 3}},
        None,
    ),
    "qgZ replaces the gradient reduce-scatter": (
        {
            "zero_optimization": {
                "stage": 3,
                "zero_quantized_gradients": True,
                "reduce_scatter": False,
            }
        },
        None,
    ),
    "stage 3 without a pipeline": (
        {"zero_optimization": {"stage": 3}},
        RunFacts(pipeline_module=True),
    ),
    "pipeline section for a PipelineModule": (
        {"pipeline": {"schedule": "gpipe"}},
        RunFacts(pipeline_module=False),
    ),
    "automatic tensor parallelism without a pipeline": (
        {"tensor_parallel": {"autotp_size": 2}},
        RunFacts(pipeline_module=True, autotp_size=2),
    ),
    "hybrid engine without a pipeline": (
        {"hybrid_engine": {"enabled": True}},
        RunFacts(pipeline_module=True),
    ),
    "MoE layers without tensor parallelism": (
        {},
        RunFacts(moe_ep_sizes=(2, 1), tensor_parallel_size=2),
    ),
    "the expert_parallel section with an mpu's tensor parallelism": (
        {"expert_parallel": {"enabled": True, "autoep_size": 2}},
        RunFacts(tensor_parallel_size=2, autotp_size=0),
    ),
    "moving experts at stage 0-2 with states in memory": (
        {
            "zero_optimization": {"stage": 3},
            "expert_parallel": {"enabled": True, "autoep_size": 2, "rebalance_interval": 10},
        },
        None,
    ),
    "experts without a pipeline": ({}, RunFacts(moe_ep_sizes=(2,), pipeline_stages=2)),
    "experts without stage 3": ({"zero_optimization": {"stage": 3}}, RunFacts(moe_ep_sizes=(2,))),
    "experts without hpZ": (
        {
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
            "expert_parallel": {"enabled": True, "autoep_size": 2},
        },
        RunFacts(moe_ep_sizes=()),
    ),
    "sequence parallelism without a pipeline": (
        {"sequence_parallel_size": 2},
        RunFacts(pipeline_module=True),
    ),
    "sequence parallelism without tensor parallelism": (
        {"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}},
        None,
    ),
    "experts without sequence parallelism": (
        {"sequence_parallel_size": 2},
        RunFacts(moe_ep_sizes=(2,)),
    ),
    "hybrid engine without sequence parallelism": (
        {"sequence_parallel_size": 2, "hybrid_engine": {"enabled": True}},
        None,
    ),
    "zero_quantized_weights only at stage 3": (
        {"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
        None,
    ),
    "zero_quantized_nontrainable_weights only at stage 3": (
        {"zero_optimization": {"stage": 2, "zero_quantized_nontrainable_weights": True}},
        None,
    ),
    "zero_quantized_gradients only at stage 3": (
        {"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
        None,
    ),
    "zero_hpz_partition_size only at stage 3": (
        {"zero_optimization": {"zero_hpz_partition_size": 2}},
        None,
    ),
    "hpZ nodes divide the ZeRO group": (
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}},
        RunFacts(zero_group_size=6),
    ),
    "compressed optimizers on plain data parallelism": (
        {"zero_optimization": {"stage": 1}},
        RunFacts(
            compressed_optimizer="OneBitAdam",
            pipeline_stages=1,
            tensor_parallel_size=1,
            moe_ep_sizes=(),
        ),
    ),
}


def test_every_combination_rule_has_a_trigger():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    assert set(RULE_TRIGGERS) == set(names)
    known = {field.name for field in dataclasses.fields(RunFacts)}
    assert all(set(rule.needs) <= known for rule in RULES)


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_each_combination_rule_refuses_naming_the_key_and_the_reason(rule):
    extra, facts = RULE_TRIGGERS[rule.name]
    expected = rule.message(ShardSpeedConfig.model_validate({**BASE, **extra}), facts or RunFacts())
    # The message names the key (or the model feature that has none) and gives the reason.
    assert rule.key in expected and ": " in expected
    if facts is None:
        with pytest.raises(ConfigError) as err:
            load(extra)
        assert expected in err.value.problems
        return
    # load_config cannot know the model: the rule waits for initialize's facts.
    config = load(extra)
    assert expected not in combination_problems(config)
    assert expected in combination_problems(config, facts)
    with pytest.raises(ConfigError, match=re.escape(rule.key)):
        refuse_combinations(config, facts)


def test_engine_compile_is_refused_at_stage_3_by_the_same_rule():
    config = load({"zero_optimization": {"stage": 3}})
    assert combination_problems(config) == []
    (message,) = combination_problems(config, RunFacts(compiling=True))
    assert "'compile'" in message and "ZeRO stage 3" in message


def test_refusals_cite_no_issue_numbers():
    with pytest.raises(ConfigError) as err:
        load({"amp": {"enabled": True}})
    assert "is removed in DeepSpeed 0.19.8" in str(err.value)
    assert not re.search(r"#\d", str(err.value))


def test_a_disabled_section_still_refuses_keys_not_honoured():
    # As in the inference config: `enabled: false` turns the feature off but accepts no key
    # shardspeed does not honour; a section shardspeed does not offer at all is accepted off.
    with pytest.raises(ConfigError, match=r"'hybrid_engine\.enable_cuda_graph' is not supported"):
        load({"hybrid_engine": {"enabled": False, "enable_cuda_graph": True}})
    load({"comet": {"enabled": False, "project": "x"}})


def test_sequence_parallel_section_keys_that_would_change_nothing_are_refused():
    with pytest.raises(ConfigError, match=re.escape("'enabled' is false, so ['mode'] would")):
        load({"sequence_parallel": {"enabled": False, "mode": "ring"}})
    with pytest.raises(ConfigError, match=re.escape("'tiling.chunk_size' sizes the tiles")):
        load({"sequence_parallel": {"tiling": {"chunk_size": 8}}})
    assert load({"sequence_parallel": {"enabled": False}}).sequence_parallel_size == 1
