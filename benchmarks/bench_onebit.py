"""1-bit Adam and 0/1 Adam against Adam on 2 ranks: bytes per step and time per step.

One invocation measures, on bench_pipe.py's GPT (7.40M parameters, 8 blocks, tied embedding/head,
fp32) and the same global batch in every mode, at world size 2 (gloo on CPU, 1 thread per
process), ZeRO stage 0, no gradient clipping, lr 3e-4:

  shardspeed `"type": "Adam"`; shardspeed `"type": "OneBitAdam"` (`freeze_step` F: Adam on
  averaged gradients for F steps, then the momentum averaged through 1-bit messages);
  shardspeed `"type": "ZeroOneAdam"` (`var_freeze_step` F, then local steps synchronised in
  1 bit); torch DDP + `torch.optim.Adam`; DeepSpeed `"type": "Adam"`; and DeepSpeed
  `"type": "OneBitAdam"` (DeepSpeed 0.19.8 no longer ships it: the run records the error);

and reports, per mode and separately for the warm-up steps (2..F) and the compressed steps
(F+2..T): ms/step (median), tokens/s, ratios against DDP and shardspeed Adam, the time in
forward+backward, in the optimizer step and inside collectives (shardspeed's comms logger), the
bytes a rank puts on the wire per step (payload from `engine.comm_summary` x `bus_factor`) and
the raw payload, the warm-up / compressed byte ratio, and the losses (first, at the freeze,
final) against Adam's. The script is both the orchestrator and the worker: every measured run is
``python -m torch.distributed.run ... bench_onebit.py --worker MODE``.

    .venv/bin/python benchmarks/bench_onebit.py --smoke      # every mode once, a few steps
    .venv/bin/python benchmarks/bench_onebit.py              # measure, print the tables
    .venv/bin/python benchmarks/bench_onebit.py --write      # ... and update BENCHMARKS.md

See benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import common
from bench_moe import A2ACounter
from bench_pipe import GPT, MIB, N_BLOCKS, global_batches, local_numel
from common import (
    BENCH_MD,
    D_MODEL,
    LR,
    N_HEADS,
    SEQ,
    VOCAB,
    error_line,
    ratio_text,
    shardspeed_source,
)

HERE = Path(__file__).resolve()
SECTION_TITLE = "## 1-bit Adam and 0/1 Adam vs Adam (world size 2)"
WORLD = 2
FREEZE_STEP = 5
# 0/1 Adam after var_freeze_step: a 1-bit synchronisation every local_step_interval steps, the
# interval doubling after every LOCAL_STEP_SCALER local steps up to LOCAL_STEP_CLIPPER (DeepSpeed's
# defaults, 32678 and 16, would synchronise every step for the whole of a short run).
LOCAL_STEP_SCALER = 4
LOCAL_STEP_CLIPPER = 4


@dataclass(frozen=True)
class Mode:
    lib: str  # "ours", "deepspeed", "ddp"
    optimizer: str  # the config's optimizer type
    what: str


MODES: dict[str, Mode] = {
    "ours_adam": Mode("ours", "Adam", "shardspeed Adam, ZeRO stage 0"),
    "ours_onebit": Mode("ours", "OneBitAdam", "shardspeed OneBitAdam, ZeRO stage 0"),
    "ours_zeroone": Mode("ours", "ZeroOneAdam", "shardspeed ZeroOneAdam, ZeRO stage 0"),
    "ddp": Mode("ddp", "Adam", "torch DDP + torch.optim.Adam"),
    "deepspeed_adam": Mode("deepspeed", "Adam", "DeepSpeed Adam, ZeRO stage 0"),
    "deepspeed_onebit": Mode("deepspeed", "OneBitAdam", "DeepSpeed OneBitAdam, ZeRO stage 0"),
}
COMPRESSED = ("OneBitAdam", "ZeroOneAdam")


def config(micro_batch: int, optimizer: str, freeze_step: int) -> dict:
    """The config given to shardspeed and DeepSpeed (shardspeed's adds the comms logger)."""
    params: dict = {"lr": LR}
    if optimizer == "OneBitAdam":
        params |= {"freeze_step": freeze_step, "comm_backend_name": "gloo"}
    elif optimizer == "ZeroOneAdam":
        params |= {
            "var_freeze_step": freeze_step,
            "local_step_scaler": LOCAL_STEP_SCALER,
            "local_step_clipper": LOCAL_STEP_CLIPPER,
            "comm_backend_name": "gloo",
        }
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": optimizer, "params": params},
        # No clipping: 1-bit Adam's momentum must not be rescaled against the frozen variance
        # (docs/compression.md), and every mode gets the same.
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
    }


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def worker(args) -> None:
    """Steps 1..T (T = warmup + steps); the orchestrator sets warmup = freeze_step + 1, so the
    timed window of `common.timed_run` is the compressed steps after the first one."""
    mode = args.worker
    spec = MODES[mode]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    comm = A2ACounter(dist)  # before shardspeed or DeepSpeed binds any collective
    rank, world = common.worker_setup(args.threads)
    freeze = args.warmup - 1
    global_batch = args.micro_batch * world
    n_steps = args.warmup + args.steps
    lo = rank * args.micro_batch
    batches = [
        (x[lo : lo + args.micro_batch], y[lo : lo + args.micro_batch])
        for x, y in global_batches(n_steps, global_batch)
    ]
    model = GPT()
    extra: dict = {"lib": spec.lib, "optimizer_type": spec.optimizer, "freeze_step": freeze}
    extra["global_batch"] = global_batch

    if spec.lib == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(model)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        extra["settings"] = "DistributedDataParallel(model), torch.optim.Adam(lr=3e-4)"

        def forward_backward(x, y):
            loss = module(x, y)
            loss.backward()
            return loss

        def update():
            opt.step()
            opt.zero_grad(set_to_none=True)

        def summary() -> dict:
            return {}

    else:
        cfg = config(args.micro_batch, spec.optimizer, freeze)
        if spec.lib == "ours":
            import shardspeed as lib

            cfg["comms_logger"] = {"enabled": True}
        else:
            import deepspeed as lib

            lib.init_distributed(dist_backend="gloo")
        extra["config"] = cfg
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        inner = getattr(engine.optimizer, "optimizer", None)
        extra["settings"] = type(engine.optimizer).__name__ + (
            f" over {type(inner).__name__}" if inner is not None else ""
        )

        def forward_backward(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            return loss

        def update():
            engine.step()

        def summary() -> dict:
            got = getattr(engine, "comm_summary", None) or {}
            return {op: [s["count"], s["bytes"], s["latency_ms"]] for op, s in got.items()}

    rec: dict[str, list] = {
        k: [] for k in ("steps_ms", "fb_steps_ms", "opt_steps_ms", "summary", "counted")
    }
    losses: list[torch.Tensor] = []

    def step(x, y):
        calls0, bytes0 = dict(comm.calls), dict(comm.bytes)
        t0 = time.perf_counter()
        loss = forward_backward(x, y)
        t1 = time.perf_counter()
        update()
        t2 = time.perf_counter()
        rec["steps_ms"].append(1e3 * (t2 - t0))
        rec["fb_steps_ms"].append(1e3 * (t1 - t0))
        rec["opt_steps_ms"].append(1e3 * (t2 - t1))
        rec["summary"].append(summary())
        rec["counted"].append(
            {
                n: [comm.calls[n] - calls0.get(n, 0), comm.bytes[n] - bytes0.get(n, 0)]
                for n in comm.calls
                if comm.calls[n] != calls0.get(n, 0)
            }
        )
        losses.append(loss.detach())
        return loss

    n_local = local_numel(model.parameters())
    comm.active = True
    result = common.timed_run(
        step, batches, args, mode=mode, rank=rank, world=world, n_params=n_local,
        barrier=dist.barrier,
    )  # fmt: skip
    comm.active = False
    loss_t = torch.stack(losses).float()
    dist.all_reduce(loss_t)
    loss_t /= world
    result["losses"] = loss_t.tolist()
    result["first_loss"], result["last_loss"] = result["losses"][0], result["losses"][-1]
    # tokens/s from the mean step of the timed (compressed) window: 0/1 Adam's steps are not
    # alike (local steps, synchronising steps), so the median would miss its cost.
    timed_ms = statistics.fmean(rec["steps_ms"][args.warmup :])
    result["tokens_per_s"] = 1e3 * global_batch * SEQ / timed_ms
    result["params_local"] = n_local
    result.update(rec)
    result.update(extra)
    result["peak_rss_mib"] = common.peak_rss_mib()
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


def windows(freeze: int, n_steps: int) -> dict[str, slice]:
    """0-based step slices: the warm-up steps 2..F (step 1 allocates optimizer state) and the
    compressed steps F+2..T (step F+1 allocates the error buffers)."""
    return {"warm-up": slice(1, freeze), "compressed": slice(freeze + 1, n_steps)}


def window_label(name: str, w: slice) -> str:
    return f"{name} (steps {w.start + 1}-{w.stop})"


def step_bytes(r: dict, n_params: int) -> tuple[list[dict], str]:
    """Per step of rank 0's run: {op: [calls, payload bytes, ms]} and where it comes from."""
    if r["lib"] == "ours":
        return r["summary"], "comms logger (`engine.comm_summary`)"
    if r["lib"] == "deepspeed":
        steps = [{op: [c, b, None] for op, (c, b) in s.items()} for s in r["counted"]]
        return steps, "torch.distributed calls counted"
    # DDP's reducer calls its all-reduces from C++: one fp32 gradient per parameter, computed.
    return [{"all_reduce": [None, 4 * n_params, None]} for _ in r["steps_ms"]], "computed (4 B x P)"


def phase_bytes(steps: list[dict], w: slice) -> dict:
    """Mean per step over the window: payload, bytes on the wire per rank (payload x bus factor
    at world size 2), collective calls by op and ms inside collectives."""
    from shardspeed.comm.logger import bus_factor

    sel = steps[w]
    n = len(sel) or 1
    payload = sum(b for s in sel for _c, b, _ms in s.values()) / n
    wire = sum(b * bus_factor(op, WORLD) for s in sel for op, (_c, b, _ms) in s.items()) / n
    calls: dict[str, float] = {}
    for s in sel:
        for op, (c, _b, _ms) in s.items():
            if c is not None:
                calls[op] = calls.get(op, 0) + c / n
    ms = [sum(v[2] for v in s.values()) for s in sel if all(v[2] is not None for v in s.values())]
    per_step_wire = [sum(b * bus_factor(op, WORLD) for op, (_c, b, _ms) in s.items()) for s in sel]
    return {
        "payload": payload,
        "wire": wire,
        "wire_min": min(per_step_wire, default=0.0),
        "wire_max": max(per_step_wire, default=0.0),
        "calls": calls,
        "comm_ms": statistics.median(ms) if len(ms) == len(sel) and ms else None,
    }


def analyse(results, modes, freeze: int, n_steps: int, n_params: int) -> dict:
    """Per mode and window: ms/step (median of each run's median, over runs), tokens/s, its
    parts, and bytes per step (from the first run: the traffic is deterministic)."""
    out: dict = {}
    ws = windows(freeze, n_steps)
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if not runs:
            continue
        r0 = runs[0]["ranks"][0]
        steps, source = step_bytes(r0, n_params)
        steps1, _ = step_bytes(runs[0]["ranks"][1], n_params)
        per: dict = {"source": source, "windows": {}}
        for name, w in ws.items():

            def run_median(key: str, w=w, runs=runs) -> float:
                return statistics.median(statistics.median(r[key][w]) for r in runs)

            ms = run_median("steps_ms")
            mean_ms = statistics.median(statistics.fmean(r["steps_ms"][w]) for r in runs)
            b = phase_bytes(steps, w)
            # Steps of the window that exchange 1-bit messages (more than the 4-byte norm) and
            # those that do not (0/1 Adam's local steps): median ms of each, over runs.
            first = w.start
            synced = [
                i + first
                for i, st in enumerate(steps[w])
                if phase_bytes([st], slice(0, 1))["wire"] > 1024
            ]
            local = [i for i in range(first, w.stop) if i not in synced]

            def median_of(idx, runs=runs) -> float | None:
                if not idx:
                    return None
                return statistics.median(
                    statistics.median(r["steps_ms"][i] for i in idx) for r in runs
                )

            comm = (
                [phase_bytes(r["summary"], w)["comm_ms"] for r in runs]
                if r0["lib"] == "ours"
                else []
            )
            per["windows"][name] = {
                "ms": ms,
                "mean_ms": mean_ms,
                "tokens_per_s": 1e3 * r0["global_batch"] * SEQ / mean_ms,
                "synced_ms": median_of(synced),
                "local_ms": median_of(local),
                "n_synced": len(synced),
                "n_local": len(local),
                "fb_ms": run_median("fb_steps_ms"),
                "opt_ms": run_median("opt_steps_ms"),
                "comm_ms": statistics.median(comm) if comm and None not in comm else None,
                "bytes": b,
                "rank1_wire": phase_bytes(steps1, w)["wire"],
                "all_ms": [
                    f"{statistics.median(r['steps_ms'][w]):.0f}" + ("*" if r.get("noisy") else "")
                    for r in runs
                ],
            }
        if r0["lib"] == "ours":
            # Cross-check the comms logger against the torch.distributed calls counted, from
            # step 2 on (step 1's summary also holds initialize's parameter broadcast).
            counted = sum(b for s in r0["counted"][1:] for _n, (_c, b) in s.items())
            logged = sum(b for s in r0["summary"][1:] for _c, b, _ms in s.values())
            per["counter_agrees"] = counted == logged
        out[mode] = per
    return out


def fmt_bytes(b: float) -> str:
    if b >= MIB:
        return f"{b / MIB:.2f} MiB"
    if b >= 1024:
        return f"{b / 1024:.1f} KiB"
    return f"{b:.0f} B"


def time_table(an, modes, freeze: int, n_steps: int) -> str:
    ws = windows(freeze, n_steps)
    lines = [
        "| mode | window | ms/step (median) | per round | ms/step (mean) | tokens/s (from the "
        "mean) | / DDP | / shardspeed Adam | "
        "forward + backward (ms) | optimizer step (ms) | inside collectives (ms, comms logger) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        if mode not in an:
            continue
        for name, w in ws.items():
            v = an[mode]["windows"][name]
            ddp = an.get("ddp", {}).get("windows", {}).get(name, {}).get("tokens_per_s")
            adam = an.get("ours_adam", {}).get("windows", {}).get(name, {}).get("tokens_per_s")
            comm = f"{v['comm_ms']:.1f}" if v["comm_ms"] is not None else "-"
            lines.append(
                f"| {mode} | {window_label(name, w)} | {v['ms']:.0f} | "
                f"{', '.join(v['all_ms'])} | {v['mean_ms']:.0f} | {v['tokens_per_s']:.0f} | "
                f"{ratio_text(v['tokens_per_s'], ddp)} | {ratio_text(v['tokens_per_s'], adam)} | "
                f"{v['fb_ms']:.0f} | {v['opt_ms']:.0f} | {comm} |"
            )
    return "\n".join(lines)


def calls_text(calls: dict) -> str:
    if not calls:
        return "-"
    return ", ".join(f"{c:.3g} x {op}" for op, c in sorted(calls.items()))


def bytes_table(an, modes) -> str:
    lines = [
        "| mode | counted by | warm-up step: collectives | payload | on the wire per rank | "
        "compressed step: collectives (mean per step) | payload | on the wire per rank | "
        "wire bytes, warm-up / compressed |",
        "|---|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for mode in modes:
        if mode not in an:
            continue
        w, c = (an[mode]["windows"][k]["bytes"] for k in ("warm-up", "compressed"))
        wire_c = fmt_bytes(c["wire"])
        if c["wire_max"] - c["wire_min"] > 1:
            wire_c += f" ({fmt_bytes(c['wire_min'])} - {fmt_bytes(c['wire_max'])})"
        lines.append(
            f"| {mode} | {an[mode]['source']} | {calls_text(w['calls'])} | "
            f"{fmt_bytes(w['payload'])} | {fmt_bytes(w['wire'])} | {calls_text(c['calls'])} | "
            f"{fmt_bytes(c['payload'])} | {wire_c} | {ratio_text(w['wire'], c['wire'], 1)} |"
        )
    return "\n".join(lines)


def loss_table(results, modes, freeze: int) -> tuple[str, list[str], bool]:
    """Losses (mean over the global batch) at step 1, F, F+1 and T, the final against shardspeed
    Adam's; checks that every mode's first loss matches shardspeed Adam's (same weights, same
    batch) and that every loss is finite."""
    lines = [
        "| mode | step 1 | step F | step F+1 | final (step T) | final / shardspeed Adam's final |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    checks, ok = [], True
    ref_runs = results.get(("ours_adam", WORLD)) or []
    ref = ref_runs[0]["losses"] if ref_runs else None
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if not runs:
            continue
        loss = runs[0]["losses"]
        lines.append(
            f"| {mode} | {loss[0]:.4f} | {loss[freeze - 1]:.4f} | {loss[freeze]:.4f} | "
            f"{loss[-1]:.4f} | {ratio_text(loss[-1], ref[-1] if ref else None)} |"
        )
        finite = all(x == x and abs(x) != float("inf") for r in runs for x in r["losses"])
        if not finite:
            ok = False
            checks.append(f"{mode}: a loss is not finite")
        if ref:
            rel = abs(loss[0] - ref[0]) / abs(ref[0])
            if rel > 1e-4:
                ok = False
                checks.append(f"{mode}: first loss {loss[0]:.6f} is {rel:.1e} off Adam's")
        same = all(r["losses"] == loss for r in runs)
        if not same:
            spread = max(abs(r["losses"][-1] - loss[-1]) for r in runs)
            checks.append(f"{mode}: final loss differs between rounds by up to {spread:.2e}")
    return "\n".join(lines), checks, ok


def findings(an, args, n_params: int) -> list[str]:
    """Plain-words explanations computed from the run's numbers."""
    out = []
    adam, one = an.get("ours_adam"), an.get("ours_onebit")
    if adam and one:
        aw, ac = adam["windows"]["warm-up"], adam["windows"]["compressed"]
        ow, oc = one["windows"]["warm-up"], one["windows"]["compressed"]
        saved = ac["bytes"]["wire"] - oc["bytes"]["wire"]
        fp32_ms = ac["comm_ms"]
        gbps = 8 * ac["bytes"]["wire"] / (fp32_ms / 1e3) / 1e9 if fp32_ms else None
        n_msgs = sum(oc["bytes"]["calls"].values())
        out.append(
            f"- Bytes: after the warm-up shardspeed's 1-bit Adam puts "
            f"{fmt_bytes(oc['bytes']['wire'])} a step on the wire per rank instead of "
            f"{fmt_bytes(ow['bytes']['wire'])} during its warm-up "
            f"({ow['bytes']['wire'] / oc['bytes']['wire']:.2f}x fewer; Adam: "
            f"{fmt_bytes(ac['bytes']['wire'])} every step). The ideal is 32x (1 bit for 32); "
            "what is left over is small here: the param group's momentum is compressed as one "
            "flat tensor, each of its two messages (all-to-all of signs, then all-gather of signs) carries a "
            "4-byte scale per rank and pads to 8 x world elements, and the engine's 4-byte "
            "all-reduce (MAX) of the gradient norm stays, in "
            f"{n_msgs:.0f} collectives a step instead of 1. The raw payload (what `comm_summary` "
            f"reports, the whole tensor of each collective) is {fmt_bytes(oc['bytes']['payload'])}"
            f", {ow['bytes']['payload'] / oc['bytes']['payload']:.1f}x below fp32's: each of the "
            "two phases counts the whole sign tensor, of which (n-1)/n leaves the rank."
        )
        if fp32_ms and oc["comm_ms"] is not None:
            extra = (oc["ms"] - oc["comm_ms"]) - (ac["ms"] - ac["comm_ms"])
            out.append(
                f"- Time: on one host gloo moves the fp32 all-reduce of "
                f"{fmt_bytes(ac['bytes']['wire'])} in {fp32_ms:.1f} ms over loopback (about "
                f"{gbps:.1f} Gbit/s per rank of bus bandwidth), "
                f"{100 * fp32_ms / ac['ms']:.0f}% of Adam's {ac['ms']:.0f} ms step. 1-bit Adam "
                f"spends {oc['comm_ms']:.1f} ms a step inside its {n_msgs:.0f} collectives "
                "(one flat exchange of the whole momentum, plus the norm's; the first collective "
                "after backward also waits for the slower rank) and pays for compression: "
                "flattening, signs, norms, packing and unpacking, error feedback. "
                f"Its step is {oc['ms']:.0f} ms against Adam's "
                f"{ac['ms']:.0f} ms ({oc['tokens_per_s'] / ac['tokens_per_s']:.3f}x the "
                f"tokens/s); its optimizer step takes {oc['opt_ms']:.0f} ms, "
                f"{oc['opt_ms'] - oc['comm_ms']:.0f} ms of it outside collectives, against "
                f"Adam's {ac['opt_ms']:.0f} ms. Even in its warm-up, sending fp32 like Adam, "
                f"its optimizer step takes {ow['opt_ms']:.0f} ms against Adam's "
                f"{aw['opt_ms']:.0f} ms: an unfused per-tensor loop against torch's fused kernel."
            )
            if extra > 0:
                bw = saved / (extra / 1e3)
                out.append(
                    f"- Where it would pay: outside the collectives 1-bit Adam's step costs "
                    f"{extra:.0f} ms more than Adam's, and it saves {fmt_bytes(saved)} per rank per "
                    f"step. Sending those bytes takes longer than {extra:.0f} ms on links slower "
                    f"than about {fmt_bytes(bw)}/s ({8 * bw / 1e9:.2f} Gbit/s) per rank, so for "
                    "this model 1-bit Adam wins when the data-parallel link is slower than that "
                    "(Ethernet between nodes, a congested network), and loses on loopback, "
                    "NVLink or InfiniBand, where the bytes are cheap. The estimate assumes the "
                    "all-reduce is not hidden behind backward and ignores per-message latency, "
                    "which grows with a slower link and favours fewer, larger messages "
                    "(the fp32 path sends one)."
                )
            else:
                out.append(
                    "- 1-bit Adam's step costs no more than Adam's outside the collectives in "
                    "this run: the saved bytes are a net gain at any link speed."
                )
    zo = an.get("ours_zeroone")
    if zo:
        zc = zo["windows"]["compressed"]
        out.append(
            f"- 0/1 Adam (`var_freeze_step` {args.freeze_step}, `local_step_scaler` "
            f"{LOCAL_STEP_SCALER}, `local_step_clipper` {LOCAL_STEP_CLIPPER}): after the freeze "
            "the ranks take local steps and synchronise in 1 bit every 1, then 2, then 4 steps, "
            f"so the bytes vary per step (mean {fmt_bytes(zc['bytes']['wire'])}, from "
            f"{fmt_bytes(zc['bytes']['wire_min'])} to {fmt_bytes(zc['bytes']['wire_max'])}); "
            f"its mean step is {zc['mean_ms']:.0f} ms (median {zc['ms']:.0f} ms): "
            + (
                f"the {zc['n_local']} local steps of the window, which exchange only the 4-byte "
                f"norm, take {zc['local_ms']:.0f} ms (median), the {zc['n_synced']} that "
                f"synchronise in 1 bit {zc['synced_ms']:.0f} ms, as long as 1-bit Adam's steps. "
                "The further the interval grows (up to `local_step_clipper`), the closer 0/1 "
                "Adam comes to Adam's time on this machine while sending fewer bytes than 1-bit "
                "Adam."
                if zc["local_ms"] is not None and zc["synced_ms"] is not None
                else "every step of the window synchronises."
            )
        )
    return out


def orchestrate(args) -> int:
    n_params = sum(p.numel() for p in GPT().parameters())
    cmd = common.command_line("bench_onebit.py")
    modes = list(args.modes)
    n_steps = args.warmup + args.steps
    print(
        f"model: GPT, {n_params / 1e6:.2f}M params ({N_BLOCKS} blocks, d_model {D_MODEL}, "
        f"{N_HEADS} heads, seq {SEQ}, vocab {VOCAB}, tied embedding/head), global batch "
        f"{args.micro_batch * WORLD}, world size {WORLD}, freeze step {args.freeze_step}, "
        f"{n_steps} steps ({args.steps} timed), {args.rounds} round(s), {len(modes)} modes, "
        f"{args.threads} thread(s) per process",
        flush=True,
    )
    source = shardspeed_source()
    print(source, flush=True)
    plan = [(mode, WORLD) for mode in modes]
    results, errors, total, tmp, discarded = common.measure(
        HERE, plan, args, prefix="bench_onebit_", width=16
    )
    an = analyse(results, modes, args.freeze_step, n_steps, n_params)
    ltable, loss_notes, losses_ok = loss_table(results, modes, args.freeze_step)
    report = {
        "time_table": time_table(an, modes, args.freeze_step, n_steps),
        "bytes_table": bytes_table(an, modes),
        "loss_table": ltable,
        "loss_notes": loss_notes,
        "findings": findings(an, args, n_params),
        "source": source,
        "load_line": common.load_line(results, discarded, args),
        "settings": {m: v[0].get("settings") for (m, _w), v in results.items() if v},
        "counter": {m: a.get("counter_agrees") for m, a in an.items() if "counter_agrees" in a},
        "rank1": {
            m: all(abs(w["rank1_wire"] - w["bytes"]["wire"]) < 1 for w in a["windows"].values())
            for m, a in an.items()
        },
        "results": results,
        "errors": errors,
    }
    for title, key in (
        ("Time per step", "time_table"),
        ("Bytes per step (rank 0)", "bytes_table"),
        ("Losses (mean over the global batch)", "loss_table"),
    ):
        print(f"\n{title}:\n\n{report[key]}")
    for line in loss_notes:
        print(f"- {line}")
    print("\n".join(report["findings"]))
    print("optimizers as built:", json.dumps(report["settings"]))
    print("comms logger = counted torch.distributed bytes:", json.dumps(report["counter"]))
    print("rank 1 sends what rank 0 sends:", json.dumps(report["rank1"]))
    common.print_run_end(
        total,
        tmp,
        errors,
        load_line=report["load_line"],
        log_chars=1500,
        losses_ok=losses_ok,
        losses_where="the losses above",
        source=source,
    )
    if args.write:
        write_section(args, n_params, cmd, total, report)
        print(f"\nupdated {BENCH_MD}")
    ours_failed = [m for (m, _w) in errors if MODES[m].lib == "ours"]
    return 1 if ours_failed or not losses_ok else 0


def deepspeed_onebit_line(errors) -> str:
    """What became of DeepSpeed's 1-bit Adam in this install."""
    import importlib.util

    try:
        shipped = importlib.util.find_spec("deepspeed.runtime.fp16.onebit") is not None
    except ModuleNotFoundError:
        shipped = False
    e = errors.get(("deepspeed_onebit", WORLD))
    text = (
        "- DeepSpeed's 1-bit Adam: `deepspeed.runtime.fp16.onebit` is "
        + ("present" if shipped else "absent")
        + " in the installed DeepSpeed"
    )
    if e:
        why = error_line("deepspeed_onebit", e)
        text += f', and `deepspeed.initialize` with `"type": "OneBitAdam"` fails: {why}'
    text += (
        ". DeepSpeed 0.19.8 dropped `runtime/fp16/onebit/` (OnebitAdam, ZeroOneAdam, OnebitLamb) "
        "and its compressed backends, so there is no DeepSpeed 1-bit row; DeepSpeed Adam is the "
        "DeepSpeed baseline instead."
    )
    return text


def write_section(args, n_params: int, cmd: str, total: float, report: dict) -> None:
    results, errors = report["results"], report["errors"]
    gb = args.micro_batch * WORLD
    f = args.freeze_step
    n_steps = args.warmup + args.steps
    ws = windows(f, n_steps)
    notes = [
        f"- Model: bench_pipe.py's GPT ({n_params / 1e6:.2f}M parameters: {N_BLOCKS} pre-norm "
        f"blocks, d_model {D_MODEL}, {N_HEADS} heads, seq {SEQ}, vocab {VOCAB}, head tied to the "
        f"token embedding; fp32), the same weights and batches in every mode (bench_pipe's "
        f"`global_batches`, {gb} sequences of {SEQ} tokens a step, {args.micro_batch} a rank).",
        "- Configs, shardspeed and DeepSpeed alike: "
        f"`{json.dumps(config(args.micro_batch, 'Adam', f))}`, with the optimizer "
        f"`{json.dumps(config(args.micro_batch, 'OneBitAdam', f)['optimizer'])}` and "
        f"`{json.dumps(config(args.micro_batch, 'ZeroOneAdam', f)['optimizer'])}` for the 1-bit "
        'modes; shardspeed\'s also has `"comms_logger": {"enabled": true}` (in all three '
        "shardspeed modes, so its small cost, two clock reads per collective, is in every "
        "shardspeed row). DDP: `torch.optim.Adam(lr=3e-4)` (torch's default per-tensor loop on "
        "CPU), no clipping.",
        "- Optimizers as built: "
        + "; ".join(f"{m}: {s}" for m, s in report["settings"].items() if s)
        + ". shardspeed's Adam is torch's fused Adam(W) kernel, DeepSpeed's its C++ CPU "
        "FusedAdam; OneBitAdam and ZeroOneAdam are per-tensor Python loops.",
        f"- Each run: {n_steps} steps. Windows: warm-up = steps 2-{f} (Adam on averaged fp32 "
        f"gradients in every mode; step 1 allocates optimizer state), compressed = steps "
        f"{f + 2}-{n_steps} (step {f + 1}, the first compressed one, allocates the error buffers "
        "and is left out). For the Adam modes both windows run the same thing: their "
        "difference is the noise. ms/step is rank 0's wall time from the forward to the end "
        "of `step()`, median (and mean) over the window's steps, then median over "
        f"{args.rounds} round(s) (modes interleaved, order rotated); tokens/s = {gb} x {SEQ} / "
        "the mean ms/step (the window's time per step: 0/1 Adam's local and synchronising steps "
        "differ, and the median would show only the former); ratios are of those tokens/s, in "
        "the same window. 'inside collectives' is the "
        "comms logger's latency summed over the step (for the async gradient all-reduce, launch "
        "to wait). Threads: "
        f"{args.threads} per process; a fresh `torch.distributed.run --standalone` per run.",
        "- Bytes: per step, rank 0. shardspeed: `engine.comm_summary` (payload: the whole tensor "
        "of each collective, as `comm_volume()` counts it) and on the wire = payload x "
        "`shardspeed.comm.logger.bus_factor(op, 2)` (all-reduce 2(n-1)/n = 1, all-to-all and "
        "all-gather (n-1)/n = 0.5): what leaves the rank. DeepSpeed: torch.distributed's "
        "collectives wrapped before it is imported (same rule). DDP: computed, one fp32 "
        "all-reduce of every gradient (its reducer runs in C++). "
        + (
            "For the shardspeed modes the counted torch.distributed bytes equal the comms logger's."
            if report["counter"] and all(report["counter"].values())
            else f"Comms logger vs counted bytes agree: {report['counter']}."
        )
        + (
            " Rank 1 sends the same bytes as rank 0."
            if all(report["rank1"].values())
            else f" Rank 1 vs rank 0 bytes agree: {report['rank1']}."
        ),
        "- Losses are a sanity check, not a convergence claim: "
        f"{n_steps} steps, freeze after {f}. Every mode starts from the same weights and batch "
        "(the first losses agree within 1e-4). After the freeze the 1-bit update is not "
        "Adam's: every coordinate of the compressed momentum has the same magnitude (the "
        "tensor's RMS, with error feedback), divided by the variance frozen at step F, so "
        "over a few steps the loss can fall faster or slower than Adam's; neither says how "
        "either would end a real run (docs/compression.md: 1.05x Adam's final loss on a "
        "longer toy run).",
    ]
    notes += [f"  - {line}" for line in report["loss_notes"]]
    notes += report["findings"]
    notes.append(deepspeed_onebit_line(errors))
    # DeepSpeed's 1-bit Adam failing has its own note above.
    others = {k: e for k, e in errors.items() if k[0] != "deepspeed_onebit"}
    notes += common.closing_notes(report["load_line"], results, [], args, others)
    blocks = [
        (
            "Time per step (rank 0; windows: "
            + ", ".join(window_label(k, w) for k, w in ws.items())
            + "):",
            report["time_table"],
        ),
        (
            "Bytes per step and rank (warm-up: a step of the warm-up window; compressed: the "
            "mean over the compressed window):",
            report["bytes_table"],
        ),
        (
            f"Losses (mean over the global batch; F = {f}, T = {n_steps}; first round):",
            report["loss_table"],
        ),
    ]
    section = common.section_text(SECTION_TITLE, cmd, total, blocks, notes, source=report["source"])
    common.write_markdown(section, SECTION_TITLE, BENCH_MD)


def main(argv=None) -> int:
    p = common.parser(__doc__)
    # --warmup is set from --freeze-step (the orchestrator passes it to the workers).
    p.set_defaults(warmup=None, steps=16)
    p.add_argument(
        "--freeze-step",
        type=int,
        default=FREEZE_STEP,
        help="OneBitAdam's freeze_step and ZeroOneAdam's var_freeze_step (default "
        f"{FREEZE_STEP}); steps 2..F are the warm-up window, the --steps steps after step F+1 "
        "the compressed (timed) window",
    )
    common.add_modes_arg(p, MODES)
    common.add_noise_args(p, budget=400.0)
    common.add_smoke_arg(p, "every mode runs: 1 round, freeze step 2, 3 compressed steps")
    common.add_write_args(p)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.warmup is not None:
        p.error("--warmup is set by --freeze-step here (freeze step + 1 untimed steps)")
    common.apply_smoke(p, args, rounds=1, freeze_step=2, steps=3, wait_idle=0.0, retries=0)
    if args.freeze_step < 2 or args.steps < 1:
        p.error("--freeze-step must be >= 2 (a warm-up window) and --steps >= 1")
    args.warmup = args.freeze_step + 1
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
