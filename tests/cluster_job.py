"""A 2-rank training job for `test_cluster_launchers.py`, however it is started (the shardspeed
launcher, srun, mpirun): `reference_training.train` at ZeRO 1, then rank 0 saves the parameters.

    python tests/cluster_job.py OUT_DIR [--local_rank=N]

Each rank also writes OUT_DIR/rank<N>.json: what it was given (argv, the rank variables the
environment ends with, the variable a --venv_script sets, its parent's pid and the launcher pid
file of its grandparent, if any) and prints a line that --enable_each_rank_log should capture.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

import shardspeed
from reference_training import train


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    shardspeed.init_distributed(dist_backend="gloo")
    result = train(micro=4, extra={"zero_optimization": {"stage": 1}})
    rank = torch.distributed.get_rank()
    pid_path = f"/tmp/{_parent_of(os.getppid())}.deepspeed"
    pid_file = None
    if os.path.exists(pid_path):
        with open(pid_path, encoding="utf-8") as handle:
            pid_file = handle.read()
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    report = {
        "argv": sys.argv[1:],
        "env": {name: os.environ.get(name) for name in names},
        "world": torch.distributed.get_world_size(),
        "venv": os.environ.get("SHARDSPEED_TEST_VENV"),
        "parent": os.getppid(),
        "pid_file": pid_file,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    if rank == 0:
        params = {str(i): p.contiguous() for i, p in enumerate(result["params"])}
        save_file(params, os.path.join(out, "params.safetensors"))  # no pickle
    print(f"cluster_job rank {rank} of {report['world']} done", flush=True)


if __name__ == "__main__":
    main()
