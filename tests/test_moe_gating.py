"""The MoE gate (`shardspeed.moe.gating`): capacity, routing, dropping, the load-balancing loss and
the additions to DeepSpeed's gate, on hand-computed cases and against DeepSpeed's own gating."""

from __future__ import annotations

import os

import pytest
import torch

from shardspeed.moe.gating import TopKGate, capacity, imbalance


def identity_gate(num_experts: int, **kwargs) -> TopKGate:
    """A gate whose logits are its input, so a test chooses the logits token by token."""
    gate = TopKGate(num_experts, num_experts, **kwargs)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(num_experts))
    return gate


def from_probs(rows: list[list[float]]) -> torch.Tensor:
    """Inputs whose gate values (softmax of the logits) under `identity_gate` are `rows`."""
    return torch.tensor(rows).log()


def routed(out) -> list[tuple[int, int, int]]:
    """(token, expert, slot) of every dispatched assignment, in token order."""
    return [tuple(i) for i in out.dispatch_mask.nonzero().tolist()]


def check_consistent(out, gates: torch.Tensor, k: int) -> None:
    """Dispatch and combine agree, slots are unique and dense, counts add up."""
    dispatch, combine = out.dispatch_mask, out.combine_weights
    assert torch.equal(dispatch, combine > 0)
    assert dispatch.sum(dim=0).max() <= 1  # one token per slot
    per_expert = dispatch.sum(dim=(0, 2))
    assert torch.equal(per_expert, out.tokens_per_expert)
    for e, n in enumerate(per_expert.tolist()):  # an expert's n tokens fill slots 0..n-1
        assert torch.equal(dispatch[:, e].any(dim=0).nonzero().flatten(), torch.arange(n))
    assert out.dropped == int(out.exp_counts.sum() - per_expert.sum())
    kept = dispatch.any(dim=2)
    totals = combine.sum(dim=(1, 2))
    if k == 1:  # a kept token is weighted by its expert's gate value
        assert torch.allclose(totals, (gates * kept).sum(dim=1))
    else:  # the kept experts' gate values renormalised to 1
        assert torch.allclose(totals, kept.any(dim=1).float())
        ratio = combine.sum(dim=2)[kept] / gates[kept]
        norms = (gates * kept).sum(dim=1, keepdim=True).expand_as(kept)[kept]
        assert torch.allclose(ratio, 1 / norms)


def test_capacity_arithmetic():
    assert capacity(8, 4, 1.0, 0) == 2
    assert capacity(10, 4, 1.0, 0) == 3  # ceil(2.5)
    assert capacity(8, 4, 1.0, 4) == 4  # min_capacity wins
    assert capacity(8, 4, 2 * 1.0, 0) == 4  # top-2 passes twice the factor
    assert capacity(7, 2, 0.5, 1) == 2  # ceil(1.75)
    # exact in the factor as written (DeepSpeed's fp32 arithmetic gives 31 and 15)
    assert capacity(25, 1, 1.2, 0) == 30
    assert capacity(35, 3, 1.2, 0) == 14


def test_imbalance():
    assert imbalance(torch.tensor([2, 2, 2, 2])) == 1.0
    assert imbalance(torch.tensor([4, 0, 0, 0])) == 4.0
    assert imbalance(torch.tensor([3, 1])) == 1.5
    assert imbalance(torch.zeros(4, dtype=torch.int64)) == 1.0


def test_top1_drops_in_position_order_without_rts():
    gate = identity_gate(2, min_capacity=0, use_rts=False)
    x = from_probs([[0.9, 0.1]] * 5 + [[0.2, 0.8]])  # tokens 0-4 want expert 0
    out = gate(x)
    assert out.combine_weights.shape == (6, 2, 3)  # capacity ceil(6 / 2)
    assert routed(out) == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (5, 1, 0)]
    assert out.exp_counts.tolist() == [5, 1]
    assert out.tokens_per_expert.tolist() == [3, 1]
    assert out.dropped == 2
    assert out.combine_weights[1, 0, 1].item() == pytest.approx(0.9)
    assert out.combine_weights[5, 1, 0].item() == pytest.approx(0.8)


def test_top1_rts_keeps_capacity_tokens_chosen_at_random():
    gate = identity_gate(2, min_capacity=0, use_rts=True)
    x = from_probs([[0.9, 0.1]] * 10 + [[0.2, 0.8]] * 2)
    kept_sets = set()
    for seed in range(4):
        torch.manual_seed(seed)
        out = gate(x)
        check_consistent(out, x.exp(), k=1)
        assert out.tokens_per_expert.tolist() == [6, 2]  # capacity 6, expert 1 under it
        assert out.dropped == 4
        kept_sets.add(tuple(out.dispatch_mask[:, 0].any(dim=1).nonzero().flatten().tolist()))
    assert len(kept_sets) > 1  # not always the first six


def test_top1_aux_loss_by_hand():
    gate = identity_gate(2, min_capacity=0)
    out = gate(from_probs([[0.75, 0.25], [0.75, 0.25], [0.25, 0.75], [0.75, 0.25]]))
    # mean gates [0.625, 0.375], first-choice fractions [0.75, 0.25]
    assert out.l_aux.item() == pytest.approx(2 * (0.625 * 0.75 + 0.375 * 0.25))


TOP2_PROBS = [[0.5, 0.3, 0.2], [0.5, 0.2, 0.3], [0.1, 0.6, 0.3], [0.1, 0.3, 0.6]]


def test_top2_by_hand():
    gate = identity_gate(3, k=2, min_capacity=0, top2_2nd_expert_sampling=False)
    out = gate(from_probs(TOP2_PROBS))
    # first choices 0, 0, 1, 2; mean gates [0.3, 0.35, 0.35]
    assert out.l_aux.item() == pytest.approx(3 * (0.3 * 0.5 + 0.35 * 0.25 + 0.35 * 0.25))
    assert out.combine_weights.shape == (4, 3, 3)  # ceil(4 / 3 * 2)
    # second-choice assignments take an expert's slots after all its first choices
    assert sorted(routed(out), key=lambda r: (r[1], r[2])) == [
        (0, 0, 0), (1, 0, 1),
        (2, 1, 0), (0, 1, 1), (3, 1, 2),
        (3, 2, 0), (1, 2, 1), (2, 2, 2),
    ]  # fmt: skip
    assert out.combine_weights[0, 0, 0].item() == pytest.approx(0.5 / 0.8)
    assert out.combine_weights[0, 1, 1].item() == pytest.approx(0.3 / 0.8)
    assert out.exp_counts.tolist() == [2, 3, 3]
    assert out.dropped == 0
    check_consistent(out, torch.tensor(TOP2_PROBS), k=2)


def test_top2_drops_second_choices_first_and_renormalises():
    gate = identity_gate(
        3, k=2, capacity_factor=0.5, min_capacity=0, top2_2nd_expert_sampling=False
    )
    out = gate(from_probs(TOP2_PROBS))
    assert out.combine_weights.shape == (4, 3, 2)  # ceil(4 / 3 * 1.0)
    # expert 1 is full before token 3's second choice, expert 2 before token 2's
    assert out.exp_counts.tolist() == [2, 3, 3]
    assert out.tokens_per_expert.tolist() == [2, 2, 2]
    assert out.dropped == 2
    assert out.combine_weights[2].sum().item() == pytest.approx(1.0)  # expert 1 alone
    assert out.combine_weights[2, 1, 0].item() == pytest.approx(1.0)
    assert out.combine_weights[3, 2, 0].item() == pytest.approx(1.0)
    check_consistent(out, torch.tensor(TOP2_PROBS), k=2)


def random_gate(num_experts: int = 8, model_dim: int = 16, **kwargs) -> TopKGate:
    torch.manual_seed(0)
    return TopKGate(model_dim, num_experts, **kwargs)


def test_top2_second_expert_sampling():
    x = torch.randn(64, 16)
    fixed = random_gate(k=2, top2_2nd_expert_sampling=False, min_capacity=0)
    runner_up = fixed(x).dispatch_mask.any(dim=2)
    assert torch.equal(fixed(x).dispatch_mask.any(dim=2), runner_up)  # deterministic

    sampled = random_gate(k=2, min_capacity=0, drop_tokens=False)
    logits = sampled.wg(x).detach()
    first = logits.argmax(dim=1)
    torch.manual_seed(1)
    choices = sampled(x).dispatch_mask.any(dim=2)
    torch.manual_seed(1)
    assert torch.equal(sampled(x).dispatch_mask.any(dim=2), choices)  # seeded
    assert choices.sum(dim=1).eq(2).all()  # two distinct experts per token
    assert choices[torch.arange(64), first].all()
    second = choices.clone()
    second[torch.arange(64), first] = False
    expected = logits.scatter(1, first.unsqueeze(1), float("-inf")).argmax(dim=1)
    assert (second.int().argmax(dim=1) != expected).any()  # sampling changed some choices
    sampled.eval()  # no sampling in eval
    eval_choices = sampled(x).dispatch_mask.any(dim=2)
    eval_second = eval_choices.clone()
    eval_second[torch.arange(64), first] = False
    assert torch.equal(eval_second.int().argmax(dim=1), expected)


@pytest.mark.parametrize("k", [1, 2])
def test_no_dropping_without_drop_tokens(k):
    gate = random_gate(
        k=k, num_experts=4, drop_tokens=False, min_capacity=64, top2_2nd_expert_sampling=False
    )
    x = torch.randn(32, 16) + 3 * gate.wg.weight[0]  # most tokens favour expert 0
    out = gate(x)
    assert out.dropped == 0
    assert out.combine_weights.shape[2] == out.exp_counts.max().item()  # min_capacity unused
    assert torch.equal(out.tokens_per_expert, out.exp_counts)

    asked = []
    gate.capacity_fn = lambda local: asked.append(local) or local + 5  # the group needs more
    assert gate(x).combine_weights.shape[2] == out.exp_counts.max().item() + 5
    assert asked == [out.exp_counts.max().item()]
    gate.capacity_fn = lambda local: local - 1
    with pytest.raises(ValueError, match="capacity_fn"):
        gate(x)


def test_temperature_sharpens_and_flattens():
    x = from_probs([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]])
    values = {}
    for t in (0.5, 1.0, 2.0):
        out = identity_gate(3, temperature=t, min_capacity=0)(x)
        assert routed(out) == [(0, 0, 0), (1, 1, 0)]  # the choice does not move
        values[t] = out.combine_weights.sum(dim=(1, 2))
    assert torch.allclose(values[1.0], torch.tensor([0.6, 0.5]))
    assert (values[0.5] > values[1.0]).all() and (values[2.0] < values[1.0]).all()
    assert values[0.5][0].item() == pytest.approx(0.36 / (0.36 + 0.09 + 0.01))  # p^2 renormalised


def test_load_factors_steer_tokens_away_from_a_loaded_expert():
    gate = identity_gate(2, min_capacity=0, drop_tokens=False)
    probs = [[0.6, 0.4]] * 4 + [[0.9, 0.1]] * 2
    x = from_probs(probs)
    plain = gate(x)
    assert plain.exp_counts.tolist() == [6, 0]

    gate.set_load_factors(torch.tensor([0.5, 0.0]))  # beats log(0.6 / 0.4) but not log(9)
    steered = gate(x)
    assert steered.exp_counts.tolist() == [2, 4]
    assert imbalance(steered.exp_counts) < imbalance(plain.exp_counts)
    # the combine weights and l_aux still use the unbiased gate values
    assert steered.combine_weights[0, 1, 0].item() == pytest.approx(0.4)
    mean_gates = torch.tensor(probs).mean(dim=0)
    expected = 2 * (mean_gates * torch.tensor([2 / 6, 4 / 6])).sum()
    assert steered.l_aux.item() == pytest.approx(expected.item())
    assert "load_factors" not in gate.state_dict()

    gate.set_load_factors(None)
    assert gate(x).exp_counts.tolist() == [6, 0]
    steered_at_build = identity_gate(2, drop_tokens=False, load_factors=torch.tensor([0.5, 0.0]))
    assert steered_at_build(x).exp_counts.tolist() == [2, 4]
    with pytest.raises(ValueError, match="shape"):
        gate.set_load_factors(torch.zeros(3))
    with pytest.raises(ValueError, match="non-negative"):
        gate.set_load_factors(torch.tensor([-1.0, 0.0]))


@pytest.mark.parametrize("k", [1, 2])
def test_combine_and_dispatch_consistent(k):
    gate = random_gate(k=k, capacity_factor=0.75, min_capacity=0)
    x = torch.randn(48, 16) + gate.wg.weight[:2].sum(dim=0)  # skewed, so some tokens drop
    torch.manual_seed(3)
    out = gate(x)
    assert out.dropped > 0
    check_consistent(out, gate.wg(x).softmax(dim=1).detach(), k)


@pytest.mark.parametrize("k", [1, 2])
def test_used_token_masks_padding(k):
    gate = random_gate(k=k, capacity_factor=4.0, use_rts=False, top2_2nd_expert_sampling=False)
    x = torch.randn(16, 16)
    used = torch.ones(16, dtype=torch.int64)
    used[10:] = 0
    full, masked = gate(x), gate(x, used_token=used)
    assert full.dropped == 0
    assert not masked.dispatch_mask[10:].any()
    assert masked.exp_counts.sum().item() == 10 * k
    # padding changes neither the capacity nor the real tokens' experts and weights (their top-2
    # slots may move up: padding no longer holds first-choice slots ahead of them)
    assert masked.combine_weights.shape == full.combine_weights.shape
    weights = masked.combine_weights.sum(dim=2)
    assert torch.equal(weights[:10], full.combine_weights[:10].sum(dim=2))
    assert torch.equal(gate(x, used_token=used.bool()).dispatch_mask, masked.dispatch_mask)


@pytest.mark.parametrize("policy", ["Jitter", "RSample"])
def test_noisy_policies_only_in_training(policy):
    gate = random_gate(noisy_gate_policy=policy, use_rts=False, drop_tokens=False)
    plain = random_gate(use_rts=False, drop_tokens=False)
    x = torch.randn(64, 16) * 0.05  # near-flat logits, so noise shows
    gate.eval()
    plain.eval()
    quiet = plain(x)
    for _ in range(2):
        assert torch.equal(gate(x).combine_weights, quiet.combine_weights)
    gate.train()
    noisy = gate(x)
    gates = plain(x).combine_weights.sum(dim=2).max(dim=1)  # (value, expert) per token
    if policy == "Jitter":  # jittered inputs move the gate values
        assert not torch.allclose(noisy.combine_weights.sum(dim=(1, 2)), gates.values)
    else:  # RSample changes choices but weights them by the unnoised gate values
        choice = noisy.dispatch_mask.any(dim=2).int().argmax(dim=1)
        assert (choice != gates.indices).any()
        softmax = gate.wg(x).softmax(dim=1).detach()
        picked = softmax[torch.arange(64), choice]
        assert torch.allclose(noisy.combine_weights.sum(dim=(1, 2)), picked)


def test_eval_uses_eval_capacity_factor():
    gate = random_gate(num_experts=4, capacity_factor=2.0, eval_capacity_factor=0.5, min_capacity=0)
    x = torch.randn(16, 16)
    assert gate(x).combine_weights.shape[2] == 8
    gate.eval()
    assert gate(x).combine_weights.shape[2] == 2


def test_gradients_and_fp32_with_half_input():
    gate = random_gate(k=2)
    out = gate(torch.randn(16, 16, dtype=torch.bfloat16))
    assert out.combine_weights.dtype == torch.float32 and out.exp_counts.dtype == torch.int64
    (out.combine_weights.sum() + out.l_aux).backward()
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() > 0


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k=3"):
        TopKGate(4, 4, k=3)
    with pytest.raises(ValueError, match="num_experts=1"):
        TopKGate(4, 1, k=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(4, 4, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="temperature"):
        TopKGate(4, 4, temperature=0.0)
    with pytest.raises(ValueError, match="used_token"):
        TopKGate(4, 4)(torch.randn(8, 4), used_token=torch.ones(7))


# --- against DeepSpeed's own gating functions, on the same logits and, where random, the same seed


@pytest.fixture(scope="module")
def ds_moe():
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        return pytest.importorskip("deepspeed.moe.sharded_moe")
    finally:
        if saved is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = saved


CASES = {
    # top-1 without RTS only where nothing drops: DeepSpeed's choice of survivors then follows
    # torch.topk's tie-breaking rather than position
    "top1": dict(k=1, use_rts=False, capacity_factor=4.0),
    "top1-rts": dict(k=1, use_rts=True),
    "top1-rsample": dict(k=1, use_rts=True, noisy_gate_policy="RSample"),
    "top1-used-token": dict(k=1, use_rts=True),
    "top2": dict(k=2, top2_2nd_expert_sampling=False),
    "top2-sampled": dict(k=2, top2_2nd_expert_sampling=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_deepspeed(ds_moe, case, seed):
    kwargs = CASES[case]
    torch.manual_seed(seed)
    gate = TopKGate(8, 4, min_capacity=2, **kwargs)
    x = torch.randn(24, 8)
    used = (torch.rand(24) > 0.3).long() if case == "top1-used-token" else None
    logits = gate.wg(x).detach()
    factor = kwargs.get("capacity_factor", 1.0)
    torch.manual_seed(100 + seed)
    if kwargs["k"] == 1:
        policy = kwargs.get("noisy_gate_policy")
        ref = ds_moe.top1gating(logits, factor, 2, used, policy, use_rts=kwargs["use_rts"])
    else:
        sampling = kwargs["top2_2nd_expert_sampling"]
        ref = ds_moe.top2gating(logits.clone(), factor, 2, top2_2nd_expert_sampling=sampling)
    torch.manual_seed(100 + seed)
    out = gate(x, used_token=used)
    l_aux, combine, dispatch, exp_counts = ref
    assert torch.allclose(out.l_aux, l_aux)
    assert torch.allclose(out.combine_weights, combine)
    assert torch.equal(out.dispatch_mask, dispatch)
    assert torch.equal(out.exp_counts, exp_counts)
