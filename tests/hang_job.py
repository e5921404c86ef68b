"""A 2-rank torchrun job for `test_hang.py`: ZeRO trains 2 steps, then one rank misbehaves.

    torchrun --nproc_per_node 2 tests/hang_job.py MODE [--stage N] [--timeout S] [--init-timeout S]

- raise: rank 1 raises inside the model's forward.
- skip: rank 1 never enters the next forward (it sleeps, as if it had skipped the collectives).
- order: the ranks call two collectives in opposite orders.
- size: rank 1 trains another step while rank 0 all-reduces one number, so the ranks call
  collectives of different sizes (at stage 0 both are all-reduces, which gloo itself answers by
  aborting the process).
- disagree: each rank's config sets another 'comms_timeout_s' (S + rank), refused at initialize.
- aside: both ranks make the same extra collective (as an evaluation would), train 3 more steps
  and end normally.

`--stage` is the ZeRO stage (default 3); `--timeout` the config's 'comms_timeout_s' (none if not
given); `--init-timeout` starts the process group with init_distributed(timeout=S seconds) first;
`--steps` the good steps before (default 2; from 4 on, the ranks follow the steps' agreed sequence
of collectives instead of checking each call).
"""

from __future__ import annotations

import argparse
import datetime
import os
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
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("raise", "skip", "order", "size", "disagree", "aside"))
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--init-timeout", type=float, default=None)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    mode = args.mode
    torch.set_num_threads(1)
    if args.init_timeout is not None:
        comm.init_distributed(timeout=datetime.timedelta(seconds=args.init_timeout))
    model = Net()
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
    }
    if args.timeout is not None:
        offset = int(os.environ["RANK"]) if mode == "disagree" else 0
        config["comms_timeout_s"] = args.timeout + offset
    engine, *_ = shardspeed.initialize(model=model, config=config)
    print(f"rank {engine.global_rank}: timeout {comm.collective_timeout()}", flush=True)
    rank = engine.global_rank
    for n in range(args.steps):
        step(engine, rank, n)
    trained = f"trained {args.steps} steps, collective #{comm.collective_sequence()}"
    print(f"rank {rank}: {trained}", flush=True)
    if mode == "raise":
        model.fail = rank == 1
        step(engine, rank, 2)
    elif mode == "skip":
        if rank == 1:
            time.sleep(120)
        step(engine, rank, 2)
    elif mode == "order":
        opposite_orders(rank)
    elif mode == "size":
        if rank == 1:
            step(engine, rank, 2)
        else:
            comm.all_reduce(torch.ones(1))
    elif mode == "aside":
        following = any(state.cycle for state in comm.comm._groups.values())
        print(f"rank {rank}: following the agreed steps: {following}", flush=True)
        total = torch.ones(3)
        comm.all_reduce(total)
        for n in range(args.steps, args.steps + 3):
            step(engine, rank, n)
        print(f"rank {rank}: done, {total.tolist()}", flush=True)


if __name__ == "__main__":
    main()
