"""ZeRO stage 3 gather units and their lifetimes: leaf modules, stage3_max_live_parameters and
stage3_max_reuse_distance, each checked for parity with one process and for the bytes it moves."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from reference_training import assert_close_relative
from shardspeed.testing import RankFailure

BLOCK = 8 * 8 + 8  # one Linear(8, 8) block: a unit of 72 elements (even, so no padding on 2 ranks)
REST = 16 * 8 + (8 * 16 + 16)  # embedding and head: the root's unit


class Stack(nn.Module):
    """Embedding, `blocks` blocks in a ModuleList (one unit each), untied head: each unit used
    once."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def train_stack(keys: dict, leaf_classes: list | None = None, steps: int = 4) -> dict:
    """Train `Stack` with these zero_optimization keys; the last step's traffic and peaks."""
    model = Stack()
    if leaf_classes:
        shardspeed.utils.set_z3_leaf_modules(model, leaf_classes)
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": keys,
        },
    )
    gen = torch.Generator().manual_seed(3)
    rank, world = engine.global_rank, engine.dp_world_size
    for _ in range(steps):
        idx = torch.randint(0, 16, (8, 5), generator=gen)
        mine = idx[rank * (8 // world) :][: 8 // world]
        shardspeed.comm.reset_comm_volume()
        logits = engine(mine[:, :-1])
        engine.backward(F.cross_entropy(logits.reshape(-1, 16), mine[:, 1:].reshape(-1)))
        engine.step()
    sharded = engine.optimizer.sharded_params
    result = {
        "gathered": shardspeed.comm.comm_volume().get("all_gather", {}).get("bytes", 0) // 4,
        "peak_live": sharded.peak_live_elements if sharded else 0,
        "units": [u.name for u in sharded.units] if sharded else [],
    }
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        return {**result, "params": [p.detach().clone() for p in model.parameters()]}


def stage3(**keys) -> dict:
    return {"stage": 3, "stage3_param_persistence_threshold": 0, **keys}


@pytest.fixture(scope="module")
def expected() -> list[torch.Tensor]:
    return train_stack({"stage": 0})["params"]


TOTAL = REST + 4 * BLOCK


@pytest.mark.parametrize(
    ("keys", "peak", "gathered"),
    [
        # DeepSpeed's defaults (1e9 for both): every unit is reused within the distance, so units
        # stay whole from forward to backward and each step gathers the model once.
        ({}, TOTAL, TOTAL),
        # No reuse: every unit is gathered for its forward and again for its backward. Prefetch
        # keeps at most one unit in flight beyond the root's unit and the one computing.
        ({"stage3_max_reuse_distance": 0}, REST + 2 * BLOCK, 2 * TOTAL),
        # The root's unit and one block: nothing prefetched, nothing kept but what fits.
        ({"stage3_max_live_parameters": REST + BLOCK}, REST + BLOCK, 2 * TOTAL - REST - BLOCK),
        # Room for one more block: either prefetched or kept, never both.
        ({"stage3_max_live_parameters": REST + 2 * BLOCK}, REST + 2 * BLOCK, None),
    ],
    ids=["defaults", "no-reuse", "live-one-block", "live-two-blocks"],
)
def test_limits_bound_live_units_and_keep_parity(pool2, expected, keys, peak, gathered):
    for result in pool2.run(train_stack, stage3(**keys)):
        assert_close_relative(result["params"], expected, 1e-5)
        assert result["peak_live"] <= keys.get("stage3_max_live_parameters", 10**9)
        assert result["peak_live"] == peak
        if gathered is not None:
            assert result["gathered"] == gathered


def test_unit_larger_than_live_limit_is_refused(pool2):
    with pytest.raises(
        RankFailure,
        match=r"stage3_max_live_parameters' is 71, but the gather unit 'head' alone holds 144",
    ):
        pool2.run(
            train_stack,
            stage3(stage3_max_live_parameters=BLOCK - 1, leaf_module={"names": ["emb", "head"]}),
        )


def test_leaf_modules_make_their_own_units(pool2, expected):
    by_name = pool2.run(
        train_stack, stage3(leaf_module={"names": ["emb"], "name_suffixes": ["head"]})
    )
    by_class = pool2.run(train_stack, stage3(), ["Embedding", nn.Linear])
    for result in [*by_name, *by_class]:
        assert_close_relative(result["params"], expected, 1e-5)
    assert by_name[0]["units"] == [
        "head",
        "blocks.3",
        "blocks.2",
        "blocks.1",
        "blocks.0",
        "emb",
        "(persistent)",
    ]
    assert by_class[0]["units"] == by_name[0]["units"]


def test_leaf_module_entry_that_matches_nothing_is_refused(pool2):
    with pytest.raises(RankFailure, match=r"leaf_module' entries \['embed'\] match no module"):
        pool2.run(train_stack, stage3(leaf_module={"names": ["embed"]}))


def test_stage3_keys_below_stage3_change_nothing_and_say_so(caplog):
    # Configs are copied between stages; DeepSpeed accepts such keys silently, shardspeed warns.
    plain = train_stack({"stage": 2}, steps=1)
    for keys in ({"stage3_max_live_parameters": 10}, {"leaf_module": {"names": ["emb"]}}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardspeed"):
            result = train_stack({"stage": 2, **keys}, steps=1)
        assert "only acts at ZeRO stage 3; at stage 2 it changes nothing" in caplog.text
        for ours, theirs in zip(result["params"], plain["params"]):
            assert torch.equal(ours, theirs)
