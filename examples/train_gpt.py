"""Train a small byte-level GPT with data parallelism, then sample from the saved model.

Written the way DeepSpeed's tutorials write a training script; only the import differs:

    shardspeed --num_procs 2 examples/train_gpt.py --deepspeed_config examples/ds_config.json
    python examples/train_gpt.py                      # one process, same config

The text is Python's own standard-library docstrings unless `--data FILE` names a text file.

It saves a checkpoint to `<out>/checkpoints` every `--checkpoint-every` steps (and after the last
one), keeping the newest two. `--resume` continues from the newest after a crash, on any number of
processes; a worker restarted by the launcher's `--max_restarts` resumes without being asked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import shardspeed as deepspeed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import ByteDataset, build_corpus
from gpt import GPT, GPTConfig

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "ds_config.json"
DEFAULT_STEPS = 700  # must match scheduler.params.total_num_steps in ds_config.json
KEEP_CHECKPOINTS = 2  # older ones are deleted once a newer one is in place


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a small byte-level GPT")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--data", type=str, default=None, help="a text file (default: stdlib docs)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument("--out", type=str, default="runs/demo", help="output directory")
    parser.add_argument("--sample_tokens", type=int, default=300, help="bytes to generate")
    parser.add_argument("--prompt", type=str, default="def ", help="start of the generated sample")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in <out>/checkpoints, if there is one",
    )
    parser.add_argument(
        "--checkpoint-every",
        "--checkpoint_every",
        dest="checkpoint_every",
        type=int,
        default=100,
        help="save a checkpoint every K optimizer steps (0: only after the last step)",
    )
    # Model size (the defaults fit the 2-process CPU demo in under 3 minutes).
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--block_size", type=int, default=128, help="context length in bytes")
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be at least 0")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_defaults() -> None:
    """Started as plain `python train_gpt.py`: describe a world of one process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def restart_count() -> int:
    """How many times the launcher (torchrun) has restarted this job's workers: 0 on the first run."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def prune_checkpoints(directory: Path, keep: list[str]) -> None:
    """Rank 0: delete every `global_step<N>` checkpoint in `directory` but those in `keep`."""
    for path in directory.iterdir():
        if re.fullmatch(r"global_step\d+", path.name) and path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)


def schedule_steps(config_path: str) -> int | None:
    """`scheduler.params.total_num_steps` of the config file, if it has one."""
    with open(config_path) as f:
        cfg = json.load(f)
    return cfg.get("scheduler", {}).get("params", {}).get("total_num_steps")


def main() -> None:
    args = parse_args()
    single_process_defaults()
    if args.deepspeed_config is None:
        args.deepspeed_config = str(DEFAULT_CONFIG)

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)  # same initial weights on every rank

    deepspeed.init_distributed()

    out = Path(args.out)
    data = build_corpus(cache_dir=out / "corpus", data_file=args.data)
    model_cfg = GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = GPT(model_cfg)
    dataset = ByteDataset(data, block_size=model_cfg.block_size)

    engine, optimizer, loader, scheduler = deepspeed.initialize(  # noqa: RUF059
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    rank = engine.global_rank
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        total = schedule_steps(args.deepspeed_config)
        if total is not None and total != args.steps:
            print(f"note: the lr schedule is sized for {total} steps, training for {args.steps}")
        print(
            f"corpus {len(data):,} bytes ({args.data or 'stdlib docstrings'}), "
            f"{len(dataset):,} windows of {model_cfg.block_size}; model "
            f"{model.num_parameters():,} parameters; {world} process(es) x {threads} thread(s)",
            flush=True,
        )

    # Resume: load_checkpoint restores weights, optimizer, lr schedule, step counters, the data
    # loader's place and the RNG; it returns (None, None) when there is no checkpoint yet.
    ckpt_dir = out / "checkpoints"
    losses: list[float] = []  # rank 0's loss at each optimizer step (kept in the checkpoints)
    saved: list[str] = []  # checkpoints of this run, oldest first
    if args.resume or restart_count() > 0:
        path, client_state = engine.load_checkpoint(str(ckpt_dir))
        if path is not None:
            losses = list(client_state.get("losses", []))
            saved.append(Path(path).name)
        if rank == 0:
            if path is None:
                print(f"no checkpoint in {ckpt_dir} yet: starting from step 0", flush=True)
            else:
                print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    elif rank == 0 and (ckpt_dir / "latest").exists():
        latest = (ckpt_dir / "latest").read_text().strip()
        print(f"starting from step 0 (--resume would continue from {ckpt_dir / latest})")

    engine.train()
    bar = tqdm(
        total=args.steps,
        initial=min(engine.global_steps, args.steps),
        desc="train",
        unit="step",
        disable=rank != 0,
        mininterval=0.5,
    )
    tokens = 0
    smooth = None
    t0 = time.perf_counter()
    done = engine.global_steps >= args.steps
    while not done:
        for x, y in loader:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = engine(x, y)
            engine.backward(loss)
            before = engine.global_steps
            engine.step()
            tokens += x.numel() * world
            if engine.global_steps == before:  # inside gradient accumulation
                continue
            value = loss.item()
            losses.append(value)
            smooth = value if smooth is None else 0.9 * smooth + 0.1 * value
            elapsed = time.perf_counter() - t0
            bar.set_postfix(loss=f"{smooth:.3f}", tok_s=f"{tokens / elapsed:,.0f}", refresh=False)
            bar.update(engine.global_steps - before)
            if engine.global_steps >= args.steps:
                done = True
            step = engine.global_steps
            if done or (args.checkpoint_every and step % args.checkpoint_every == 0):
                engine.save_checkpoint(str(ckpt_dir), client_state={"losses": losses})
                saved.append(f"global_step{step}")
                if rank == 0:
                    prune_checkpoints(ckpt_dir, saved[-KEEP_CHECKPOINTS:])
            if done:
                break
    bar.close()
    elapsed = time.perf_counter() - t0

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in engine.module.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(model_cfg.to_dict(), indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return

    trained = bar.n - bar.initial
    rate = f" ({tokens / elapsed:,.0f} tokens/s)" if trained else ""
    print(f"trained {trained} steps in {elapsed:.1f}s{rate}; saved {out / 'model.safetensors'}")
    if losses:
        k = min(20, len(losses))
        start, end = losses[0], sum(losses[-k:]) / k
        print(
            f"start loss {start:.3f} (ln 256 = {math.log(256):.3f}), end loss {end:.3f} "
            f"(mean of last {k} steps)"
        )

    # Reload from the files just written, as a user of the trained model would.
    cfg = GPTConfig.from_dict(json.loads((out / "config.json").read_text()))
    trained = GPT(cfg)
    trained.load_state_dict(load_file(str(out / "model.safetensors")))
    prompt = torch.tensor([list(args.prompt.encode("utf-8"))], dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    sample = trained.generate(prompt, args.sample_tokens, temperature=0.8, top_k=40, generator=gen)
    text = bytes(sample[0].tolist()).decode("utf-8", errors="replace")
    print("---- sample ----")
    print(text)
    print("----------------")


if __name__ == "__main__":
    main()
