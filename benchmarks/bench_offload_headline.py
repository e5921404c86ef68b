"""Headline: train, on this machine, a GPT whose fp32 Adam model states (16 bytes per parameter)
exceed 1.5x its memory, with the optimizer states offloaded to NVMe swap files.

Two ranks, ZeRO stage 3, the model built under `zero.Init` (never whole in one process), the fp32
parameter shards (the masters) and the Adam moments in swap files under /tmp; what stays in memory
is each rank's fp32 gradient shard (4 bytes per parameter over both ranks) and the units in use.
Records parameters, seconds per step, peak RSS per rank and bytes on disk. (Without parameter
offload, the shards and gradients alone were 19.7 GB and both ranks were OOM-killed at ~12 GiB.)
`HEADLINE_SMOKE=1` runs the script on a tiny model.

    .venv/bin/python benchmarks/bench_offload_headline.py --write
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

SECTION_TITLE = "## Headline: NVMe offload beyond the machine's memory"
D_MODEL, N_LAYERS, N_HEADS, SEQ = 2560, 31, 20, 64
if os.environ.get("HEADLINE_SMOKE"):  # a tiny model, to check the script end to end
    D_MODEL, N_LAYERS, N_HEADS = 64, 2, 2


def worker(out: str, steps: int, swap: str) -> None:
    import torch

    import shardspeed

    common.D_MODEL, common.N_LAYERS, common.N_HEADS, common.SEQ = D_MODEL, N_LAYERS, N_HEADS, SEQ
    torch.set_num_threads(1)
    shardspeed.init_distributed()
    start = time.perf_counter()
    with shardspeed.zero.Init():
        model = common.build_model()
    params = sum(p.ds_numel for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": common.LR}},
        "gradient_clipping": common.CLIP,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 20_000_000,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 110_000_000,
            "sub_group_size": 100_000_000,
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "offload_param": {"device": "nvme", "nvme_path": swap},
        },
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    built = time.perf_counter() - start
    rank = engine.global_rank
    times, losses = [], []
    for x, y in common.make_batches(rank, steps, 1):
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        shardspeed.comm.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    memory = engine.memory_breakdown()
    result = {
        "rank": rank,
        "params": params,
        "build_s": built,
        "step_s": times,
        "losses": losses,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "on_nvme": memory["on_nvme"],
        "in_memory": memory["total"],
    }
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    engine.destroy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--swap", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--write", action="store_true", help="write the section into BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.out, args.steps, args.swap)
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir="/tmp") as swap, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            __file__, "--worker", "--out", out, "--swap", swap, "--steps", str(args.steps),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(common.REPO / "src"), "OMP_NUM_THREADS": "1"}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if run.returncode:
            print(run.stdout[-3000:], run.stderr[-5000:])
            return run.returncode
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    total = time.perf_counter() - started
    mem_total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    params = ranks[0]["params"]
    states = 16 * params
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
    rss = [r["peak_rss"] for r in ranks]
    gib = 2**30
    table = [
        "| parameters | fp32 Adam model states (16 B/param) | machine memory | states / memory "
        "| seconds per step (each step) | peak RSS per rank | peak RSS, both ranks | in memory after "
        "the steps, both ranks | on NVMe, both ranks | losses (rank 0) |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
        f"| {params:,} | {states / gib:.1f} GiB | {mem_total / gib:.1f} GiB | "
        f"{states / mem_total:.2f}x | {', '.join(f'{t:.0f}' for t in step_s)} | "
        f"{', '.join(f'{x / gib:.1f}' for x in rss)} GiB | {sum(rss) / gib:.1f} GiB | "
        f"{sum(r['in_memory'] for r in ranks) / gib:.1f} GiB | "
        f"{sum(r['on_nvme'] for r in ranks) / gib:.1f} GiB | "
        f"{', '.join(f'{x:.3f}' for x in ranks[0]['losses'])} |",
    ]
    notes = [
        f"- Model: the benchmarks' GPT with d_model {D_MODEL}, {N_LAYERS} layers, {N_HEADS} heads, "
        f"vocab {common.VOCAB}, seq {SEQ}, untied head; fp32 AdamW; micro batch 1 per rank; 2 ranks "
        "(`torch.distributed.run --standalone`, gloo, 1 thread each); built under `zero.Init` "
        f"(model build and `initialize` took {ranks[0]['build_s']:.0f}s, not in the step times).",
        "- Config: ZeRO stage 3, `stage3_max_reuse_distance` 0 and `stage3_max_live_parameters` "
        "1.1e8 (one block and the root's embeddings whole at a time), no prefetch, "
        "`reduce_bucket_size` 2e7, `sub_group_size` 1e8, `offload_optimizer` and `offload_param` "
        "nvme under /tmp (ext4 on a virtual disk, not an NVMe drive), no pipelining.",
        "- What stays in memory: each rank's fp32 gradient shard (4 of the 16 bytes per parameter, "
        "over both ranks) and the units in use; the fp32 shards (masters) and the Adam moments are "
        "on disk, read for each gather and around each piece's optimizer step.",
    ]
    cmd = "python benchmarks/bench_offload_headline.py --write"
    section = common.section_text(SECTION_TITLE, cmd, total, ["\n".join(table)], notes)
    print(section)
    if args.write:
        common.write_markdown(section, SECTION_TITLE, common.BENCH_MD)
        print(f"updated {common.BENCH_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
