"""A job that ends normally, for `test_exit.py` and `benchmarks/bench_exit.py`: every rank must
exit with status 0, however it was started.

    torchrun --nproc_per_node 2 tests/exit_job.py MODE [--dir DIR]

- train: ZeRO 1 trains, saves and loads a checkpoint (in DIR), ZeRO 3 trains, and the script
  returns right after an asynchronous all-reduce of a temporary tensor that it never waits for
  (the last work of the gloo threads then ends as the interpreter does).
- inflight: only that last part, with the group started by `shardspeed.init_distributed`.
- torch-inflight: the same with torch's own `init_process_group` and no shardspeed (the floor
  that torch gives: some of these runs abort at exit).
- killed: train, then rank 1 is killed before the end; rank 0 must still end, within
  SHARDSPEED_EXIT_TIMEOUT, saying which rank did not come.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def train(stage: int, directory: str | None) -> None:
    """Three steps at ZeRO `stage`; then, given a directory, a checkpoint saved and loaded."""
    import shardspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    gen = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    if directory is not None:
        engine.save_checkpoint(directory)
        engine.load_checkpoint(directory)


def leave_in_flight() -> None:
    """Collectives of temporaries, the last one never waited for."""
    for _ in range(50):
        dist.all_reduce(torch.ones(256))
    dist.all_reduce(torch.ones(256), async_op=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("train", "inflight", "torch-inflight", "killed"))
    parser.add_argument("--dir", help="the checkpoint directory (train, killed)")
    parser.add_argument("--local_rank", type=int, default=-1, help="the shardspeed launcher's")
    args = parser.parse_args()
    if args.mode in ("train", "killed") and args.dir is None:
        parser.error(f"{args.mode} needs --dir")
    torch.set_num_threads(1)
    if args.mode == "torch-inflight":
        dist.init_process_group("gloo")
        leave_in_flight()
        return
    import shardspeed

    shardspeed.init_distributed()
    if args.mode in ("train", "killed"):
        train(1, args.dir)
        train(3, None)
    if args.mode != "killed":
        leave_in_flight()
    elif dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"rank {dist.get_rank()}: returned", flush=True)


if __name__ == "__main__":
    main()
