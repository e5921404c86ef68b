"""What the ecosystem's own DeepSpeed tests read, DeepSpeed's way (transformers'
`test_trainer_distributed_deepspeed.py`, accelerate's `tests/deepspeed/`, PEFT's ZeRO-3 test):
`deepspeed.ops.aio`, the version line at `initialize`, `zero.Init` building in the config's
precision, the optimizer's master-shard attributes, WarmupLR's accepted range, `move_to_device`,
and ZeRO-3 on one process keeping parameters partitioned."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

import shardspeed
from reference_training import assert_close_relative, reference
from shardspeed.zero.init import ZeroParamStatus


def _alias_probe(code: str) -> str:
    """Run `code` in a fresh interpreter with the `deepspeed` alias on; its stdout."""
    env_code = "import shardspeed.alias as a; a.install()\n" + code
    done = subprocess.run(
        [sys.executable, "-c", env_code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_deepspeed_ops_aio_names_the_async_io_builder() -> None:
    out = _alias_probe(
        "import deepspeed\n"
        "from deepspeed.ops.aio import AsyncIOBuilder\n"
        "print(AsyncIOBuilder.NAME, deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME])"
    )
    assert out == "async_io True"  # shardspeed's NVMe swapper does that op's work


def _initialize_log_lines() -> list[str]:
    """What `initialize` logs on shardspeed's logger (DeepSpeed's `deepspeed.utils.logger`)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("shardspeed")
    logger.addHandler(handler)
    try:
        model = nn.Linear(2, 2)
        shardspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        )
    finally:
        logger.removeHandler(handler)
    return lines


def test_initialize_logs_deepspeeds_version_line() -> None:
    from shardspeed.testing import RankPool

    with RankPool(1) as pool:
        (lines,) = pool.run(_initialize_log_lines)
    assert "DeepSpeed info: version=0.19.8, git-hash=[none], git-branch=[none]" in lines


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [({"fp16": {"enabled": True}}, torch.float16), ({"bf16": {"enabled": True}}, torch.bfloat16)],
)
def test_zero_init_builds_in_the_configs_precision(precision: dict, dtype: torch.dtype) -> None:
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3}, **precision}
    with shardspeed.zero.Init(config_dict_or_path=config):
        layer = nn.Linear(8, 8)
    assert layer.weight.ds_tensor.dtype == dtype  # what each rank keeps, as it is built
    with shardspeed.zero.Init(config_dict_or_path=config, dtype=torch.float32):
        kept = nn.Linear(8, 8)
    assert kept.weight.ds_tensor.dtype == torch.float32  # an explicit dtype wins
    with shardspeed.zero.Init(
        config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    ):
        plain = nn.Linear(8, 8)
    assert plain.weight.ds_tensor.dtype == torch.float32


def _master_attributes(stage: int) -> dict:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    engine, optimizer, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_batch_size": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage},
        },
    )
    del engine
    found = {}
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        if hasattr(optimizer, name):
            found[name] = sorted({str(t.dtype) for t in getattr(optimizer, name)})
    return found


@pytest.mark.parametrize(
    ("stage", "name"),
    [(1, "single_partition_of_fp32_groups"), (2, "single_partition_of_fp32_groups"),
     (3, "fp32_partitioned_groups_flat")],
)  # fmt: skip
def test_optimizer_master_shards_under_deepspeeds_names(pool2, stage: int, name: str) -> None:
    # The attribute DeepSpeed's optimizer of that stage has, and only that one: bf16 model,
    # fp32 masters.
    for found in pool2.run(_master_attributes, stage):
        assert found == {name: ["torch.float32"]}


def test_warmup_schedules_accept_zero_warmup_steps_in_the_config() -> None:
    from shardspeed.config import load_config

    for name, extra in (("WarmupLR", {}), ("WarmupDecayLR", {"total_num_steps": 10})):
        params = {"warmup_num_steps": 0, **extra}
        config = {"train_batch_size": 1, "scheduler": {"type": name, "params": params}}
        loaded = load_config(config, 1)
        assert loaded.scheduler.params["warmup_num_steps"] == 0
    # Building one with 0 raises, as DeepSpeed's class does.
    from shardspeed.optim.lr_schedules import WarmupLR

    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 0"):
        WarmupLR(optimizer, warmup_num_steps=0)


def test_move_to_device_follows_deepspeed() -> None:
    from shardspeed.compat.deepspeed.runtime.utils import move_to_device

    t, u = torch.ones(2), torch.zeros(3)
    moved = move_to_device({"a": [t, (u, 3)], "b": "text"}, "cpu")
    assert torch.equal(moved["a"][0], t) and moved["a"][1][1] == 3 and moved["b"] == "text"
    kept = move_to_device(t, "cpu", criterion_func=lambda x: torch.is_tensor(x))
    assert kept is t  # moved in place where the criterion holds
    out = _alias_probe(
        "from deepspeed.runtime.utils import move_to_device\nprint(callable(move_to_device))"
    )
    assert out == "True"


def _one_process_stage3() -> dict:
    from reference_training import STEPS, batch, config, make_model

    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(8, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}),
    )
    for step in range(STEPS):
        x, y = batch(step)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    statuses = {str(p.ds_status) for p in model.parameters()}
    numels = {p.numel() for p in model.parameters()}
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    return {"statuses": statuses, "numels": numels, "params": params}


def _persistent_status() -> dict:
    """A large and a small layer at ZeRO 3 (default persistence threshold) on one process: each
    parameter's (shape, status, ds_persist) after initialize and after one step."""
    model = torch.nn.Sequential(torch.nn.Linear(768, 768), torch.nn.Linear(768, 8))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def seen() -> dict:
        return {
            n: (tuple(p.shape), str(p.ds_status), p.ds_persist) for n, p in model.named_parameters()
        }

    before = seen()
    engine.backward(engine(torch.randn(1, 768)).sum())
    engine.step()
    return {"before": before, "after": seen()}


def test_stage3_persistent_parameters_are_partitioned_until_the_first_forward() -> None:
    """What DeepSpeed 0.19.8 shows (checked on it): after initialize every parameter is empty
    and NOT_AVAILABLE, those under stage3_param_persistence_threshold marked ds_persist; from
    the first forward on those stay whole. PEFT's ZeRO-3 save warning reads this."""
    from shardspeed.testing import RankPool

    with RankPool(1) as pool:
        (result,) = pool.run(_persistent_status)
    absent, whole = str(ZeroParamStatus.NOT_AVAILABLE), str(ZeroParamStatus.AVAILABLE)
    assert result["before"] == {
        "0.weight": ((0,), absent, False),
        "0.bias": ((0,), absent, True),
        "1.weight": ((0,), absent, True),
        "1.bias": ((0,), absent, True),
    }
    assert result["after"] == {
        "0.weight": ((0,), absent, False),
        "0.bias": ((768,), whole, True),
        "1.weight": ((8, 768), whole, True),
        "1.bias": ((8,), whole, True),
    }


def test_stage3_on_one_process_keeps_parameters_partitioned() -> None:
    """As at any world size (DeepSpeed's too): outside a unit's use a parameter is empty and
    NOT_AVAILABLE, with its whole shape in ds_shape; and training equals the reference."""
    from shardspeed.testing import RankPool

    with RankPool(1) as pool:
        (result,) = pool.run(_one_process_stage3)
    assert result["statuses"] == {str(ZeroParamStatus.NOT_AVAILABLE)}
    assert result["numels"] == {0}
    assert_close_relative(result["params"], reference(), 1e-5)
