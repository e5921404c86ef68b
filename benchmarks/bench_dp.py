"""Data parallelism (ZeRO stage 0): shardspeed vs a plain PyTorch loop, torch DDP and DeepSpeed.

.venv/bin/python benchmarks/bench_dp.py [--quick] [--write]
"""

from __future__ import annotations

import harness as h
import render

SCENARIO = h.Scenario(
    name="dp",
    section="## Data parallelism (stage 0) vs PyTorch, DDP and DeepSpeed",
    # ws1: the engine against a plain loop; ws2: against DDP and DeepSpeed. *_fused: the same
    # loops with AdamW(fused=True), the kernel shardspeed builds on CPU (information).
    modes=dict(torch=1, torch_fused=1, ours_ws1=1, ddp=2, ddp_fused=2, ours=2, deepspeed=2),
    comparisons=[
        ("ours_ws1", "torch", 0.97, "ws 1: shardspeed vs plain PyTorch loop"),
        ("ours_ws1", "torch_fused", None, "ws 1: vs plain loop with AdamW(fused=True)"),
        ("ours", "ddp", 1.0, "ws 2: shardspeed stage 0 vs torch DDP"),
        ("ours", "ddp_fused", None, "ws 2: vs DDP with AdamW(fused=True)"),
        ("ours", "deepspeed", 1.0, "ws 2: shardspeed stage 0 vs DeepSpeed stage 0"),
    ],
)


def worker(mode: str, args) -> dict:
    rank, world = h.setup(args.threads)
    lib = mode.removesuffix("_ws1").removesuffix("_fused")
    model = h.build_lm()
    fused = mode.endswith("_fused")
    forward, backward, update, _ = h.trainer(lib, model, h.config(args.micro_batch), fused=fused)
    batches = h.random_batches(rank, args.warmup + args.steps, args.micro_batch)
    step = h.step_fn(forward, backward, update)
    tokens = world * args.micro_batch * h.SEQ
    return h.timed(step, batches, args.warmup, args.steps, tokens)


def tables(results: dict) -> dict:
    out = {"ratios": render.ratio_table(results, SCENARIO.comparisons)}
    return out | {"modes": render.mode_table(results), "run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_dp.py")
