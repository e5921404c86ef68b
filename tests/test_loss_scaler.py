"""Loss-scale trajectories worked out by hand from DeepSpeed 0.19.8's DynamicLossScaler rules.

Notation in the comments: `i` is the step counter before the update, `last` the step of the last
overflow (-1 at the start), `stable = i - last - 1`; a clean step grows the scale when
`stable > 0 and stable % window == 0`.
"""

import json
import logging

import pytest

from shardspeed.precision import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
)

T, F = True, False


def trajectory(scaler, overflows):
    """The scale after each update."""
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.loss_scale)
    return out


def test_window_growth_without_overflow():
    s = DynamicLossScaler(init_scale=16, scale_window=3)
    # stable = i for i = 0..7 (last = -1): growth when stable is 3 and 6, i.e. on the 4th and 7th
    # clean steps -- the first growth waits window + 1 steps.
    assert trajectory(s, [F] * 8) == [16, 16, 16, 32, 32, 32, 64, 64]
    assert s.cur_iter == 8


def test_overflow_halves_and_restarts_window():
    s = DynamicLossScaler(init_scale=16, scale_window=2)
    # i0 clean (stable 0); i1 overflow -> 8, last = 1; i2, i3 clean (stable 0, 1);
    # i4 stable 2 -> 16; i5 stable 3; i6 stable 4 -> 32.
    assert trajectory(s, [F, T, F, F, F, F, F]) == [16, 8, 8, 8, 16, 16, 32]
    assert s.last_overflow_iter == 1


def test_hysteresis_two_first_overflow_only_spends_credit():
    s = DynamicLossScaler(init_scale=16, scale_window=2, delayed_shift=2)
    # i0 overflow: credit 2 -> 1, scale kept; i1 overflow: credit 1 -> 8 (credit stays 1);
    # i2 clean; i3 overflow with credit 1 -> 4; i4, i5 clean (stable 0, 1);
    # i6 stable 2 -> 8 and credit refilled to 2; i7 overflow spends credit, scale kept.
    assert trajectory(s, [T, T, F, T, F, F, F, T]) == [16, 8, 8, 4, 4, 4, 8, 8]
    assert s.cur_hysteresis == 1


def test_consecutive_hysteresis_refills_on_every_clean_step():
    s = DynamicLossScaler(
        init_scale=16, scale_window=2, delayed_shift=2, consecutive_hysteresis=True
    )
    # Same pattern as above. i0 spends credit; i1 -> 8; i2 clean refills credit to 2, so
    # i3's overflow only spends it (scale stays 8, unlike without consecutive hysteresis);
    # i4, i5 clean (stable 0, 1); i6 stable 2 -> 16; i7 spends the refilled credit.
    assert trajectory(s, [T, T, F, T, F, F, F, T]) == [16, 8, 8, 8, 8, 8, 16, 16]
    assert s.cur_hysteresis == 1


def test_min_scale_clamps_then_raises():
    s = DynamicLossScaler(init_scale=8, min_scale=3)
    # 8 -> 4 -> max(2, 3) = 3; the next overflow at the minimum must raise.
    assert trajectory(s, [T, T]) == [4, 3]
    with pytest.raises(LossScaleAtMinimumError, match="already at minimum") as err:
        s.update(True)
    assert isinstance(err.value, RuntimeError)
    assert "bf16" in str(err.value)
    # The failed update leaves the state as it was.
    assert (s.loss_scale, s.cur_iter) == (3, 2)


def test_min_scale_without_raise_stays_at_minimum():
    s = DynamicLossScaler(init_scale=4, min_scale=2, raise_error_at_min_scale=False)
    # 4 -> 2, then overflows at the minimum keep it at 2.
    assert trajectory(s, [T, T, T]) == [2, 2, 2]


def test_overflow_messages(caplog):
    s = DynamicLossScaler(init_scale=16, delayed_shift=2)
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        s.update(True)
        s.update(True)
    assert caplog.messages == [
        "[shardspeed] OVERFLOW! Skipping step. Attempted loss scale: 16, but hysteresis is 2. "
        "Reducing hysteresis to 1",
        "[shardspeed] OVERFLOW! Skipping step. Attempted loss scale: 16, reducing to 8",
    ]


def test_fractional_scales_are_printed_exactly(caplog):
    s = DynamicLossScaler(init_scale=0.5, min_scale=0.125)
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        s.update(True)
    assert caplog.messages == [
        "[shardspeed] OVERFLOW! Skipping step. Attempted loss scale: 0.5, reducing to 0.25"
    ]


def test_static_scaler_never_changes(caplog):
    s = StaticLossScaler(128)
    assert s.dynamic is False
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        assert trajectory(s, [F, T, T, F]) == [128.0] * 4
    assert len(caplog.messages) == 2
    assert all("OVERFLOW! Skipping step." in m for m in caplog.messages)
    assert s.state_dict() == {"dynamic": False, "cur_scale": 128.0}


def test_state_dict_round_trip_through_json():
    pattern = [T, F, F, T, F, F, F]
    a = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=3)
    trajectory(a, pattern)
    saved = json.loads(json.dumps(a.state_dict()))
    assert saved["cur_iter"] == 7 and saved["last_overflow_iter"] == 3
    b = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=3)
    b.load_state_dict(saved)
    assert b.state_dict() == a.state_dict()
    # Both continue identically.
    more = [F, T, T, T, F, F, F]
    assert trajectory(b, more) == trajectory(a, more)


def test_load_keeps_configured_settings_and_caps_credit():
    a = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=3)
    b = DynamicLossScaler(init_scale=1024, scale_window=5, delayed_shift=2)
    b.load_state_dict(a.state_dict())
    assert (b.loss_scale, b.scale_window, b.cur_hysteresis) == (64, 5, 2)


def test_loading_the_other_kind_keeps_the_configured_scaler(caplog):
    dyn = DynamicLossScaler(init_scale=64)
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        dyn.load_state_dict(StaticLossScaler(8).state_dict())
    assert dyn.loss_scale == 64
    assert "static loss scaler" in caplog.messages[0]


def test_build_loss_scaler_maps_fp16_keys():
    dyn = build_loss_scaler(
        loss_scale=0,
        initial_scale_power=12,
        loss_scale_window=500,
        hysteresis=3,
        consecutive_hysteresis=True,
        min_loss_scale=2,
    )
    assert isinstance(dyn, DynamicLossScaler) and dyn.dynamic
    assert dyn.loss_scale == 4096.0
    assert (dyn.scale_window, dyn.delayed_shift, dyn.cur_hysteresis) == (500, 3, 3)
    assert (dyn.consecutive_hysteresis, dyn.min_scale, dyn.scale_factor) == (True, 2.0, 2.0)
    assert dyn.raise_error_at_min_scale is True

    static = build_loss_scaler(256, 16, 1000, 2, False, 1)
    assert isinstance(static, StaticLossScaler)
    assert static.loss_scale == 256.0


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_build_loss_scaler_rejects_bad_loss_scale(bad):
    with pytest.raises(ValueError, match=r"fp16\.loss_scale"):
        build_loss_scaler(bad, 16, 1000, 2, False, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scale_window": 0}, "loss_scale_window"),
        ({"delayed_shift": 0}, "hysteresis"),
        ({"min_scale": 0}, "min_loss_scale"),
        ({"init_scale": 0.5}, "below min_loss_scale"),
        ({"scale_factor": 1.0}, "scale_factor"),
    ],
)
def test_dynamic_scaler_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)
