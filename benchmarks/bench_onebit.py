"""1-bit Adam and 0/1 Adam vs Adam at world size 2 (shardspeed, DDP, DeepSpeed).

.venv/bin/python benchmarks/bench_onebit.py [--quick] [--write]
"""

from __future__ import annotations

import statistics
import time

import harness as h
import render

# mode -> (library, optimizer type)
MODES = {"ours_adam": ("ours", "Adam"), "ours_onebit": ("ours", "OneBitAdam")}
MODES |= {"ours_zeroone": ("ours", "ZeroOneAdam"), "ddp": ("ddp", "Adam")}
MODES |= {"deepspeed_adam": ("deepspeed", "Adam"), "deepspeed_onebit": ("deepspeed", "OneBitAdam")}
SCENARIO = h.Scenario(
    name="onebit",
    section="## 1-bit Adam and 0/1 Adam vs Adam (world size 2)",
    modes=dict.fromkeys(MODES, 2),
    warmup=6,
    steps=16,
    quick={"warmup": 3, "steps": 3, "rounds": 1},
)


def config(optimizer: str, freeze: int) -> dict:
    params: dict = {"lr": h.LR}
    if optimizer == "OneBitAdam":
        params |= {"freeze_step": freeze, "comm_backend_name": "gloo"}
    elif optimizer == "ZeroOneAdam":
        params |= {"var_freeze_step": freeze, "local_step_scaler": 4, "local_step_clipper": 4}
        params["comm_backend_name"] = "gloo"
    # No clipping: 1-bit Adam's momentum must not be rescaled against the frozen variance.
    return h.config(8, optimizer={"type": optimizer, "params": params}, gradient_clipping=0.0)


def worker(mode: str, args) -> dict:
    import torch.distributed as dist

    lib, optimizer = MODES[mode]
    comm = h.CommCounter(dist)  # before shardspeed or DeepSpeed binds any collective
    rank, _world = h.setup(args.threads)
    n, freeze = args.warmup + args.steps, args.warmup - 1
    batches = h.rank_slice(h.progression_batches(n, 16), rank, 8)
    model = h.tied_gpt(lambda i: h.gpt_block())
    if lib == "ddp":
        forward, backward, update, _opt = h.trainer("ddp", model, adam="Adam", clip=False)
        summary = dict
    else:
        cfg = config(optimizer, freeze)
        if lib == "ours":
            cfg["comms_logger"] = {"enabled": True}
        else:
            h.library("deepspeed").init_distributed(dist_backend="gloo")
        forward, backward, update, engine = h.trainer(lib, model, cfg)

        def summary():
            got = getattr(engine, "comm_summary", None) or {}
            return {op: [s["count"], s["bytes"], s["latency_ms"]] for op, s in got.items()}

    rec = {k: [] for k in ("steps_ms", "fb_ms", "opt_ms", "summary", "counted", "losses")}

    def step(x, y):
        before = comm.snapshot()
        t0 = time.perf_counter()
        loss = forward(x, y)
        backward(loss)
        t1 = time.perf_counter()
        update()
        t2 = time.perf_counter()
        rec["steps_ms"].append(1e3 * (t2 - t0))
        rec["fb_ms"].append(1e3 * (t1 - t0))
        rec["opt_ms"].append(1e3 * (t2 - t1))
        rec["summary"].append(summary())
        calls, nbytes = before["calls"], before["bytes"]
        changed = [k for k, c in comm.calls.items() if c != calls.get(k, 0)]
        counts = {k: comm.calls[k] - calls.get(k, 0) for k in changed}
        rec["counted"].append({k: [counts[k], comm.bytes[k] - nbytes.get(k, 0)] for k in changed})
        rec["losses"].append(loss.detach())
        return loss

    comm.active = True
    result = h.timed(step, batches, args.warmup, args.steps, 16 * h.SEQ)
    losses = h.loss_curve(rec.pop("losses"))
    # tokens/s from the mean step of the compressed window: 0/1 Adam's steps are not alike.
    result["tokens_per_s"] = 1e3 * 16 * h.SEQ / statistics.fmean(rec["steps_ms"][args.warmup :])
    params = h.local_numel(model.parameters())
    return result | rec | losses | {"freeze": freeze, "lib": lib, "params": params}


def windows(freeze: int, n: int) -> dict[str, slice]:
    """Warm-up: steps 2..F; compressed: F+2..T (steps 1 and F+1 allocate state)."""
    return {"warm-up": slice(1, freeze), "compressed": slice(freeze + 1, n)}


def step_bytes(r: dict) -> tuple[list[dict], str]:
    """Per step: {op: [calls, payload bytes, ms]} and where it comes from."""
    if r["lib"] == "ours":
        return r["summary"], "comms logger (`engine.comm_summary`)"
    if r["lib"] == "deepspeed":
        steps = [{op: [c, b, None] for op, (c, b) in s.items()} for s in r["counted"]]
        return steps, "torch.distributed calls counted"
    computed = [{"all_reduce": [None, 4 * r["params"], None]} for _ in r["steps_ms"]]
    return computed, "computed (4 B x P)"


def window_bytes(steps: list[dict], w: slice) -> dict:
    """Mean per step over the window: payload, wire bytes per rank, calls by op, comm ms."""
    from shardspeed.comm.logger import bus_factor

    sel = steps[w] or [{}]
    wire = [sum(b * bus_factor(op, 2) for op, (_c, b, _ms) in s.items()) for s in sel]
    calls: dict[str, float] = {}
    for s in sel:
        for op, (c, _b, _ms) in s.items():
            calls[op] = calls.get(op, 0) + (c or 0) / len(sel)
    timed = [s for s in sel if s and all(v[2] is not None for v in s.values())]
    ms = [sum(v[2] for v in s.values()) for s in timed]
    out = {"payload": statistics.fmean(sum(b for _c, b, _m in s.values()) for s in sel)}
    out |= {"wire": statistics.fmean(wire), "wire_min": min(wire), "wire_max": max(wire)}
    out["calls"] = {k: v for k, v in calls.items() if v}
    return out | {"comm_ms": statistics.median(ms) if ms else None}


def size(b: float) -> str:
    if b >= 2**20:
        return f"{b / 2**20:.2f} MiB"
    return f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b:.0f} B"


def time_table(results: dict) -> str:
    rows, tps = [], {}
    for mode, rs in results["runs"].items():
        for name, w in windows(rs[0]["freeze"], len(rs[0]["steps_ms"])).items() if rs else ():

            def median_ms(key: str, w=w, rs=rs) -> str:
                return f"{statistics.median(statistics.median(r[key][w]) for r in rs):.0f}"

            mean_ms = statistics.median(statistics.fmean(r["steps_ms"][w]) for r in rs)
            tps[mode, name] = 1e3 * 16 * h.SEQ / mean_ms
            comm = window_bytes(rs[0]["summary"], w)["comm_ms"] if rs[0]["lib"] == "ours" else None
            per_round = ", ".join(f"{statistics.median(r['steps_ms'][w]):.0f}" for r in rs)
            cells = [f"{name} (steps {w.start + 1}-{w.stop})", median_ms("steps_ms"), per_round]
            cells += [f"{mean_ms:.0f}", f"{tps[mode, name]:.0f}", name]
            cells += [median_ms("fb_ms"), median_ms("opt_ms"), render.fmt(comm, ".1f")]
            rows.append([mode, *cells])
    for row in rows:  # ratios in the same window
        name, mode = row.pop(6), row[0]
        row[6:6] = [render.ratio(tps[mode, name], tps.get((b, name))) for b in ("ddp", "ours_adam")]
    head = "mode | window | ms/step (median) | per round | ms/step (mean)"
    head += " | tokens/s (from the mean) | / DDP | / shardspeed Adam | forward + backward (ms) | optimizer step (ms)"
    return render.table(head + " | inside collectives (ms, comms logger)", rows, "llrlrrrrrrr")


def bytes_table(results: dict) -> str:
    def calls(d):
        return ", ".join(f"{v:.3g} x {op}" for op, v in sorted(d.items())) or "-"

    rows = []
    for mode in render.measured(results):
        rs = results["runs"][mode]
        steps, source = step_bytes(rs[0]["ranks"][0])
        ws = windows(rs[0]["freeze"], len(steps))
        wu, c = (window_bytes(steps, ws[k]) for k in ("warm-up", "compressed"))
        spread = f" ({size(c['wire_min'])} - {size(c['wire_max'])})"
        wire_c = size(c["wire"]) + spread * (c["wire_max"] - c["wire_min"] > 1)
        cells = [calls(wu["calls"]), size(wu["payload"]), size(wu["wire"]), calls(c["calls"])]
        cells += [size(c["payload"]), wire_c, render.ratio(wu["wire"], c["wire"], ".1f")]
        rows.append([mode, source, *cells])
    head = "mode | counted by | warm-up step: collectives | payload | on the wire per rank"
    head += " | compressed step: collectives (mean per step) | payload | on the wire per rank"
    return render.table(head + " | wire bytes, warm-up / compressed", rows, "lllrrlrrr")


def loss_table(results: dict) -> str:
    ref = render.runs(results, "ours_adam")
    rows = []
    for mode, rs in results["runs"].items():
        if rs:
            losses, f = rs[0]["losses"], rs[0]["freeze"]
            cells = [f"{losses[i]:.4f}" for i in (0, f - 1, f, -1)]
            final = render.ratio(losses[-1], ref[0]["losses"][-1] if ref else None)
            rows.append([mode, *cells, final])
    head = "mode | step 1 | step F | step F+1 | final (step T) | final / shardspeed Adam's final"
    return render.table(head, rows, "lrrrrr")


def tables(results: dict) -> dict:
    out = {"time": time_table(results), "bytes": bytes_table(results)}
    return out | {"losses": loss_table(results), "run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_onebit.py")
