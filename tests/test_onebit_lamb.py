"""1-bit LAMB (`"type": "OneBitLamb"`): the warm-up is shardspeed's Lamb, and after it, at 2 ranks
through `initialize` at ZeRO stage 0, a run is deterministic, trains, and its first compressed
step equals the step written out below from the optimizer's state and the ranks' gradients."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.comm import all_gather, get_rank, get_world_size
from shardspeed.config import ConfigError, load_config
from shardspeed.config.loader import optimizer_params
from shardspeed.optim import Lamb, build_optimizer
from shardspeed.optim.onebit import OneBitLamb

DIM, HIDDEN, ROWS, FREEZE, STEPS = 16, 32, 256, 10, 40
HYPER = {
    "lr": 0.1,
    "freeze_step": FREEZE,
    "weight_decay": 0.01,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "coeff_beta": 0.9,
    "factor_max": 4.0,
    "factor_min": 0.5,
    "factor_threshold": 0.1,
    "comm_backend_name": "gloo",
}


# -- warm-up -----------------------------------------------------------------------------------


def test_warm_up_is_lamb_and_averages_its_trust_ratios():
    torch.manual_seed(0)
    shapes = [(6, 5), (5,), (3, 4, 2)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    common = {"lr": 0.05, "weight_decay": 0.01, "max_coeff": 2.0, "min_coeff": 0.1}
    onebit = OneBitLamb(ours, freeze_step=1000, comm_backend_name="gloo", **common)
    lamb = Lamb(theirs, **common)
    frozen = [0.0] * len(shapes)
    for _ in range(10):
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
        onebit.step()
        lamb.step()
        assert onebit.get_lamb_coeffs() == pytest.approx(lamb.get_lamb_coeffs(), rel=5e-5)
        # Each ratio that is not exactly 1 enters an average of weight coeff_beta = 0.9.
        frozen = [
            f if c == 1.0 else 0.9 * f + 0.1 * c for f, c in zip(frozen, onebit.get_lamb_coeffs())
        ]
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=5e-5, atol=0)  # the brief's bound; measured: equal
    saved = [float(onebit.state[p]["lamb_coeff_freeze"]) for p in ours]
    assert saved == pytest.approx(frozen, rel=1e-6)
    assert not onebit.communicates_gradients()
    assert onebit.needs_whole_tensors(onebit.param_groups[0])


# -- after warm-up, 2 ranks through the engine --------------------------------------------------


def one_bit_average(flat: torch.Tensor) -> torch.Tensor:
    """The average 1-bit exchange of fresh error buffers gives: every rank's tensor (gathered
    exactly) padded to a multiple of 8 x world, each one replaced by sign * RMS (0 counts as +),
    averaged; then each rank's chunk of that average replaced by sign * its RMS."""
    world = get_world_size()
    everyone = [torch.empty_like(flat) for _ in range(world)]
    all_gather(everyone, flat)
    total = -(-flat.numel() // (8 * world)) * 8 * world

    def signs(v: torch.Tensor) -> torch.Tensor:
        rms = torch.linalg.vector_norm(v) / math.sqrt(v.numel())
        return torch.where(v >= 0, rms, -rms)

    server = torch.stack([signs(F.pad(t, (0, total - flat.numel()))) for t in everyone]).mean(0)
    return torch.cat([signs(chunk) for chunk in server.chunk(world)])[: flat.numel()]


def expected_first_compressed_step(params, grads, states) -> list[torch.Tensor]:
    """1-bit LAMB's first compressed step, written out for one param group."""
    lr, wd, eps = HYPER["lr"], HYPER["weight_decay"], HYPER["eps"]
    b1, b2 = HYPER["betas"]
    rms = [s["exp_avg"].norm() / math.sqrt(s["exp_avg"].numel()) for s in states]
    scaling = [sum(rms) / len(rms) / r for r in rms]
    local = [(b1 * s["exp_avg"] + (1 - b1) * g) * c for s, g, c in zip(states, grads, scaling)]
    averaged = one_bit_average(torch.cat([m.reshape(-1) for m in local]))
    momenta = [
        a.view_as(m) / c
        for a, m, c in zip(averaged.split([m.numel() for m in local]), local, scaling)
    ]
    step_size = lr * math.sqrt(1 - b2**FREEZE) / (1 - b1 ** (FREEZE + 1))
    out = []
    for p, m, s in zip(params, momenta, states):
        implied = (m - b1 * s["exp_avg"]) / (1 - b1)
        fresh = b2 * s["exp_avg_sq"] + (1 - b2) * implied * implied
        denom, denom_fresh = s["exp_avg_sq"].sqrt() + eps, fresh.sqrt() + eps
        plain = m / denom
        update = plain + wd * p
        share = min(1.0, float(plain.norm() / update.norm()))
        factor = float((denom / denom_fresh).max()) * share + 1 - share
        factor = min(max(factor, 0.5, 0.9), 4.0, 1.1)  # bounds, then within 10% of 1
        out.append(p - step_size * float(s["lamb_coeff_freeze"]) * factor * update)
    return out


def _engine(**config: Any) -> tuple[nn.Module, Any]:
    """The test's small regression model under an engine with OneBitLamb (HYPER)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": ROWS,
            "optimizer": {"type": "OneBitLamb", "params": HYPER},
            **config,
        },
    )
    return model, engine


def _train_two_ranks() -> dict:
    rank = get_rank()
    model, engine = _engine(gradient_clipping=0.0)  # the comparison is of the optimizer
    optimizer = engine.basic_optimizer
    truth = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(ROWS, DIM, generator=gen)
    y = torch.tanh(x @ truth) + 0.05 * torch.randn(ROWS, 1, generator=gen)
    losses, gap, compressing = [], None, []
    for step in range(1, STEPS + 1):
        compressing.append(optimizer.communicates_gradients())
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        if step == FREEZE + 1:
            params = [p.detach().clone() for p in optimizer.param_groups[0]["params"]]
            grads = [p.grad.detach().clone() for p in model.parameters()]
            states = [
                {k: v.clone() for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
                for p in optimizer.param_groups[0]["params"]
            ]
            expected = expected_first_compressed_step(params, grads, states)
        engine.step()
        if step == FREEZE + 1:
            actual = optimizer.param_groups[0]["params"]
            gap = max(float((a.detach() - e).norm() / e.norm()) for a, e in zip(actual, expected))
        losses.append(loss.item())
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "losses": losses,
        "gap": gap,
        "compressing": compressing,
    }


def _at_stage_one(name: str) -> str:
    try:
        shardspeed.initialize(
            model=nn.Linear(4, 1),
            config={
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": name},
                "zero_optimization": {"stage": 1},
            },
        )
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_compressed_phase_at_two_ranks(pool2):
    first = pool2.run(_train_two_ranks)
    again = pool2.run(_train_two_ranks)
    for rank in (0, 1):  # deterministic, and the ranks never drift apart
        for a, b, c in zip(first[0]["weights"], first[rank]["weights"], again[rank]["weights"]):
            assert torch.equal(a, b) and torch.equal(b, c)
    result = first[0]
    assert result["compressing"] == [False] * FREEZE + [True] * (STEPS - FREEZE)
    # The same operations, some in another order: fp32 rounding only (measured: 0 to 2e-8).
    assert result["gap"] < 1e-6
    # It trains through the compressed phase too (measured: loss 0.99, 0.58 at the freeze, 0.29
    # after 30 compressed steps).
    losses = result["losses"]
    assert losses[FREEZE] < 0.7 * losses[0] and losses[-1] < 0.7 * losses[FREEZE]
    # At ZeRO 1-3 OneBitLamb steps whole tensors on their owners (tests/test_whole_tensor_
    # optimizers.py); 1-bit Adam needs its exchange and stays at stage 0.
    assert pool2.run(_at_stage_one, "OneBitLamb")[0] == "accepted"
    assert "ZeRO stage 0 only" in pool2.run(_at_stage_one, "OneBitAdam")[0]


# -- config and state ------------------------------------------------------------------------


def test_config_round_trip():
    params = {**HYPER, "max_coeff": 0.3, "min_coeff": 0.01, "bias_correction": False}
    config = load_config(
        json.loads(
            json.dumps(
                {"train_batch_size": 1, "optimizer": {"type": "onebitlamb", "params": params}}
            )
        ),
        1,
    )
    name, validated = optimizer_params(config)
    assert name == "OneBitLamb"
    dumped = validated.model_dump()
    assert {k: dumped[k] for k in params} == {**params, "betas": (0.9, 0.999)}
    optimizer = build_optimizer(name, validated, [nn.Parameter(torch.zeros(3))])
    assert isinstance(optimizer, OneBitLamb)
    assert (optimizer.freeze_step, optimizer.factor_threshold) == (FREEZE, 0.1)
    assert optimizer.param_groups[0]["max_coeff"] == 0.3


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"factor_min": 5.0}, "factor_min"),
        ({"coeff_beta": 1.0}, "coeff_beta"),
        ({"amsgrad": True}, "amsgrad"),
        ({"freeze": 3}, r"optimizer\.params\.freeze"),
    ],
)
def test_bad_params_are_refused_by_key(params, match):
    with pytest.raises(ConfigError, match=match):
        load_config(
            {"train_batch_size": 1, "optimizer": {"type": "OneBitLamb", "params": params}}, 1
        )


def test_state_dict_keeps_phase_and_per_tensor_coefficients():
    params = [nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(2, 2) * 3)]
    optimizer = OneBitLamb(params, freeze_step=2, comm_backend_name="gloo")
    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, step + 1.0)
        optimizer.step()
    fresh = OneBitLamb(params, freeze_step=2, comm_backend_name="gloo")
    fresh.load_state_dict(optimizer.state_dict())
    assert fresh.communicates_gradients()
    for p in params:
        for key in ("lamb_coeff_freeze", "last_factor", "scaling_coeff"):
            assert torch.equal(fresh.state[p][key], optimizer.state[p][key])


def _per_tensor_states_through_checkpoint(directory: str) -> list[tuple[dict, dict]]:
    """Train past the freeze, save; a fresh engine loads: each tensor's 0-dimensional states."""
    rank = get_rank()
    states = []
    for load in (False, True):
        _, engine = _engine()
        if load:
            engine.load_checkpoint(directory)
        else:
            gen = torch.Generator().manual_seed(100 + rank)
            x, y = torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, 1, generator=gen)
            for _ in range(FREEZE + 3):
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
            engine.save_checkpoint(directory)
        optimizer = engine.basic_optimizer
        states.append(
            [
                {
                    k: float(v)
                    for k, v in optimizer.state[p].items()
                    if torch.is_tensor(v) and v.dim() == 0
                }
                for p in optimizer.param_groups[0]["params"]
            ]
        )
    return list(zip(*states))


def test_per_tensor_coefficients_survive_a_checkpoint(pool2, tmp_path):
    """1-bit Lamb's frozen trust ratios and scaling coefficients differ per tensor: a checkpoint
    keeps each tensor's own (saved whole per parameter), not one value per param group."""
    for saved, loaded in pool2.run(_per_tensor_states_through_checkpoint, str(tmp_path))[0]:
        assert saved == loaded
    values = pool2.run(_per_tensor_states_through_checkpoint, str(tmp_path / "again"))[0]
    assert len({pair[0]["lamb_coeff_freeze"] for pair in values}) > 1  # they do differ
