"""Muon with its auxiliary AdamW (`"type": "Muon"`): which parameters get Muon, how each half's
settings resolve, the update against a plain re-implementation of the same math, config errors by
key, and a run through `initialize` at ZeRO stage 0."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardspeed.config import ConfigError, load_config, tuning_report
from shardspeed.config.optimizer import MuonParams
from shardspeed.optim import build_optimizer
from shardspeed.optim.muon import Muon, muon_param_groups, tag_muon_parameters
from shardspeed.testing import run_on_ranks


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 16)  # wide after the transpose: 16 x 6 is tall
        self.down = nn.Linear(16, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        h = h + self.down(torch.tanh(self.up(h)))
        return self.lm_head(self.norm(h))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 11, (4, 5), generator=gen)
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())


# -- an independent reference: one parameter at a time, the formulas written out -------------


def orthogonal(g: torch.Tensor) -> torch.Tensor:
    """Five quintic Newton-Schulz steps (the plain form, also for "gram", which is the same
    polynomial evaluated differently), then the aspect-ratio scale."""
    rows, cols = g.shape
    x = g.T if rows > cols else g
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    x = x.T if rows > cols else x
    return x * math.sqrt(max(1.0, rows / cols))


class Reference:
    """Muon (Nesterov) for matrices not named embed/lm_head, bias-corrected AdamW otherwise."""

    def __init__(self, model: nn.Module, muon: dict, adam: dict, adam_w_mode: bool = True):
        self.params = [
            (p, p.dim() >= 2 and "embed" not in n and "lm_head" not in n)
            for n, p in model.named_parameters()
        ]
        self.muon, self.adam, self.adam_w_mode = muon, adam, adam_w_mode
        self.state: dict[nn.Parameter, dict] = {}
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        for p, use_muon in self.params:
            g, s = p.grad, self.state.setdefault(p, {})
            if use_muon:
                h = self.muon
                s["m"] = h["momentum"] * s.get("m", 0 * g) + (1 - h["momentum"]) * g
                u = (1 - h["momentum"]) * g + h["momentum"] * s["m"]
                p.copy_(p * (1 - h["lr"] * h["weight_decay"]) - h["lr"] * orthogonal(u))
                continue
            h = self.adam
            b1, b2 = h["betas"]
            if not self.adam_w_mode:
                g = g + h["weight_decay"] * p
            s["m"] = b1 * s.get("m", 0 * g) + (1 - b1) * g
            s["v"] = b2 * s.get("v", 0 * g) + (1 - b2) * g * g
            m_hat, v_hat = s["m"] / (1 - b1**self.t), s["v"] / (1 - b2**self.t)
            decay = h["weight_decay"] if self.adam_w_mode else 0.0
            p.copy_(p * (1 - h["lr"] * decay) - h["lr"] * m_hat / (v_hat.sqrt() + h["eps"]))


def train(model: nn.Module, optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        model.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# -- which parameters, which settings --------------------------------------------------------


def test_hidden_matrices_get_muon_the_rest_adamw():
    model = tiny()
    tag_muon_parameters(model)
    marked = {name: p.use_muon for name, p in model.named_parameters()}
    assert marked == {
        "embed_tokens.weight": False,
        "up.weight": True,
        "up.bias": False,
        "down.weight": True,
        "norm.weight": False,
        "norm.bias": False,
        "lm_head.weight": False,
    }


def test_each_half_resolves_shared_then_its_own_lr_then_the_group():
    model = tiny()
    tag_muon_parameters(model)
    model.norm.weight.requires_grad_(False)  # frozen: in neither half
    no_decay = [model.up.bias, model.norm.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in no_decay)]
    settings = MuonParams.model_validate(
        {"lr": 0.5, "adam_lr": 0.003, "weight_decay": 0.1, "momentum": 0.9}
    ).half_settings()
    groups = muon_param_groups(
        [{"params": rest}, {"params": no_decay, "weight_decay": 0.0, "name": "nd"}], settings
    )
    described = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    assert described == [
        {
            "use_muon": True,
            "name": "group0-muon-params",
            "lr": 0.5,
            "momentum": 0.9,
            "weight_decay": 0.1,
            "ns_method": "gram",
        },
        {
            "use_muon": False,
            "name": "group0-adam-params",
            "lr": 0.003,
            "betas": (0.9, 0.95),
            "eps": 1e-10,
            "weight_decay": 0.1,
        },
        {
            "use_muon": False,
            "name": "nd-adam-params",
            "lr": 0.003,
            "betas": (0.9, 0.95),
            "eps": 1e-10,
            "weight_decay": 0.0,
        },
    ]
    assert [len(g["params"]) for g in groups] == [2, 2, 2]
    # Without any lr each half takes its own default; one loose list keeps the plain names.
    optimizer = Muon(muon_param_groups(model.parameters(), {}))
    assert [(g["name"], g["lr"]) for g in optimizer.param_groups] == [
        ("muon-params", 0.02),
        ("adam-params", 3e-4),
    ]
    assert [optimizer.needs_whole_tensors(g) for g in optimizer.param_groups] == [True, False]


def test_untagged_parameters_and_flat_muon_tensors_are_refused():
    with pytest.raises(ValueError, match="use_muon"):
        muon_param_groups([nn.Parameter(torch.zeros(3, 3))], {})
    flat = nn.Parameter(torch.zeros(9))
    flat.grad = torch.ones(9)
    with pytest.raises(ValueError, match="whole matrices"):
        Muon([{"params": [flat], "use_muon": True}]).step()


# -- the update ------------------------------------------------------------------------------

SETTINGS = {
    "lr": 0.3,  # overridden by both halves' own
    "muon_lr": 0.02,
    "adam_lr": 0.003,
    "weight_decay": 0.1,
    "momentum": 0.9,
    "betas": [0.8, 0.95],
    "eps": 1e-8,
}


@pytest.mark.parametrize(
    ("ns_method", "adam_w_mode"), [("gram", True), ("standard", True), ("gram", False)]
)
def test_muon_equals_the_reference(ns_method, adam_w_mode):
    params = MuonParams.model_validate(
        {**SETTINGS, "ns_method": ns_method, "adam_w_mode": adam_w_mode}
    )
    ours, theirs = tiny(), tiny()
    optimizer = build_optimizer("Muon", params, ours.parameters(), ours)
    muon = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1}
    adam = {"lr": 0.003, "betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    reference = Reference(theirs, muon, adam, adam_w_mode)
    losses = train(ours, optimizer, 6)
    train(theirs, reference, 6)
    assert losses[-1] < losses[0]
    # fp32 on CPU throughout: the same arithmetic in another order, plus (for "gram") the same
    # polynomial evaluated through the Gram matrix; measured differences are ~1e-7.
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=2e-6, msg=name)
    moved = (ours.up.weight - tiny().up.weight).norm()
    assert moved > 0.01  # Muon really stepped the hidden matrices


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"nesterov": False}, r"optimizer\.params\.nesterov"),
        ({"ns_steps": 3}, r"optimizer\.params\.ns_steps"),
        ({"ns_method": "fast"}, r"optimizer\.params\.ns_method"),
        ({"momentum": 1.0}, r"optimizer\.params\.momentum"),
        ({"adam_lr": -1.0}, r"optimizer\.params\.adam_lr"),
        ({"per_head_muon": True}, "per-head Newton-Schulz"),
        ({"max_grad_norm": 1.0}, "gradient_clipping"),
    ],
)
def test_bad_muon_params_are_refused_by_key(params, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"train_batch_size": 1, "optimizer": {"type": "Muon", "params": params}}, 1)


def test_keys_that_change_nothing_are_reported():
    """`torch_adam` and `foreach` choose DeepSpeed's kernels; shardspeed's AdamW half is the same
    arithmetic either way, and the start-of-run report says so for each one set."""
    params = {"torch_adam": True, "foreach": False}
    config = load_config(
        {"train_batch_size": 1, "optimizer": {"type": "Muon", "params": params}}, 1
    )
    report = tuning_report(config)
    assert [line.split(" = ")[0] for line in report] == [
        "optimizer.params.torch_adam",
        "optimizer.params.foreach",
    ]


def test_type_is_case_insensitive_as_in_deepspeed():
    config = load_config({"train_batch_size": 1, "optimizer": {"type": "muon"}}, 1)
    assert config.optimizer is not None


def _engine_trains() -> dict:
    import shardspeed

    model, reference_model = tiny(), tiny()
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "muon", "params": {"lr": 0.02, "adam_lr": 0.003}},
            "gradient_clipping": 0.0,  # compare optimizers, not clipping
            "zero_optimization": {"stage": 0},
        },
    )
    losses = []
    for step in range(8):
        loss = loss_of(engine, step)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    reference = Reference(
        reference_model,
        {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0},
        {"lr": 0.003, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0},
    )
    train(reference_model, reference, 8)
    return {
        "losses": losses,
        "type": type(engine.basic_optimizer).__name__,
        "gap": max(
            float((p - q).abs().max())
            for p, q in zip(model.parameters(), reference_model.parameters())
        ),
    }


def test_the_engine_builds_muon_from_config_and_trains():
    result = run_on_ranks(_engine_trains, 1)[0]
    assert result["type"] == "Muon"
    assert result["losses"][-1] < result["losses"][0]
    assert result["gap"] < 2e-6  # as test_muon_equals_the_reference: fp32 rounding
