"""DeepSpeed names that libraries call beyond `initialize`, with DeepSpeed's meaning: the accelerator,
process-group accessors, per-parameter views into ZeRO shards (`safe_get_full_*`), zero.Init
parameters gathered before `initialize`, the caller-owned accumulation boundary, `engine.config` as a
dict, `engine.compile`, the CPU optimizer classes, and the small helpers."""

from __future__ import annotations

import importlib.metadata
import logging
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardspeed
from reference_training import GLOBAL_BATCH, LR, batch, config, make_model
from shardspeed import alias, compat
from shardspeed.accelerator import Accelerator, get_accelerator, set_accelerator
from shardspeed.utils import (
    groups,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_set_full_fp32_param,
)

# -- the accelerator ------------------------------------------------------------------------------


def test_cpu_accelerator_answers_what_libraries_ask() -> None:
    cpu = Accelerator("cpu")
    assert cpu.device_name() == "cpu" and cpu.current_device_name() == "cpu"
    assert cpu.device(3) == torch.device("cpu")
    assert cpu.communication_backend_name() == "gloo"
    assert cpu.is_bf16_supported() and cpu.is_available()
    assert torch.float32 in cpu.supported_dtypes() and torch.bfloat16 in cpu.supported_dtypes()
    cpu.synchronize()  # a synchronous device: nothing to wait for
    stream = cpu.Stream()
    with cpu.stream(stream):
        event = cpu.Event(enable_timing=True)
        event.record()
    assert event.query() and cpu.current_stream().query()
    assert cpu.memory_allocated() > 0 and cpu.max_memory_allocated() >= cpu.memory_allocated()
    assert cpu.total_memory() >= cpu.available_memory() > 0
    assert cpu.FloatTensor([1, 2]).dtype == torch.float32
    cpu.manual_seed(5)
    assert torch.initial_seed() == 5


def test_accelerator_choice_follows_ds_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardspeed.accelerator.real_accelerator as real

    monkeypatch.setattr(real, "_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator().device_name() == "cpu"
    assert get_accelerator() is get_accelerator()
    monkeypatch.setattr(real, "_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu' is not supported"):
        get_accelerator()
    with pytest.raises(TypeError, match="takes an Accelerator"):
        set_accelerator("cpu")
    with pytest.raises(ValueError, match="accelerator 'npu' is not supported"):
        Accelerator("npu")


# -- process groups -------------------------------------------------------------------------------


def _groups_after_initialize() -> dict:
    engine, *_ = shardspeed.initialize(model=make_model(), config=config(4))
    expert = groups._get_expert_parallel_group("ep_size_2")
    return {
        "dp": (groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()),
        "dp_ranks": groups._get_data_parallel_group_ranks(),
        "sp": (groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()),
        "sp_group_size": dist.get_world_size(groups._get_sequence_parallel_group()),
        "mp": groups._get_model_parallel_world_size(),
        "ep": (groups._get_expert_parallel_world_size("ep_size_2"), dist.get_world_size(expert)),
        "rank": engine.global_rank,
    }


def test_groups_report_the_running_topology(pool2) -> None:
    for seen in pool2.run(_groups_after_initialize):
        assert seen["dp"] == (2, seen["rank"])
        assert seen["dp_ranks"] == [0, 1]
        assert seen["sp"] == (1, 0) and seen["sp_group_size"] == 1
        assert seen["mp"] == 1 and seen["ep"] == (2, 2)


def test_expert_group_names_are_deepspeeds() -> None:
    with pytest.raises(ValueError, match="'ep_size_<N>'"):
        groups._expert_size("experts")


# -- views into ZeRO shards -------------------------------------------------------------------------


def _fragments(stage: int) -> dict:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        config=config(
            GLOBAL_BATCH // 2,
            zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0}
            if stage == 3
            else {"stage": stage},
        ),
    )
    rank, world = engine.global_rank, engine.dp_world_size
    x, y = batch(0)
    micro = GLOBAL_BATCH // world
    engine.backward(
        F.mse_loss(engine(x[rank * micro : (rank + 1) * micro]), y[rank * micro :][:micro])
    )
    weight = model[2].weight
    grad = safe_get_full_grad(weight)
    local = safe_get_local_grad(weight).numel()
    engine.step()
    out = {
        "grad": grad,
        "local_grad_numel": local,
        "param": safe_get_full_fp32_param(weight),
        "exp_avg": safe_get_full_optimizer_state(weight, "exp_avg"),
        "local_param": safe_get_local_fp32_param(weight),
    }
    safe_set_full_fp32_param(weight, torch.full((16, 16), 0.25))
    with shardspeed.zero.GatheredParameters([weight]):
        out["after_set"] = weight.detach().clone()
    out["master_after_set"] = safe_get_full_fp32_param(weight)
    return out


def _reference_fragments() -> dict:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    grad = model[2].weight.grad.clone()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {
        "grad": grad,
        "param": model[2].weight.detach(),
        "exp_avg": opt.state[model[2].weight]["exp_avg"],
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_accessors_see_whole_tensors_at_every_stage(pool2, stage: int) -> None:
    expected = _reference_fragments()
    results = pool2.run(_fragments, stage)
    for out in results:
        torch.testing.assert_close(out["grad"], expected["grad"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out["param"], expected["param"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out["exp_avg"], expected["exp_avg"], rtol=1e-5, atol=1e-9)
        assert torch.equal(out["after_set"], torch.full((16, 16), 0.25))
        assert torch.equal(out["master_after_set"], torch.full((16, 16), 0.25))
    local = [out["local_param"].numel() for out in results]
    if stage == 0:
        assert local == [256, 256] and [o["local_grad_numel"] for o in results] == [256, 256]
    else:  # the ranks' pieces make the tensor exactly once
        assert sum(local) == 256 and all(0 < n < 256 for n in local)
        assert sum(o["local_grad_numel"] for o in results) == 256


def test_safe_accessors_on_an_untrained_parameter() -> None:
    frozen = nn.Parameter(torch.ones(3))
    frozen.grad = torch.full((3,), 2.0)
    assert safe_get_full_fp32_param(frozen) is None
    assert safe_get_full_optimizer_state(frozen, "exp_avg") is None
    assert torch.equal(safe_get_full_grad(frozen), frozen.grad)


# -- zero.Init parameters before initialize ---------------------------------------------------------


def _gather_before_initialize() -> dict:
    rank = dist.get_rank()
    with shardspeed.zero.Init():
        layer = nn.Linear(5, 3)
    empty_before = layer.weight.numel() == 0
    with torch.no_grad():
        with shardspeed.zero.GatheredParameters(list(layer.parameters()), modifier_rank=0):
            whole_inside = tuple(layer.weight.shape)
            if rank == 0:
                layer.weight.copy_(torch.arange(15.0).view(3, 5))
        with shardspeed.zero.GatheredParameters(list(layer.parameters())):
            seen = layer.weight.detach().clone()
            layer.weight.fill_(-1.0)  # no modifier rank: dropped on exit
    with shardspeed.zero.GatheredParameters([layer.weight]):
        after_unmodified = layer.weight.detach().clone()
    status = layer.weight.ds_status
    return {
        "empty_before": empty_before,
        "whole_inside": whole_inside,
        "seen": seen,
        "after_unmodified": after_unmodified,
        "slice": layer.weight.ds_tensor.clone(),
        "released": layer.weight.numel() == 0,
        "status": status.name,
    }


def test_gathered_parameters_reach_zero_init_slices_before_initialize(pool2) -> None:
    expected = torch.arange(15.0).view(3, 5)
    results = pool2.run(_gather_before_initialize)
    for out in results:
        assert out["empty_before"] and out["whole_inside"] == (3, 5) and out["released"]
        assert torch.equal(out["seen"], expected), "rank 0's write reached every rank"
        assert torch.equal(out["after_unmodified"], expected), "writes without a modifier drop"
        assert out["status"] == "NOT_AVAILABLE"
    slices = torch.cat([out["slice"] for out in results])
    assert torch.equal(slices[:15], expected.flatten()), "each rank keeps its slice of the write"


def _stage3_on_one_rank_under_init() -> list[torch.Tensor]:
    from reference_training import train

    return train(GLOBAL_BATCH, {"zero_optimization": {"stage": 3}}, under_init=True)["params"]


def test_stage3_on_one_rank_takes_a_zero_init_model() -> None:
    from reference_training import assert_close_relative, reference
    from shardspeed.testing import RankPool

    with RankPool(1) as pool:
        (params,) = pool.run(_stage3_on_one_rank_under_init)
    assert_close_relative(params, reference(), 1e-5)


def test_register_external_parameter_keeps_the_parameter_whole() -> None:
    from shardspeed.zero.partitioned import Stage3Options, plan_units

    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    shared = model[0][0].weight
    shardspeed.zero.register_external_parameter(model[0][1], shared)
    units = plan_units(model, list(model.parameters()), Stage3Options(persistence_threshold=0))
    persistent = next(u for u in units if u.persistent)
    assert any(p is shared for p in persistent.params)
    shardspeed.zero.unregister_external_parameter(model[0][1], shared)
    units = plan_units(model, list(model.parameters()), Stage3Options(persistence_threshold=0))
    assert not any(p is shared for u in units if u.persistent for p in u.params)


def test_partition_parameters_names() -> None:
    from shardspeed.zero import partition_parameters as pp

    assert pp._orig_torch_arange is torch.arange
    assert pp.ZeroParamStatus.NOT_AVAILABLE.name == "NOT_AVAILABLE"
    build = pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.bfloat16, "cpu")
    made = build(2, 3)
    assert made.dtype == torch.bfloat16 and made.device == torch.device("cpu")
    assert build(2, dtype=torch.int64).dtype == torch.int64  # only floating tensors change


# -- the accumulation boundary the caller owns ------------------------------------------------------


def _caller_owned_boundary(stage: int) -> dict:
    """gradient_accumulation_steps 4 in the config, but the caller ends windows of 2 (as
    accelerate does): the engine steps exactly where told, averaging the window's micro-steps."""
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage},
        },
    )
    rank = engine.global_rank
    applied = []
    for step in range(3):
        x, y = batch(step)
        for m in range(2):
            engine.set_gradient_accumulation_boundary(m == 1)
            start = (m * 2 + rank) * 2
            # The window's loss is the mean over its micro-steps, whatever the config says.
            loss = F.mse_loss(engine(x[start : start + 2]), y[start : start + 2]) / 2
            engine.backward(loss, scale_wrt_gas=False)
            if m == 1:
                engine.step()
                applied.append(engine.global_steps)
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "applied": applied, "micro_steps": engine.micro_steps}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_set_gradient_accumulation_boundary(pool2, stage: int) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(3):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for out in pool2.run(_caller_owned_boundary, stage):
        assert out["applied"] == [1, 2, 3] and out["micro_steps"] == 3
        for ours, theirs in zip(out["params"], model.parameters()):
            torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)


def test_set_gradient_accumulation_boundary_takes_a_bool(pool2) -> None:
    with pytest.raises(Exception, match="is_boundary must be a bool"):
        pool2.run(_boundary_int)


def _boundary_int() -> None:
    engine, *_ = shardspeed.initialize(model=make_model(), config=config(4))
    engine.set_gradient_accumulation_boundary(1)


# -- the engine's config, compile, the 16-bit state dict ------------------------------------------


def _engine_surface() -> dict:
    source = {**config(4), "steps_per_print": float("inf")}
    engine, *_ = shardspeed.initialize(model=make_model(), config=source)
    x, _ = batch(0)
    before = engine(x[:4]).detach()
    engine.compile(backend="eager")
    after = engine(x[:4]).detach()
    try:
        engine._consolidated_16bit_state_dict()
        refused = None
    except ValueError as error:
        refused = str(error)
    return {
        "config_is_source": engine.config is source,
        "stage": engine.config.get("zero_optimization", {}).get("stage"),
        "run_config_stage": engine.run_config.zero_optimization.stage,
        "steps_per_print": engine.run_config.steps_per_print,
        "compiled": engine.is_compiled,
        "same_output": torch.equal(before, after),
        "gather_flag": engine.zero_gather_16bit_weights_on_model_save(),
        "refused": refused,
        "isinstance": isinstance(engine, shardspeed.DeepSpeedEngine),
    }


def test_engine_config_compile_and_names(pool2) -> None:
    for out in pool2.run(_engine_surface):
        assert out["config_is_source"] and out["stage"] is None and out["run_config_stage"] == 0
        assert out["steps_per_print"] is None  # float("inf"), accelerate's value: never print
        assert out["compiled"] and out["same_output"] and out["isinstance"]
        assert out["gather_flag"] is False
        assert "only applicable where weights are partitioned" in out["refused"]


def _zero3_state_dict() -> dict:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        config=config(
            4,
            zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0},
        ),
    )
    state = engine._zero3_consolidated_16bit_state_dict()
    return {"rank": engine.global_rank, "state": state}


def test_zero3_consolidated_state_dict_is_whole_on_rank_zero(pool2) -> None:
    expected = make_model().state_dict()
    first, second = pool2.run(_zero3_state_dict)
    assert second["state"] is None
    assert first["state"].keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(first["state"][name], value), name


def _scheduler_without_optimizer() -> dict:
    source = {
        "train_micro_batch_size_per_gpu": 4,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "zero_optimization": {"stage": 3},
    }
    with shardspeed.zero.Init():
        model = make_model()
    engine, *_ = shardspeed.initialize(model=model, config=source)
    x, _ = batch(0)
    with torch.no_grad():
        out = engine(x[:4])
    return {"scheduler": engine.lr_scheduler, "finite": bool(torch.isfinite(out).all())}


def test_engine_for_evaluation_keeps_no_scheduler_and_makes_zero_init_whole(pool2) -> None:
    for out in pool2.run(_scheduler_without_optimizer):
        assert out["scheduler"] is None and out["finite"]


# -- optimizers -----------------------------------------------------------------------------------


def test_lion_follows_its_formula() -> None:
    from shardspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from shardspeed.optim.lion import Lion

    torch.manual_seed(0)
    start = torch.randn(10)
    grads = [torch.randn(10) for _ in range(3)]
    p = nn.Parameter(start.clone())
    lion = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    w, m = start.clone(), torch.zeros(10)
    for g in grads:
        p.grad = g.clone()
        lion.step()
        w = w * (1 - 0.1 * 0.5) - 0.1 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    torch.testing.assert_close(p.detach(), w)
    torch.testing.assert_close(lion.state[p]["exp_avg"], m)
    assert isinstance(FusedLion([nn.Parameter(torch.ones(2))]), Lion)
    with pytest.raises(ValueError, match="fp32_optimizer_states=True needs fp32 parameters"):
        DeepSpeedCPULion([nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])


def test_lion_and_cpu_adagrad_train_through_the_engine(pool2) -> None:
    results = pool2.run(_train_with, {"type": "Lion", "params": {"lr": 1e-3}})
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["loss_after"] < results[0]["loss_before"]


def _train_with(optimizer: dict) -> dict:
    engine, *_ = shardspeed.initialize(
        model=make_model(),
        config={**config(4, zero_optimization={"stage": 2}), "optimizer": optimizer},
    )
    rank = engine.global_rank
    x, y = batch(0)
    losses = []
    for _ in range(20):
        loss = F.mse_loss(engine(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "params": [p.detach().sum().item() for p in engine.module.parameters()],
        "loss_before": losses[0],
        "loss_after": losses[-1],
    }


def test_cpu_adagrad_is_torch_adagrad() -> None:
    from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad

    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    ours = DeepSpeedCPUAdagrad([a], lr=0.1, eps=1e-10, weight_decay=0.01)
    torch_adagrad = torch.optim.Adagrad([b], lr=0.1, eps=1e-10, weight_decay=0.01)
    for step in range(3):
        a.grad = b.grad = torch.full((4,), float(step + 1))
        ours.step()
        torch_adagrad.step()
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdagrad([nn.Parameter(torch.ones(1))], amsgrad=True)


# -- small helpers and module layout ----------------------------------------------------------------


def test_clone_tensors_for_torch_save_copies_views() -> None:
    from shardspeed.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(6.0)
    state = {"a": flat[:3], "b": [flat[3:], 7], "c": (flat[:1],)}
    cloned = clone_tensors_for_torch_save(state)
    assert cloned["a"].untyped_storage().nbytes() == 12  # its own storage, not the buffer's
    assert cloned["b"][1] == 7 and isinstance(cloned["c"], tuple)
    assert torch.equal(cloned["b"][0], flat[3:])


def test_module_layout_names() -> None:
    import shardspeed.runtime

    assert shardspeed.runtime.lr_schedules.VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]
    assert shardspeed.DeepSpeedEngine is shardspeed.runtime.engine.DeepSpeedEngine
    from shardspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME

    assert DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert shardspeed.utils.logger is logging.getLogger("shardspeed")
    assert compat.shardspeed_name("deepspeed.utils.groups") == "shardspeed.comm.groups"


def test_log_dist_logs_on_the_ranks_asked(caplog: pytest.LogCaptureFixture) -> None:
    from shardspeed.utils import log_dist

    with caplog.at_level(logging.INFO, logger="shardspeed"):
        log_dist("hello", ranks=[0])
        log_dist("elsewhere", ranks=[3])
    messages = [r.getMessage() for r in caplog.records]
    assert "[Rank 0] hello" in messages and not any("elsewhere" in m for m in messages)


def test_deepspeed_distribution_answers_only_ordinary_lookups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    finder = alias._AliasFinder()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    assert importlib.metadata.version("deepspeed") == compat.DEEPSPEED_VERSION
    assert "shardspeed" in importlib.metadata.metadata("deepspeed")["Summary"]
    context = importlib.metadata.DistributionFinder.Context
    # A tool that scans given locations (pip, for one) sees only what is installed there.
    assert list(finder.find_distributions(context(name="deepspeed", path=list(sys.path)))) == []
    assert list(finder.find_distributions(context(name="torch"))) == []
    assert len(list(finder.find_distributions(context()))) == 1


def test_tp_model_init_takes_the_runs_config_as_transformers_passes_it() -> None:
    from shardspeed.config import ConfigError

    model = make_model()
    config = {"tensor_parallel": {"autotp_size": 2}, "train_batch_size": 8}
    assert shardspeed.tp_model_init(model, 2, torch.float32, config=config) is model
    assert model._shardspeed_tp_init == (2, torch.float32)
    with pytest.raises(ConfigError, match=r"'tensor_parallel\.autotp_size': 4"):
        shardspeed.tp_model_init(
            model, 2, torch.float32, config={"tensor_parallel": {"autotp_size": 4}}
        )
    with pytest.raises(ValueError, match=r"tp_model_init\(tp_group=...\) is not supported"):
        shardspeed.tp_model_init(model, 2, torch.float32, tp_group=None)
