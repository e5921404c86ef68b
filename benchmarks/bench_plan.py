"""Dry runs at real size: the step-time model against published runs, start-up cost and
checkpoint save and load cost against world size, on torch's fake process group (one rank of
each world, on this machine's CPU).

    .venv/bin/python benchmarks/bench_plan.py [published|startup|checkpoint [WORLD ...]]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from shardspeed import comm
from shardspeed.checkpoint.format import INDEX, MANIFEST, bytes_read, reset_bytes_read
from shardspeed.planning import Cluster, dry_run
from shardspeed.planning.checkpoints import engine_as, file_opens, world_checkpoint
from shardspeed.planning.dry_run import fake_world
from shardspeed.planning.models import PRESETS, ZERO3_AT_SCALE

# (name, model, cluster, micro-batch, extra config, seq, checkpointing, published tokens/s/GPU, source)
PUBLISHED = [
    ("Llama 3.1 8B, 8 H100, FSDP, bs 2, selective AC", "llama3-8b", Cluster(1, 8, "H100-SXM"),
     2, {}, 8192, False, 5762, "torchtitan docs/performance.md Table 1"),
    ("Llama 3 8B, 64 A100, FSDP, bs 1, selective op AC", "llama3-8b", Cluster(8, 8, "A100-80GB"),
     1, {}, 8192, False, 2973, "torchtitan docs/performance.md (64 A100 table)"),
    ("Llama 3 70B, 64 A100, FSDP, bs 1, full AC", "llama3-70b", Cluster(8, 8, "A100-80GB"),
     1, {}, 8192, True, 331, "torchtitan docs/performance.md (64 A100 table)"),
]  # fmt: skip


def published() -> None:
    print("| run | published tokens/s/GPU | predicted | error | source |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, model, cluster, micro, extra, seq, ac, figure, source in PUBLISHED:
        config = {**ZERO3_AT_SCALE, "train_micro_batch_size_per_gpu": micro, **extra}
        result = dry_run(model, config, cluster, seq_len=seq, steps=1, activation_checkpointing=ac)
        seconds = result.step_time(result.ranks[0]).total
        predicted = result.tokens_per_step / seconds / cluster.world_size
        print(f"| {name} | {figure:,} | {predicted:,.0f} | {predicted / figure - 1:+.1%} | {source} |",
              flush=True)  # fmt: skip


def startup() -> None:
    print("| model | world | initialize + 1 step, one rank (s) |")
    print("| --- | ---: | ---: |")
    for model in ("llama3-8b", "llama3-70b"):
        for nodes in (8, 64, 512):
            config = {**ZERO3_AT_SCALE, "train_micro_batch_size_per_gpu": 1}
            start = time.perf_counter()
            dry_run(model, config, Cluster(nodes, 8), seq_len=128, steps=1)
            print(f"| {model} | {nodes * 8} | {time.perf_counter() - start:.1f} |", flush=True)


# A small Llama-like model: what a rank reads at load and receives at save grows with the world,
# not with the model (each file is written as its header, with holes for the tensors' bytes).
SMALL = PRESETS["llama-tiny"]


def checkpoint(worlds: list[int]) -> None:
    """Per rank (0, which validates the tag for every rank, and 1): the bytes a load reads of
    the manifest and its index, the files it opens, and the bytes the save's and load's
    collectives move through the rank; with the index, then without it (as before it existed:
    every rank parses the whole manifest, as checkpoints written before it still load)."""
    config = {**ZERO3_AT_SCALE, "train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}  # fmt: skip
    print("| world | manifest (MB) | rank | index | load: manifest + index bytes read "
          "| load: files opened (opens) | load: collective bytes | save: collective bytes "
          "| save + load (s) |")  # fmt: skip
    print("| ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: |")
    for world in worlds:
        cluster = Cluster(max(1, world // 8), min(8, world))
        root = Path(tempfile.mkdtemp())
        tag = world_checkpoint(SMALL, config, cluster, root)
        manifest = (tag / MANIFEST).stat().st_size / 1e6
        for indexed in (True, False):
            if not indexed:
                (tag / INDEX).unlink()
            for rank in (0, 1):
                with fake_world(rank, cluster):
                    engine = engine_as(rank, SMALL, config)
                    start = time.perf_counter()
                    comm.reset_comm_volume()
                    reset_bytes_read()
                    with file_opens(root) as opens:
                        engine.load_checkpoint(str(root))
                    read = bytes_read()
                    loaded = sum(c["bytes"] for c in comm.comm_volume().values())
                    target = Path(tempfile.mkdtemp())
                    (target / ".saved.partial").mkdir()  # rank 0 makes it: in a dry run, no rank 0
                    comm.reset_comm_volume()
                    engine.save_checkpoint(str(target), tag="saved")
                    saved = sum(c["bytes"] for c in comm.comm_volume().values())
                    seconds = time.perf_counter() - start
                parsed = read.get(MANIFEST, 0) + read.get(INDEX, 0)
                print(f"| {world} | {manifest:.1f} | {rank} | {'yes' if indexed else 'no'} "
                      f"| {parsed:,} | {len(opens)} ({sum(opens.values())}) | {loaded:,} "
                      f"| {saved:,} | {seconds:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    which = sys.argv[1:] or ["published", "startup"]
    if which[0] == "checkpoint":
        checkpoint([int(w) for w in which[1:]] or [8, 64, 512, 4096])
    else:
        for part in which:
            {"published": published, "startup": startup}[part]()
