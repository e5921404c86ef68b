"""One GPU, one process, bf16: shardspeed's engine against plain torch, FSDP2 and DeepSpeed.

python3 benchmarks/bench_gpu.py --deadline 150 --timeout 75 [--quick]
"""

from __future__ import annotations

import harness as h
import render

OURS = tuple(f"ours_s{s}" for s in range(4))
DEEPSPEED = tuple(f"deepspeed_s{s}" for s in range(4))
SCENARIO = h.Scenario(
    name="gpu",
    section="## GPU: one NVIDIA H200, single process, bf16",
    modes=dict.fromkeys(("torch", "fsdp2", *OURS, *DEEPSPEED), 1),
    warmup=5,
    steps=30,
    rounds=1,
    micro_batch=8,
    timeout=90,
    env=lambda mode, _args: (
        {"DS_ACCELERATOR": cuda_kind(), "DS_BUILD_OPS": "0"} | {"DS_SKIP_CUDA_CHECK": "1"}
    ),
    options={"--small": dict(action="store_true", help="a tiny model (what --quick runs)")},
    quick={"warmup": 1, "steps": 2, "rounds": 1, "micro_batch": 2, "small": True},
)
SHAPE = dict(n_embd=1024, n_layer=12, n_head=16, block_size=1024)
SMALL = dict(n_embd=64, n_layer=2, n_head=2, block_size=32)
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s by NVIDIA's datasheet (SXM): for a rough MFU only
GIB = 2**30


def cuda_kind() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_step(lib: str, model, micro_batch: int, stage: int, device):
    """shardspeed, or DeepSpeed over a client fused AdamW; (step, settings, effective stage)."""
    import torch

    cfg = h.config(micro_batch, stage, bf16={"enabled": True}, steps_per_print=1_000_000)
    if lib == "ours":
        engine, *_ = h.library("ours").initialize(model=model, config=cfg)
        zopt = engine.optimizer
        fused = zopt.optimizer.defaults.get("fused")
        settings = f"{type(zopt.optimizer).__name__}(fused={fused}), gradients in {zopt.grad_dtype}"
        effective = zopt.stage
    else:
        deepspeed = h.library("deepspeed")
        del cfg["optimizer"]
        opt = torch.optim.AdamW(model.to(device).parameters(), lr=h.LR, fused=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        settings = f"deepspeed {deepspeed.__version__}, {type(engine.optimizer).__name__}"
        settings += " over torch AdamW(fused=True)"
        effective = stage
    return h.step_fn(engine, engine.backward, engine.step), settings, effective


def worker(mode: str, args) -> dict:
    import torch

    h.setup(args.threads, init=False)
    device = torch.device(cuda_kind(), 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = SMALL if args.small else SHAPE
    model = h.build_lm(**shape)
    n_params = sum(p.numel() for p in model.parameters())
    batches = h.random_batches(0, args.warmup + args.steps, args.micro_batch, shape["block_size"])
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    effective = None
    if mode == "torch":
        forward, backward, update, _ = h.trainer("torch", model.to(device), fused=True)

        def autocast_forward(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return forward(x, y)

        step = h.step_fn(autocast_forward, backward, update)
        settings = "fp32 weights, autocast bf16, AdamW(fused=True), clip_grad_norm_"
    elif mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        trained = h.trainer("fsdp2", model.to(device), fused=True, fsdp={"mp_policy": mp})
        step = h.step_fn(*trained[:3])
        settings = "fully_shard per block and root (reshard_after_forward default), param bf16, "
        settings += "reduce fp32, AdamW(fused=True), clip_grad_norm_"
    else:
        lib, stage = mode.split("_s")
        step, settings, effective = engine_step(lib, model, args.micro_batch, int(stage), device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    tokens = args.micro_batch * shape["block_size"]
    result = h.timed(step, batches, args.warmup, args.steps, tokens, sync)
    # Training FLOPs per token: 6 per parameter plus attention's scores and values (causal
    # masking halves 12 L T d); a rough figure for the MFU column.
    flops = 6 * n_params + 6 * shape["n_layer"] * shape["block_size"] * shape["n_embd"]
    result |= {"settings": settings, "effective_stage": effective, "params": n_params}
    result["model_tflops"] = flops * result["tokens_per_s"] / 1e12
    if device.type == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        result["allocated_after_gib"] = torch.cuda.memory_allocated(device) / GIB
    return result


def peak(r: dict) -> float:
    """Peak GPU memory allocated (GiB), or the peak RSS without a GPU."""
    return r.get("peak_allocated_gib", r["peak_rss_mib"] / 1024)


def tables(results: dict) -> dict:
    rows, ratios = [], []
    for mode in results["runs"]:
        rs = render.runs(results, mode)
        if not rs:
            rows.append([mode, "-", render.failure(results, mode)] + ["-"] * 7)
            continue
        r, tf = rs[0], rs[0]["model_tflops"]
        gpu = "peak_allocated_gib" in r
        mfu = f"{tf:.0f} ({100 * tf * 1e12 / H200_BF16_PEAK:.0f}%)" if gpu else f"{tf:.3f}"
        memory = [f"{peak(r):.2f}" + ("" if gpu else " (RSS)")]
        memory += [
            render.fmt(r.get(k), ".2f") for k in ("peak_reserved_gib", "allocated_after_gib")
        ]
        speed = [f"{r['tokens_per_s']:,.0f}", render.fmt(r["step_ms"], ".1f"), mfu]
        losses = f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}"
        rows.append([mode, r["effective_stage"], *speed, *memory, losses, r["settings"]])
    for ours in OURS:
        for base in ("torch", "fsdp2", f"deepspeed_s{ours[-1]}"):
            a, b = render.runs(results, ours), render.runs(results, base)
            if a and b:
                tps = render.ratio(a[0]["tokens_per_s"], b[0]["tokens_per_s"])
                ratios.append([ours, base, tps, render.ratio(peak(a[0]), peak(b[0]))])
            elif a or b:
                ratios.append([ours, base, f"n/a ({base if a else ours} not measured)", "-"])
    head = ["mode", "effective ZeRO stage", "tokens/s", "ms/step", "model TFLOP/s (MFU vs 989)"]
    head += ["peak allocated GiB", "peak reserved GiB", "held after GiB", "loss first -> last"]
    ratio_head = "shardspeed | baseline | tokens/s ratio | peak memory ratio"
    out = {"modes": render.table([*head, "settings"], rows, "lrrrrrrrll")}
    out["ratios"] = render.table(ratio_head, ratios, "llrr")
    return out | {"run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_gpu.py")
