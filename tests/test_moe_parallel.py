"""Expert parallelism combined with data parallelism (hybrid DP+EP) through `initialize`: equal to
the single-process fp32 reference after 5 steps at every expert-parallel size and ZeRO stage 0 to 2;
expert gradients reach the right group; checkpoints reshard between expert-parallel sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moe_model as mm
import shardspeed
from reference_training import assert_named_close
from shardspeed.testing import HostSyncCounter

# fp32 against fp32; only summation orders differ (experts see other ranks' tokens in one batch,
# gradients summed over groups): the issue asks for 1e-5 relative.
TOL = 1e-5


def _check(whole: dict, expected: dict) -> None:
    assert_named_close(whole, expected, TOL)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_ep2_by_dp2_equals_the_reference(pool4, zero):
    results = pool4.run(mm.train, 2, zero)
    _check(mm.join(results), mm.reference(mm.MICRO * 4))


@pytest.mark.parametrize(
    "options",
    [{"split_groups": True}, {"zero_extra": {"offload_optimizer": {"device": "cpu"}}}],
    ids=["split-param-groups", "cpu-offload"],
)
def test_ep2_by_dp2_with_split_groups_or_offload(pool4, options):
    results = pool4.run(mm.train, 2, 2, **options)
    _check(mm.join(results), mm.reference(mm.MICRO * 4))


def test_use_data_before_expert_parallelism_swaps_the_groups(pool4):
    results = pool4.run(mm.train, 2, 1, use_data_before_expert_parallelism=True)
    _check(mm.join(results), mm.reference(mm.MICRO * 4))
    # Now ranks 0 and 1 hold the same experts (an expert-data group), 0 and 2 different ones.
    local = [r["experts"] for r in results]
    for name in local[0]:
        assert torch.equal(local[0][name], local[1][name]), name
        assert torch.equal(local[2][name], local[3][name]), name
        assert not torch.allclose(local[0][name], local[2][name]), name


@pytest.mark.parametrize("routing", sorted(mm.ROUTINGS))
def test_ep2_by_dp1_and_ep1_by_dp2_equal_the_reference(pool2, routing):
    expected = mm.reference(mm.MICRO * 2, routing)
    for ep in (2, 1):
        _check(mm.join(pool2.run(mm.train, ep, 1, routing=routing)), expected)


def _host_syncs_after_training(ep: int) -> list[str]:
    """Where the host waited for the device during 3 more steps of a trained engine."""
    engine = mm.train(ep, keep_engine=True)
    dp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    rows = slice(rank * mm.MICRO, (rank + 1) * mm.MICRO)
    with HostSyncCounter() as syncs:
        for step in range(3):
            ids, labels = mm.global_batch(step, mm.MICRO * dp)
            engine.backward(mm.loss_fn(engine(ids[rows]), labels[rows]))
            engine.step()
    return syncs.places


def test_expert_parallel_steps_wait_for_the_device_once(pool2):
    # Capacity is fixed (tokens are dropped), so routing and both all-to-alls run without
    # reading anything back; only the gradient norm is.
    for places in pool2.run(_host_syncs_after_training, 2):
        assert len(places) == 3 and all("zero/optimizer.py" in p for p in places), places


def test_expert_weights_differ_across_expert_ranks_and_agree_across_replicas(pool4):
    results = pool4.run(mm.train, 2, 2)
    # Ranks 0 and 1 form an expert group (experts 0-1 and 2-3 of each layer); ranks 0 and 2 hold
    # the same experts (an expert-data group), as do 1 and 3.
    local = [r["experts"] for r in results]
    assert sorted(local[0]) == sorted(local[1])
    for name in local[0]:
        assert torch.equal(local[0][name], local[2][name]), name
        assert torch.equal(local[1][name], local[3][name]), name
        assert not torch.allclose(local[0][name], local[1][name]), name
    expert_names = {n for r in results for n in r["params"] if "deepspeed_experts" in n}
    stems = {n.split("deepspeed_experts.")[1].split(".")[0] for n in expert_names}
    assert stems == {"0", "1", "2", "3"}
    # Every rank reports the same global load, and the norm every rank computed agrees.
    assert len({r["norm"] for r in results}) == 1
    for name, load in results[0]["load"].items():
        # top-1: every token of the step's last micro-batches asks for one expert.
        assert int(load["exp_counts"].sum()) == 4 * mm.MICRO * mm.SEQ, name
        assert int(load["tokens_per_expert"].sum()) + int(load["dropped"]) == 4 * mm.MICRO * mm.SEQ
        assert load["imbalance"] >= 1.0
        assert torch.equal(results[3]["load"][name]["exp_counts"], load["exp_counts"])


@pytest.mark.parametrize(
    ("save", "load"),
    [((2, 1), (1, 2)), ((2, 0), (2, 2)), ((1, 0), (2, 1))],
    ids=["ep2-zero1-to-ep1-zero2", "ep2-zero0-to-ep2-zero2", "ep1-zero0-to-ep2-zero1"],
)
def test_checkpoint_reshards_across_expert_parallel_sizes(pool4, pool2, tmp_path, save, load):
    """Saved after step 3 by one layout (ep, ZeRO stage), resumed by another; the final weights
    equal the reference. ep 2 saves on 4 ranks and ep 1 on 2; the other side loads on 2 or 4
    ranks, with the micro-batches per rank adjusted so that the global batches stay the same."""
    path = str(tmp_path / "ckpt")
    global_size = mm.MICRO * 4
    (save_ep, save_zero), (load_ep, load_zero) = save, load
    saver = pool4 if save_ep == 2 else pool2
    loader = pool2 if saver is pool4 else pool4
    saver.run(mm.train, save_ep, save_zero, global_size, path)
    resumed = loader.run(mm.train, load_ep, load_zero, global_size, None, path)
    _check(mm.join(resumed), mm.reference(global_size))


class _StatefulExpert(nn.Module):
    """An expert with state besides its trained weights: a frozen offset (set per expert) and a
    persistent count of the tokens it has processed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.offset = nn.Parameter(torch.zeros(8), requires_grad=False)
        self.register_buffer("tokens_seen", torch.zeros(()))

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        self.tokens_seen += (slots != 0).any(dim=-1).sum()  # empty slots are all zeros
        return self.linear(slots) + self.offset


def _stateful_experts(ep: int, path: str, save: bool) -> dict[str, torch.Tensor]:
    """An MoE layer of 4 stateful experts through `initialize`; trained 2 steps and saved, or
    loaded. Returns this rank's experts' offsets and token counts under their global names."""
    from shardspeed.moe.layer import MoE

    torch.manual_seed(0)
    layer = MoE(8, _StatefulExpert(), num_experts=4, ep_size=ep)
    engine, *_ = shardspeed.initialize(
        model=layer,
        model_parameters=[p for p in layer.parameters() if p.requires_grad],
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    names = {local: name for local, (name, _) in engine.expert_tensor_names.items()}
    state = dict(layer.named_buffers()) | dict(layer.named_parameters())
    if save:
        for local, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            expert.offset.fill_(float(layer.global_expert_index(local)))
        gen = torch.Generator().manual_seed(torch.distributed.get_rank())
        for _ in range(2):
            out, l_aux, _ = engine(torch.randn(4, 6, 8, generator=gen))
            engine.backward(out.square().mean() + l_aux)
            engine.step()
        engine.save_checkpoint(path)
    else:
        engine.load_checkpoint(path)
    return {
        names.get(n, n): t.detach().clone()
        for n, t in state.items()
        if n.endswith(("offset", "tokens_seen"))
    }


def test_expert_buffers_and_frozen_parameters_reshard(pool2, tmp_path):
    # Each expert's own state is saved under its global name by one holder, and loads into
    # whichever rank holds that expert at another expert-parallel size.
    path = str(tmp_path / "ckpt")
    saved: dict[str, torch.Tensor] = {}
    for rank_state in pool2.run(_stateful_experts, 2, path, True):
        saved.update(rank_state)
    assert len(saved) == 8 and sum(float(t) for n, t in saved.items() if "tokens" in n) > 0
    for ep in (2, 1):
        for rank_state in pool2.run(_stateful_experts, ep, path, False):
            for name, value in rank_state.items():
                assert torch.equal(value, saved[name]), (ep, name)
        assert len(rank_state) == (8 if ep == 1 else 4)


def test_save_16bit_model_gathers_every_expert(pool4, tmp_path):
    from safetensors.torch import load_file

    pool4.run(mm.train_and_export, 2, str(tmp_path))
    exported = load_file(str(tmp_path / "model.safetensors"))
    expected = mm.reference(mm.MICRO * 4)
    _check({n: exported[n] for n in expected}, expected)


def _refusal(ep: int, **extra) -> str:
    from shardspeed.config import ConfigError

    try:
        mm.train(ep, **extra)
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_impossible_expert_parallel_layouts_are_refused(pool2):
    assert "does not divide the data-parallel size 2" in pool2.run(_refusal, 4)[0]
    message = pool2.run(_refusal, 2, tensor_parallel={"autotp_size": 2})[0]
    assert "tensor parallelism" in message and "expert parallelism of size [2]" in message
    assert "ZeRO stage 3" in pool2.run(_refusal, 2, zero=3)[0]
