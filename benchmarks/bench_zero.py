"""ZeRO stages 1, 2 and 3: shardspeed vs DeepSpeed and torch FSDP2, throughput and memory.

One invocation measures, at world size 2, on the same model and token batches as bench_dp.py:

  shardspeed ZeRO stage 1 vs DeepSpeed stage 1,
  shardspeed ZeRO stage 2 vs DeepSpeed stage 2,
  shardspeed ZeRO stage 2 vs torch FSDP2 (``fully_shard`` per block and on the root with
  ``reshard_after_forward=False``, its ZeRO-2 equivalent; ``torch.optim.AdamW``, clip 1.0),

or, with ``--stage3``, instead:

  shardspeed ZeRO stage 3 vs DeepSpeed stage 3,
  shardspeed ZeRO stage 3 vs torch FSDP2 with fully_shard's default ``reshard_after_forward``
  (None: True, i.e. ZeRO-3, for the blocks; False for the root),

the tokens/s ratios, and per rank the model-state bytes each framework holds (against the ZeRO
formula) and the peak RSS. The script is both the orchestrator and the worker: every measured
run is ``python -m torch.distributed.run ... bench_zero.py --worker MODE`` (gloo on CPU).

    .venv/bin/python benchmarks/bench_zero.py              # measure, print the tables
    .venv/bin/python benchmarks/bench_zero.py --write      # ... and update BENCHMARKS.md
    .venv/bin/python benchmarks/bench_zero.py --stage3 --write   # stage 3 only, its own section
    .venv/bin/python benchmarks/bench_zero.py --profile    # profile ours vs the baselines

See benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import sys
from collections import deque
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
SECTION_TITLE = "## ZeRO stages 1 and 2 vs DeepSpeed and FSDP2"
SECTION_TITLE_S3 = "## ZeRO stage 3 vs DeepSpeed and FSDP2"
WORLD = 2
MIB = 2**20

# fsdp2_fused (informational, no target): FSDP2 with torch.optim.AdamW(fused=True), the kernel
# shardspeed builds on CPU.
FP32_MODES = ("ours_s1", "deepspeed_s1", "ours_s2", "deepspeed_s2", "fsdp2", "fsdp2_fused")
# --bf16 adds stage 2 in bf16: `"bf16": {"enabled": true}` for shardspeed and DeepSpeed, FSDP2 with
# MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (fp32 sharded parameters = masters).
BF16_MODES = ("ours_s2_bf16", "deepspeed_s2_bf16", "fsdp2_bf16")
# --stage3: ZeRO stage 3 (fp32) in place of the modes above: the same config with stage 3 for
# shardspeed and DeepSpeed; FSDP2 with fully_shard's default reshard_after_forward (None: True on
# the blocks, False on the root).
STAGE3_MODES = ("ours_s3", "deepspeed_s3", "fsdp2_s3", "fsdp2_s3_fused")
# Only with --modes (information): FSDP2 with reshard_after_forward=True passed explicitly, so the
# root is resharded after forward too (and all-gathered again for backward), as shardspeed does.
EXTRA_S3_MODES = ("fsdp2_s3_strict",)
MODES = FP32_MODES + BF16_MODES + STAGE3_MODES + EXTRA_S3_MODES
COMPARISONS = [
    (("ours_s1", WORLD), ("deepspeed_s1", WORLD), 1.0, "shardspeed stage 1 vs DeepSpeed stage 1"),
    (("ours_s2", WORLD), ("deepspeed_s2", WORLD), 1.0, "shardspeed stage 2 vs DeepSpeed stage 2"),
    (("ours_s2", WORLD), ("fsdp2", WORLD), 1.0, "shardspeed stage 2 vs FSDP2 (ZeRO-2 mode)"),
    (("ours_s2", WORLD), ("fsdp2_fused", WORLD), None, "vs FSDP2 with AdamW(fused=True)"),
    (
        ("ours_s2_bf16", WORLD),
        ("deepspeed_s2_bf16", WORLD),
        1.0,
        "bf16: shardspeed stage 2 vs DeepSpeed stage 2",
    ),
    (("ours_s2_bf16", WORLD), ("fsdp2_bf16", WORLD), 1.0, "bf16: shardspeed stage 2 vs FSDP2"),
    (("ours_s3", WORLD), ("deepspeed_s3", WORLD), 1.0, "shardspeed stage 3 vs DeepSpeed stage 3"),
    (
        ("ours_s3", WORLD),
        ("fsdp2_s3", WORLD),
        1.0,
        "shardspeed stage 3 vs FSDP2 (default resharding)",
    ),
    (
        ("ours_s3", WORLD),
        ("fsdp2_s3_fused", WORLD),
        None,
        "vs that FSDP2 with AdamW(fused=True)",
    ),
    (
        ("ours_s3", WORLD),
        ("fsdp2_s3_strict", WORLD),
        None,
        "vs FSDP2 with reshard_after_forward=True on the root too",
    ),
]
CENSUS_POINTS = ("after_forward", "after_backward", "after_step")
KINDS = ("parameters", "gradients", "master_weights", "optimizer_states")


def mode_stage(mode: str) -> int:
    """The ZeRO stage a mode runs (FSDP2: the stage it is compared with)."""
    return 3 if "_s3" in mode else 1 if "_s1" in mode else 2


def mode_precision(mode: str) -> str:
    return "bf16" if mode.endswith("_bf16") else "fp32"


def ds_config(micro_batch: int, stage: int, precision: str = "fp32") -> dict:
    """The config given verbatim to both shardspeed and DeepSpeed."""
    cfg = common.ds_config(micro_batch, stage=stage)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# --------------------------------------------------------------------------------------------
# Worker side: model-state census
# --------------------------------------------------------------------------------------------


def _local(t):
    """The plain tensor behind `t` (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def reachable_tensors(root, prefixes: tuple[str, ...], depth: int = 10) -> list:
    """Tensors reachable from `root` through containers and the __dict__ of objects whose class
    lives in a module starting with one of `prefixes` (modules, i.e. the model, are not entered:
    their parameters are counted on their own)."""
    import torch
    from torch import nn

    out, seen = [], set()
    stack = [(root, depth)]
    while stack:
        obj, d = stack.pop()
        if obj is None or id(obj) in seen or d < 0:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(_local(obj))
            continue
        if isinstance(obj, nn.Module):
            continue
        if isinstance(obj, dict):
            stack.extend((v, d - 1) for v in obj.values())
            stack.extend((k, d - 1) for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, list | tuple | set | frozenset | deque):
            stack.extend((v, d - 1) for v in obj)
        elif type(obj).__module__.startswith(prefixes):
            attrs = getattr(obj, "__dict__", None)
            if attrs:
                stack.extend((v, d - 1) for v in attrs.values())
    return out


class Census:
    """Bytes of distinct storages, by kind; a storage is counted once, in the first kind it
    appears in (kinds are added in the order of KINDS, then 'other')."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, tensors) -> None:
        total = self.bytes.get(kind, 0)
        for t in tensors:
            if t is None:
                continue
            t = _local(t)
            if t.device.type == "meta":  # no memory (and every meta storage has data_ptr 0)
                continue
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                total += storage.nbytes()
        self.bytes[kind] = total


def census_ours(engine) -> dict:
    """Ours: `engine.memory_breakdown()` minus buffers; 'other': any further tensor reachable from
    the ZeRO optimizer (reduction buckets in flight and the like)."""
    mb = engine.memory_breakdown()
    out = {k: mb[k] for k in KINDS}
    c = Census()
    for kind, tensors in engine.optimizer.held_tensors().items():
        c.add(kind, tensors)
    c.add("buffers", engine.module.buffers())
    c.add("other", reachable_tensors(engine.optimizer, ("shardspeed",)))
    out["other"] = c.bytes["other"]
    out["breakdown_buffers"] = mb["buffers"]
    if "gathered_peak" in mb:  # stage 3, where the engine reports it
        out["gathered_peak"] = mb["gathered_peak"]
    return out


def census_deepspeed(engine) -> dict:
    """DeepSpeed ZeRO-1/2: module parameters (views into bit16_groups_flat), gradients (p.grad,
    averaged_gradients, grads_in_partition, the fp32 partitions' .grad), the fp32 master partitions
    (single_partition_of_fp32_groups: a clone even for an fp32 model), the inner optimizer's state;
    'other': everything else reachable from the ZeRO optimizer."""
    opt = engine.optimizer
    masters = list(getattr(opt, "single_partition_of_fp32_groups", []) or [])
    c = Census()
    c.add("parameters", list(engine.module.parameters()))
    c.add("parameters", getattr(opt, "bit16_groups_flat", []) or [])
    grads = [p.grad for p in engine.module.parameters()] + [m.grad for m in masters]
    grads += reachable_tensors(getattr(opt, "averaged_gradients", None), ("deepspeed",))
    grads += reachable_tensors(getattr(opt, "grads_in_partition", None), ("deepspeed",))
    c.add("gradients", grads)
    c.add("master_weights", masters)
    inner = getattr(opt, "optimizer", None)
    states = [v for s in inner.state.values() for v in s.values()] if inner is not None else []
    c.add("optimizer_states", [v for v in states if hasattr(v, "untyped_storage")])
    c.add("other", reachable_tensors(opt, ("deepspeed",)))
    return {k: c.bytes.get(k, 0) for k in (*KINDS, "other")}


def census_deepspeed_s3(engine) -> dict:
    """DeepSpeed ZeRO-3: parameters are each parameter's partition (`ds_tensor`, views into
    `fp16_partitioned_groups_flat`) plus `p.data` while a parameter is gathered (empty otherwise);
    gradients the flat partition buffer `grad_partitions_flat_buffer`, `averaged_gradients`, the
    fp32 partitions' `.grad` and any `p.grad`; the fp32 master partitions
    `fp32_partitioned_groups_flat` (a copy even for an fp32 model on CPU); the inner optimizer's
    state. The ipg reduction buckets (`torch.empty(reduce_bucket_size)`, 5e8 elements by
    default, only the pages written are resident) are kept apart as 'bucket' (virtual bytes);
    'other': everything else reachable from the ZeRO optimizer and its parameter coordinator."""
    opt = engine.optimizer
    params = list(engine.module.parameters())
    c = Census()
    c.add("parameters", params)
    c.add("parameters", [getattr(p, "ds_tensor", None) for p in params])
    c.add("parameters", getattr(opt, "fp16_partitioned_groups_flat", []) or [])
    masters = list(getattr(opt, "fp32_partitioned_groups_flat", []) or [])
    grads = [p.grad for p in params] + [m.grad for m in masters]
    grads.append(getattr(opt, "grad_partitions_flat_buffer", None))
    grads += reachable_tensors(getattr(opt, "averaged_gradients", None), ("deepspeed",))
    c.add("gradients", grads)
    c.add("master_weights", masters)
    inner = getattr(opt, "optimizer", None)
    states = [v for s in inner.state.values() for v in s.values()] if inner is not None else []
    c.add("optimizer_states", [v for v in states if hasattr(v, "untyped_storage")])
    buckets = getattr(opt, "ipg_buckets", {}) or {}
    c.add("bucket", [getattr(b, "buffer", None) for b in buckets.values()])
    c.add(
        "other",
        reachable_tensors([opt, getattr(opt, "parameter_offload", None)], ("deepspeed",)),
    )
    return {k: c.bytes.get(k, 0) for k in (*KINDS, "other", "bucket")}


def census_fsdp2(model, opt) -> dict:
    """FSDP2: parameters are the local shards of the DTensor parameters plus whatever FSDP's
    FSDPParam objects hold (the unsharded parameters and all-gather outputs while unsharded);
    gradients the local shards of p.grad; no separate master copy (fp32); the optimizer state's local
    shards; 'other': anything else reachable from the FSDP states (communication buffers)."""
    from torch.distributed.fsdp import FSDPModule

    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]
    fsdp_params = [fp for g in groups for fp in g.fsdp_params]
    c = Census()
    c.add("parameters", list(model.parameters()))
    c.add("parameters", reachable_tensors(fsdp_params, ("torch.distributed",)))
    c.add("gradients", [p.grad for p in model.parameters()])
    c.add("master_weights", [])
    opt_states = [v for s in opt.state.values() for v in s.values()]
    c.add("optimizer_states", [v for v in opt_states if hasattr(v, "untyped_storage")])
    c.add("other", reachable_tensors(states, ("torch.distributed",)))
    return {k: c.bytes.get(k, 0) for k in (*KINDS, "other")}


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def worker(args) -> None:
    mode = args.worker
    if mode.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    rank, world = common.worker_setup(args.threads)

    model = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    # One batch more than the timed run uses: the census step after it.
    batches = make_batches(rank, args.warmup + args.steps + 1, args.micro_batch)

    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = {}
        if mode_precision(mode) == "bf16":
            mp["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        # Stage 2 modes: reshard_after_forward=False (ZeRO-2). The _s3 modes: fully_shard's
        # default, None, which is True (ZeRO-3) for the blocks and False for the root, whose
        # parameters backward needs first.
        if mode == "fsdp2_s3_strict":
            mp["reshard_after_forward"] = True
            reshard = "True (passed explicitly: the root too)"
        elif mode_stage(mode) == 3:
            reshard = "None (default: True on the blocks, False on the root)"
        else:
            mp["reshard_after_forward"] = False
            reshard = "False"
        for block in model.blocks:
            fully_shard(block, **mp)
        fully_shard(model, **mp)
        fused = {"fused": True} if mode.endswith("_fused") else {}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, **fused)

        def forward(x, y):
            return model(x, y)

        def backward(loss):
            loss.backward()

        def update():
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def census():
            return census_fsdp2(model, opt)

        settings = (
            f"fully_shard(reshard_after_forward={reshard}"
            f"{', ' + repr(mp['mp_policy']) if 'mp_policy' in mp else ''})"
        )
        settings += f", AdamW(fused={bool(fused)})"

    elif mode.startswith(("ours", "deepspeed")):
        if mode.startswith("ours"):
            import shardspeed as lib
        else:
            import deepspeed as lib
        cfg = ds_config(args.micro_batch, mode_stage(mode), mode_precision(mode))
        engine, _opt, _, _ = lib.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )

        def forward(x, y):
            return engine(x, y)

        def backward(loss):
            engine.backward(loss)

        def update():
            engine.step()

        def census():
            if mode.startswith("ours"):
                return census_ours(engine)
            if mode_stage(mode) == 3:
                return census_deepspeed_s3(engine)
            return census_deepspeed(engine)

        zopt = engine.optimizer
        if mode.startswith("ours"):
            red = zopt.reducer
            settings = (
                f"{type(zopt.optimizer).__name__}(fused={zopt.optimizer.defaults.get('fused')}), "
                f"gradients in {zopt.grad_dtype}, reduced in "
                f"{red.comm_dtype} with {red.collective}, {len(red._buckets)} bucket(s), "
                f"overlap {red.overlap}"
            )
            sp = getattr(zopt, "sharded_params", None)
            if sp is not None:
                persistent = [p for u in sp.units if u.persistent for p in u.params]
                gathered = [len(u.params) for u in sp.units if not u.persistent]
                settings += (
                    f"; {len(sp.units)} units ({len(gathered)} gathered on use, parameters per "
                    f"unit {gathered}), persistent: {len(persistent)} parameters, "
                    f"{sum(sp.layout.numels[sp.index[p]] for p in persistent):,} elements, "
                    + f"prefetch of the next unit when it holds <= "
                    f"{sp.options.prefetch_elements:.0e} elements, max live "
                    f"{sp.options.max_live_elements:.0e}, reuse distance "
                    f"{sp.options.max_reuse_distance:.0e}"
                )
        else:
            settings = (
                f"{type(zopt.optimizer).__name__}, communication_data_type "
                f"{engine.communication_data_type}, gradient_accumulation_dtype "
                f"{getattr(zopt, 'gradient_accumulation_dtype', '?')}, overlap_comm "
                f"{engine.zero_overlap_comm()}, reduce_scatter {engine.zero_reduce_scatter()}"
            )
            if mode_stage(mode) == 3:
                zc = engine._config.zero_config
                persistent = list(getattr(zopt, "persistent_parameters", []) or [])
                settings += (
                    f"; persistent: {len(persistent)} parameters, "
                    f"{sum(p.ds_numel for p in persistent):,} elements; prefetch_bucket_size "
                    f"{zc.prefetch_bucket_size:.0e}, max_live_parameters "
                    f"{zc.max_live_parameters:.0e}, max_reuse_distance {zc.max_reuse_distance:.0e}"
                )

    else:
        raise SystemExit(f"unknown worker mode {mode!r}")

    def step(x, y):
        loss = forward(x, y)
        backward(loss)
        update()
        return loss

    result = common.timed_run(
        step,
        batches,
        args,
        mode=mode,
        rank=rank,
        world=world,
        n_params=n_params,
        barrier=dist.barrier,
    )

    # The census step: one more ordinary step, the model states counted after each phase.
    x, y = batches[-1]
    points = {}
    loss = forward(x, y)
    points["after_forward"] = census()
    backward(loss)
    points["after_backward"] = census()
    update()
    points["after_step"] = census()
    result["census"] = points
    result["settings"] = settings
    result["peak_rss_mib"] = common.peak_rss_mib()
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


def formula_bytes(n_params: int, stage: int, precision: str = "fp32") -> float:
    from shardspeed.zero import model_state_bytes

    return model_state_bytes(n_params, WORLD, stage, precision=precision)["total"]


def model_state_total(point: dict) -> int:
    return sum(point[k] for k in KINDS)


def memory_table(results, n_params: int):
    """Per mode (rank 0, and the max over ranks for the peak): model-state bytes by kind at the
    point of the census step where their sum is largest, that sum against the ZeRO formula, the
    sum at each point, framework tensors beyond the model states, and peak RSS per rank."""
    lines = [
        "| mode | ZeRO formula | parameters | gradients | fp32 master copy | optimizer states "
        "| model states, max (at) | / formula | after fwd / bwd / step | other framework tensors "
        "| peak RSS rank 0 / rank 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    rows = {}
    for (mode, _world), runs in results.items():
        if not runs:
            continue
        run = runs[-1]
        per_rank = [r["census"] for r in run["ranks"]]
        points = per_rank[0]
        at = max(CENSUS_POINTS, key=lambda p: model_state_total(points[p]))
        peak = points[at]
        total = model_state_total(peak)
        ranks_max = max(model_state_total(pr[p]) for pr in per_rank for p in CENSUS_POINTS)
        formula = formula_bytes(n_params, mode_stage(mode), mode_precision(mode))
        rss = [max(r["ranks"][i]["peak_rss_mib"] for r in runs) for i in range(WORLD)]
        other = max(pr[p]["other"] for pr in per_rank for p in CENSUS_POINTS)

        def mib(b):
            return f"{b / MIB:.1f}"

        lines.append(
            f"| {mode} | {mib(formula)} | {mib(peak['parameters'])} | {mib(peak['gradients'])} | "
            f"{mib(peak['master_weights'])} | {mib(peak['optimizer_states'])} | "
            f"{mib(total)} ({at.replace('after_', 'after ')}) | {total / formula:.3f} | "
            + " / ".join(mib(model_state_total(points[p])) for p in CENSUS_POINTS)
            + f" | {mib(other)} | {rss[0]:.0f} / {rss[1]:.0f} |"
        )
        rows[mode] = {
            "total": total,
            "formula": formula,
            "ranks_max": ranks_max,
            "other": other,
            "rss": rss,
            "at": at,
        }
    return "\n".join(lines), rows


def selected_modes(args) -> list[str]:
    """--modes if given, else the fp32 stage 1/2 modes (--stage3: the stage 3 ones); --bf16 adds
    the bf16 modes."""
    default = STAGE3_MODES if args.stage3 else FP32_MODES
    wanted = set(args.modes or default) | (set(BF16_MODES) if args.bf16 else set())
    return [m for m in MODES if m in wanted]


def is_stage3_run(modes) -> bool:
    return bool(modes) and all(mode_stage(m) == 3 for m in modes)


def settings_lines(results) -> list[str]:
    """What each framework ended up doing (optimizer class, dtypes, collectives), per mode."""
    return [
        f"- {mode}: {runs[-1].get('settings', '?')}"
        for (mode, _world), runs in results.items()
        if runs
    ]


def orchestrate(args) -> int:
    if args.profile:
        return profile_mode(args)
    n_params = sum(p.numel() for p in build_model().parameters())
    cmd = common.command_line("bench_zero.py")
    print(
        f"model: {n_params / 1e6:.2f}M params, seq {SEQ}, micro batch {args.micro_batch}, "
        f"world size {WORLD}, {args.warmup} warm-up + {args.steps} timed steps, {args.rounds} "
        f"rounds, {args.threads} thread(s) per process (torch.set_num_threads, OMP_NUM_THREADS)",
        flush=True,
    )
    print(common.shardspeed_source(), flush=True)
    plan = [(m, WORLD) for m in selected_modes(args)]
    results, errors, total, tmp, discarded = common.measure(
        HERE, plan, args, prefix="bench_zero_", width=12
    )
    rows, ratio_table, mode_table = common.summarize(results, errors, COMPARISONS)
    mem_table, mem_rows = memory_table(results, n_params)
    print()
    print(ratio_table)
    print()
    print(mode_table)
    print()
    print("Model states per rank (MiB = 2**20 bytes; rank 0):")
    print()
    print(mem_table)
    settings = settings_lines(results)
    print("\nAs run (from the workers):")
    print("\n".join(settings))
    load_line = common.load_line(results, discarded, args)
    common.print_run_end(total, tmp, errors, load_line=load_line)

    if args.write:
        report = {
            "n_params": n_params,
            "cmd": cmd,
            "total": total,
            "rows": rows,
            "ratio_table": ratio_table,
            "mode_table": mode_table,
            "mem_table": mem_table,
            "mem_rows": mem_rows,
            "load_line": load_line,
            "results": results,
            "errors": errors,
            "settings": settings,
        }
        writer = write_section_s3 if is_stage3_run(selected_modes(args)) else write_section
        writer(args, report)
        print(f"\nupdated {BENCH_MD}")
    return 1 if errors else 0


def write_section(args, report: dict) -> None:
    """The section of the stage 1 and 2 run."""
    p, results, settings = report["n_params"], report["results"], report["settings"]
    notes = [
        f"- Model and data as in the stage-0 section: GPT-style LM, {p / 1e6:.2f}M parameters "
        f"(vocab {VOCAB}, d_model {D_MODEL}, {N_LAYERS} layers, {N_HEADS} heads, seq {SEQ}), fp32 (the bf16 rows: see below), "
        "fixed seed; synthetic token batches from a seed per (rank, step), identical in every "
        f"mode; micro batch {args.micro_batch} per rank, world size {WORLD}.",
        f"- Each run: {args.warmup} warm-up steps, then {args.steps} timed steps (barrier before "
        "and after); tokens/s = world size x micro batch x seq x steps / time, measured on rank 0. "
        f"{args.rounds} rounds with the modes interleaved (order rotated per round); table ratios "
        "are median(ours) / median(baseline); per-round ratios pair runs of the same round. "
        f"Threads: {args.threads} per process (`torch.set_num_threads`, `OMP_NUM_THREADS`). Every "
        "run is a fresh `torch.distributed.run --standalone` process group (gloo on CPU); start-up "
        "and `initialize` are not timed.",
        "- shardspeed and DeepSpeed get the same config dict, only the stage differing: "
        f"`{json.dumps(ds_config(args.micro_batch, 2))}` (no other zero keys: each library uses its "
        "own defaults, e.g. DeepSpeed `overlap_comm` false for stages 1-2, shardspeed overlaps when "
        "unset; `reduce_bucket_size` 5e8 elements on both, more than the model, so both reduce in one "
        "bucket). DeepSpeed runs with `DS_ACCELERATOR=cpu` and its C++ CPU FusedAdam; shardspeed "
        "builds `torch.optim.AdamW(fused=True)`.",
        "- FSDP2: `torch.distributed.fsdp.fully_shard(block, reshard_after_forward=False)` for each "
        "transformer block, then on the root (embeddings, final norm, head); "
        "`torch.optim.AdamW(lr=3e-4)` (torch's default on CPU: the per-tensor loop) and "
        "`torch.nn.utils.clip_grad_norm_(params, 1.0)` on the DTensor parameters; the row 'with "
        "AdamW(fused=True)' is the same with `fused=True` (information, no target).",
        *(
            [
                '- bf16 rows (`--bf16`): the same config plus `"bf16": {"enabled": true}` for '
                "shardspeed and DeepSpeed; FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16, "
                "reduce_dtype=fp32)` over fp32 sharded parameters (they are its master copy, counted "
                "under parameters). The defaults differ in the gradients (see 'As run' below): "
                "shardspeed accumulates and reduces them in fp32, DeepSpeed 0.19.8 keeps and reduces "
                "them in bf16, half the bytes per reduction; FSDP2 reduces in fp32."
            ]
            if any(mode_precision(m) == "bf16" for m, _w in results)
            else []
        ),
        "- Model-state bytes are counted on a census step run after the timed steps: after its "
        "forward, after its backward and after its optimizer step, each storage counted once "
        "(views share storage); the table shows rank 0 at the point where the sum of parameters, "
        "gradients, master copy and optimizer states is largest. shardspeed: "
        "`engine.memory_breakdown()` minus `buffers` (the model has none). DeepSpeed: module "
        "parameters (views into `bit16_groups_flat`), gradients (`p.grad`, `averaged_gradients`, "
        "`grads_in_partition`, the fp32 partitions' `.grad`), `single_partition_of_fp32_groups` "
        "(the fp32 master partition, a clone even for an fp32 model) and the inner optimizer's "
        "state. FSDP2: the local shards of the DTensor parameters plus the tensors FSDP's "
        "`FSDPParam`s hold (the unsharded parameters while unsharded), the local shards of the "
        "gradients and of AdamW's state. 'other framework tensors' is the largest storage total "
        "over the three points of any further tensor reachable from the framework's ZeRO "
        "optimizer / FSDP states (meta tensors skipped). Buffers that live only inside backward "
        "or the step are gone at these points and only peak RSS shows them: shardspeed stage 2's "
        "reduction bucket (one bucket of the whole model here, as `reduce_bucket_size` exceeds "
        "P), DeepSpeed's ipg bucket (`torch.empty(reduce_bucket_size)`, only the written pages "
        "resident), FSDP2's all-gather / reduce-scatter buffers and unsharded gradients.",
        f"- ZeRO formula (fp32, P = {p:,}, N = {WORLD}): stage 1 8P + 8P/N = "
        f"{formula_bytes(p, 1) / MIB:.1f} MiB, stage 2 4P + 12P/N = {formula_bytes(p, 2) / MIB:.1f} "
        "MiB (`shardspeed.zero.model_state_bytes(P, 2, stage, precision='fp32')['total']`); "
        "FSDP2 is compared with stage 2; bf16 rows with the bf16 formula, stage 2 2P + 14P/N = "
        f"{formula_bytes(p, 2, 'bf16') / MIB:.1f} MiB (bf16 parameters and gradients, fp32 "
        "master and Adam states). Peak RSS is `ru_maxrss` of each rank at the end "
        "(max over rounds): it includes the Python interpreter, torch and the framework's imports.",
        "- Shared 2-core machine: 'other load' is the CPU used during each timed window by "
        "anything other than that run's ranks (from /proc/stat minus the ranks' own CPU time), "
        "in cores; high values mean that round is noisy.",
        f"- This run: {report['load_line']}",
        "- As run (read back from each framework in the workers):",
        *(f"  {line}" for line in settings),
    ]
    finish_section(SECTION_TITLE, args, report, notes)


def finish_section(title: str, args, report: dict, notes: list[str]) -> None:
    """The notes every section ends with (spread, memory over the formula, missed targets, --note
    lines, failures), then the section itself written into BENCHMARKS.md."""
    notes = list(notes)
    spread = common.spread_note(report["results"])
    if spread:
        notes.append(spread)
    for mode, m in report["mem_rows"].items():
        if m["total"] > 1.05 * m["formula"]:
            notes.append(
                f"- {mode} holds {m['total'] / m['formula']:.2f}x the ZeRO formula's model-state "
                f"bytes ({m['total'] / MIB:.1f} vs {m['formula'] / MIB:.1f} MiB, {m['at']})."
            )
    notes += common.targets_missed(
        report["rows"],
        end=". See the notes below."
        if args.note
        else " (`bench_zero.py --profile --modes ...` shows where the time goes).",
    )
    notes += common.note_lines(args)
    notes += common.error_notes(report["errors"], with_world=True, markers=())
    blocks = [
        report["ratio_table"],
        ("Per mode:", report["mode_table"]),
        ("Model states per rank (MiB = 2**20 bytes):", report["mem_table"]),
    ]
    section = common.section_text(title, report["cmd"], report["total"], blocks, notes)
    common.write_markdown(section, title, BENCH_MD)


def write_section_s3(args, report: dict) -> None:
    """The section of the --stage3 run."""
    p, results, settings = report["n_params"], report["results"], report["settings"]
    formula = formula_bytes(p, 3)
    ours = results.get(("ours_s3", WORLD)) or []
    ds_bucket = [
        max(pt.get("bucket", 0) for pt in r["census"].values())
        for run in results.get(("deepspeed_s3", WORLD)) or []
        for r in run["ranks"][:1]
    ]
    gathered = [
        max(pt.get("gathered_peak") or 0 for pt in r["census"].values())
        for run in ours
        for r in run["ranks"][:1]
    ]
    notes = [
        f"- Model and data as in the sections above: GPT-style LM, {p / 1e6:.2f}M parameters "
        f"(vocab {VOCAB}, d_model {D_MODEL}, {N_LAYERS} layers, {N_HEADS} heads, seq {SEQ}), fp32, "
        "fixed seed; synthetic token batches from a seed per (rank, step), identical in every "
        f"mode; micro batch {args.micro_batch} per rank, world size {WORLD}. "
        f"{common.shardspeed_source()}.",
        f"- Each run: {args.warmup} warm-up steps, then {args.steps} timed steps (barrier before "
        "and after); tokens/s = world size x micro batch x seq x steps / time, measured on rank 0. "
        f"{args.rounds} rounds with the modes interleaved (order rotated per round); table ratios "
        "are median(ours) / median(baseline); per-round ratios pair runs of the same round. "
        f"Threads: {args.threads} per process. Every run is a fresh `torch.distributed.run "
        "--standalone` process group (gloo on CPU); start-up and `initialize` are not timed.",
        "- shardspeed and DeepSpeed get the same config dict: "
        f"`{json.dumps(ds_config(args.micro_batch, 3))}`; no stage3_* key is set, so each library "
        "uses its own defaults. The declared defaults are the same numbers "
        "(`stage3_param_persistence_threshold` 1e5, `stage3_model_persistence_threshold` "
        "sys.maxsize, `stage3_prefetch_bucket_size` 5e7, `stage3_max_live_parameters` 1e9, "
        "`stage3_max_reuse_distance` 1e9, `reduce_bucket_size` 5e8, `sub_group_size` 1e9) and both "
        "pick the same persistent parameters (see 'As run'), but the behaviour differs: "
        "(a) `overlap_comm` is true by default in DeepSpeed at stage 3 (false at stages 1-2); "
        "shardspeed overlaps when unset at every stage. (b) DeepSpeed fetches per submodule "
        "(each Linear / LayerNorm / Embedding by its own hooks), records the module order in the "
        "first step and then prefetches up to `stage3_prefetch_bucket_size` elements ahead (the "
        "whole model here); shardspeed gathers per unit (a transformer block, the rest of the "
        "model) on use and prefetches the next unit of the recorded order (one unit in flight). "
        "(c) Both release a parameter after use only if it is not used again within "
        "`stage3_max_reuse_distance` elements; with 1e9 > P every parameter stays gathered from "
        "its forward to its backward, so both hold the whole model after forward (the census "
        "'after fwd' column) and gather it once per step. (d) DeepSpeed on CPU keeps a second fp32 copy "
        "of the partition (`fp32_partitioned_groups_flat`): its no-copy branch compares a "
        "torch.device with the string 'cpu', which is false; shardspeed's fp32 shard is its own "
        "master. DeepSpeed runs with its C++ CPU FusedAdam, shardspeed with "
        "`torch.optim.AdamW(fused=True)`.",
        "- FSDP2: `fully_shard(block)` for each transformer block, then `fully_shard(model)` on "
        "the root (embeddings, final norm, head), with `reshard_after_forward` left at its "
        "default, None, which in torch 2.13 means True (reshard after forward, ZeRO-3) for the "
        "blocks and False for the root: the root's parameters (embeddings and head, 40% of P "
        "here) stay unsharded from forward to backward, which needs them first. "
        "`torch.optim.AdamW(lr=3e-4)` (on CPU: the per-tensor loop) and "
        "`torch.nn.utils.clip_grad_norm_(params, 1.0)`; the row 'with AdamW(fused=True)' is the "
        "same with `fused=True` (information, no target).",
        *(
            [
                "- fsdp2_s3_strict (`--modes`, information): the same FSDP2 with "
                "`reshard_after_forward=True` passed explicitly, so the root is resharded after "
                "forward and all-gathered again for backward, as shardspeed does with its 'rest of "
                "the model' unit."
            ]
            if ("fsdp2_s3_strict", WORLD) in results
            else []
        ),
        "- Model-state bytes are counted on a census step after the timed steps (after its "
        "forward, backward and optimizer step, each storage once), rank 0 at the point where the "
        "sum is largest. shardspeed: `engine.memory_breakdown()` minus buffers: its 1/N shard, "
        "the persistent unit whole on every rank, any gathered unit, the gradient shard and "
        "AdamW's state. DeepSpeed: each parameter's partition (`ds_tensor`) plus `p.data` while "
        "gathered, gradients (`grad_partitions_flat_buffer`, `averaged_gradients`, the fp32 "
        "partitions' `.grad`), the fp32 partitions, the inner optimizer's state. FSDP2: local "
        "shards of the DTensor parameters plus what its `FSDPParam`s hold while unsharded, local "
        "shards of gradients and optimizer state. Units gathered inside forward or backward are "
        "gone at these points: peak RSS (`ru_maxrss` per rank, max over rounds, including "
        "interpreter and imports) includes them.",
        *(
            [
                f"- shardspeed's most gathered-parameter bytes alive at once "
                f"(`memory_breakdown()['gathered_peak']`, rank 0): {max(gathered) / MIB:.1f} MiB."
            ]
            if gathered and max(gathered)
            else []
        ),
        *(
            [
                f"- Not in the table: DeepSpeed's ipg reduction bucket, `torch.empty("
                f"reduce_bucket_size)` = {max(ds_bucket) / MIB:.0f} MiB of address space allocated "
                "at initialize, of which only the pages written are resident (at most the "
                "gradients of one backward, here the whole model's 4P); peak RSS counts those."
            ]
            if ds_bucket and max(ds_bucket)
            else []
        ),
        f"- ZeRO formula (fp32, P = {p:,}, N = {WORLD}): stage 3 16P/N = {formula / MIB:.1f} MiB "
        "(`shardspeed.zero.model_state_bytes(P, 2, 3, precision='fp32')['total']`), for all "
        "three frameworks.",
        "- Shared 2-core machine: 'other load' is the CPU used during each timed window by "
        "anything other than that run's ranks, in cores; high values mean that round is noisy.",
        f"- This run: {report['load_line']}",
        "- As run (read back from each framework in the workers):",
        *(f"  {line}" for line in settings),
    ]
    finish_section(SECTION_TITLE_S3, args, report, notes)


def profile_mode(args) -> int:
    """Profile rank 0 of each mode in --modes once at world size 2."""
    return common.profile_modes(HERE, selected_modes(args), args, "bench_zero_prof_", WORLD)


def main(argv=None) -> int:
    p = common.parser(__doc__, MODES)
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=MODES,
        metavar="MODE",
        help=f"modes to run, of {', '.join(MODES)} (default: the fp32 stage 1/2 modes "
        f"{', '.join(FP32_MODES)}; with --stage3: {', '.join(STAGE3_MODES)}; the *_fused modes are "
        "the informational FSDP2 baselines with AdamW(fused=True), fsdp2_s3_strict FSDP2 with "
        "reshard_after_forward=True on the root too)",
    )
    p.add_argument(
        "--stage3",
        action="store_true",
        help="run the ZeRO stage 3 comparisons instead (" + ", ".join(STAGE3_MODES) + "); "
        f"--write then updates the section '{SECTION_TITLE_S3[3:]}' (about 4 minutes on an idle "
        "machine)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="also run stage 2 in bf16: " + ", ".join(BF16_MODES) + " (adds about 2.5 minutes)",
    )
    common.add_noise_args(p, budget=200.0)
    common.add_write_args(p, note_help=f"{common.NOTE_HELP} (repeatable)")
    p.add_argument("--profile", action="store_true", help="profile each of --modes once")
    p.add_argument("--profile-out", help="directory for --profile output")
    args = p.parse_args(argv)
    if not args.worker:
        modes = selected_modes(args)
        if args.stage3 and args.bf16:
            p.error("--bf16 has no stage 3 modes; run --stage3 and --bf16 separately")
        if args.write and not is_stage3_run(modes) and any(mode_stage(m) == 3 for m in modes):
            p.error("--write: stage 3 modes have their own section; run them alone (--stage3)")
    if args.worker:
        worker(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
