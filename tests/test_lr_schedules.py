"""DeepSpeed-style LR schedules: each lr checked against its closed form, computed here independently."""

import math

import pytest
import torch
from pydantic import ValidationError

from shardspeed.config.scheduler import (
    SCHEDULER_PARAMS,
    OneCycleParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from shardspeed.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def sgd(lr=0.5, momentum=0.0, groups=1):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def adam(lr=0.5):
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=(0.9, 0.999))


def lrs_by_step(schedule, steps):
    """lr of group 0 after each of `steps` calls to step(); index i is last_batch_iteration i."""
    out = []
    for _ in range(steps):
        schedule.step()
        out.append(schedule.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_log_curve_then_hold():
    opt = sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.01  # written at construction
    got = lrs_by_step(sched, 14)
    for i, lr in enumerate(got):
        expected = 0.01 + 0.09 * math.log(i + 1) / math.log(10) if i < 10 else 0.1
        assert lr == pytest.approx(expected, rel=1e-12)
    # DeepSpeed's documented data point: 3.01e-4 after two steps with max 1e-3 and N=10.
    opt = sgd(lr=1e-3)
    sched = WarmupLR(opt, warmup_num_steps=10)  # max lr defaults to the optimizer's lr
    sched.step()
    sched.step()
    assert sched.get_last_lr() == [pytest.approx(1e-3 * math.log(2) / math.log(10))]
    assert sched.get_last_lr()[0] == pytest.approx(3.0103e-4, rel=1e-4)


def test_warmup_linear_and_one_step_counts_as_two():
    sched = WarmupLR(sgd(), 0.0, 0.2, warmup_num_steps=4, warmup_type="linear")
    assert lrs_by_step(sched, 6) == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.2])
    one = WarmupLR(sgd(), 0.0, 0.2, warmup_num_steps=1, warmup_type="linear")
    assert one.warmup_num_steps == 2
    assert lrs_by_step(one, 3) == pytest.approx([0.0, 0.1, 0.2])


def test_warmup_per_group_lists_and_default_max_from_each_group():
    opt = sgd(groups=2)
    opt.param_groups[1]["lr"] = 0.3
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_num_steps=2, warmup_type="linear")
    sched.step()
    sched.step()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.5, 0.3])
    with pytest.raises(ValueError, match="one per param group"):
        WarmupLR(sgd(groups=2), warmup_min_lr=[0.0, 0.1, 0.2])


def test_warmup_decay_reaches_zero_at_total_steps():
    sched = WarmupDecayLR(
        sgd(), total_num_steps=10, warmup_max_lr=0.2, warmup_num_steps=4, warmup_type="linear"
    )
    got = lrs_by_step(sched, 14)
    for i, lr in enumerate(got):
        expected = 0.2 * i / 4 if i < 4 else 0.2 * max(0.0, (10 - i) / (10 - 4))
        assert lr == pytest.approx(expected, abs=1e-15)
    assert got[4] == pytest.approx(0.2)  # peak right after warmup
    assert got[7] == pytest.approx(0.1)
    assert got[10] == 0.0 and got[13] == 0.0


def test_warmup_decay_log_warmup():
    sched = WarmupDecayLR(sgd(), total_num_steps=100, warmup_max_lr=0.01, warmup_num_steps=50)
    got = lrs_by_step(sched, 60)
    assert got[20] == pytest.approx(0.01 * math.log(21) / math.log(50))
    assert got[55] == pytest.approx(0.01 * (100 - 55) / 50)


def test_warmup_cosine_ratios_and_end():
    opt = sgd(lr=0.3)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=20,
        warmup_min_ratio=0.1,
        warmup_num_steps=5,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    assert opt.param_groups[0]["lr"] == 0.0  # DeepSpeed starts at 0, not at the min ratio
    got = lrs_by_step(sched, 30)
    for i, lr in enumerate(got):
        if i < 5:
            ratio = 0.1 + 0.9 * i / 5
        else:
            progress = min(1.0, (i - 5 + 1) / 15)
            ratio = 0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2
        assert lr == pytest.approx(0.3 * ratio, rel=1e-12)
    assert got[4] == pytest.approx(0.3 * 0.82)
    assert got[19] == pytest.approx(0.3 * 0.01)  # cosine end
    assert got[29] == pytest.approx(0.3 * 0.01)  # and it stays at the floor


def test_warmup_cosine_log_warmup():
    sched = WarmupCosineLR(sgd(lr=2.0), total_num_steps=50, warmup_num_steps=8)
    got = lrs_by_step(sched, 8)
    assert got[3] == pytest.approx(2.0 * math.log(4) / math.log(8))


def one_cycle_reference(i):
    """lr and momentum at last_batch_iteration i for min 0.1, max 1.0, halves 4 and 6,
    decay_step_size 2, decay_lr_rate 0.5, momenta 0.8..0.9, decay_mom_rate 0.1."""
    t = i + 1  # batches seen
    if i < 10:
        scale = t / 4 if t <= 4 else (10 - t) / 6
        return 0.1 + 0.9 * scale, 0.9 - 0.1 * scale
    k = i - 10 + 1
    return 0.1 / (1 + 0.5 * k / 2), 0.9 * (1 + 0.1 * k / 2)


ONE_CYCLE = dict(
    cycle_min_lr=0.1,
    cycle_max_lr=1.0,
    cycle_first_step_size=4,
    cycle_second_step_size=6,
    decay_step_size=2,
    decay_lr_rate=0.5,
    cycle_min_mom=0.8,
    cycle_max_mom=0.9,
    decay_mom_rate=0.1,
)


def test_one_cycle_both_phases_decay_and_adam_betas():
    opt = adam()
    sched = OneCycle(opt, **ONE_CYCLE)
    group = opt.param_groups[0]
    assert group["lr"] == 0.1 and group["betas"] == (0.8, 0.999)  # starts at the minimum momentum
    for i in range(16):
        sched.step()
        lr, mom = one_cycle_reference(i)
        assert group["lr"] == pytest.approx(lr, rel=1e-12), i
        assert group["betas"][0] == pytest.approx(mom, rel=1e-12), i
        assert group["betas"][1] == 0.999  # the optimizer's own beta2 is kept
        # DeepSpeed's form for Adam-like groups: the (beta0, beta1) pair, beta1 the group's own.
        assert sched.get_mom() == [(pytest.approx(mom), 0.999)]
    # Landmarks: the peak after the first half, back to the minimum at the cycle's end, then decay.
    sched.step(3)
    assert group["lr"] == pytest.approx(1.0) and group["betas"][0] == pytest.approx(0.8)
    sched.step(9)
    assert group["lr"] == pytest.approx(0.1) and group["betas"][0] == pytest.approx(0.9)
    sched.step(11)
    assert group["lr"] == pytest.approx(0.1 / 1.5) and group["betas"][0] == pytest.approx(0.99)


def test_one_cycle_sgd_momentum_and_no_decay_by_default():
    opt = sgd(momentum=0.5)
    sched = OneCycle(opt, cycle_min_lr=0.2, cycle_max_lr=0.6, cycle_first_step_size=2)
    assert opt.param_groups[0]["momentum"] == 0.8
    got = []
    for _ in range(7):
        sched.step()
        got.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
    expected = [
        (0.4, 0.85),
        (0.6, 0.8),
        (0.4, 0.85),
        (0.2, 0.9),
        (0.2, 0.9),
        (0.2, 0.9),
        (0.2, 0.9),
    ]
    assert got == [(pytest.approx(a), pytest.approx(b)) for a, b in expected]


def test_one_cycle_stairs():
    sched = OneCycle(
        sgd(),
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_first_stair_count=2,
    )
    # Two stairs per half: the lr holds at 0, 0.5 and 1 instead of moving every step.
    assert lrs_by_step(sched, 8) == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


def test_one_cycle_get_mom_of_sgd_groups_is_a_number():
    sched = OneCycle(sgd(momentum=0.5), cycle_min_lr=0.2, cycle_max_lr=0.6, cycle_first_step_size=2)
    assert sched.get_mom() == [pytest.approx(0.9)]
    sched.step()
    assert sched.get_mom() == [pytest.approx(0.85)]


def test_one_cycle_without_momentum_support_only_cycles_lr():
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=0.3, cycle_first_step_size=2)
    sched.step()
    assert sched.get_mom() is None
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)


def test_lr_range_test_staircase_and_continuous():
    sched = LRRangeTest(
        sgd(),
        lr_range_test_min_lr=0.01,
        lr_range_test_step_size=3,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=True,
    )
    assert sched.get_last_lr() == [0.01]
    got = lrs_by_step(sched, 9)
    assert got == pytest.approx([0.01 * (1 + 2 * math.floor((i + 1) / 3)) for i in range(9)])
    assert got == pytest.approx([0.01, 0.01, 0.03, 0.03, 0.03, 0.05, 0.05, 0.05, 0.07])
    cont = LRRangeTest(sgd(), 0.01, lr_range_test_step_size=3, lr_range_test_step_rate=2.0)
    assert lrs_by_step(cont, 3) == pytest.approx([0.01 * (1 + 2 * (i + 1) / 3) for i in range(3)])


def test_state_dict_round_trip_resumes_the_schedule():
    make = lambda opt: WarmupDecayLR(  # noqa: E731
        opt, total_num_steps=20, warmup_max_lr=0.4, warmup_num_steps=5, warmup_type="linear"
    )
    first = make(sgd())
    lrs_by_step(first, 7)
    state = first.state_dict()
    assert state == {"last_batch_iteration": 6}
    resumed = make(sgd())
    resumed.load_state_dict(state)
    assert resumed.last_batch_iteration == 6
    assert lrs_by_step(resumed, 3) == pytest.approx(lrs_by_step(first, 3))
    assert resumed.get_last_lr() == [pytest.approx(0.4 * (20 - 9) / 15)]


def test_resumed_construction_leaves_lr_alone_and_step_can_jump():
    opt = sgd(lr=0.7)
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=4, last_batch_iteration=5)
    assert opt.param_groups[0]["lr"] == 0.7
    with pytest.raises(RuntimeError, match="step"):
        sched.get_last_lr()
    sched.step(1)
    assert sched.last_batch_iteration == 1
    assert sched.get_last_lr() == [pytest.approx(math.log(2) / math.log(4))]


def test_tensor_lr_is_filled_in_place():
    lr = torch.tensor(0.5)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = WarmupLR(opt, warmup_min_lr=0.1, warmup_num_steps=2)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.1)
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(
        0.1 + 0.4 * math.log(2) / math.log(2)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda opt, kind: WarmupLR(opt, warmup_num_steps=10, warmup_type=kind),
        lambda opt, kind: WarmupDecayLR(opt, 100, warmup_num_steps=10, warmup_type=kind),
        lambda opt, kind: WarmupCosineLR(opt, 100, warmup_num_steps=10, warmup_type=kind),
    ],
)
def test_unknown_warmup_type_is_refused(make):
    # DeepSpeed's constructors warn and use the log curve; an unknown curve is a typo, so refuse it.
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear', got 'cosine'"):
        make(sgd(lr=0.1), "cosine")


def test_param_key_constants_are_the_config_keys():
    from shardspeed.optim import lr_schedules as lrs

    keys = {name: getattr(lrs, name) for name in dir(lrs) if name.isupper()}
    schedule_keys = {
        value
        for name, value in keys.items()
        if name not in ("VALID_LR_SCHEDULES", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE")
        and value not in lrs.VALID_LR_SCHEDULES
    }
    config_keys = set().union(*(model.model_fields for model in SCHEDULER_PARAMS.values()))
    assert schedule_keys == config_keys
    assert (lrs.WARMUP_LOG_RATE, lrs.WARMUP_LINEAR_RATE) == ("log", "linear")


def test_scheduler_params_defaults_and_refusals():
    assert set(SCHEDULER_PARAMS) == {
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
        "OneCycle",
        "LRRangeTest",
    }
    warm = WarmupLRParams()
    assert (warm.warmup_min_lr, warm.warmup_max_lr, warm.warmup_num_steps) == (0.0, None, 1000)
    assert warm.warmup_type == "log" and warm.last_batch_iteration == -1
    assert WarmupDecayLRParams(total_num_steps=10).warmup_max_lr == 0.001
    assert WarmupCosineLRParams(total_num_steps=10).cos_min_ratio == 0.0001
    cycle = OneCycleParams(cycle_min_lr=0.1, cycle_max_lr=1)
    assert (cycle.cycle_first_step_size, cycle.cycle_momentum, cycle.cycle_max_mom) == (
        2000,
        True,
        0.9,
    )
    bad = [
        (WarmupLRParams, {"warmup_num_step": 10}, "extra_forbidden"),
        (WarmupLRParams, {"warmup_num_steps": -1}, "greater_than_equal"),  # 0 is DeepSpeed's
        (WarmupLRParams, {"warmup_type": "cosine"}, "literal_error"),
        (WarmupLRParams, {"warmup_min_lr": -1.0}, "greater_than_equal"),
        (WarmupDecayLRParams, {}, "missing"),
        (WarmupCosineLRParams, {"total_num_steps": 5, "cos_min_ratio": 2.0}, "less_than_equal"),
        (OneCycleParams, {"cycle_min_lr": 0.1}, "missing"),
        (
            OneCycleParams,
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_max_mom": 1.0},
            "less_than",
        ),
    ]
    for model, params, error in bad:
        with pytest.raises(ValidationError) as info:
            model.model_validate(params)
        assert info.value.errors()[0]["type"] == error, (model, params)


def test_build_scheduler_from_params():
    opt = sgd(lr=0.2)
    sched = build_scheduler(
        "WarmupLR", WarmupLRParams(warmup_num_steps=5, warmup_type="linear"), opt
    )
    assert isinstance(sched, WarmupLR)
    assert lrs_by_step(sched, 2) == pytest.approx([0.0, 0.04])
    with pytest.raises(TypeError, match="WarmupDecayLRParams"):
        build_scheduler("WarmupDecayLR", WarmupLRParams(), opt)
    with pytest.raises(ValueError, match="unknown scheduler"):
        build_scheduler("CosineAnnealing", WarmupLRParams(), opt)
