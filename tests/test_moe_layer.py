"""The MoE layer (experts on every rank): output equals the gate-weighted sum of the chosen
experts computed token by token, DeepSpeed's parameter names, residual MoE, training through the
engine, load telemetry, and the refusals of what comes later."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.moe.layer import MoE
from shardspeed.testing import HostSyncCounter

DIM, EXPERTS = 8, 4


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))


def _by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed one token and one expert at a time."""
    gate = layer.deepspeed_moe.last_gate
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    tokens = x.reshape(-1, DIM)
    out = torch.zeros_like(tokens)
    for s in range(tokens.shape[0]):
        for e in range(EXPERTS):
            weight = gate.combine_weights[s, e].sum()
            if weight > 0:
                out[s] += weight * experts[e](tokens[s])
    return out.reshape(x.shape)


@pytest.mark.parametrize("k", [1, 2])
def test_output_is_the_gate_weighted_sum_of_the_chosen_experts(k):
    torch.manual_seed(0)
    layer = MoE(DIM, _expert(), num_experts=EXPERTS, k=k, use_rts=False, capacity_factor=0.5)
    x = torch.randn(3, 8, DIM)
    out, l_aux, counts = layer(x)
    assert torch.allclose(out, _by_token(layer, x), atol=1e-6)
    assert int(counts.sum()) == 24 * k  # every token asked for k experts
    load = layer.expert_load()
    assert int(load["dropped"]) == int(counts.sum() - load["tokens_per_expert"].sum()) > 0
    assert l_aux.requires_grad


@pytest.mark.parametrize("k,use_rts", [(1, True), (1, False), (2, False)])
def test_routing_with_a_fixed_capacity_never_waits_for_the_device(k, use_rts):
    # Dropping tokens fixes every shape in advance, so forward and backward must not read a
    # count back (on a GPU that would stall the stream once per MoE layer).
    torch.manual_seed(0)
    layer = MoE(DIM, _expert(), num_experts=EXPERTS, k=k, use_rts=use_rts, capacity_factor=0.5)
    x = torch.randn(3, 8, DIM, requires_grad=True)
    with HostSyncCounter() as syncs:
        out, l_aux, _ = layer(x)
        (out.square().sum() + l_aux).backward()
    assert syncs.places == []
    assert torch.allclose(out, _by_token(layer, x), atol=1e-6)
    assert x.grad is not None and layer.deepspeed_moe.gate.wg.weight.grad is not None


def test_deepspeed_parameter_names_and_independent_experts():
    layer = MoE(DIM, _expert(), num_experts=EXPERTS)
    names = [n for n, _ in layer.named_parameters()]
    assert names[0] == "deepspeed_moe.gate.wg.weight"
    assert "deepspeed_moe.experts.deepspeed_experts.3.2.bias" in names
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    assert experts[0][0].weight is not experts[1][0].weight


def test_residual_moe_mixes_a_dense_mlp():
    torch.manual_seed(1)
    layer = MoE(DIM, _expert(), num_experts=EXPERTS, use_residual=True)
    x = torch.randn(2, 4, DIM)
    out, _, _ = layer(x)
    moe_out, _, _ = layer.deepspeed_moe(x)
    mix = torch.softmax(layer.coefficient(x), dim=-1)
    assert torch.allclose(out, moe_out * mix[..., :1] + layer.mlp(x) * mix[..., 1:], atol=1e-6)


def test_unsupported_options_are_refused():
    for kwargs in ({"use_tutel": True}, {"enable_expert_tensor_parallelism": True}):
        with pytest.raises(NotImplementedError, match="not supported"):
            MoE(DIM, _expert(), num_experts=EXPERTS, **kwargs)
    with pytest.raises(ValueError, match="divisible"):
        MoE(DIM, _expert(), num_experts=3, ep_size=2)


def test_expert_parallel_layer_needs_its_groups():
    layer = MoE(DIM, _expert(), num_experts=EXPERTS, ep_size=2)
    assert layer.num_local_experts == EXPERTS // 2
    marks = {(p.allreduce, p.group_name) for p in layer.deepspeed_moe.experts.parameters()}
    assert marks == {(False, "ep_size_2")}
    assert not hasattr(layer.deepspeed_moe.gate.wg.weight, "allreduce")
    with pytest.raises(RuntimeError, match=r"shardspeed\.initialize"):
        layer(torch.randn(2, 4, DIM))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        # No second-expert sampling: both runs must route alike without sharing an RNG.
        self.moe = MoE(
            DIM,
            _expert(),
            num_experts=EXPERTS,
            k=2,
            drop_tokens=False,
            top2_2nd_expert_sampling=False,
        )
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, l_aux, _ = self.moe(x)
        return self.out(hidden), l_aux


def _train(steps: int) -> list[torch.Tensor]:
    model = _Net()
    engine, *_ = shardspeed.initialize(
        model=model,
        config={"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}},
    )
    rank = engine.global_rank
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, DIM, generator=gen), torch.randn(8, 4, 1, generator=gen)
        out, l_aux = engine(x[rank * 4 : (rank + 1) * 4])
        engine.backward(F.mse_loss(out, y[rank * 4 : (rank + 1) * 4]) + 0.01 * l_aux)
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


def test_trains_through_the_engine_like_one_process(pool2):
    # Experts replicated on both ranks: data parallelism must give the one-process result.
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, DIM, generator=gen), torch.randn(8, 4, 1, generator=gen)
        halves = [model(x[i * 4 : (i + 1) * 4]) for i in range(2)]
        loss = (
            sum(F.mse_loss(o, y[i * 4 : (i + 1) * 4]) + 0.01 * a for i, (o, a) in enumerate(halves))
            / 2
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for got, want in zip(pool2.run(_train, 3)[0], model.parameters()):
        assert torch.allclose(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_split_params_into_moe_groups_as_deepspeed():
    from shardspeed.moe.utils import (
        configure_moe_param_groups,
        has_moe_layers,
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
        split_params_into_shared_and_expert_params,
    )

    net = nn.Sequential(nn.Linear(DIM, DIM), MoE(DIM, _expert(), num_experts=EXPERTS, ep_size=2))
    assert has_moe_layers(net) == (True, EXPERTS)
    params = list(net.parameters())
    shared, expert = split_params_into_shared_and_expert_params(params)
    assert all(is_moe_param(p) for p in expert) and not any(is_moe_param(p) for p in shared)
    # 2 shared linear tensors + the gate's weight; 2 local experts x (2 weights + 2 biases).
    assert (len(shared), len(expert)) == (3, 8)

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": params, "name": "all", "lr": 0.5}
    )
    assert [(g["name"], g.get("moe", False), len(g["params"])) for g in groups] == [
        ("all", False, 3),
        ("ep_size_2", True, 8),
    ]
    assert groups[1]["lr"] == 0.5  # the expert group keeps its source group's settings
    # max_group_size cuts an expert group into runs of whole parameters.
    biggest = max(p.numel() for p in expert)
    pieces = split_params_into_different_moe_groups_for_optimizer(
        [{"params": params, "name": "all"}], max_group_size=biggest
    )
    assert len(pieces) > 2 and all(
        sum(p.numel() for p in g["params"]) <= biggest for g in pieces[1:]
    )
    assert [g["name"] for g in configure_moe_param_groups(params)] == ["dense-params", "ep_size_2"]
    with pytest.raises(ValueError, match="'name'"):
        split_params_into_different_moe_groups_for_optimizer([{"params": params}])
