"""1-bit Adam through `initialize` (`"type": "OneBitAdam"`, ZeRO stage 0, 2 ranks): a toy
regression converges to within a stated tolerance of Adam, the ranks stay identical, and the bytes
on the wire per step after the warm-up fall by more than 16x, as the comms logger measures them."""

from __future__ import annotations

import pytest
import torch

import shardspeed
from shardspeed.comm.logger import bus_factor

STEPS, FREEZE, ROWS, COLS = 200, 20, 2048, 256


def _regress(kind: str) -> dict:
    """Least squares on this rank's rows; returns final loss, weights and wire bytes per step."""
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(11)
    # A solution of +-1s from zero weights: Adam's warm-up (lr 0.05 for FREEZE steps) gets
    # close before the variance freezes, which 1-bit Adam needs to be stable after it.
    truth = torch.randn(COLS, 1, generator=gen).sign()
    data = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(ROWS, COLS, generator=data)
    y = x @ truth + 0.1 * torch.randn(ROWS, 1, generator=data)
    torch.manual_seed(0)
    model = torch.nn.Linear(COLS, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    params = {"lr": 0.05} | ({"freeze_step": FREEZE} if kind == "OneBitAdam" else {})
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": ROWS,
            "optimizer": {"type": kind, "params": params},
            # No clipping (shardspeed's default clips at 1.0): the comparison is of the optimizers.
            "gradient_clipping": 0.0,
            "comms_logger": {"enabled": True},
        },
    )
    wire = []
    for _ in range(STEPS):
        loss = (engine(x) - y).square().mean()
        engine.backward(loss)
        engine.step()
        wire.append(
            sum(
                s["bytes"] * bus_factor(op.split(" ")[0], 2)
                for op, s in engine.comm_summary.items()
            )
        )
    final = float((model(x) - y).square().mean())
    return {"loss": final, "weight": model.weight.detach().clone(), "wire": wire}


def test_onebit_adam_converges_like_adam_with_16x_fewer_bytes(pool2):
    adam = pool2.run(_regress, "Adam")
    onebit = pool2.run(_regress, "OneBitAdam")
    assert torch.equal(onebit[0]["weight"], onebit[1]["weight"])  # ranks stay identical
    # Within 20% of Adam's final loss and 2% of its weights (measured: about 5% and 0.2%).
    assert onebit[0]["loss"] < 1.2 * adam[0]["loss"]
    distance = (onebit[0]["weight"] - adam[0]["weight"]).norm() / adam[0]["weight"].norm()
    assert distance < 0.02
    warm, compressed = onebit[0]["wire"][: FREEZE - 1], onebit[0]["wire"][FREEZE + 1 :]
    assert min(warm) > 0 and max(compressed) > 0
    assert min(warm) / max(compressed) > 16


def _refused() -> str:
    from shardspeed.config import ConfigError

    try:
        shardspeed.initialize(
            model=torch.nn.Linear(4, 1),
            config={
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "OneBitAdam"},
                "zero_optimization": {"stage": 1},
            },
        )
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_onebit_adam_refuses_zero_sharding(pool2):
    assert "ZeRO stage 0" in pool2.run(_refused)[0]


@pytest.mark.parametrize("params", [{"amsgrad": True}, {"comm_backend_name": "mpi"}])
def test_onebit_params_are_checked_by_key(params):
    from shardspeed.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"optimizer\.params"):
        load_config(
            {"train_batch_size": 1, "optimizer": {"type": "OneBitAdam", "params": params}}, 1
        )
