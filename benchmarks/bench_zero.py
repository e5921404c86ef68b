"""ZeRO stages 1, 2 (fp32, bf16) and 3: shardspeed vs DeepSpeed and FSDP2, speed and memory.

.venv/bin/python benchmarks/bench_zero.py [--stage3] [--quick] [--write]
"""

from __future__ import annotations

import functools

import harness as h
import render

STAGE12 = ("ddp", "ddp_fused", "ours_s1", "deepspeed_s1", "ours_s2", "deepspeed_s2", "fsdp2")
STAGE12 += ("fsdp2_fused", "ours_s2_bf16", "deepspeed_s2_bf16", "fsdp2_bf16")
# fsdp2_s3_strict (information): reshard_after_forward=True passed explicitly, the root too.
STRICT = "reshard_after_forward=True on the root too"
STAGE3 = ("ours_s3", "deepspeed_s3", "fsdp2_s3", "fsdp2_s3_fused", "fsdp2_s3_strict")
SCENARIO = h.Scenario(
    name="zero",
    section="## ZeRO stages 1 and 2 vs DeepSpeed and FSDP2",
    modes=dict.fromkeys(STAGE12 + STAGE3, 2),
    comparisons=[
        ("ours_s1", "ddp", 0.97, "shardspeed stage 1 vs torch DDP"),
        ("ours_s2", "ddp", 0.97, "shardspeed stage 2 vs torch DDP"),
        ("ours_s2", "ddp_fused", None, "vs DDP with AdamW(fused=True)"),
        ("ours_s1", "deepspeed_s1", 1.0, "shardspeed stage 1 vs DeepSpeed stage 1"),
        ("ours_s2", "deepspeed_s2", 1.0, "shardspeed stage 2 vs DeepSpeed stage 2"),
        ("ours_s2", "fsdp2", 1.0, "shardspeed stage 2 vs FSDP2 (ZeRO-2 mode)"),
        ("ours_s2", "fsdp2_fused", None, "vs FSDP2 with AdamW(fused=True)"),
        ("ours_s2_bf16", "deepspeed_s2_bf16", 1.0, "bf16: shardspeed stage 2 vs DeepSpeed stage 2"),
        ("ours_s2_bf16", "fsdp2_bf16", 1.0, "bf16: shardspeed stage 2 vs FSDP2"),
        ("ours_s3", "deepspeed_s3", 1.0, "shardspeed stage 3 vs DeepSpeed stage 3"),
        ("ours_s3", "fsdp2_s3", 1.0, "shardspeed stage 3 vs FSDP2 (default resharding)"),
        ("ours_s3", "fsdp2_s3_fused", None, "vs that FSDP2 with AdamW(fused=True)"),
        ("ours_s3", "fsdp2_s3_strict", None, f"vs FSDP2 with {STRICT}"),
    ],
    default_modes=STAGE12,
    presets={"--stage3": STAGE3[:4]},
)
POINTS = ("after_forward", "after_backward", "after_step")


def stage(mode: str) -> int:
    """The ZeRO stage a mode runs (FSDP2: the stage it is compared with; DDP: 0)."""
    if mode.startswith("ddp"):
        return 0
    return 3 if "_s3" in mode else 1 if "_s1" in mode else 2


def precision(mode: str) -> str:
    return "bf16" if mode.endswith("_bf16") else "fp32"


def fsdp_options(mode: str) -> tuple[dict, str]:
    """fully_shard's options: stage 2 modes keep parameters unsharded after forward."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    opts: dict = {}
    if precision(mode) == "bf16":
        opts["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
    if mode == "fsdp2_s3_strict":
        return opts | {"reshard_after_forward": True}, "True (passed explicitly: the root too)"
    if stage(mode) == 3:
        return opts, "None (default: True on the blocks, False on the root)"
    return opts | {"reshard_after_forward": False}, "False"


def settings_ours(engine) -> str:
    zopt = engine.optimizer
    red = zopt.reducer
    text = (
        f"{type(zopt.optimizer).__name__}(fused={zopt.optimizer.defaults.get('fused')}), "
        f"gradients in {zopt.grad_dtype}, reduced in {red.comm_dtype} with {red.collective}, "
        f"{len(red._buckets)} bucket(s), overlap {red.overlap}"
    )
    sp = getattr(zopt, "sharded_params", None)
    if sp is not None:
        persistent = [p for u in sp.units if u.persistent for p in u.params]
        gathered = [len(u.params) for u in sp.units if not u.persistent]
        text += (
            f"; {len(sp.units)} units ({len(gathered)} gathered on use, parameters per unit "
            f"{gathered}), persistent: {len(persistent)} parameters, "
            f"{sum(sp.layout.numels[sp.index[p]] for p in persistent):,} elements, prefetch "
            f"<= {sp.options.prefetch_elements:.0e}, max live "
            f"{sp.options.max_live_elements:.0e}, reuse distance "
            f"{sp.options.max_reuse_distance:.0e}"
        )
    return text


def settings_deepspeed(engine, zero_stage: int) -> str:
    zopt = engine.optimizer
    text = (
        f"{type(zopt.optimizer).__name__}, communication_data_type "
        f"{engine.communication_data_type}, gradient_accumulation_dtype "
        f"{getattr(zopt, 'gradient_accumulation_dtype', '?')}, overlap_comm "
        f"{engine.zero_overlap_comm()}, reduce_scatter {engine.zero_reduce_scatter()}"
    )
    if zero_stage == 3:
        zc = engine._config.zero_config
        persistent = list(getattr(zopt, "persistent_parameters", None) or [])
        text += (
            f"; persistent: {len(persistent)} parameters, "
            f"{sum(p.ds_numel for p in persistent):,} elements; prefetch_bucket_size "
            f"{zc.prefetch_bucket_size:.0e}, max_live_parameters {zc.max_live_parameters:.0e}, "
            f"max_reuse_distance {zc.max_reuse_distance:.0e}"
        )
    return text


def worker(mode: str, args) -> dict:
    rank, world = h.setup(args.threads)
    model = h.build_lm()
    # One batch more than the timed run uses: the census step after it.
    batches = h.random_batches(rank, args.warmup + args.steps + 1, args.micro_batch)
    if mode.startswith("ddp"):
        fused = mode.endswith("_fused")
        forward, backward, update, opt = h.trainer("ddp", model, fused=fused)
        settings = f"DistributedDataParallel, AdamW(fused={fused})"
        # DDP's own reduction buckets are not model states and are left out.
        census = functools.partial(h.census_torch, list(model.parameters()), opt, "other")
    elif mode.startswith("fsdp2"):
        opts, reshard = fsdp_options(mode)
        fused = mode.endswith("_fused")
        forward, backward, update, opt = h.trainer("fsdp2", model, fsdp=opts, fused=fused)
        policy = f", {opts['mp_policy']!r}" if "mp_policy" in opts else ""
        settings = f"fully_shard(reshard_after_forward={reshard}{policy}), AdamW(fused={fused})"
        census = functools.partial(h.census_fsdp2, model, opt)
    else:
        lib = mode.split("_")[0]
        cfg = h.config(args.micro_batch, stage(mode))
        if precision(mode) == "bf16":
            cfg["bf16"] = {"enabled": True}
        forward, backward, update, engine = h.trainer(lib, model, cfg)
        ours = lib == "ours"
        settings = settings_ours(engine) if ours else settings_deepspeed(engine, stage(mode))
        census = functools.partial(h.census_ours if ours else h.census_deepspeed, engine)
    step = h.step_fn(forward, backward, update)
    result = h.timed(step, batches, args.warmup, args.steps, world * args.micro_batch * h.SEQ)
    x, y = batches[-1]  # the census step: model states counted after each phase
    loss = forward(x, y)
    points = {"after_forward": census()}
    backward(loss)
    points["after_backward"] = census()
    update()
    points["after_step"] = census()
    n_params = sum(p.numel() for p in h.build_lm().parameters())
    result |= {"census": points, "settings": settings, "params": n_params}
    return result | {"peak_rss_mib": h.peak_rss_mib()}


def states(point: dict) -> int:
    return sum(point[k] for k in h.STATE_KINDS)


def memory_table(results: dict, modes) -> str:
    """Rank 0's peak model states by kind against the ZeRO formula, and peak RSS."""
    from shardspeed.zero import model_state_bytes

    def mib(b):
        return f"{b / render.MIB:.1f}"

    rows = []
    for mode in modes:
        rs = render.runs(results, mode)
        if not rs:
            continue
        per_rank = [r["census"] for r in rs[-1]["ranks"]]
        at = max(POINTS, key=lambda p: states(per_rank[0][p]))
        peak, total = per_rank[0][at], states(per_rank[0][at])
        formula = model_state_bytes(rs[0]["params"], 2, stage(mode), precision=precision(mode))
        formula = formula["total"]
        other = max(pr[p]["other"] for pr in per_rank for p in POINTS)
        rss = render.ranks_text(results, mode, lambda r: r["peak_rss_mib"], ".0f", max)
        cells = [mib(formula), *(mib(peak[k]) for k in h.STATE_KINDS)]
        cells += [f"{mib(total)} ({at.replace('_', ' ')})", f"{total / formula:.3f}"]
        cells.append(" / ".join(mib(states(per_rank[0][p])) for p in POINTS))
        rows.append([mode, *cells, mib(other), rss])
    head = "mode | ZeRO formula | parameters | gradients | fp32 master copy | optimizer states"
    head += " | model states, max (at) | / formula | after fwd / bwd / step"
    head += " | other framework tensors | peak RSS rank 0 / rank 1"
    return render.table(head, rows, "lrrrrrrrlrl")


def settings_table(results: dict, modes) -> str:
    rows = []
    for mode in modes:
        rs = render.runs(results, mode)
        if rs:
            gathered = rs[-1]["census"]["after_step"].get("gathered_peak")
            gathered_mib = render.fmt(gathered and gathered / 2**20, ".1f")
            rows.append([mode, rs[-1]["settings"], gathered_mib])
    head = "mode | as run (read back from the framework) | most gathered bytes at once (MiB)"
    return render.table(head, rows, "llr")


def tables(results: dict) -> dict:
    out = {}
    for part, modes in (("s12", STAGE12), ("s3", STAGE3)):
        present = [m for m in modes if m in results["runs"]]
        if not present:
            continue
        comps = [c for c in SCENARIO.comparisons if c[0] in present]
        out[f"{part}-ratios"] = render.ratio_table(results, comps)
        out[f"{part}-modes"] = render.mode_table(results, present)
        out[f"{part}-memory"] = memory_table(results, present)
        out[f"{part}-settings"] = settings_table(results, present)
        out[f"{part}-run"] = render.run_line(results)
    return out


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_zero.py")
