"""Data parallelism (stage 0), accumulation, precision, clipping and overflow, on real gloo ranks.

Reference: the same model, seed and global batches trained in one process in fp32 with plain torch
(AdamW, clip_grad_norm_). fp32 runs must match to 1e-5 relative (only the summation order of the
all-reduce differs); fp16 and bf16 runs track the reference within the rounding of their formats.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from reference_training import (
    GLOBAL_BATCH,
    LR,
    STEPS,
    assert_close_relative,
    batch,
    config,
    make_model,
    reference,
    train,
)
from shardspeed.testing import HostSyncCounter

# -- parity with the single-process reference ------------------------------------------------


def test_single_process_matches_reference():
    result = train(micro=GLOBAL_BATCH)
    assert_close_relative(result["params"], reference(), 1e-5)
    assert result["global_steps"] == STEPS and result["global_samples"] == STEPS * GLOBAL_BATCH


def test_two_ranks_match_reference(pool2):
    results = pool2.run(train, 4)
    expected = reference()
    for result in results:
        assert_close_relative(result["params"], expected, 1e-5)
    assert results[0]["params"][0].equal(results[1]["params"][0])


def test_four_ranks_match_reference(pool4):
    results = pool4.run(train, 2)
    expected = reference()
    for result in results:
        assert_close_relative(result["params"], expected, 1e-5)


def test_accumulation_micro2_x2_equals_micro4(pool2):
    # 2 ranks: micro 2 x accumulation 2 and micro 4 x accumulation 1 both make batches of 8.
    accumulated = pool2.run(train, 2)
    plain = pool2.run(train, 4)
    assert_close_relative(accumulated[0]["params"], plain[0]["params"], 1e-5)
    assert_close_relative(accumulated[0]["params"], reference(), 1e-5)
    assert accumulated[0]["global_steps"] == STEPS


@pytest.mark.parametrize(
    ("extra", "tol"),
    [
        ({"zero_optimization": {"reduce_bucket_size": 20}}, 1e-5),  # many buckets
        ({"zero_optimization": {"overlap_comm": False}}, 1e-5),
        ({"prescale_gradients": True}, 1e-5),
        ({"gradient_predivide_factor": 2.0}, 1e-5),
        ({"communication_data_type": "fp16"}, 2e-3),
        ({"communication_data_type": "bf16"}, 2e-2),
    ],
    ids=["buckets", "no-overlap", "prescale", "predivide", "comm-fp16", "comm-bf16"],
)
def test_reduction_options_keep_parity(pool2, extra, tol):
    results = pool2.run(train, 4, extra)
    for result in results:
        assert_close_relative(result["params"], reference(), tol)


@pytest.mark.parametrize(("precision", "tol"), [("fp16", 5e-3), ("bf16", 3e-2)])
def test_half_precision_tracks_fp32(pool2, precision, tol):
    results = pool2.run(train, 4, {precision: {"enabled": True}})
    expected = reference()
    for result in results:
        assert_close_relative(result["params"], expected, tol)
        assert result["skipped"] == 0
    assert results[0]["params"][2].equal(results[1]["params"][2])


def test_clipping_and_reported_norm(pool2):
    results = pool2.run(train, 4, {"gradient_clipping": 0.05})
    assert_close_relative(results[0]["params"], reference(clip=0.05), 1e-5)
    # The reported norm is the pre-clip global norm; check step 0 against the reference's.
    model = make_model()
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    assert results[0]["norms"][0] == pytest.approx(norm, rel=1e-5)
    assert results[0]["norms"] == results[1]["norms"]


def test_no_clipping(pool2):
    results = pool2.run(train, 4, {"gradient_clipping": 0.0})
    assert_close_relative(results[0]["params"], reference(clip=0.0), 1e-5)


# -- the hot path -------------------------------------------------------------------------------


def host_syncs_per_step(extra: dict) -> list[str]:
    """Where the host waited for the device during 3 optimizer steps (after a first one, which
    reports memory), at micro 2 x accumulation 2 per rank."""
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(2, **extra)
    )
    rank, world = engine.global_rank, engine.dp_world_size
    dtype = next(engine.module.parameters()).dtype
    syncs = HostSyncCounter()
    for step in range(4):
        x, y = batch(step)
        with syncs if step > 0 else contextlib.nullcontext():
            for m in range(2):
                start = (m * world + rank) * 2
                loss = F.mse_loss(
                    engine(x[start : start + 2].to(dtype)).float(), y[start : start + 2]
                )
                engine.backward(loss)
                engine.step()
    return syncs.places


@pytest.mark.parametrize(
    "extra",
    [
        {"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0},
        {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}},
        {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_clipping": 1.0},
        {"zero_optimization": {"stage": 3}},
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    ],
    ids=["stage0-clip", "stage1-fp16", "stage2-bf16-clip", "stage3", "stage2-offload"],
)
def test_one_host_sync_per_optimizer_step(pool2, extra):
    # The gradient norm decides whether and how the step applies (overflow, clipping): reading it
    # is the step's one wait for the device. Forward, backward and reduction never wait.
    for places in pool2.run(host_syncs_per_step, extra):
        assert len(places) == 3, places
        assert all("zero/optimizer.py" in place for place in places), places


# -- step bookkeeping ---------------------------------------------------------------------------


def trace_counters() -> list[tuple]:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    rows = []
    for step in range(4):
        boundary = engine.is_gradient_accumulation_boundary()
        x, y = batch(step)
        engine.backward(F.mse_loss(engine(x[:2]), y[:2]))
        engine.step()
        rows.append((step, boundary, engine.global_steps, engine.global_samples))
    return rows


def test_counters_follow_deepspeed(pool2):
    # DeepSpeed 0.19.8, micro 2 x accumulation 2 on 2 ranks: train_batch_size 8.
    expected = [(0, False, 0, 0), (1, True, 1, 8), (2, False, 1, 8), (3, True, 2, 16)]
    assert pool2.run(trace_counters) == [expected, expected]


def backward_returns_divided_loss() -> tuple[float, float]:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(2)
    )
    x, y = batch(0)
    loss = F.mse_loss(engine(x[:2]), y[:2])
    return loss.item(), engine.backward(loss).item()


def test_backward_returns_loss_divided_by_accumulation():
    loss, returned = backward_returns_divided_loss()  # 1 rank, micro 2, batch 8: accumulation 4
    assert returned == pytest.approx(loss / 4)


# -- overflow and non-finite gradients ----------------------------------------------------------


def train_with_inf(precision: dict) -> dict:
    """Rank 1 feeds an inf at step 2; every rank must skip that step together."""
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            **config(4),
            **precision,
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_num_steps": 10, "warmup_type": "linear", "warmup_max_lr": LR},
            },
        },
    )
    dtype = next(model.parameters()).dtype
    snapshots, lrs, scales, norms = [], [], [], []
    for step in range(4):
        x, y = batch(step)
        xs, ys = x[engine.global_rank * 4 :][:4].clone(), y[engine.global_rank * 4 :][:4]
        if step == 2 and engine.global_rank == 1:
            xs[0, 0] = float("inf")
        engine.backward(F.mse_loss(engine(xs.to(dtype)).float(), ys))
        engine.step()
        snapshots.append([p.detach().float().clone() for p in model.parameters()])
        lrs.append(engine.get_lr()[0])
        scales.append(engine.loss_scale)
        norms.append(engine.get_global_grad_norm())
    return {
        "norms": norms,
        "snapshots": snapshots,
        "lrs": lrs,
        "scales": scales,
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "applied_last": engine.was_step_applied(),
    }


def test_injected_inf_skips_the_step_on_all_ranks(pool2):
    results = pool2.run(train_with_inf, {"fp16": {"enabled": True, "hysteresis": 1}})
    for result in results:
        snaps = result["snapshots"]
        assert result["skipped"] == 1 and result["global_steps"] == 4
        assert all(a.equal(b) for a, b in zip(snaps[1], snaps[2])), "step 2 changed the weights"
        assert not all(a.equal(b) for a, b in zip(snaps[2], snaps[3]))
        assert result["scales"] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
        # DeepSpeed's reported norm of a skipped step is inf (the inf input makes it NaN here).
        assert result["norms"][2] == math.inf
        assert all(math.isfinite(n) for i, n in enumerate(result["norms"]) if i != 2)
        # The scheduler does not step on a skipped step: lr after step 2 equals lr after step 1.
        assert result["lrs"][1] == result["lrs"][2] < result["lrs"][3]
        assert result["applied_last"]
    for a, b in zip(results[0]["snapshots"][3], results[1]["snapshots"][3]):
        assert a.equal(b)


def test_hysteresis_keeps_scale_on_first_overflow(pool2):
    results = pool2.run(train_with_inf, {"fp16": {"enabled": True}})  # hysteresis 2
    assert results[0]["scales"] == [2.0**16] * 4
    assert results[0]["skipped"] == 1


def test_bf16_check_grad_overflow_skips(pool2):
    results = pool2.run(train_with_inf, {"bf16": {"enabled": True, "check_grad_overflow": True}})
    assert [r["skipped"] for r in results] == [1, 1]
    assert [r["norms"][2] for r in results] == [math.inf, math.inf]


def test_nonfinite_gradient_in_fp32_stops_with_the_parameter_named(pool2):
    with pytest.raises(
        Exception, match=r"non-finite gradient .* in parameter '\d+\.(weight|bias)'"
    ):
        pool2.run(train_with_inf, {})


# -- gradient sync control, client objects ------------------------------------------------------


def no_sync_then_sync() -> list[torch.Tensor]:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 2, **config(2), "train_batch_size": 4},
    )
    rank = engine.global_rank
    x, y = batch(0)
    with engine.no_sync():
        engine.backward(F.mse_loss(engine(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]))
    engine.backward(F.mse_loss(engine(x[4 + rank * 2 :][:2]), y[4 + rank * 2 :][:2]))
    engine.step()
    # Reference: the sum of the two losses over the whole batch halves, in one process.
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    (F.mse_loss(ref(x[:4]), y[:4]) + F.mse_loss(ref(x[4:]), y[4:])).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    return [
        ((p.detach() - r.detach()).norm() / r.norm()).item()
        for p, r in zip(model.parameters(), ref.parameters())
    ]


def test_no_sync_accumulates_locally_then_averages(pool2):
    for errors in pool2.run(no_sync_then_sync):
        assert max(errors) < 1e-5


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def unused_parameter_run() -> dict:
    model = WithUnused()
    before = model.unused.weight.detach().clone()
    no_decay = {
        **config(4, zero_optimization={"reduce_bucket_size": 30}),
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
    }
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=no_decay
    )
    x, y = batch(0)
    rank = engine.global_rank
    engine.backward(F.mse_loss(engine(x[rank * 4 :][:4]), y[rank * 4 :][:4]))
    engine.step()
    return {"unchanged": model.unused.weight.detach().equal(before), "steps": engine.global_steps}


def test_unused_parameter_does_not_block_reduction(pool2):
    assert pool2.run(unused_parameter_run) == [{"unchanged": True, "steps": 1}] * 2


def client_objects() -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, engine_opt, _, engine_sched = shardspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config={"train_batch_size": 2}
    )
    x, y = batch(0)
    engine.backward(F.mse_loss(engine(x[:2]), y[:2]))
    engine.step()
    callable_engine, *_ = shardspeed.initialize(
        model=make_model(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.25),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1),
        config={"train_batch_size": 2},
    )
    return {
        "lr": engine.get_lr(),
        "same_sched": engine_sched is sched,
        "inner": engine_opt.optimizer is opt,
        "callable_lr": callable_engine.get_lr(),
    }


def test_client_optimizer_and_scheduler():
    result = client_objects()
    assert result == {
        "lr": [0.25],
        "same_sched": True,
        "inner": True,
        "callable_lr": [0.25],
    }


def test_client_optimizer_and_config_optimizer_conflict():
    model = make_model()
    with pytest.raises(shardspeed.ConfigError, match="remove one"):
        shardspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config(8)
        )


def loader_run() -> list[float]:
    data = [(torch.full((2,), float(i)), torch.zeros(1)) for i in range(8)]
    model = nn.Linear(2, 1)
    _, _, loader, _ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=data,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    return sorted(float(x[0]) for xs, _ in loader for x in xs)


def test_training_data_gives_disjoint_shards(pool2):
    first, second = pool2.run(loader_run)
    assert len(first) == len(second) == 4
    assert sorted(first + second) == [float(i) for i in range(8)]


def test_engine_passes_attributes_to_module():
    model = make_model()
    model.custom_value = 42
    engine, *_ = shardspeed.initialize(model=copy.deepcopy(model), config=config(8))
    assert engine.custom_value == 42
    assert engine.train_batch_size() == 8 and engine.gradient_accumulation_steps() == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_parameters_stay_frozen(precision):
    model = make_model()
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(8, **extra)
    )
    x, y = batch(0)
    dtype = next(engine.module.parameters()).dtype
    before = model[4].weight.detach().float().clone()
    engine.backward(F.mse_loss(engine(x.to(dtype)).float(), y))
    engine.step()
    assert model[0].weight.detach().float().equal(frozen.to(dtype).float())
    assert not model[4].weight.detach().float().equal(before)


def test_fp16_auto_cast_takes_fp32_inputs():
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model, config=config(8, fp16={"enabled": True, "auto_cast": True})
    )
    x, y = batch(0)
    out = engine(x)  # fp32 input, fp16 model
    assert out.dtype == torch.float16
    engine.backward(F.mse_loss(out.float(), y))
    engine.step()
    assert engine.was_step_applied() and engine.loss_scale == 2.0**16


def test_wall_clock_breakdown_and_progress_lines(caplog):
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model, config=config(8, wall_clock_breakdown=True, steps_per_print=2)
    )
    x, y = batch(0)
    with caplog.at_level("INFO", logger="shardspeed"):
        for _ in range(2):
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    assert "step=2, skipped=0, lr=[1.0000e-02]" in caplog.text
    assert "forward:" in caplog.text and "backward:" in caplog.text and "step:" in caplog.text


def test_batch_size_setters():
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, config=config(2))  # 1 rank: accumulation 4
    engine.set_train_batch_size(4)
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (4, 2)
    x, y = batch(0)
    boundaries = []
    for i in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(F.mse_loss(engine(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]))
        engine.step()
    assert boundaries == [False, True, False, True] and engine.global_steps == 2
    assert engine.micro_steps == 4
    engine.set_train_micro_batch_size(4)
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (8, 2)
    with pytest.raises(ValueError, match="positive multiple"):
        engine.set_train_batch_size(6)
