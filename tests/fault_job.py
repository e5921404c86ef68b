"""A small training job that checkpoints and resumes, for `test_checkpoint_faults.py`.

    python tests/fault_job.py --dir CKPT --steps N [--every K] [--dump S ...] [--dumps DIR]
    shardspeed --num_procs 2 --max_restarts 1 tests/fault_job.py --dir CKPT --steps N --kill_at k

At start it loads `latest` from `--dir` when there is one, then trains to global step N with a
fixed global batch of 8 (micro-batches of 4, so one rank accumulates 2) from the engine's own data
loader, saving a checkpoint every K steps and after the last one. Rank 0 writes the parameters
after each step listed in `--dump` to `<dumps>/step<S>.safetensors`.

Faults, each injected from here (the library has no hooks for them):

- `--kill_at k`: rank 1 (rank 0 when alone) SIGKILLs itself when step k is about to start, on the
  first attempt only (`TORCHELASTIC_RESTART_COUNT` unset or "0").
- `--fault write|manifest|rename|latest` with `--fault_at S`: the save after step S dies by SIGKILL
  half-way through writing this rank's tensor file (`write`), half-way through the manifest
  (`manifest`), just before the partial directory is renamed into place (`rename`), or after the
  rename but before `latest` is replaced (`latest`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import TensorDataset

import shardspeed
from shardspeed.checkpoint import engine_state
from shardspeed.checkpoint import format as checkpoint_format

GLOBAL_BATCH, MICRO = 8, 4
SAMPLES = 64  # 8 steps per pass over the data


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, required=True, help="train up to this global step")
    parser.add_argument("--every", type=int, default=2, help="save every K steps")
    parser.add_argument("--stage", type=int, default=2, help="zero_optimization.stage")
    parser.add_argument("--dump", type=int, nargs="*", default=[], help="steps to write params at")
    parser.add_argument("--dumps", default=None, help="where to write them (default --dir/dumps)")
    parser.add_argument("--kill_at", type=int, default=None)
    parser.add_argument("--fault", choices=["write", "manifest", "rename", "latest"])
    parser.add_argument("--fault_at", type=int, default=None)
    return parser.parse_args()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def make_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 4, generator=gen)
    )


def config(stage: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_fault(kind: str) -> None:
    """Make the next save die at the place `kind` names."""
    if kind == "write":
        real = engine_state.write_tensor_file

        def write_half_then_die(path: Path, tensors: dict[str, torch.Tensor]):
            whole = path.with_name(path.name + ".whole")
            real(whole, tensors)
            data = whole.read_bytes()
            whole.unlink()
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            die()

        engine_state.write_tensor_file = write_half_then_die
    elif kind == "manifest":

        def write_half_manifest_then_die(path: Path, value: object) -> None:
            text = json.dumps(value)
            path.with_name(f".{path.name}.tmp").write_text(text[: len(text) // 2])
            die()

        checkpoint_format.write_json_atomic = write_half_manifest_then_die  # under write_manifest
    elif kind == "rename":
        real_rename = Path.rename

        def rename(self: Path, target):
            if self.name.endswith(".partial"):
                die()
            return real_rename(self, target)

        Path.rename = rename
    elif kind == "latest":
        real_replace = Path.replace

        def replace(self: Path, target):
            if Path(target).name == engine_state.LATEST:
                die()
            return real_replace(self, target)

        Path.replace = replace


def dump(model: nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    params = {n: p.detach().float().clone().contiguous() for n, p in model.named_parameters()}
    save_file(params, str(path))


@record
def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = make_model()
    engine, _, loader, _ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=make_dataset(),
        config=config(args.stage),
    )
    rank, world = engine.global_rank, engine.dp_world_size
    path, _ = engine.load_checkpoint(args.dir)
    where = f"{path} at step {engine.global_steps}" if path else "nothing (fresh start)"
    print(f"rank {rank}/{world} attempt {attempt}: resumed from {where}", flush=True)
    dumps = Path(args.dumps or Path(args.dir) / "dumps")
    victim = 1 if world > 1 else 0

    while engine.global_steps < args.steps:
        for x, y in loader:
            step = engine.global_steps
            if step == args.kill_at and attempt == 0 and rank == victim:
                print(f"rank {rank}: killing myself before step {step}", flush=True)
                die()
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
            if engine.global_steps == step:  # inside gradient accumulation
                continue
            step = engine.global_steps
            if step in args.dump:
                with shardspeed.zero.GatheredParameters(list(model.parameters())):
                    if rank == 0:
                        dump(model, dumps / f"step{step}.safetensors")
            if step % args.every == 0 or step == args.steps:
                if args.fault is not None and step == args.fault_at:
                    install_fault(args.fault)
                engine.save_checkpoint(args.dir)
            if step >= args.steps:
                break
    print(f"rank {rank} attempt {attempt}: finished at step {engine.global_steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's shutdown: a gloo worker thread that is still releasing a
    # finished collective then needs the GIL, and when that lands in the shutdown the process
    # aborts ("terminate called without an active exception"), about 1 run in 30 here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
