"""ZeRO++ at stage 3: quantized weight gathers (qwZ), hierarchical partitioning (hpZ) and
quantized gradients (qgZ), each alone and all three together.

Each configuration trains the same model on the same global batches at 2 and 4 ranks; plain
stage 3 at the same world size is the reference. Checked: the bytes of every step's gathers and
gradient reduction by group size against the formulas of `expected_gathers` and
`expected_gradients`, the memory hpZ adds, bit-exactness of hpZ alone, how closely the quantized
ones track unquantized training, and that explicit gathers stay exact.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import shardspeed
from shardspeed.config import ConfigError, load_config
from shardspeed.testing import RankFailure
from shardspeed.zero.quantize import GRADIENT_BITS, WEIGHT_BITS, error_bound, payload_bytes

WIDTH, VOCAB, STEPS, LR = 64, 32, 20, 1e-3


class Stack(nn.Module):
    """Embedding, four blocks in a ModuleList (a gather unit each), head: units of 4160 and 4128
    elements, so that a shard spans several quantization blocks at 2 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def stage3(**keys) -> dict:
    # No persistent parameters and no reuse: every unit is gathered for its forward and again for
    # its backward, the case ZeRO++'s formulas describe.
    return {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        **keys,
    }


QWZ = {"zero_quantized_weights": True}
HPZ = {"zero_hpz_partition_size": 2}
QGZ = {"zero_quantized_gradients": True}


def train(keys: dict, two_groups: bool) -> dict:
    """Train `Stack` for STEPS steps; the last step's gathers by group size and what the tests
    compare. `two_groups`: biases in a param group of their own (two regions per unit)."""
    model = Stack()
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups if two_groups else model.parameters(), lr=LR)
    engine, *_ = shardspeed.initialize(
        model=model,
        optimizer=optimizer,
        config={"train_batch_size": 8, "zero_optimization": keys},
    )
    gen = torch.Generator().manual_seed(3)
    rank, world = engine.global_rank, engine.dp_world_size
    losses = []
    for _ in range(STEPS):
        idx = torch.randint(0, VOCAB, (8, 9), generator=gen)
        mine = idx[rank * (8 // world) :][: 8 // world]
        shardspeed.comm.reset_comm_volume()
        logits = engine(mine[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    volume = shardspeed.comm.comm_volume(by_group=True)
    sharded = engine.optimizer.sharded_params
    units = [n for u, n in enumerate(sharded.numel) if not sharded.units[u].persistent]
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    return {
        "gathers": {key: v["bytes"] for key, v in volume.items() if key[0] == "all_gather"},
        "gradients": {key: v["bytes"] for key, v in volume.items() if key[0] != "all_gather"},
        "layout": (engine.optimizer.layout.total, engine.optimizer.layout.shard_numel()),
        "unit_numels": units,
        "secondary_numel": sum(t.numel() for t in sharded.secondaries()),
        "losses": torch.stack(losses),
        "params": params,
    }


def expected_gathers(unit_numels: list[int], world: int, k: int, qwz: bool) -> Counter:
    """Bytes one step gathers, keyed by (collective, group size), from the units' sizes (padded
    to a multiple of the world size). Plain stage 3: each unit's fp32 values twice (forward and
    backward) over all ranks. qwZ: what travels is each rank's shard (the unit's numel / world)
    as one int8 payload with an fp32 scale per 256 values, from every rank. hpZ: the backward
    gather runs within the node, of the k secondary pieces (numel / k each), quantized too under
    qwZ as DeepSpeed does."""
    total: Counter = Counter()
    for numel in unit_numels:
        for ranks in (world, k if k > 1 else world):
            piece = numel // ranks
            sent = payload_bytes(piece, WEIGHT_BITS) if qwz else piece * 4
            total[("all_gather", ranks)] += sent * ranks
    return total


def expected_gradients(total: int, shard: int, world: int, qgz: bool) -> Counter:
    """Bytes one step's gradient reduction sends, keyed by (collective, group size): the layout
    (`total` elements, `shard` per rank) is one bucket here. Unquantized, gloo reduces each
    owner's piece to it: the whole bucket in fp32. qgZ: one all-to-all carrying every owner's part
    (its `shard` elements) as int4 with an fp32 scale per 256 values, plus the norm's all-reduce
    either way (one fp32)."""
    sent = Counter({("all_reduce", world): 4})
    if qgz:
        sent[("all_to_all", world)] += world * payload_bytes(shard, GRADIENT_BITS)
    else:
        sent[("reduce", world)] += total * 4
    return sent


CASES = {
    "plain": {},
    "qwz": QWZ,
    "hpz": HPZ,
    "qgz": QGZ,
    "qwz+hpz": {**QWZ, **HPZ},
    "all three": {**QWZ, **HPZ, **QGZ},
}


@pytest.fixture(scope="module")
def runs(pool2, pool4) -> dict:
    """Every case at 2 ranks (two param groups) and 4 ranks (one): each rank's results (the
    losses are each rank's own micro-batch's)."""
    return {
        (world, name): pool.run(train, stage3(**keys), world == 2)
        for world, pool in ((2, pool2), (4, pool4))
        for name, keys in CASES.items()
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gathered_bytes_follow_the_formula(runs, world, case):
    keys = CASES[case]
    k = keys.get("zero_hpz_partition_size", 1)
    for result in runs[world, case]:
        numels = result["unit_numels"]
        expected = expected_gathers(numels, world, k, "zero_quantized_weights" in keys)
        assert Counter(result["gathers"]) == expected
        total, shard = result["layout"]
        gradients = expected_gradients(total, shard, world, "zero_quantized_gradients" in keys)
        assert Counter(result["gradients"]) == gradients
        # hpZ keeps 1/k of every unit as its secondary copy; nothing without it.
        assert result["secondary_numel"] == (sum(numels) // k if k > 1 else 0)


def test_qwz_moves_fewer_bytes_and_hpz_keeps_the_backward_gather_in_the_node(runs):
    gathers = {case: runs[4, case][0]["gathers"] for case in CASES}
    plain, qwz, both = (sum(gathers[c].values()) for c in ("plain", "qwz", "qwz+hpz"))
    # int8 and an fp32 scale per 256 values against fp32: 1/4 + 1/256 for large shards; this
    # model's shards of 1040 (4160 / 4) are padded to 5 blocks, (1280 + 20) / (1040 * 4) = 0.3125.
    assert qwz / plain == pytest.approx(0.3125, abs=0.001)
    across = ("all_gather", 4)
    assert gathers["hpz"][across] * 2 == gathers["plain"][across]
    assert both < qwz


@pytest.mark.parametrize("world", [2, 4])
def test_hpz_alone_trains_bit_exact_with_plain_stage_3(runs, world):
    # The secondary pieces are copies of the gathered values: the backward sees the same weights.
    for plain, hpz in zip(runs[world, "plain"], runs[world, "hpz"]):
        assert torch.equal(hpz["losses"], plain["losses"])
        assert all(torch.equal(a, b) for a, b in zip(hpz["params"], plain["params"]))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["qwz", "qwz+hpz"])
def test_qwz_tracks_unquantized_training(runs, world, case):
    # The fp32 masters never see quantization: only the weights each step's forward and backward
    # compute with are off, by at most half a quantization step of their 256-value block
    # (absmax / 254, `error_bound`). AdamW moves a weight by about LR per step whatever the
    # gradient's size, so a gradient error of a fraction of a percent changes an update by a
    # fraction of LR: 20 steps move weights apart by far less than 20 * LR = 0.02, ~15% of their
    # typical size (0.125 at init). Measured: 1.9e-3 relative at 2 ranks, 2.7e-3 at 4; the loss
    # within 4e-4. 1e-2 leaves room, yet a broken dequantization (weights off by whole blocks)
    # fails it.
    for plain, quantized in zip(runs[world, "plain"], runs[world, case]):
        drift = [(a - b).norm() / b.norm() for a, b in zip(quantized["params"], plain["params"])]
        assert 0 < max(drift).item() < 1e-2
        # The loss follows: within 1% of unquantized training at every step.
        relative = (quantized["losses"] - plain["losses"]).abs() / plain["losses"]
        assert relative.max().item() < 1e-2


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["qgz", "all three"])
def test_qgz_tracks_unquantized_training(runs, world, case):
    # Gradients arrive off by at most half an int4 step of their 256-value block (absmax / 14
    # per rank's copy). AdamW divides by the gradient's own scale, so an element small against its
    # block's largest can lose its sign: its update is then off by up to 2 * LR a step, 0.04 over
    # 20 steps, against weights of ~0.125. Most elements are not that small: measured 2.2e-2
    # relative at 2 ranks and 4.1e-2 at 4, the loss within 1.3e-3. 0.1 and 1% leave room, yet
    # gradients dequantized with wrong scales or summed from the wrong parts fail both.
    for plain, quantized in zip(runs[world, "plain"], runs[world, case]):
        drift = [(a - b).norm() / b.norm() for a, b in zip(quantized["params"], plain["params"])]
        assert 0 < max(drift).item() < 0.1
        relative = (quantized["losses"] - plain["losses"]).abs() / plain["losses"]
        assert relative.max().item() < 1e-2


def test_all_three_cut_bytes_across_nodes_at_least_3_5_times(runs):
    """At 4 ranks in nodes of 2: what crosses between nodes (collectives over all 4 ranks) with
    qwZ, hpZ and qgZ together against plain stage 3 (fp32: 2 gathers and the gradients' reduce,
    4 bytes an element each, against int8 forward gathers and int4 gradients). Measured 6.7x on
    this small model, whose shards pad to whole 256-value blocks (8x for large shards)."""

    def across(result: dict) -> int:
        sent = {**result["gathers"], **result["gradients"]}
        return sum(v for (_, size), v in sent.items() if size == 4)

    for plain, all_three in zip(runs[4, "plain"], runs[4, "all three"]):
        assert across(plain) / across(all_three) >= 3.5


def explicit_gathers_under_qwz(tmp: str) -> dict:
    """After a forward under qwZ (units kept whole with their dequantized values), explicit
    gathers and save_16bit_model must give exact values."""
    model = Stack()
    keys = {**QWZ, "stage": 3, "stage3_param_persistence_threshold": 0}  # default reuse: kept
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {**keys, "stage3_gather_16bit_weights_on_model_save": True},
        },
    )
    gen = torch.Generator().manual_seed(engine.global_rank)
    # One step records the order units are used in; the next forward then keeps them whole.
    engine.backward(engine(torch.randint(0, VOCAB, (2, 8), generator=gen)).sum())
    engine.step()
    params = list(model.parameters())
    with shardspeed.zero.GatheredParameters(params):  # nothing gathered now: exact
        exact = [p.detach().clone() for p in params]
    engine(torch.randint(0, VOCAB, (2, 8), generator=gen))
    sharded = engine.optimizer.sharded_params
    whole = sum(not sharded.units[u].persistent for u in sharded.buffers)
    lossy = [p.detach().clone() for p in params]
    with shardspeed.zero.GatheredParameters(params):
        regathered = [p.detach().clone() for p in params]
    engine.save_16bit_model(tmp)
    names = [name for name, _ in model.named_parameters()]
    saved = load_file(f"{tmp}/model.safetensors") if engine.global_rank == 0 else None
    return {
        "exact": exact,
        "lossy": lossy,
        "regathered": regathered,
        # No element is off by more than half the step of the coarsest block: the model's
        # largest magnitude over 254.
        "bound": error_bound(torch.cat([e.reshape(-1) for e in exact]), WEIGHT_BITS).item(),
        "whole": whole,
        "saved": None if saved is None else [saved[n] for n in names],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_explicit_gathers_and_saves_stay_exact_under_qwz(pool2, pool4, tmp_path, world):
    pool = pool2 if world == 2 else pool4
    results = pool.run(explicit_gathers_under_qwz, str(tmp_path / str(world)))
    for result in results:
        assert result["whole"] == 5  # every unit still whole after the forward
        assert all(torch.equal(a, b) for a, b in zip(result["regathered"], result["exact"]))
        assert not all(torch.equal(a, b) for a, b in zip(result["lossy"], result["exact"]))
        error = max((a - b).abs().max().item() for a, b in zip(result["lossy"], result["exact"]))
        assert error <= result["bound"]
    saved = results[0]["saved"]
    assert all(torch.equal(a, b) for a, b in zip(saved, results[0]["exact"]))


def test_zeropp_keys_are_refused_below_stage_3():
    for key, value in (
        ("zero_quantized_weights", True),
        ("zero_quantized_gradients", True),
        ("zero_hpz_partition_size", 2),
        ("zero_quantized_nontrainable_weights", True),
    ):
        with pytest.raises(ConfigError, match=rf"'zero_optimization\.{key}' is a ZeRO\+\+"):
            load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, key: value}}, 1)
    # At stage 3 they are accepted (frozen weights stored quantized: test_zero3_untrained.py).
    together = stage3(**QWZ, **HPZ, **QGZ, zero_quantized_nontrainable_weights=True)
    load_config({"train_batch_size": 2, "zero_optimization": together}, 1)
    # qgZ's int4 pieces take the place of the reduce-scatter and its wire dtype.
    with pytest.raises(ConfigError, match="'communication_data_type' 'bf16' would change nothing"):
        load_config(
            {
                "train_batch_size": 2,
                "communication_data_type": "bf16",
                "zero_optimization": stage3(**QGZ),
            },
            1,
        )


def initialize_with_nodes(size: int) -> None:
    shardspeed.initialize(
        model=Stack(),
        config={
            "train_batch_size": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": stage3(zero_hpz_partition_size=size),
        },
    )


def test_hpz_partition_size_must_divide_the_data_parallel_size(pool4):
    with pytest.raises(
        RankFailure,
        match=r"'zero_optimization\.zero_hpz_partition_size' is 3, which does not divide the 4",
    ):
        pool4.run(initialize_with_nodes, 3)
