"""Optimizers whose update of an element depends on its whole tensor (Lamb's trust ratio,
Adafactor's factored second moment, Muon's orthogonalisation, 1-bit Lamb's per-tensor scaling) at
ZeRO stages 1, 2 and 3: the shard plan gives each rank whole tensors, so training equals the
single-process optimizer (1-bit Lamb: its own one-process run, past its warm-up too; ZeRO then
averages the gradients, and its 1-bit exchange is stage 0's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from reference_training import assert_close_relative
from shardspeed.optim import Lamb
from shardspeed.optim.muon import Muon, muon_param_groups, tag_muon_parameters
from shardspeed.optim.onebit import OneBitLamb

STEPS = 4
GLOBAL_BATCH = 8
WIDTH = 16


class Blocks(nn.Module):
    """Three blocks in a ModuleList (three stage-3 gather units) between an input and a head:
    matrices of three sizes and vectors, so bins of whole tensors come out uneven."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(3)
        )
        self.head = nn.Linear(WIDTH, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def lamb(model: nn.Module) -> torch.optim.Optimizer:
    return Lamb(model.parameters(), lr=0.02, weight_decay=0.01)


def adafactor(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(model.parameters(), lr=0.02)


def muon(model: nn.Module) -> torch.optim.Optimizer:
    """DeepSpeed's split: the blocks' matrices on Muon, the rest (input layer and biases too,
    by name and shape) on its AdamW half, each half with its own learning rate."""
    tag_muon_parameters(model)
    settings = {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01}
    return Muon(muon_param_groups(model.parameters(), settings))


def onebit_lamb(model: nn.Module) -> torch.optim.Optimizer:
    """Two warm-up steps (Lamb, variance updated), then two with the variance frozen and the
    per-tensor scaling of 1-bit Lamb."""
    return OneBitLamb(model.parameters(), lr=0.02, freeze_step=2, comm_backend_name="gloo")


class Unknown(torch.optim.Adafactor):
    """Adafactor under a name shardspeed does not know."""


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "lamb": lamb,
    "adafactor": adafactor,
    "muon": muon,
    "onebitlamb": onebit_lamb,
    "unknown": lambda model: Unknown(model.parameters(), lr=0.02),
}

STAGES = {
    0: {"stage": 0},
    1: {"stage": 1},
    2: {"stage": 2},
    3: {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def reference(name: str) -> list[torch.Tensor]:
    """The optimizer in one process on the whole global batches."""
    model = Blocks()
    optimizer = OPTIMIZERS[name](model)
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def train(
    name: str,
    stage: int,
    micro: int,
    extra: dict | None = None,
    steps: range = range(STEPS),
    load: str | None = None,
    save: str | None = None,
) -> dict[str, Any]:
    """`steps` of training (resumed from checkpoint directory `load`, saved to `save`)."""
    model = Blocks()
    engine, *_ = shardspeed.initialize(
        model=model,
        optimizer=OPTIMIZERS[name](model),
        config={
            "train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_clipping": 0.0,
            "zero_optimization": STAGES[stage],
            **(extra or {}),
        },
    )
    rank, world = engine.global_rank, engine.dp_world_size
    dtype = next(engine.module.parameters()).dtype
    if load is not None:
        engine.load_checkpoint(load)
    for step in steps:
        x, y = batch(step)
        for m in range(engine.gradient_accumulation_steps()):
            start = (m * world + rank) * micro
            out = engine(x[start : start + micro].to(dtype)).float()
            loss = F.mse_loss(out, y[start : start + micro])
            engine.backward(loss)
            engine.step()
    if save is not None:
        engine.save_checkpoint(save)
    plan = engine.optimizer.plan
    masters = [(m.param, tuple(m.shape)) for m in plan.masters]
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    shapes = [tuple(shape) for shape in plan.layout.shapes]
    return {"params": params, "masters": masters, "shapes": shapes}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["adafactor", "lamb", "muon", "onebitlamb"])
@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process(pool2, pool4, world, name, stage):
    pool = pool2 if world == 2 else pool4
    results = pool.run(train, name, stage, 1 if world == 4 else 2)
    expected = reference(name)
    for result in results:
        # Summation order differs from one process (micro-batches, then ranks): 5e-5 relative.
        assert_close_relative(result["params"], expected, 5e-5)
    # Every parameter is one rank's master, whole, in its own shape (Muon: every matrix; its
    # AdamW half keeps flat shards).
    shapes = results[0]["shapes"]
    owned = [param for result in results for param, _ in result["masters"] if param is not None]
    whole = [i for i, shape in enumerate(shapes) if name != "muon" or len(shape) >= 2]
    assert sorted(owned) == whole
    for result in results:
        for param, shape in result["masters"]:
            assert param is None or shape == shapes[param]


def test_unknown_optimizers_get_whole_tensors_unless_declared_elementwise(pool2):
    """An optimizer shardspeed does not know gets whole tensors and the single-process result;
    declared element-wise ('zero_allow_untested_optimizer', DeepSpeed's flat shards), this one
    (Adafactor renamed) loses its factored moments and per-tensor clipping: the check has teeth."""
    expected = reference("adafactor")
    for allow, close in ((False, True), (True, False)):
        extra = {"zero_allow_untested_optimizer": allow}
        params = pool2.run(train, "unknown", 2, 2, extra)[0]["params"]
        err = max(((a - e).norm() / e.norm()).item() for a, e in zip(params, expected))
        assert (err < 5e-5) is close, err


def test_elementwise_groups_stay_flat(pool2):
    """AdamW keeps flat shards: one master per region, cut across tensors."""
    results = pool2.run(train_adamw)
    for masters in results:
        assert all(param is None and len(shape) == 1 for param, shape in masters)


def train_adamw() -> list:
    model = Blocks()
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": GLOBAL_BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 2},
        },
    )
    return [(m.param, tuple(m.shape)) for m in engine.optimizer.plan.masters]


@pytest.mark.parametrize("name", ["adafactor", "lamb", "muon", "onebitlamb"])
def test_checkpoint_reshards_across_world_sizes_and_stages(pool2, pool4, tmp_path, name):
    """Saved at ZeRO 2 on 2 ranks halfway, resumed at ZeRO 3 on 4 ranks and at ZeRO 1 on 2:
    the end equals uninterrupted single-process training (Adafactor's factored moments are
    saved whole in their own shapes; Lamb's per-element moments as pieces of parameters)."""
    half = STEPS // 2
    pool2.run(train, name, 2, 2, steps=range(half), save=str(tmp_path))
    expected = reference(name)
    resumed = [
        pool4.run(train, name, 3, 1, steps=range(half, STEPS), load=str(tmp_path)),
        pool2.run(train, name, 1, 2, steps=range(half, STEPS), load=str(tmp_path)),
    ]
    for results in resumed:
        for result in results:
            assert_close_relative(result["params"], expected, 5e-5)


OFFLOADED = {
    "zero_optimization": {
        **STAGES[3],
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
}


@pytest.mark.parametrize("name", ["adafactor", "lamb", "muon"])
def test_offloaded_and_bf16_masters_step_whole_tensors(pool2, name):
    """Masters copied to host memory (ZeRO 3 with CPU offload) are cut into whole tensors the
    same way: equal to one process. With a bf16 model the fp32 masters are copies too; the
    forward's bf16 rounding is all that differs (measured: 2.8e-3 for Lamb and Adafactor, 1.4e-2
    for Muon, whose orthogonalised update does not shrink with the gradient's error)."""
    expected = reference(name)
    for result in pool2.run(train, name, 3, 2, OFFLOADED):
        assert_close_relative(result["params"], expected, 5e-5)
    for result in pool2.run(train, name, 2, 2, {"bf16": {"enabled": True}}):
        params = [p.float() for p in result["params"]]
        assert_close_relative(params, expected, 3e-2)
