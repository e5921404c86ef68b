"""Optimizer offload (none, cpu, nvme, pipelined nvme); `--headline`: 2.5B parameters from NVMe.

.venv/bin/python benchmarks/bench_offload.py [--headline] [--quick] [--write]
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import harness as h
import render

NVME_MODES = ("nvme", "nvme_pipelined")
SCENARIO = h.Scenario(
    name="offload",
    section="## Optimizer offload (CPU and NVMe)",
    modes={"none": 2, "cpu": 2, "nvme": 2, "nvme_pipelined": 2, "headline": 2},
    warmup=2,
    steps=8,
    rounds=1,
    micro_batch=2,
    default_modes=("none", "cpu", *NVME_MODES),
    presets={"--headline": ("headline",)},
    options={
        "--pieces": dict(type=int, default=8, help="master tensors per rank (default 8)"),
        "--small": dict(action="store_true", help="the ~5M-parameter model (what --quick runs)"),
    },
    quick={"warmup": 2, "steps": 2, "rounds": 1, "small": True},
)
# DeepSpeed's aio defaults, written out so that the config in BENCHMARKS.md is the whole story.
AIO = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1}
AIO |= {"single_submit": False, "overlap_events": True}
# The headline model (about 2.46B parameters) and its steps; --quick: a tiny one.
HEADLINE = dict(n_embd=2560, n_layer=31, n_head=20, block_size=64)
HEADLINE_SMALL = dict(n_embd=64, n_layer=2, n_head=2, block_size=64)
HEADLINE_STEPS = 3


def piece_limit(sizes: list[int], pieces: int) -> int:
    """The smallest `sub_group_size` that cuts tensors of these sizes into <= `pieces` runs."""

    def count(limit: int) -> int:
        n, run = 1, 0
        for s in sizes:
            if run and run + s > limit:
                n, run = n + 1, 0
            run += s
        return n

    lo, hi = 1, sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) <= pieces else (mid + 1, hi)
    return lo


def offload_config(mode: str, args, sizes: list[int], swap: str) -> dict:
    cfg = h.config(args.micro_batch, 2)
    zero = cfg["zero_optimization"]
    zero["sub_group_size"] = piece_limit(sizes, args.pieces)
    if mode == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif mode in NVME_MODES:
        pipelined = mode == "nvme_pipelined"
        offload = {"device": "nvme", "nvme_path": swap, "buffer_count": 4}
        zero["offload_optimizer"] = offload | {
            "pipeline_read": pipelined,
            "pipeline_write": pipelined,
        }
        cfg["aio"] = dict(AIO)
    return cfg


def headline_config(swap: str) -> dict:
    """Stage 3, one block whole at a time, no prefetch; masters and moments on NVMe."""
    cfg = h.config(1, 3)
    zero = {"reduce_bucket_size": 20_000_000, "stage3_prefetch_bucket_size": 0}
    zero |= {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 110_000_000}
    nvme = {"device": "nvme", "nvme_path": swap}
    cfg["zero_optimization"] |= zero | {"sub_group_size": 100_000_000}
    cfg["zero_optimization"] |= {"offload_optimizer": nvme, "offload_param": dict(nvme)}
    return cfg


class _Transfer:
    __slots__ = ("done", "nbytes", "start", "waited")

    def __init__(self, start: float, nbytes: int):
        self.start, self.done, self.nbytes, self.waited = start, None, nbytes, 0.0


class _TimedFuture(Future):
    """A swapper future that notes when it completed and how long `result()` blocked."""

    def set_result(self, result):
        rec = getattr(self, "_bench", None)
        if rec is not None and rec.done is None:
            rec.done = time.perf_counter()
        super().set_result(result)

    def result(self, timeout=None):
        t0 = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            t1 = time.perf_counter()
            rec = getattr(self, "_bench", None)
            if rec is not None:
                rec.waited += t1 - t0
                if rec.done is None:  # completed without passing through set_result above
                    rec.done = t1


class StepProbe:
    """Times the inner optimizer's `step()` calls and, with NVMe offload, every swap transfer."""

    def __init__(self, engine):
        self.adam_s = 0.0
        self.transfers: list[_Transfer] = []
        inner = engine.optimizer.optimizer
        inner_step = inner.step

        def timed_step(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner_step(*a, **kw)
            finally:
                self.adam_s += time.perf_counter() - t0

        inner.step = timed_step
        swapped = getattr(engine.optimizer, "swapped", None)
        self.direct = None
        if swapped is not None:
            self.direct = swapped.swapper.direct
            swapped.swapper.read = self._tracked(swapped.swapper.read)
            swapped.swapper.write = self._tracked(swapped.swapper.write)

    def _tracked(self, submit):
        def call(key, tensor):
            rec = _Transfer(time.perf_counter(), tensor.numel() * tensor.element_size())
            future = submit(key, tensor)
            future._bench = rec
            future.__class__ = _TimedFuture
            if future.done() and rec.done is None:
                rec.done = time.perf_counter()
            self.transfers.append(rec)
            return future

        return call

    def take(self) -> dict:
        """This step's numbers (since the last call), and a fresh start."""
        recs, self.transfers = self.transfers, []
        adam, self.adam_s = self.adam_s, 0.0
        now = time.perf_counter()
        spans = sorted((r.start, r.done if r.done is not None else now) for r in recs)
        busy, end = 0.0, float("-inf")
        for a, b in spans:  # the union of the in-flight intervals
            if b > end:
                busy += b - max(a, end)
                end = b
        out = {"adam_s": adam, "io_waited_s": sum(r.waited for r in recs), "io_busy_s": busy}
        out |= {"io_sum_s": sum(b - a for a, b in spans), "io_bytes": sum(r.nbytes for r in recs)}
        return out | {"io_transfers": len(recs)}


def worker(mode: str, args) -> dict:
    rank, _world = h.setup(args.threads)
    # One swap directory per run (MASTER_PORT is the same on both ranks), removed at the end.
    swap = Path("/tmp") / f"bench_offload_swap_{os.environ['MASTER_PORT']}"
    swap.mkdir(parents=True, exist_ok=True)
    try:
        result = (headline if mode == "headline" else offload_steps)(rank, args, mode, str(swap))
    finally:
        h.barrier()
        if rank == 0:
            shutil.rmtree(swap, ignore_errors=True)
    return result | {"peak_rss_mib": h.peak_rss_mib()}


def offload_steps(rank: int, args, mode: str, swap: str) -> dict:
    import shardspeed

    model = h.build_lm() if args.small else h.build_lm(**h.LM_100M)
    sizes = [p.numel() for p in model.parameters()][::-1]  # the ZeRO layout's order
    cfg = offload_config(mode, args, sizes, swap)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    probe = StepProbe(engine)
    losses, per_step = [], []
    for i, (x, y) in enumerate(h.random_batches(rank, args.warmup + args.steps, args.micro_batch)):
        if i == args.warmup:
            probe.take()
            window = h.Window().start()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        losses.append(loss.item())
        if i >= args.warmup:
            per_step.append({"step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "engine_step_s": t2 - t1})
            per_step[-1].update(probe.take())
    window.stop()
    masters = engine.optimizer.masters
    result = window.result() | {"losses": losses, "per_step": per_step}
    result |= {"memory": engine.memory_breakdown(), "pieces": len(masters)}
    result["largest_piece"] = max(m.numel() for m in masters)
    result["sub_group_size"] = cfg["zero_optimization"]["sub_group_size"]
    result["o_direct"] = probe.direct
    engine.destroy()  # removes the swap files
    return result


def headline(rank: int, args, _mode: str, swap: str) -> dict:
    """Built under zero.Init (never whole in one process); seconds of each step, barrier-timed."""
    import shardspeed

    shape = HEADLINE_SMALL if args.small else HEADLINE
    start = time.perf_counter()
    with shardspeed.zero.Init():
        model = h.build_lm(**shape)
    engine, *_ = shardspeed.initialize(model=model, config=headline_config(swap))
    built = time.perf_counter() - start
    times, losses = [], []
    for x, y in h.random_batches(rank, HEADLINE_STEPS, 1, seq=shape["block_size"]):
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        h.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    memory = engine.memory_breakdown()
    engine.destroy()
    params = sum(p.ds_numel for p in model.parameters())
    result = {"params": params, "build_s": built, "step_s": times, "losses": losses}
    return result | {"on_nvme": memory["on_nvme"], "in_memory": memory["total"]}


def summary(runs: list[dict]) -> dict:
    """Per step the slowest rank's step time; the parts and I/O; hidden share of the I/O."""
    med = h.median
    per_rank = [[[x["step_s"] for x in rk["per_step"]] for rk in r["ranks"]] for r in runs]
    steps = [max(s) for ranks in per_rank for s in zip(*ranks)]
    each = [s for r in runs for rk in r["ranks"] for s in rk["per_step"]]
    waited, busy = sum(s["io_waited_s"] for s in each), sum(s["io_busy_s"] for s in each)
    ranks = runs[0]["ranks"]

    def ms(key: str) -> float:
        return 1000 * med(s[key] for s in each)

    out = {"step_ms": 1000 * med(steps)}
    out["range"] = f"{1000 * min(steps):.0f} - {1000 * max(steps):.0f}"
    out |= {"fwd_bwd_ms": ms("fwd_bwd_s"), "engine_step_ms": ms("engine_step_s")}
    out |= {"adam_ms": ms("adam_s"), "waited_ms": ms("io_waited_s")}
    out["rest_ms"] = 1000 * med(s["engine_step_s"] - s["adam_s"] - s["io_waited_s"] for s in each)
    out |= {"busy_ms": ms("io_busy_s"), "sum_ms": ms("io_sum_s")}
    out["hidden"] = 1 - waited / busy if busy > 0 else None
    out["mb_per_step"] = med(s["io_bytes"] for s in each) / 1e6
    out["mb_s"] = sum(s["io_bytes"] for s in each) / busy / 1e6 if busy > 0 else None
    out["transfers"] = med(s["io_transfers"] for s in each)
    for kind in ("on_nvme", "on_device"):
        out[kind] = max(rk["memory"][kind] for rk in ranks) / 2**30
    out["pieces"] = f"{ranks[0]['pieces']} ({max(rk['largest_piece'] for rk in ranks):,})"
    return out | {"o_direct": ranks[0]["o_direct"]}


def offload_tables(results: dict) -> dict:
    modes = [m for m in ("none", "cpu", *NVME_MODES) if render.runs(results, m)]
    sums = {m: summary(render.runs(results, m)) for m in modes}
    base = sums.get("none")
    ref = [rk["losses"] for rk in render.runs(results, "none")[0]["ranks"]] if base else None
    main, detail = [], []
    for m, s in sums.items():
        rs = render.runs(results, m)
        same = ref and all([rk["losses"] for rk in r["ranks"]] == ref for r in rs)
        hidden = s["hidden"] and 100 * s["hidden"]
        cells = [render.fmt(s["step_ms"]), s["range"]]
        cells += [render.ratio(s["step_ms"], base and base["step_ms"])]
        cells += [render.fmt(max(r["peak_rss_mib"] for r in rs))]
        cells += [render.fmt(s["on_device"], ".2f"), render.fmt(s["on_nvme"], ".2f")]
        cells += ["-" if hidden is None else f"{hidden:.0f}%"]
        cells += ["-" if ref is None else "bit-equal" if same else "DIFFER"]
        main.append([m + " *" * any(r.get("noisy") for r in rs), *cells])
        io = [s["busy_ms"], s["sum_ms"], s["transfers"], s["mb_per_step"], s["mb_s"]]
        io = [render.fmt(v) for v in io] + ["yes" if s["o_direct"] else "no"]
        keys = ("fwd_bwd_ms", "engine_step_ms", "adam_ms", "waited_ms", "rest_ms")
        cells = [render.fmt(s[k]) for k in keys] + (io if m in NVME_MODES else ["-"] * 6)
        loads = ", ".join(render.fmt(r.get("other_load"), ".2f") for r in rs)
        detail.append([m, s["pieces"], *cells, loads])
    head = ["mode", "step ms (median)", "min - max", "ratio to none", "peak RSS per rank (MiB)"]
    head += ["on_device GiB", "on_nvme GiB", "I/O hidden behind compute", "losses vs none"]
    parts = ["mode", "pieces per rank (largest, elements)", "fwd+bwd ms", "`engine.step()` ms"]
    parts += ["Adam `step()` ms", "waited on I/O ms", "rest of `engine.step()` ms"]
    parts += ["I/O in flight ms", "sum of transfer times ms", "transfers", "MB moved per step"]
    parts += ["MB/s while in flight", "O_DIRECT", "other load (cores)"]
    out = {"modes": render.table(head, main, "lrlrrrrrl")}
    out["parts"] = render.table(parts, detail, "llrrrrrrrrrrll")
    return out | {"run": render.run_line(results)}


def headline_table(results: dict) -> dict:
    rs = render.runs(results, "headline")
    if not rs:
        return {}
    ranks, gib = rs[0]["ranks"], 2**30
    memory = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    states = 16 * ranks[0]["params"]
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    rss = [r["peak_rss_mib"] * 2**20 for r in ranks]
    sizes = [states, memory, sum(r["in_memory"] for r in ranks), sum(r["on_nvme"] for r in ranks)]
    states_gib, memory_gib, held, nvme = (f"{x / gib:.1f} GiB" for x in sizes)
    row = [f"{ranks[0]['params']:,}", states_gib, memory_gib, f"{states / memory:.2f}x"]
    per_rank = ", ".join(f"{x / gib:.1f}" for x in rss) + " GiB"
    row += [", ".join(f"{t:.0f}" for t in step_s), per_rank, f"{sum(rss) / gib:.1f} GiB"]
    row += [held, nvme, ", ".join(f"{x:.3f}" for x in ranks[0]["losses"])]
    head = "parameters | fp32 Adam model states (16 B/param) | machine memory | states / memory"
    head += " | seconds per step (each step) | peak RSS per rank | peak RSS, both ranks"
    head += " | in memory after the steps, both ranks | on NVMe, both ranks | losses (rank 0)"
    build = f" Model build and `initialize`: {ranks[0]['build_s']:.0f}s."
    out = {"headline": render.table(head, [row], "rrrrlrrrrl")}
    return out | {"headline-run": render.run_line(results) + build}


def tables(results: dict) -> dict:
    out = headline_table(results)
    if any(render.runs(results, m) for m in ("none", "cpu", *NVME_MODES)):
        out |= offload_tables(results)
    return out


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_offload.py")
