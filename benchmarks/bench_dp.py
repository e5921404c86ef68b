"""Data-parallel throughput benchmark: shardspeed vs plain PyTorch, torch DDP and DeepSpeed.

One invocation measures, on the same model and the same token batches:

  (a) world size 1: shardspeed engine vs a plain PyTorch loop (AdamW, clip_grad_norm_ 1.0);
  (b) world size 2: shardspeed ZeRO stage 0 (data parallel) vs torch DDP and vs DeepSpeed stage 0.

The script is both the orchestrator and the worker. The orchestrator starts every measured run
as ``python -m torch.distributed.run ... bench_dp.py --worker MODE`` (gloo on CPU), runs the
modes interleaved for several rounds, takes the median tokens/s per mode and reports ratios.

    .venv/bin/python benchmarks/bench_dp.py                # measure, print the table
    .venv/bin/python benchmarks/bench_dp.py --write        # ... and update BENCHMARKS.md
    .venv/bin/python benchmarks/bench_dp.py --profile      # profile ours vs DDP at world size 2

See benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import common
from common import (
    BENCH_MD,
    CLIP,
    D_MODEL,
    LR,
    N_HEADS,
    N_LAYERS,
    SEQ,
    VOCAB,
    build_model,
    make_batches,
)

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
SECTION_TITLE = "## Data parallelism (stage 0) vs PyTorch, DDP and DeepSpeed"

# "torch_fused" / "ddp_fused" (informational, no target): the same loops with AdamW(fused=True).
WS1_MODES = ("torch", "torch_fused", "ours")
WS2_MODES = ("ddp", "ddp_fused", "ours", "deepspeed")

COMPARISONS = [
    (("ours", 1), ("torch", 1), 0.97, "ws 1: shardspeed vs plain PyTorch loop"),
    (("ours", 1), ("torch_fused", 1), None, "ws 1: vs plain loop with AdamW(fused=True)"),
    (("ours", 2), ("ddp", 2), 1.0, "ws 2: shardspeed stage 0 vs torch DDP"),
    (("ours", 2), ("ddp_fused", 2), None, "ws 2: vs DDP with AdamW(fused=True)"),
    (("ours", 2), ("deepspeed", 2), 1.0, "ws 2: shardspeed stage 0 vs DeepSpeed stage 0"),
]


def ds_config(micro_batch: int) -> dict:
    """The config given verbatim to both shardspeed and DeepSpeed."""
    return common.ds_config(micro_batch, stage=0)


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def worker(args) -> None:
    mode = args.worker
    if mode == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    rank, world = common.worker_setup(args.threads, init=False)
    if world > 1:
        dist.init_process_group("gloo")

    model = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    batches = make_batches(rank, args.warmup + args.steps, args.micro_batch)
    cfg = ds_config(args.micro_batch)

    if mode in ("torch", "ddp", "torch_fused", "ddp_fused"):
        if mode.startswith("ddp"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            module = DDP(model)
        else:
            module = model
        fused = {"fused": True} if mode.endswith("_fused") else {}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, **fused)

        def step(x, y):
            loss = module(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    elif mode in ("ours", "deepspeed"):
        if mode == "ours":
            import shardspeed as lib
        else:
            import deepspeed as lib
        engine, _opt, _, _ = lib.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss

    else:
        raise SystemExit(f"unknown worker mode {mode!r}")

    def barrier():
        if world > 1:
            dist.barrier()

    result = common.timed_run(
        step, batches, args, mode=mode, rank=rank, world=world, n_params=n_params, barrier=barrier
    )
    if args.out:
        Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


def measure(args):
    plan = []
    if not args.skip_ws1:
        plan += [(m, 1) for m in WS1_MODES if m in args.modes]
    plan += [(m, 2) for m in WS2_MODES if m in args.modes]
    return common.measure(HERE, plan, args, prefix="bench_dp_")


def orchestrate(args) -> int:
    if args.profile:
        return profile_mode(args)
    import torch  # only for the parameter count

    del torch
    n_params = sum(p.numel() for p in build_model().parameters())
    cmd = common.command_line("bench_dp.py")
    print(
        f"model: {n_params / 1e6:.2f}M params, seq {SEQ}, micro batch {args.micro_batch}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds, "
        f"{args.threads} thread(s) per process (torch.set_num_threads, OMP_NUM_THREADS)",
        flush=True,
    )
    results, errors, total, tmp, discarded = measure(args)
    rows, ratio_table, mode_table = common.summarize(results, errors, COMPARISONS)
    print()
    print(ratio_table)
    print()
    print(mode_table)
    load_line = common.load_line(results, discarded, args)
    common.print_run_end(total, tmp, errors, load_line=load_line)

    if args.write:
        notes = [
            f"- Model: GPT-style LM, {n_params / 1e6:.2f}M parameters (vocab {VOCAB}, d_model {D_MODEL}, "
            f"{N_LAYERS} layers, {N_HEADS} heads, seq {SEQ}), fp32, fixed seed; synthetic token batches "
            f"generated from a seed per (rank, step), identical in every mode; micro batch {args.micro_batch} per rank.",
            f"- Each run: {args.warmup} warm-up steps, then {args.steps} timed steps (barrier before and after "
            "at world size 2); tokens/s = world size x micro batch x seq x steps / time, measured on rank 0. "
            f"{args.rounds} rounds with the modes interleaved (order rotated per round); table ratios are "
            "median(ours) / median(baseline); per-round ratios pair runs of the same round.",
            f"- Threads: {args.threads} per process (`torch.set_num_threads({args.threads})`, "
            f"`OMP_NUM_THREADS={args.threads}`) in every run, at world size 1 and 2.",
            "- Every run is a fresh `torch.distributed.run --standalone` process group (gloo backend on CPU); "
            "start-up and `initialize` are not timed.",
            f"- Same config dict for shardspeed and DeepSpeed: `{json.dumps(ds_config(args.micro_batch))}`. "
            "The plain-PyTorch and DDP loops use `torch.optim.AdamW(lr=3e-4)` and "
            "`torch.nn.utils.clip_grad_norm_(..., 1.0)` so the work is equal. DeepSpeed runs with "
            "`DS_ACCELERATOR=cpu`; with this config it uses its CPU FusedAdam op (JIT-built C++), not torch.optim.AdamW.",
            "- Optimizer kernels differ by design: shardspeed builds `torch.optim.AdamW(fused=True)` on CPU "
            "(one `_fused_adamw_` kernel), the plain-PyTorch and DDP baselines use `torch.optim.AdamW` "
            "with torch's defaults (on CPU: the per-tensor loop), DeepSpeed its C++ CPU FusedAdam. Part "
            "of any shardspeed lead comes from that; the rows 'with AdamW(fused=True)' compare against "
            "the same loops with `torch.optim.AdamW(fused=True)` (informational, no target).",
            "- Shared 2-core machine: other work may run at the same time. 'other load' is the CPU "
            "used during each timed window by anything other than that run's ranks (from /proc/stat "
            "minus the ranks' own CPU time), in cores; high values mean that round is noisy.",
        ]
        notes += common.closing_notes(
            load_line, results, rows, args, errors, ratios=False, with_world=True, markers=()
        )
        blocks = [ratio_table, ("Per mode:", mode_table)]
        section = common.section_text(SECTION_TITLE, cmd, total, blocks, notes)
        common.write_markdown(section, SECTION_TITLE, BENCH_MD)
        print(f"\nupdated {BENCH_MD}")
    return 1 if errors else 0


def profile_mode(args) -> int:
    """Profile rank 0 of ours and of DDP (plain and fused AdamW) at world size 2."""
    return common.profile_modes(HERE, ("ddp", "ddp_fused", "ours"), args, "bench_dp_prof_")


def main(argv=None) -> int:
    p = common.parser(__doc__, ["ours", "torch", "ddp", "deepspeed", "torch_fused", "ddp_fused"])
    p.add_argument(
        "--modes",
        nargs="+",
        default=["torch", "torch_fused", "ours", "ddp", "ddp_fused", "deepspeed"],
        help="modes to run (default: all; torch_fused and ddp_fused are the informational "
        "baselines using AdamW(fused=True))",
    )
    p.add_argument("--skip-ws1", action="store_true", help="only the world-size-2 comparisons")
    common.add_noise_args(p, budget=200.0)
    p.add_argument("--write", action="store_true", help=f"update {BENCH_MD.name}")
    p.add_argument("--profile", action="store_true", help="profile ours vs DDP at world size 2")
    p.add_argument("--profile-out", help="directory for --profile output")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
