"""Optimizer offload: training step time with optimizer states in memory, "on the CPU", or on NVMe.

One invocation measures, on the GPT-style model of the other benchmarks scaled up to about 100M
parameters (fp32, AdamW, gradient clipping 1.0), ZeRO stage 2 at world size 2, four modes that
differ only in ``zero_optimization.offload_optimizer``:

  none            no offload
  cpu             ``{"device": "cpu"}`` (without a GPU nothing moves: expected equal to none)
  nvme            ``{"device": "nvme", ...}``, no pipelining: each piece's Adam moments are read
                  before its step and written after it, waiting for both
  nvme_pipelined  the same with ``pipeline_read`` and ``pipeline_write``: the next piece is read,
                  and the last one written, while a piece steps

Every mode gets the same ``sub_group_size``, chosen so each rank has about ``--pieces`` (8) master
tensors (pieces), and the same ``aio`` section; the swap files go under ``--nvme-dir`` (``/tmp``,
the local disk).

Per mode, for the timed steps after the warm-up (per step the slowest rank):

  - the training step time (forward + backward + ``engine.step()``), median, and its ratio to none;
  - its parts: forward + backward, ``engine.step()``, the inner torch optimizer's ``step()`` calls
    (Adam's arithmetic), and for the NVMe modes the time the step waited on swap transfers;
  - peak RSS per rank (``ru_maxrss``, max over ranks) and ``engine.memory_breakdown()``
    (``on_device``, ``on_nvme``);
  - for the NVMe modes, the I/O: bytes moved, the time transfers were in flight (the union over
    the step of each transfer's interval from submission to completion), and the share of that
    time hidden behind compute: ``1 - waited / in flight``. The waits are the calls to
    ``Future.result()`` on the swapper's futures, which is where ``SwappedStates`` blocks (read
    before a piece steps, write-behind drained); both are measured by wrapping the swapper's
    ``read`` / ``write`` in the worker (no change to shardspeed);
  - whether every loss equals no offload's, bit for bit.

The script is both the orchestrator and the worker: every run is
``python -m torch.distributed.run ... bench_offload.py --worker MODE`` (gloo on CPU), started,
checked for other load and rerun by ``common.measure``.

    .venv/bin/python benchmarks/bench_offload.py            # measure, print the tables
    .venv/bin/python benchmarks/bench_offload.py --write    # ... and update BENCHMARKS.md
    .venv/bin/python benchmarks/bench_offload.py --small    # ~5M parameters, few steps: smoke

The default run (one round per mode of 2 warm-up and 8 timed steps) should take about 4 minutes on
an idle 2-core machine, more when other work forces reruns (none after --budget, 300 s); --small
about 30 seconds.

Options: ``--world 1`` runs stage 1 at world size 1 instead; ``--modes`` a subset; ``--pieces N``;
``--buffer-count N``; ``--nvme-dir DIR``; ``--rounds`` / ``--warmup`` / ``--steps`` /
``--micro-batch`` / ``--threads``; the load-noise options of the other benchmarks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import common
from common import BENCH_MD, SEQ, VOCAB

HERE = Path(__file__).resolve()
SECTION_TITLE = "## Optimizer offload (CPU and NVMe)"
ENV_KEY = "SHARDSPEED_BENCH_OFFLOAD"  # the worker's settings beyond run_one's command line
MIB = 2**20
MB = 1e6

MODES = ("none", "cpu", "nvme", "nvme_pipelined")
NVME_MODES = ("nvme", "nvme_pipelined")

# The model of common.build_model, scaled through its shape constants (98.5M parameters), and the
# unchanged one (about 5M) for --small.
FULL = {
    "shape": {"D_MODEL": 768, "N_LAYERS": 13, "N_HEADS": 12},
    "rounds": 1,
    "warmup": 2,
    "steps": 8,
    "micro_batch": 2,
}
SMALL = {
    "shape": {"D_MODEL": common.D_MODEL, "N_LAYERS": common.N_LAYERS, "N_HEADS": common.N_HEADS},
    "rounds": 1,
    "warmup": 2,
    "steps": 4,
    "micro_batch": 2,
}
# DeepSpeed's aio defaults, written out so the config in the notes is the whole story.
AIO = {
    "block_size": 1048576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
}


def piece_limit(sizes: list[int], pieces: int) -> int:
    """The smallest ``sub_group_size`` for which runs of whole tensors of these sizes (cut greedily
    in the given order, as the ZeRO layout does) number at most `pieces`."""

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


def config(mode: str, micro_batch: int, stage: int, spec: dict) -> dict:
    cfg = common.ds_config(micro_batch, stage)
    zero = cfg["zero_optimization"]
    zero["sub_group_size"] = spec["sub_group_size"]
    if mode == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif mode in NVME_MODES:
        pipelined = mode == "nvme_pipelined"
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": spec["nvme_path"],
            "buffer_count": spec["buffer_count"],
            "pipeline_read": pipelined,
            "pipeline_write": pipelined,
        }
        cfg["aio"] = dict(AIO)
    return cfg


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


class _Transfer:
    __slots__ = ("done", "nbytes", "start", "waited")

    def __init__(self, start: float, nbytes: int):
        self.start, self.done, self.nbytes, self.waited = start, None, nbytes, 0.0


class _TimedFuture(Future):
    """A swapper future that notes when it completed and how long ``result()`` blocked.

    Futures the swapper returns are switched to this class (no new state but one attribute), so
    ``SwappedStates`` waits through ``result()`` here, unchanged."""

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
    """Times the inner optimizer's ``step()`` calls and, with NVMe offload, every swap transfer."""

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
            swapper = swapped.swapper
            self.direct = swapper.direct
            swapper.read = self._tracked(swapper.read)
            swapper.write = self._tracked(swapper.write)

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
        return {
            "adam_s": adam,
            "io_waited_s": sum(r.waited for r in recs),
            "io_busy_s": busy,
            "io_sum_s": sum(b - a for a, b in spans),
            "io_bytes": sum(r.nbytes for r in recs),
            "io_transfers": len(recs),
        }


def set_shape(shape: dict) -> None:
    for key, value in shape.items():
        setattr(common, key, value)  # build_model reads them when called


def worker(args) -> None:
    spec = json.loads(os.environ[ENV_KEY])
    mode = args.worker
    import torch
    import torch.distributed as dist

    rank, world = common.worker_setup(args.threads)
    set_shape(spec["shape"])
    import shardspeed

    model = common.build_model()
    n_params = sum(p.numel() for p in model.parameters())
    cfg = config(mode, args.micro_batch, spec["stage"], spec)
    engine, _opt, _, _ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    probe = StepProbe(engine)
    batches = common.make_batches(rank, args.warmup + args.steps, args.micro_batch)

    losses, per_step = [], []
    for x, y in batches[: args.warmup]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    probe.take()
    dist.barrier()
    busy0, cpu0 = common.machine_busy_s(), time.process_time()
    t_start = time.perf_counter()
    for x, y in batches[args.warmup :]:
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        losses.append(loss.item())
        per_step.append({"step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "engine_step_s": t2 - t1})
        per_step[-1].update(probe.take())
    dist.barrier()
    elapsed = time.perf_counter() - t_start
    busy1, cpu1 = common.machine_busy_s(), time.process_time()

    breakdown = engine.memory_breakdown()
    masters = engine.optimizer.masters
    result = {
        "mode": mode,
        "world_size": world,
        "rank": rank,
        "stage": spec["stage"],
        "threads": torch.get_num_threads(),
        "params": n_params,
        "steps": args.steps,
        "elapsed_s": elapsed,
        "tokens_per_s": args.steps * args.micro_batch * SEQ * world / elapsed,
        "step_ms": 1000 * elapsed / args.steps,
        "machine_busy_s": busy1 - busy0,
        "own_cpu_s": cpu1 - cpu0,
        "losses": losses,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "per_step": per_step,
        "memory": breakdown,
        "pieces": len(masters),
        "largest_piece": max(m.numel() for m in masters),
        "o_direct": probe.direct,
        "peak_rss_mib": common.peak_rss_mib(),
        "torch": torch.__version__,
    }
    engine.destroy()  # removes the swap files
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


def model_sizes(shape: dict) -> list[int]:
    """Parameter sizes in the order the ZeRO layout lays them out (reverse model order)."""
    d, n = shape["D_MODEL"], shape["N_LAYERS"]
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    sizes = [VOCAB * d, SEQ * d, *block * n, d, d, VOCAB * d]
    return sizes[::-1]


def filesystem(path: Path) -> str:
    proc = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", str(path)],
        capture_output=True,
        text=True,
    )
    parts = proc.stdout.split()
    return f"{parts[0]} on {parts[1]}" if proc.returncode == 0 and len(parts) == 2 else "unknown"


def per_step(runs: list[dict], key: str, over_ranks=max) -> list[float]:
    """`key` of every timed step of every run, `over_ranks` of the ranks' values of each step."""
    out = []
    for r in runs:
        for steps in zip(*[rk["per_step"] for rk in r["ranks"]]):
            out.append(over_ranks(s[key] for s in steps))
    return out


def summary(runs: list[dict]) -> dict:
    median = common.median
    steps = per_step(runs, "step_s")
    rank_steps = [s for r in runs for rk in r["ranks"] for s in rk["per_step"]]
    waited = sum(s["io_waited_s"] for s in rank_steps)
    busy = sum(s["io_busy_s"] for s in rank_steps)
    moved = sum(s["io_bytes"] for s in rank_steps)
    ranks = runs[0]["ranks"]
    return {
        "step_ms": 1000 * median(steps),
        "step_ms_min": 1000 * min(steps),
        "step_ms_max": 1000 * max(steps),
        "round_ms": [1000 * median(per_step([r], "step_s")) for r in runs],
        "fwd_bwd_ms": 1000 * median([s["fwd_bwd_s"] for s in rank_steps]),
        "engine_step_ms": 1000 * median([s["engine_step_s"] for s in rank_steps]),
        "adam_ms": 1000 * median([s["adam_s"] for s in rank_steps]),
        "waited_ms": 1000 * median([s["io_waited_s"] for s in rank_steps]),
        "rest_ms": 1000
        * median([s["engine_step_s"] - s["adam_s"] - s["io_waited_s"] for s in rank_steps]),
        "busy_ms": 1000 * median([s["io_busy_s"] for s in rank_steps]),
        "sum_ms": 1000 * median([s["io_sum_s"] for s in rank_steps]),
        "hidden": 1 - waited / busy if busy > 0 else None,
        "mb_per_step": median([s["io_bytes"] for s in rank_steps]) / MB,
        "mb_s": moved / busy / MB if busy > 0 else None,
        "transfers": median([s["io_transfers"] for s in rank_steps]),
        "rss": max(r["peak_rss_mib"] for r in runs),
        "on_nvme": max(rk["memory"]["on_nvme"] for rk in ranks),
        "on_device": max(rk["memory"]["on_device"] for rk in ranks),
        "states": max(rk["memory"]["optimizer_states"] for rk in ranks),
        "pieces": sorted({rk["pieces"] for rk in ranks}),
        "largest": max(rk["largest_piece"] for rk in ranks),
        "o_direct": ranks[0]["o_direct"],
        "load": [r["foreign_cores"] for r in runs],
        "noisy": any(r.get("noisy") for r in runs),
    }


def losses_text(runs: list[dict], base: list[dict] | None) -> str:
    if not base:
        return "-"
    ref = [rk["losses"] for rk in base[0]["ranks"]]
    same = all([rk["losses"] for rk in r["ranks"]] == ref for r in runs)
    return "bit-equal" if same else "DIFFER"


def tables(results: dict, errors: dict, world: int) -> tuple[str, str]:
    sums = {mode: summary(v) for (mode, _w), v in results.items() if v}
    base = sums.get("none")
    base_runs = results.get(("none", world))

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f}"

    lines = [
        "| mode | step ms (median) | min - max | ratio to none | peak RSS per rank (MiB) "
        "| on_device GiB | on_nvme GiB | I/O hidden behind compute | losses vs none |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for (mode, _w), runs in results.items():
        s = sums.get(mode)
        if s is None:
            err = errors.get((mode, world), {}).get("error", "not run")
            lines.append(f"| {mode} | error: {err} |" + " - |" * 7)
            continue
        ratio = f"{s['step_ms'] / base['step_ms']:.3f}" if base else "n/a"
        hidden = f"{100 * s['hidden']:.0f}%" if s["hidden"] is not None else "-"
        lines.append(
            f"| {mode}{' *' if s['noisy'] else ''} | {s['step_ms']:.0f} | "
            f"{s['step_ms_min']:.0f} - {s['step_ms_max']:.0f} | {ratio} | {s['rss']:.0f} | "
            f"{gib(s['on_device'])} | {gib(s['on_nvme'])} | {hidden} | "
            f"{losses_text(runs, base_runs)} |"
        )
    main = "\n".join(lines)

    lines = [
        "| mode | pieces per rank (largest, elements) | fwd+bwd ms | `engine.step()` ms "
        "| Adam `step()` ms | waited on I/O ms | rest of `engine.step()` ms | I/O in flight ms | sum of transfer times ms "
        "| transfers | MB moved per step | MB/s while in flight | O_DIRECT | other load (cores) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for mode, s in sums.items():
        io = mode in NVME_MODES
        dash = "-"
        lines.append(
            f"| {mode} | {', '.join(map(str, s['pieces']))} ({s['largest']:,}) | "
            f"{s['fwd_bwd_ms']:.0f} | {s['engine_step_ms']:.0f} | {s['adam_ms']:.0f} | "
            f"{s['waited_ms']:.0f} | {s['rest_ms']:.0f} | "
            + (
                f"{s['busy_ms']:.0f} | {s['sum_ms']:.0f} | {s['transfers']:.0f} | "
                f"{s['mb_per_step']:.0f} | {s['mb_s']:.0f} | {'yes' if s['o_direct'] else 'no'} | "
                if io
                else f"{dash} | {dash} | {dash} | {dash} | {dash} | {dash} | "
            )
            + ", ".join(f"{x:.2f}" for x in s["load"])
            + " |"
        )
    detail = "\n".join(lines)
    return main, detail


def orchestrate(args) -> int:
    preset = SMALL if args.small else FULL
    for key in ("rounds", "warmup", "steps", "micro_batch"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    shape = preset["shape"]
    sizes = model_sizes(shape)
    n_params = sum(sizes)
    world = args.world
    stage = 2 if world > 1 else 1
    plan = [(m, world) for m in args.modes]
    cmd = common.command_line("bench_offload.py", keep_notes=True)
    root = Path(tempfile.mkdtemp(prefix="bench_offload_swap_", dir=args.nvme_dir)).resolve()
    fs = filesystem(root)
    spec = {
        "shape": shape,
        "stage": stage,
        "sub_group_size": piece_limit(sizes, args.pieces),
        "nvme_path": str(root),
        "buffer_count": args.buffer_count,
    }
    os.environ[ENV_KEY] = json.dumps(spec)
    print(
        f"model: {n_params / 1e6:.2f}M params (d_model {shape['D_MODEL']}, {shape['N_LAYERS']} "
        f"layers, {shape['N_HEADS']} heads, vocab {VOCAB}, seq {SEQ}), fp32 AdamW; ZeRO stage "
        f"{stage}, world size {world}, {args.threads} thread(s) per process, micro batch "
        f"{args.micro_batch}; {args.rounds} round(s) of {args.warmup} warm-up + {args.steps} "
        f"timed steps; sub_group_size {spec['sub_group_size']:,} (~{args.pieces} pieces per "
        f"rank); swap files under {root} ({fs})",
        flush=True,
    )
    print(common.shardspeed_commit(), flush=True)
    try:
        results, errors, total, tmp, discarded = common.measure(
            HERE, plan, args, prefix="bench_offload_", width=14
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    main, detail = tables(results, errors, world)
    print()
    print(main)
    print()
    print(detail)
    common.print_run_end(total, tmp, errors, with_world=False)
    if args.write:
        where = f"`{args.nvme_dir}` ({fs})"
        write_section(args, cmd, n_params, spec, where, total, results, errors, discarded)
        print(f"\nupdated {BENCH_MD}")
    return 1 if errors else 0


def write_section(args, cmd, n_params, spec, where, total, results, errors, discarded) -> None:
    world = args.world
    main, detail = tables(results, errors, world)
    sums = {mode: summary(v) for (mode, _w), v in results.items() if v}
    shape = spec["shape"]
    example = config("nvme_pipelined", args.micro_batch, spec["stage"], spec)
    example["zero_optimization"]["offload_optimizer"]["nvme_path"] = "DIR"
    pieces = sorted({p for s in sums.values() for p in s["pieces"]})
    direct = sorted({s["o_direct"] for m, s in sums.items() if m in NVME_MODES})
    direct_text = {(True,): "with O_DIRECT", (False,): "buffered (O_DIRECT refused)"}.get(
        tuple(direct), "O_DIRECT not determined"
    )
    notes = [
        f"- Model: the GPT-style LM of the sections above (`common.D_MODEL` {shape['D_MODEL']}, "
        f"`N_LAYERS` {shape['N_LAYERS']}, `N_HEADS` {shape['N_HEADS']}; vocab {VOCAB}, seq {SEQ}): "
        f"{n_params:,} parameters, fp32, AdamW (torch's fused CPU kernel), ZeRO stage "
        f"{spec['stage']} at world size {world}, micro batch {args.micro_batch} per rank, "
        f"{args.threads} thread(s) per process, gloo. {common.shardspeed_commit()}.",
        f"- Config of `nvme_pipelined` (the others differ only in `offload_optimizer`: absent, "
        f'`{{"device": "cpu"}}`, or pipelining off; `aio` only in the NVMe modes): '
        f"`{json.dumps(example)}`. `sub_group_size` {spec['sub_group_size']:,} in every mode, so "
        f"the layout is the same: {', '.join(map(str, pieces))} pieces (master tensors) per rank.",
        f"- Swap files under {where}, the machine's local disk (no NVMe device here: a virtual "
        f"disk), {direct_text}; they are removed at the end of each run (`engine.destroy()`).",
        f"- Per mode {args.rounds} round(s), each a fresh `torch.distributed.run --standalone` run: "
        f"{args.warmup} warm-up steps (the first one creates the moments and writes them out), a "
        f"barrier, {args.steps} timed steps. Step time = forward + backward + `engine.step()`, per "
        "step the slowest rank, median over the timed steps of all rounds; the parts in the second "
        "table are medians over steps and ranks.",
        "- `cpu`: with no GPU the model, its gradients and the optimizer are in host memory "
        "already, so CPU offload moves nothing and should equal `none`.",
        "- NVMe modes: the optimizer steps one piece at a time (one `step()` call of the torch "
        "optimizer per piece, the other pieces' gradients set to None), reading the piece's "
        "`exp_avg` and `exp_avg_sq` before and writing them after, so their step also carries "
        "per-piece Python overhead (state swaps, futures, an optimizer call per piece) that a "
        "one-call step does not. The second table splits `engine.step()` into Adam's own time "
        "(the torch optimizer's `step()` calls), the I/O waits and the rest (finishing the "
        "gradient reduction, norm, clipping, copying into the model, and in the NVMe modes the "
        "per-piece loop and the submission of transfers).",
        "- I/O accounting (per rank, by wrapping the swapper's `read` / `write` in the worker): "
        "'waited' is the time `SwappedStates` blocked in `Future.result()` on swap transfers; "
        "'in flight' the union over the step of each transfer's interval from submission to "
        "completion (queueing in the thread pool included), i.e. the time any transfer was under "
        "way; 'sum of transfer times' adds the intervals up (concurrent ones count twice). "
        "Hidden share = 1 - waited / in flight, over all timed steps and ranks. Without "
        "pipelining a piece's two transfers are submitted together and then waited for, so its "
        "share is near 0: only the second one's submission (and, for reads, the optimizer state "
        "bookkeeping before the wait) overlaps the first, which shows with small pieces; with "
        "pipelining the next piece's read overlaps this piece's "
        "Adam step and writes drain in the background, bounded by how long those steps take. "
        "MB/s is bytes moved / time in flight on one rank while the other rank does the same.",
        "- Peak RSS is `ru_maxrss` of each rank over the whole run (start-up and model "
        "construction included), the max over ranks; `on_device` / `on_nvme` are "
        "`engine.memory_breakdown()` after the timed steps (max over ranks; `on_device` is host "
        "memory here; `on_nvme` the swap files' size, padding included).",
        "- Losses: every loss of every rank (warm-up and timed) compared with `none`'s.",
        f"- Other load (CPU used by other processes during a run's timed steps): "
        f"{len(discarded)} run(s) rerun for more than {args.max_other_load} cores; "
        f"{sum(s['noisy'] for s in sums.values())} mode(s) with a noisy run kept (retries or the "
        "time budget exhausted), marked * after the mode in the first table.",
        *common.note_lines(args),
        *common.error_notes(errors, markers=()),
    ]
    if "none" in sums:
        ratios = ", ".join(
            f"{m} {s['step_ms'] / sums['none']['step_ms']:.2f}x"
            for m, s in sums.items()
            if m != "none"
        )
        hidden = ", ".join(
            f"{m} {100 * s['hidden']:.0f}%" for m, s in sums.items() if s["hidden"] is not None
        )
        summary_line = f"Step time relative to no offload: {ratios}. I/O hidden: {hidden or '-'}."
    else:
        summary_line = "No offload baseline was measured."
    blocks = [
        summary_line,
        main,
        ("Parts of a step and the I/O (medians per rank and step):", detail),
    ]
    section = common.section_text(SECTION_TITLE, cmd, total, blocks, notes)
    common.write_markdown(section, SECTION_TITLE, BENCH_MD)


def main(argv=None) -> int:
    p = common.parser(__doc__, MODES, profile_dir=False)
    p.set_defaults(rounds=None, warmup=None, steps=None, micro_batch=None)  # from the preset
    p.add_argument(
        "--small", action="store_true", help="smoke run: the ~5M-parameter model, few steps"
    )
    p.add_argument(
        "--world",
        type=int,
        choices=(1, 2),
        default=2,
        help="2: ZeRO stage 2 at world size 2 (default); 1: stage 1 in one process",
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--pieces", type=int, default=8, help="pieces per rank (default 8)")
    p.add_argument("--buffer-count", type=int, default=4, help="offload buffer_count (default 4)")
    p.add_argument("--nvme-dir", default="/tmp", help="where the swap files go (default /tmp)")
    common.add_noise_args(p, budget=300.0)
    common.add_write_args(p, note_help="a line added to the written notes")
    p.set_defaults(retries=None)  # 1, or 0 with --small
    args = p.parse_args(argv)
    if args.retries is None:
        args.retries = 0 if args.small else 1
    if args.worker:
        worker(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
