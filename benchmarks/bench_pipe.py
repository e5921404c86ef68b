"""Pipeline parallelism on 2 stages vs data parallelism on 2 ranks: tokens/s, memory, bubble.

.venv/bin/python benchmarks/bench_pipe.py [--quick] [--write]
"""

from __future__ import annotations

import resource
import statistics
import time

import harness as h
import render

# Short schedule name -> (shardspeed's pipeline.schedule, virtual stages per rank).
SCHEDULES = {"1f1b": ("1f1b", 1), "gpipe": ("gpipe", 1), "interleaved": ("interleaved_1f1b", 2)}
MS = (2, 4, 8)
GLOBAL_BATCH = 16
PIPE_MODES = [f"pipe_{s}_m{m}" for s in SCHEDULES for m in MS] + [f"dspipe_m{m}" for m in MS]
DP_MODES = ["ours_dp", "ddp", "fsdp2", "deepspeed_dp"]
VS_DEEPSPEED = "shardspeed pipeline 1F1B vs DeepSpeed pipeline (1F1B)"
SCENARIO = h.Scenario(
    name="pipe",
    section="## Pipeline parallelism (2 stages) vs data parallelism",
    modes=dict.fromkeys(PIPE_MODES + DP_MODES, 2),
    warmup=2,
    steps=8,
    comparisons=[
        *[(f"pipe_1f1b_m{m}", f"dspipe_m{m}", 1.0, f"m={m}: {VS_DEEPSPEED}") for m in MS],
        ("pipe_1f1b_m8", "ddp", None, "m=8: shardspeed pipeline 1F1B vs torch DDP"),
        ("pipe_1f1b_m8", "fsdp2", None, "m=8: shardspeed pipeline 1F1B vs torch FSDP2"),
        ("ours_dp", "ddp", 1.0, "shardspeed DP (stage 0) vs torch DDP"),
        ("ours_dp", "deepspeed_dp", 1.0, "shardspeed DP vs DeepSpeed DP"),
        ("ours_dp", "fsdp2", None, "shardspeed DP vs torch FSDP2"),
    ],
)


def parse_mode(mode: str) -> tuple[str, str | None, int]:
    """("dp", None, 1), ("ours", schedule, m) or ("deepspeed", "1f1b", m)."""
    if mode in DP_MODES:
        return "dp", None, 1
    m = int(mode.rsplit("_m", 1)[1])
    return ("deepspeed", "1f1b", m) if mode.startswith("dspipe") else ("ours", mode[5:-3], m)


class PassTimer:
    """Seconds in forward and backward this step, and the schedule's window."""

    def __init__(self) -> None:
        self.busy = self.start = self.reduce = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0

        return timed

    def mark(self, fn, attr: str, reset: bool = False):
        def marked(*args, **kwargs):
            if reset:
                self.busy = 0.0
            setattr(self, attr, time.perf_counter())
            return fn(*args, **kwargs)

        return marked


def ours_pipeline(world: int, schedule: str, m: int, timer: PassTimer, rank: int):
    import shardspeed
    from shardspeed import pipe
    from shardspeed.pipe.engine import PipelineSchedule
    from shardspeed.pipe.schedule import max_in_flight, train_schedule

    name, chunks = SCHEDULES[schedule]
    block = h.gpt_block().__class__
    model = h.pipeline_module(pipe, world, block, h.lm_config(), virtual_stages=chunks)
    cfg = h.config(GLOBAL_BATCH // m, gradient_accumulation_steps=m, pipeline={"schedule": name})
    engine, *_ = shardspeed.initialize(model=model, config=cfg)
    part = next(p for p in engine.components if isinstance(p, PipelineSchedule))
    part._forward, part._backward = timer.wrap(part._forward), timer.wrap(part._backward)
    engine._apply_step = timer.mark(engine._apply_step, "reduce")
    live = max_in_flight(train_schedule(name, world, m, chunks)[rank])
    return engine, {"schedule_live": live, "virtual_stages": chunks}


def deepspeed_pipeline(world: int, m: int, timer: PassTimer):
    import torch

    deepspeed = h.library("deepspeed")
    from deepspeed import pipe
    from deepspeed.runtime.pipe import schedule as ds

    deepspeed.init_distributed(dist_backend="gloo")
    # seed_fn: DeepSpeed's default fails on Python 3.11 (numpy integers to random.seed).
    block = h.gpt_block().__class__
    model = h.pipeline_module(pipe, world, block, h.lm_config(), seed_fn=torch.manual_seed)
    model.seed_layers = False  # else it reseeds every layer in every forward
    cfg = h.config(GLOBAL_BATCH // m, gradient_accumulation_steps=m)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    table = dict(type(engine)._INSTRUCTION_MAP)
    for kind in (ds.ForwardPass, ds.BackwardPass):
        table[kind] = timer.wrap(table[kind])
    table[ds.ReduceTiedGrads] = timer.mark(table[ds.ReduceTiedGrads], "reduce")
    engine._INSTRUCTION_MAP = table
    engine._exec_schedule = timer.mark(engine._exec_schedule, "start", reset=True)
    return engine, {"virtual_stages": 1}


def worker(mode: str, args) -> dict:
    kind, schedule, m = parse_mode(mode)
    rank, world = h.setup(args.threads)
    batches = h.progression_batches(args.warmup + args.steps, GLOBAL_BATCH)
    steps = {"loss": [], "bubble": [], "busy": [], "window": [], "live": []}
    timer, extra, faults = PassTimer(), {}, []
    if kind == "dp":
        batches = h.rank_slice(batches, rank, GLOBAL_BATCH // world)
        model = h.tied_gpt(lambda i: h.gpt_block())
        forward, backward, update, engine = h.trainer(
            mode.split("_")[0], model, h.config(GLOBAL_BATCH // world)
        )
        step_once = h.step_fn(forward, backward, update)
    else:
        if kind == "ours":
            engine, extra = ours_pipeline(world, schedule, m, timer, rank)
        else:
            engine, extra = deepspeed_pipeline(world, m, timer)

        def step_once(x, y):
            timer.busy, timer.start = 0.0, time.perf_counter()
            loss = engine.train_batch(h.micro_batches(x, y, m))
            steps["busy"].append(timer.busy)
            steps["window"].append(timer.reduce - timer.start)
            if kind == "ours":
                steps["bubble"].append(engine.bubble[0])
                steps["live"].append(engine.peak_live_micro_batches)
            else:
                steps["bubble"].append(1.0 - timer.busy / (timer.reduce - timer.start))
            return loss

    def step(x, y):
        if len(steps["loss"]) == args.warmup:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        loss = step_once(x, y)
        steps["loss"].append(loss.detach())
        return loss

    result = h.timed(step, batches, args.warmup, args.steps, GLOBAL_BATCH * h.SEQ)
    faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults[0]
    result["page_faults_per_step"] = faulted / args.steps
    result |= h.loss_curve(steps["loss"], kind == "dp")
    params = (engine.module if kind != "dp" else model).parameters()
    result |= extra | {"kind": kind, "m": m, "params_local": h.local_numel(params)}
    if kind != "dp":
        after_warmup = {k: steps[k][args.warmup :] for k in ("bubble", "busy", "window")}
        result |= {f"{k}_steps": v for k, v in after_warmup.items()}
        live = steps["live"][args.warmup :]
        result["peak_live"] = max(live) if kind == "ours" else int(engine.num_pipe_buffers)
    if mode.startswith("ours") or kind == "ours":
        mem = engine.memory_breakdown()
        result["model_state_bytes"] = mem["total"] - mem["buffers"]
    return result | {"peak_rss_mib": h.peak_rss_mib()}


def schedule_name(mode: str) -> str:
    kind, schedule, _ = parse_mode(mode)
    names = {"dp": "data parallel", "deepspeed": "DeepSpeed 1F1B"}
    return names.get(kind) or SCHEDULES[schedule][0]


def throughput_table(results: dict) -> str:
    def shape(mode: str) -> str:
        kind, _, m = parse_mode(mode)
        return f"1 x {GLOBAL_BATCH // 2} per rank" if kind == "dp" else f"{m} x {GLOBAL_BATCH // m}"

    def ds_pipe(mode: str) -> str | None:
        kind, _, m = parse_mode(mode)
        return f"dspipe_m{m}" if kind == "ours" else None

    def faults(mode: str) -> str:
        per_rank = render.per_rank(results, mode, lambda r: r["page_faults_per_step"])
        return " / ".join(f"{f / 1000:.1f}k" for f in per_rank)

    bases = {"DDP": "ddp", "FSDP2": "fsdp2", "DeepSpeed pipeline (same m)": ds_pipe}
    bases |= {"DeepSpeed DP": "deepspeed_dp", "shardspeed DP": "ours_dp"}
    spec = [("mode", "l", str), ("schedule", "l", schedule_name), ("m x micro batch", "l", shape)]
    spec += render.speed_columns(results, bases)
    spec.append(("page faults per step (rank 0 / 1)", "l", faults))
    return render.columns(spec, [m for m in results["runs"] if render.med(results, m)])


def memory_table(results: dict) -> str:
    def live(mode: str) -> str:
        kind = parse_mode(mode)[0]
        if kind == "dp":
            return "-"
        peak = render.ranks_text(results, mode, lambda r: r["peak_live"], "d", max)
        if kind != "ours":
            return peak + " (buffers)"
        first = render.runs(results, mode)[0]["ranks"]
        return peak + f" (schedule: {' / '.join(str(r['schedule_live']) for r in first)})"

    spec = render.model_columns(results)
    spec += render.rss_columns(results, False, "peak RSS per rank (MiB, rank 0 / 1)")
    spec.append(("micro-batches alive at once (stage 0 / 1)", "l", live))
    return render.columns(spec, render.measured(results))


def window_idle(run: dict) -> list[float]:
    """Each stage's idle share of the pipeline's window, mean over the timed steps."""
    ranks = run["ranks"]
    windows = [max(steps) for steps in zip(*(x["window_steps"] for x in ranks))]
    return [statistics.fmean(1 - b / w for b, w in zip(r["busy_steps"], windows)) for r in ranks]


def bubble_table(results: dict) -> str:
    rows = []
    for mode in results["runs"]:
        rs = render.runs(results, mode)
        kind, _, m = parse_mode(mode)
        if kind == "dp" or not rs:
            continue
        v = rs[0]["virtual_stages"]
        own = render.per_rank(results, mode, lambda r: statistics.fmean(r["bubble_steps"]))
        per_run = [window_idle(run) for run in rs]
        window = [statistics.median(x[r] for x in per_run) for r in range(2)]
        busy = render.per_rank(results, mode, lambda r: statistics.fmean(r["busy_steps"]))
        t = max(busy) + min(busy) / (v * m)  # the busier stage's work plus one chunk of the other
        own_text = render.slash(own, ".3f")
        own_text += " (same quantity, timed from outside)" * (kind == "deepspeed")
        cells = [schedule_name(mode), m, v, f"{1 / (v * m + 1):.3f}", own_text]
        cells += [render.slash(window, ".3f"), render.slash([1000 * b for b in busy], ".0f")]
        rows.append([*cells, render.slash([1 - b / t for b in busy], ".3f")])
    head = "schedule | m | v | theory (p-1)/(v*m+p-1) | engine.bubble, stage 0 / 1"
    head += " | idle share of the pipeline's window, stage 0 / 1"
    head += " | fwd+bwd busy per step, stage 0 / 1 (ms)"
    return render.table(head + " | estimate from that stage balance, stage 0 / 1", rows, "lrrrllll")


def tables(results: dict) -> dict:
    own = {"memory": memory_table(results), "bubble": bubble_table(results)}
    throughput = throughput_table(results)
    return render.training_tables(results, SCENARIO.comparisons, throughput, own, 1e-4)


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_pipe.py")
