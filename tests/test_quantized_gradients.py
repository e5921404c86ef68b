"""ZeRO++ quantized gradients (qgZ): the reducer's int4 all-to-all gives each owner the sum of the
ranks' gradients within the quantizer's bound, moves the bytes the payload formula says (about 8x
fewer than fp32), and ZeRO stage 2 and 3 training with it tracks fp32 training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.comm import comm_volume, reset_comm_volume
from shardspeed.zero.flat import FlatLayout
from shardspeed.zero.optimizer import ReduceOptions, ZeroOptimizer
from shardspeed.zero.partitioned import Stage3Options
from shardspeed.zero.quantize import BLOCK, GRADIENT_BITS, error_bound, payload_bytes
from shardspeed.zero.reducer import GradientReducer

# Two regions (param groups) of tensors whose magnitudes differ by 10^4, so that one scale for a
# whole part would swamp the small ones: the bound below is per block.
SIZES = ((4000, 4000, 8000), (5170, 900))
SCALES = ((1e-3, 1.0, 0.1), (10.0, 0.5))


def _gradients(rank: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    return [
        [torch.randn(n, generator=gen) * s for n, s in zip(sizes, scales)]
        for sizes, scales in zip(SIZES, SCALES)
    ]


def _block_bounds(part: torch.Tensor) -> torch.Tensor:
    """Each element's bound: half its block's step, `error_bound` of the block as a row."""
    padded = F.pad(part, (0, -len(part) % BLOCK)).view(-1, BLOCK)
    return error_bound(padded, GRADIENT_BITS).repeat_interleave(BLOCK)[: len(part)]


def _reduce(bucket_elements: int, quantized: bool) -> dict:
    """Each rank's gradients through a pooled-bucket reducer (as at stages 2 and 3), averaged;
    what this rank received in its shard against the exact average and the bound."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = [_gradients(r) for r in range(world)]
    layout = FlatLayout.of(everyone[0], shards=world)

    def flat(grads: list[list[torch.Tensor]]) -> torch.Tensor:
        out = torch.zeros(layout.total)
        for view, grad in zip(layout.views(out), (g for region in grads for g in region)):
            view.copy_(grad)
        return out

    flats = [flat(g) for g in everyone]
    shard = torch.full((layout.shard_numel(),), float("nan"))
    reducer = GradientReducer(
        layout, bucket_elements, None, torch.float32, torch.float32, 1.0, 1.0 / world,
        collective="reduce", quantized=quantized,
        on_reduced=lambda offset, piece: shard[offset : offset + len(piece)].copy_(piece),
    )  # fmt: skip
    reset_comm_volume()
    reducer.reset()
    reducer.active = True
    for i, grad in enumerate(g for region in everyone[rank] for g in region):
        reducer.gradient_slot(i).copy_(grad)
        reducer.mark_ready(i)
    reducer.finish()
    volume = comm_volume()
    expected = torch.zeros_like(shard, dtype=torch.float64)
    bound = torch.zeros_like(shard, dtype=torch.float64)
    sent = 0  # the formula: each owner's part of each bucket as one payload
    for bucket in reducer._buckets:
        pieces = layout.owners(bucket.start, bucket.end)
        for owner in range(world):
            spans = [(a, b, offset) for _, r, a, b, offset in pieces if r == owner]
            sent += payload_bytes(sum(b - a for a, b, _ in spans), GRADIENT_BITS)
            if owner != rank or not spans:
                continue
            for k in range(world):
                part = torch.cat([flats[k][a:b] for a, b, _ in spans])
                at = 0
                for a, b, offset in spans:
                    expected[offset : offset + b - a] += flats[k][a:b].double() / world
                    bound[offset : offset + b - a] += _block_bounds(part)[at : at + b - a] / world
                    at += b - a
    return {
        "shard": shard.double(),
        "expected": expected,
        "bound": bound,
        "volume": volume,
        "formula": sent,
        "total": layout.total,
        "buckets": len(reducer._buckets),
    }


# 3000: a bucket per tensor, several of them owned by one rank alone; 1 << 20: one bucket across
# both regions, where every owner's part is two pieces.
@pytest.mark.parametrize("bucket_elements", [3000, 1 << 20], ids=["small-buckets", "one-bucket"])
@pytest.mark.parametrize("world", [2, 4])
def test_owner_gets_the_sum_within_the_bound_and_the_payload_bytes(
    pool2, pool4, world, bucket_elements
):
    pool = pool2 if world == 2 else pool4
    quantized = pool.run(_reduce, bucket_elements, True)
    plain = pool.run(_reduce, bucket_elements, False)
    for q, p in zip(quantized, plain):
        error = (q["shard"] - q["expected"]).abs()
        # fp32 sums of `world` terms: a few ulps of the largest magnitude beside the bound.
        slack = 1e-6 * q["expected"].abs().max()
        assert torch.all(error <= q["bound"] + slack), (error - q["bound"]).max()
        # Quantization really happened, and the bound is not loose: the largest error is a fair
        # part of it (uniform rounding errors, summed over the ranks).
        assert error.max() > 0.1 * q["bound"][error.argmax()]
        # Bytes: one all-to-all per bucket carrying exactly the payloads of the owners' parts;
        # the unquantized reduce sends the whole bucket in fp32.
        assert q["volume"] == {"all_to_all": {"calls": q["buckets"], "bytes": q["formula"]}}
        assert p["volume"]["reduce"]["bytes"] == 4 * p["total"]
        # M * (0.5 + 4 / BLOCK) up to one block's rounding per part.
        ideal = p["total"] * (GRADIENT_BITS / 8 + 4 / BLOCK)
        assert ideal <= q["formula"] <= ideal + q["buckets"] * world * (BLOCK // 2 + 4)
    # 4 / (0.5 + 4 / 256) = 7.76 fewer bytes than fp32 at most; whole blocks per part cost the rest
    # (7.51 to 7.60 here).
    assert plain[0]["volume"]["reduce"]["bytes"] / quantized[0]["formula"] > 7.4


# -- training -------------------------------------------------------------------------------------

STEPS = 20
LR = 0.05
GLOBAL_BATCH = 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=gen)
    return x, torch.sin(x[:, :8] * 2) + x[:, 8:] * 0.5


def _full_loss(model: nn.Module) -> float:
    x, y = _batch(STEPS)
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def _train(stage: int, quantized: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    optimizer = ZeroOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        stage=stage,
        dp_rank=rank,
        dp_world_size=world,
        reduce=ReduceOptions(bucket_elements=3000, quantized_gradients=quantized),
        stage3=Stage3Options(persistence_threshold=0),
    )
    part = GLOBAL_BATCH // world
    reset_comm_volume()
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.start_micro_step(True)
        F.mse_loss(model(x[rank * part :][:part]), y[rank * part :][:part]).backward()
        optimizer.step()
    volume = comm_volume()
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
    loss = _full_loss(model)
    optimizer.close()
    return {"params": params, "loss": loss, "volume": volume}


def _reference() -> dict:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"start": start, "params": params, "loss": _full_loss(model)}


@pytest.mark.parametrize("stage", [2, 3])
def test_training_with_quantized_gradients_tracks_fp32(pool2, stage):
    reference = _reference()
    quantized = pool2.run(_train, stage, True)
    plain = pool2.run(_train, stage, False)
    for result in quantized:
        assert torch.equal(result["params"], quantized[0]["params"])  # the ranks agree
        assert "reduce" not in result["volume"]
    moved = (reference["params"] - reference["start"]).norm()
    assert (plain[0]["params"] - reference["params"]).norm() < 1e-5 * moved
    # A step is 1/7 of its block's largest gradient, so each rank's copy errs by up to 7% of that
    # (about 12% of a Gaussian block's spread, as a standard deviation); the mean of 2 copies by
    # about 8%. Gradients change slowly, so these errors repeat from step to step rather than
    # cancel: the path can stray by about that fraction of its length. Measured 5.6%; 15% allowed.
    drift = (quantized[0]["params"] - reference["params"]).norm()
    assert drift < 0.15 * moved
    # The loss is flat across such a small stray: measured 0.15% of what training gained; 5%.
    gained = _full_loss(_model()) - reference["loss"]
    assert abs(quantized[0]["loss"] - reference["loss"]) < 0.05 * gained
    # The gradients' bytes against fp32's: 6.99x fewer, short of 7.76x as this small model's parts
    # round up to whole blocks.
    sent = quantized[0]["volume"]["all_to_all"]["bytes"]
    assert plain[0]["volume"]["reduce"]["bytes"] > 6.5 * sent
