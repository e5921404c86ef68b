"""Shared by the data-parallel and ZeRO tests: a tiny model, fixed global batches, the fp32
single-process reference, and a training function that runs on every rank of a `RankPool`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.optim import WarmupLR

STEPS = 5
GLOBAL_BATCH = 8
LR = 0.01


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups with their own hyper-parameters: the first layer at half lr and no decay."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not f for f in first)]
    return [{"params": first, "lr": LR / 2, "weight_decay": 0.0}, {"params": rest}]


SCHEDULE = {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}}


def reference(
    clip: float = 1.0, weight_decay: float = 0.01, groups: bool = False, schedule: bool = False
) -> list[torch.Tensor]:
    """The same training in one process, fp32, plain torch (plus our WarmupLR when asked)."""
    model = make_model()
    params = param_groups(model) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=weight_decay)
    scheduler = WarmupLR(opt, **SCHEDULE["params"]) if schedule else None
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def config(micro: int, **extra) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        **extra,
    }


def train(
    micro: int, extra: dict | None = None, groups: bool = False, under_init: bool = False
) -> dict:
    """Train STEPS global batches; each rank takes its own micro-batches of every global batch.

    `under_init` builds the model inside `shardspeed.zero.Init` (ZeRO stage 3 only).
    """
    with shardspeed.zero.Init(enabled=under_init):
        model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=param_groups(model) if groups else model.parameters(),
        config=config(micro, **(extra or {})),
    )
    rank, world = engine.global_rank, engine.dp_world_size
    gas = engine.gradient_accumulation_steps()
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        for m in range(gas):
            start = (m * world + rank) * micro
            xs, ys = x[start : start + micro], y[start : start + micro]
            dtype = next(engine.module.parameters()).dtype
            loss = F.mse_loss(engine(xs.to(dtype)).float(), ys)
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    with shardspeed.zero.GatheredParameters(list(model.parameters())):  # whole even at stage 3
        params = [p.detach().float().clone() for p in model.parameters()]
    return {
        "params": params,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped": engine.skipped_steps,
        "norms": norms,
        "memory": engine.memory_breakdown(),
    }


def assert_close_relative(actual: list, expected: list, tol: float) -> None:
    for a, e in zip(actual, expected):
        err = ((a - e).norm() / e.norm()).item()
        assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def assert_named_close(actual: dict, expected: dict, tol: float) -> None:
    """Same names, and each tensor within `tol` relative (norm of the difference over the norm)."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        err = ((actual[name] - value).norm() / value.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.1e} > {tol:.0e}"
