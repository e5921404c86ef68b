"""A 2-rank torchrun job for `test_hang.py`: ZeRO stage 3 trains 2 steps, then one rank misbehaves.

    torchrun --nproc_per_node 2 tests/hang_job.py raise|skip|order

- raise: rank 1 raises inside the model's forward.
- skip: rank 1 never enters the next forward (it sleeps, as if it had skipped the collectives).
- order: the ranks call two collectives in opposite orders (all_reduce and all_gather_into_tensor
  use different gloo slots, so each waits for a message the other never sends).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import shardspeed
from shardspeed import comm


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)
        self.fail = False  # set on one rank to raise inside forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom in forward")
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def step(engine, rank: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
    xs, ys = x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
    engine.backward(F.mse_loss(engine(xs), ys))
    engine.step()


def opposite_orders(rank: int) -> None:
    small, gathered = torch.ones(4), torch.empty(8)
    if rank == 0:
        comm.all_reduce(small)
        comm.all_gather_into_tensor(gathered, small)
    else:
        comm.all_gather_into_tensor(gathered, small)
        comm.all_reduce(small)


@record  # torchrun's failure summary then shows each failed rank's error
def main(mode: str) -> None:
    torch.set_num_threads(1)
    model = Net()
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    rank = engine.global_rank
    for n in range(2):
        step(engine, rank, n)
    print(f"rank {rank}: trained 2 steps, collective #{comm.collective_sequence()}", flush=True)
    if mode == "raise":
        model.fail = rank == 1
        step(engine, rank, 2)
    elif mode == "skip":
        if rank == 1:
            time.sleep(120)
        step(engine, rank, 2)
    elif mode == "order":
        opposite_orders(rank)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1])
