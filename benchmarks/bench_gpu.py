"""One GPU, one process: shardspeed's engine against plain torch, FSDP2 and DeepSpeed, in bf16.

Every mode trains the GPT-style LM of ``common.py`` made bigger (d_model 1024, 12 layers, 16 heads,
sequence 1024, vocabulary 4096: about 161M parameters) on micro-batches of 8 identical token
sequences from the same initial weights, with AdamW (lr 3e-4, torch's fused CUDA kernel
everywhere) and gradient clipping at 1.0:

  torch        fp32 weights, gradients and Adam states; forward and backward under
               ``torch.autocast("cuda", dtype=torch.bfloat16)`` (bf16 matmuls, fp32 masters)
  fsdp2        ``fully_shard`` on each block and on the root, world size 1 (NCCL), with
               ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 sharded
               parameters (the masters), bf16 compute
  ours_s0..s3  ``shardspeed.initialize`` with ``"bf16": {"enabled": true}`` and ZeRO stage 0..3:
               bf16 weights, fp32 masters, fp32 gradient accumulation (world size 1 runs stages
               2 and 3 as stage 1, which the table's "effective stage" column shows)
  deepspeed_s0..s3  ``deepspeed.initialize`` (0.19.8) with the same config but a client
               ``torch.optim.AdamW(fused=True)``, so DeepSpeed compiles none of its own kernels

Each mode is a fresh process (``--worker MODE``) so that peak GPU memory
(``torch.cuda.max_memory_allocated``) is its own; warm-up steps, then timed steps between
``torch.cuda.synchronize()`` calls. The whole run stops starting modes when ``--budget`` seconds
are used (default 170); a mode that fails or is skipped gets its reason in the table.

    python3 benchmarks/bench_gpu.py --out /tmp/bench_gpu.md   # also writes /tmp/bench_gpu.json
    .venv/bin/python benchmarks/bench_gpu.py --smoke          # tiny model, runs on CPU too
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

try:
    from shardspeed.utils.net import free_port
except ImportError:  # run from a checkout without installing: the package is in src/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from shardspeed.utils.net import free_port

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
GIB = 2**30

# The GPU shape; --smoke replaces it with a tiny one.
FULL = {"D_MODEL": 1024, "N_LAYERS": 12, "N_HEADS": 16, "SEQ": 1024, "VOCAB": 4096}
SMOKE = {"D_MODEL": 64, "N_LAYERS": 2, "N_HEADS": 2, "SEQ": 32, "VOCAB": 256}
MICRO_BATCH, SMOKE_MICRO_BATCH = 8, 2
WARMUP, STEPS = 5, 30
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s by NVIDIA's datasheet (SXM): for a rough MFU only

OURS = tuple(f"ours_s{s}" for s in range(4))
DEEPSPEED = tuple(f"deepspeed_s{s}" for s in range(4))
MODES = ("torch", "fsdp2", *OURS, *DEEPSPEED)


def shape(smoke: bool) -> dict:
    return SMOKE if smoke else FULL


def apply_shape(smoke: bool) -> None:
    """Point common.py's model and batches at this benchmark's shape (they read its globals)."""
    for key, value in shape(smoke).items():
        setattr(common, key, value)


def mode_stage(mode: str) -> int | None:
    return int(mode[-1]) if mode.startswith(("ours_s", "deepspeed_s")) else None


def engine_config(micro: int, stage: int, with_optimizer: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": common.CLIP,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
    }
    if with_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": common.LR}}
    return cfg


# --------------------------------------------------------------------------------------------
# Worker: one mode in this process
# --------------------------------------------------------------------------------------------


def worker(args) -> dict:
    mode = args.worker
    if mode.startswith("deepspeed"):
        # Nothing of DeepSpeed's is compiled: the optimizer is torch's, and no op is built.
        os.environ.setdefault("DS_BUILD_OPS", "0")
        os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")
    import torch

    cuda = torch.cuda.is_available()
    if mode.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    apply_shape(args.smoke)
    n_batches = args.warmup + args.steps
    batches = [
        (x.to(device), y.to(device)) for x, y in common.make_batches(0, n_batches, args.micro_batch)
    ]
    model = common.build_model()
    n_params = sum(p.numel() for p in model.parameters())
    extra: dict = {}

    if mode == "torch":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=common.LR, fused=True)

        def step(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        settings = "fp32 weights, autocast bf16, AdamW(fused=True), clip_grad_norm_"

    elif mode == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dist.init_process_group("nccl" if cuda else "gloo")
        model.to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=common.LR, fused=True)

        def step(x, y):
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        settings = (
            "fully_shard per block and root (reshard_after_forward default), param bf16, "
            "reduce fp32, AdamW(fused=True), clip_grad_norm_"
        )

    elif mode.startswith(("ours", "deepspeed")):
        stage = mode_stage(mode)
        if mode.startswith("ours"):
            import shardspeed

            engine, *_ = shardspeed.initialize(
                model=model, config=engine_config(args.micro_batch, stage, True)
            )
            zopt = engine.optimizer
            extra["effective_stage"] = zopt.stage
            settings = (
                f"{type(zopt.optimizer).__name__}(fused={zopt.optimizer.defaults.get('fused')}), "
                f"gradients in {zopt.grad_dtype}"
            )
        else:
            import deepspeed

            model.to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=common.LR, fused=True)
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=opt, config=engine_config(args.micro_batch, stage, False)
            )
            extra["effective_stage"] = stage
            settings = f"deepspeed {deepspeed.__version__}, {type(engine.optimizer).__name__}"
            settings += " over torch AdamW(fused=True)"

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss

    else:
        raise SystemExit(f"unknown mode {mode!r}")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t_start = time.perf_counter()
    losses = [step(x, y).item() for x, y in batches[: args.warmup]]
    sync()
    warm_s = time.perf_counter() - t_start
    t0 = time.perf_counter()
    for x, y in batches[args.warmup :]:
        loss = step(x, y)
    sync()
    elapsed = time.perf_counter() - t0
    losses.append(loss.item())

    seq = shape(args.smoke)["SEQ"]
    tokens = args.steps * args.micro_batch * seq
    dims = shape(args.smoke)
    # Training FLOPs per token: 6 per parameter plus attention's scores and values (6 * L * T * d
    # with causal masking halving 12 L T d); a rough figure for the MFU column.
    flops_per_token = 6 * n_params + 6 * dims["N_LAYERS"] * seq * dims["D_MODEL"]
    result = {
        "mode": mode,
        "params": n_params,
        "settings": settings,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "warmup_steps": args.warmup,
        "steps": args.steps,
        "warmup_s": warm_s,
        "elapsed_s": elapsed,
        "step_ms": 1000 * elapsed / args.steps,
        "tokens_per_s": tokens / elapsed,
        "model_tflops": flops_per_token * tokens / elapsed / 1e12,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "torch": torch.__version__,
        **extra,
    }
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        result["allocated_after_gib"] = torch.cuda.memory_allocated(device) / GIB
    else:
        result["peak_rss_gib"] = common.peak_rss_mib() / 1024
    if mode.startswith("ours"):
        result["memory_breakdown"] = engine.memory_breakdown()
        engine.destroy()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------


def run_mode(mode: str, args, tmp: Path, timeout: float) -> dict:
    out = tmp / f"{mode}.json"
    cmd = [sys.executable, str(HERE), "--worker", mode, "--result", str(out)]
    cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd += ["--micro-batch", str(args.micro_batch)]
    if args.smoke:
        cmd.append("--smoke")
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        PYTHONUNBUFFERED="1",
    )
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    log = tmp / f"{mode}.log"
    t0 = time.perf_counter()
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout
            )
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    wall = time.perf_counter() - t0
    if code == 0 and out.exists():
        result = json.loads(out.read_text())
        result["wall_s"] = wall
        return result
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    reason = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
    last = [line for line in tail.splitlines() if line.strip()]
    return {
        "mode": mode,
        "error": reason,
        "error_line": last[-1][:300] if last else "",
        "log_tail": tail,
        "wall_s": wall,
    }


def deepspeed_reason() -> str | None:
    """Why DeepSpeed cannot be measured here, or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    return None


def orchestrate(args) -> dict:
    modes = list(args.modes or MODES)
    if args.no_deepspeed:
        modes = [m for m in modes if not m.startswith("deepspeed")]
    results: dict[str, dict] = {}
    skip_ds = deepspeed_reason()
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    walls: list[float] = []
    for mode in modes:
        used = time.perf_counter() - start
        left = args.budget - used
        guess = max(walls) if walls else 0.0
        if mode.startswith("deepspeed") and skip_ds:
            results[mode] = {"mode": mode, "skipped": skip_ds}
        elif left < max(guess, 10.0):
            results[mode] = {
                "mode": mode,
                "skipped": f"time budget: {used:.0f} of {args.budget:.0f} s used",
            }
        else:
            print(f"[bench_gpu] {mode} ...", flush=True)
            r = run_mode(mode, args, tmp, timeout=min(args.mode_timeout, left))
            results[mode] = r
            walls.append(r["wall_s"])
            if "error" in r:
                print(f"[bench_gpu] {mode}: FAILED ({r['error']}): {r['error_line']}", flush=True)
                print(r["log_tail"][-1500:], flush=True)
                if mode.startswith("deepspeed") and "Traceback" in r["log_tail"]:
                    first = r.get("error_line") or r["error"]
                    skip_ds = f"an earlier DeepSpeed mode failed: {first}"
            else:
                print(
                    f"[bench_gpu] {mode}: {r['tokens_per_s']:,.0f} tokens/s, "
                    f"{r['step_ms']:.1f} ms/step, peak "
                    f"{r.get('peak_allocated_gib', r.get('peak_rss_gib', 0)):.2f} GiB, loss "
                    f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} (run {r['wall_s']:.0f} s)",
                    flush=True,
                )
        if "skipped" in results[mode]:
            print(f"[bench_gpu] {mode}: skipped ({results[mode]['skipped']})", flush=True)
    return {
        "benchmark": "bench_gpu",
        "smoke": args.smoke,
        "shape": {**shape(args.smoke), "MICRO_BATCH": args.micro_batch},
        "warmup": args.warmup,
        "steps": args.steps,
        "machine": machine(),
        "total_s": time.perf_counter() - start,
        "results": results,
        "ratios": ratios(results),
    }


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["deepspeed"] = version("deepspeed")
    except Exception:
        info["deepspeed"] = None
    return info


def ok(results: dict, mode: str) -> dict | None:
    r = results.get(mode)
    return r if r and "tokens_per_s" in r else None


def ratios(results: dict) -> list[dict]:
    rows = []
    for ours in OURS:
        stage = mode_stage(ours)
        if ours not in results:
            continue  # not asked for (--modes)
        for base in ("torch", "fsdp2", f"deepspeed_s{stage}"):
            if base not in results:
                continue
            a, b = ok(results, ours), ok(results, base)
            row = {"ours": ours, "baseline": base}
            if a and b:
                row["tokens_per_s_ratio"] = a["tokens_per_s"] / b["tokens_per_s"]
                mem = "peak_allocated_gib" if "peak_allocated_gib" in a else "peak_rss_gib"
                row["peak_memory_ratio"] = a[mem] / b[mem] if b.get(mem) else None
            else:
                row["missing"] = base if a else ours
            rows.append(row)
    return rows


def markdown(report: dict) -> str:
    results = report["results"]
    gpu = report["machine"].get("gpu")
    where = f"one {gpu}" if gpu else "CPU only (no GPU)"
    dims = report["shape"]
    lines = [
        f"# bench_gpu{' (smoke)' if report['smoke'] else ''}: {where}, one process, bf16",
        "",
        f"Model: GPT-style LM from benchmarks/common.py, d_model {dims['D_MODEL']}, "
        f"{dims['N_LAYERS']} layers, {dims['N_HEADS']} heads, sequence {dims['SEQ']}, vocabulary "
        f"{dims['VOCAB']}, micro-batch {dims['MICRO_BATCH']}; {report['warmup']} warm-up + "
        f"{report['steps']} timed steps per mode, each mode a fresh process. torch "
        f"{report['machine'].get('torch')} (CUDA {report['machine'].get('cuda')}), deepspeed "
        f"{report['machine'].get('deepspeed')}, Python {report['machine']['python']}. "
        f"Total {report['total_s']:.0f} s.",
        "",
        *(
            [
                "**Smoke run**: a tiny model for a few steps; the numbers only show that each mode runs.",
                "",
            ]
            if report["smoke"]
            else []
        ),
        "| mode | effective ZeRO stage | tokens/s | ms/step | model TFLOP/s (MFU vs 989) | "
        "peak allocated GiB | peak reserved GiB | held after GiB | loss first -> last | "
        "settings |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for mode, r in results.items():
        if "tokens_per_s" not in r:
            why = r.get("skipped") or f"{r.get('error')}: {r.get('error_line', '')}"
            why = why.replace("|", "/")
            lines.append(
                f"| {mode} | - | {'skipped' if 'skipped' in r else 'FAILED'}: {why} |" + " - |" * 7
            )
            continue
        stage = r.get("effective_stage", "-")
        tf = r["model_tflops"]
        mfu = (
            f"{tf:.0f} ({100 * tf * 1e12 / H200_BF16_PEAK:.0f}%)"
            if "peak_allocated_gib" in r
            else f"{tf:.3f}"
        )
        peak = r.get("peak_allocated_gib", r.get("peak_rss_gib"))
        reserved = r.get("peak_reserved_gib")
        held = r.get("allocated_after_gib")
        lines.append(
            f"| {mode} | {stage} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {mfu} | "
            f"{peak:.2f}{'' if 'peak_allocated_gib' in r else ' (RSS)'} | "
            f"{'-' if reserved is None else f'{reserved:.2f}'} | "
            f"{'-' if held is None else f'{held:.2f}'} | "
            f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} | {r['settings']} |"
        )
    lines += [
        "",
        "Ratios (shardspeed / baseline; tokens/s above 1 is faster, peak memory below 1 is less):",
        "",
        "| shardspeed | baseline | tokens/s ratio | peak memory ratio |",
        "|---|---|---:|---:|",
    ]
    for row in report["ratios"]:
        if "tokens_per_s_ratio" in row:
            mem = row["peak_memory_ratio"]
            lines.append(
                f"| {row['ours']} | {row['baseline']} | {row['tokens_per_s_ratio']:.3f} | "
                f"{'-' if mem is None else f'{mem:.3f}'} |"
            )
        else:
            lines.append(
                f"| {row['ours']} | {row['baseline']} | n/a ({row['missing']} not measured) | - |"
            )
    lines += [
        "",
        "- torch: fp32 weights under bf16 autocast; fsdp2, shardspeed and DeepSpeed: bf16 compute "
        "with fp32 master weights. All use torch's fused AdamW kernel.",
        "- At world size 1 shardspeed runs ZeRO stages 2 and 3 as stage 1 (nothing to shard); "
        "DeepSpeed and FSDP2 keep their sharded code paths with one shard.",
        "- Peak memory is `torch.cuda.max_memory_allocated()` over the whole process (model "
        "moved to the GPU, warm-up and timed steps).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="markdown path (the JSON goes beside it); default stdout")
    p.add_argument("--smoke", action="store_true", help="a tiny model, a few steps; runs on CPU")
    p.add_argument("--modes", nargs="+", choices=MODES, help=f"subset of {' '.join(MODES)}")
    p.add_argument("--no-deepspeed", action="store_true", help="leave the DeepSpeed modes out")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--budget", type=float, default=170.0, help="seconds for all modes (170)")
    p.add_argument("--mode-timeout", type=float, default=90.0, help="seconds per mode (90)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.warmup is None:
        args.warmup = 1 if args.smoke else WARMUP
    if args.steps is None:
        args.steps = 2 if args.smoke else STEPS
    if args.micro_batch is None:
        args.micro_batch = SMOKE_MICRO_BATCH if args.smoke else MICRO_BATCH

    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args)))
        return

    report = orchestrate(args)
    text = markdown(report)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
        print(text)
        print(f"[bench_gpu] wrote {out} and {out.with_suffix('.json')}")
    else:
        print(text)
        print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
