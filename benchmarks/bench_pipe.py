"""Pipeline parallelism on 2 stages vs data parallelism on 2 ranks: speed, memory, bubble.

One invocation measures, on the same GPT (8 transformer blocks, tied embedding and head) and the
same global batch (16 sequences a step), at world size 2 (gloo on CPU):

  shardspeed's PipelineEngine, 2 stages x 1 replica, with the schedules 1f1b, gpipe and
  interleaved_1f1b (virtual_stages=2), each at m = 2, 4 and 8 micro-batches
  (gradient_accumulation_steps = m, micro batch = 16 / m);
  DeepSpeed's PipelineEngine (deepspeed.pipe.PipelineModule, its one schedule, 1F1B) at the same m;
  data parallelism over the same model: shardspeed ZeRO stage 0, torch DDP, torch FSDP2
  (fully_shard) and DeepSpeed ZeRO stage 0 (micro batch 8 per rank, no accumulation);

and reports tokens/s with ratios, peak RSS per rank, each stage's measured bubble (idle share of
the step) against the theory (p-1)/(v*m+p-1), and the micro-batches alive at once per stage.
The script is both the orchestrator and the worker: every measured run is
``python -m torch.distributed.run ... bench_pipe.py --worker MODE``.

    .venv/bin/python benchmarks/bench_pipe.py --smoke      # every mode once, 1+2 steps (~3 min)
    .venv/bin/python benchmarks/bench_pipe.py              # measure, print the tables
    .venv/bin/python benchmarks/bench_pipe.py --write      # ... and update BENCHMARKS.md

See benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import common
from common import BENCH_MD, CLIP, D_MODEL, LR, N_HEADS, SEQ, VOCAB, shardspeed_source

HERE = Path(__file__).resolve()
SECTION_TITLE = "## Pipeline parallelism (2 stages) vs data parallelism"
WORLD = 2
N_BLOCKS = 8
BASE_SEED = common.MODEL_SEED  # layer i is built under torch.manual_seed(BASE_SEED + i)
MIB = 2**20
USED_VOCAB = 256  # the batches use the first 256 token ids (see global_batches)

# Short schedule name in mode names -> (shardspeed's pipeline.schedule, virtual stages per rank).
SCHEDULES = {"1f1b": ("1f1b", 1), "gpipe": ("gpipe", 1), "interleaved": ("interleaved_1f1b", 2)}
MICRO_BATCH_COUNTS = (2, 4, 8)
DP_MODES = ("ours_dp", "ddp", "fsdp2", "deepspeed_dp")
MODE_RE = re.compile(r"^(?:pipe_(1f1b|gpipe|interleaved)|(dspipe))_m(\d+)$")


def pipe_mode(schedule: str, m: int) -> str:
    return f"pipe_{schedule}_m{m}"


def dspipe_mode(m: int) -> str:
    return f"dspipe_m{m}"


def parse_mode(mode: str) -> tuple[str, str | None, int]:
    """("dp", None, 1) for a data-parallel mode; ("ours" / "deepspeed", schedule, m) for a
    pipeline mode."""
    if mode in DP_MODES:
        return "dp", None, 1
    match = MODE_RE.match(mode)
    if not match:
        raise ValueError(f"unknown mode {mode!r}")
    if match.group(2):
        return "deepspeed", "1f1b", int(match.group(3))
    return "ours", match.group(1), int(match.group(3))


# --------------------------------------------------------------------------------------------
# The model: a GPT as pipeline layers (tied token embedding and output head)
# --------------------------------------------------------------------------------------------


class Embedding(nn.Module):
    """Token and position embeddings (GPT-2's N(0, 0.02) init, so the tied head starts small)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Embedding(SEQ, D_MODEL)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions.weight[: ids.shape[1]]


class Block(nn.Module):
    """The pre-norm transformer block of common.build_model (causal attention, 4x MLP)."""

    def __init__(self) -> None:
        super().__init__()
        d = D_MODEL
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, N_HEADS, d // N_HEADS).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output projection, tied to the token embedding."""
    return F.linear(x, embedding.tokens.weight)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs(pipe) -> list:
    """The GPT as pipeline layers, with `pipe` = shardspeed.pipe or deepspeed.pipe (both have
    LayerSpec and TiedLayerSpec): embedding, N_BLOCKS blocks, final norm, tied head."""
    embed = dict(tied_weight_attr="tokens.weight")
    return [
        pipe.TiedLayerSpec("embed", Embedding, **embed),
        *[pipe.LayerSpec(Block) for _ in range(N_BLOCKS)],
        pipe.LayerSpec(nn.LayerNorm, D_MODEL),
        pipe.TiedLayerSpec("embed", Embedding, forward_fn=head, **embed),
    ]


class GPT(nn.Module):
    """The same layers as one module (for data parallelism), layer i built under the seed the
    pipelines give it, so every mode starts from the same weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED + 0)
        self.embed = Embedding()
        blocks = []
        for i in range(N_BLOCKS):
            torch.manual_seed(BASE_SEED + 1 + i)
            blocks.append(Block())
        self.blocks = nn.ModuleList(blocks)
        torch.manual_seed(BASE_SEED + 1 + N_BLOCKS)
        self.ln_f = nn.LayerNorm(D_MODEL)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return loss_fn(head(self.embed, self.ln_f(x)), labels)


def global_batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step i's global batch, the same in every mode: each sequence an arithmetic progression
    mod USED_VOCAB (random start, random stride 1..16) over the first USED_VOCAB token ids, so
    the loss visibly falls within a few steps (the head still scores all VOCAB ids)."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(common.DATA_SEED + i)
        start = torch.randint(0, USED_VOCAB, (size, 1), generator=g)
        stride = torch.randint(1, 17, (size, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % USED_VOCAB
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def pipe_config(global_batch: int, m: int) -> dict:
    """The config given to both pipeline engines (shardspeed's adds pipeline.schedule)."""
    cfg = common.ds_config(global_batch // m, stage=0)
    cfg["gradient_accumulation_steps"] = m
    return cfg


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


class PassTimer:
    """Seconds a pipeline engine spends in its forward and backward passes in the current step,
    and the wall time from the start of the step to the end of its schedule's passes and
    transfers (shardspeed: the start of the optimizer step, right after ReduceGrads; DeepSpeed:
    the start of ReduceTiedGrads): the quantities shardspeed's engine uses for `engine.bubble`."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.start = self.reduce = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0

        return timed

    def reset(self) -> None:
        self.busy = 0.0
        self.start = time.perf_counter()


def instrument_ours(engine, timer: PassTimer) -> None:
    engine._forward = timer.wrap(engine._forward)
    engine._backward = timer.wrap(engine._backward)
    apply_step = engine._apply_step

    def mark_step(*args, **kwargs):
        timer.reduce = time.perf_counter()
        return apply_step(*args, **kwargs)

    engine._apply_step = mark_step


def instrument_deepspeed(engine, timer: PassTimer) -> None:
    """Wrap DeepSpeed's forward/backward instructions (through an instance copy of its
    instruction map) and mark the start of the schedule and of ReduceTiedGrads."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    table = dict(type(engine)._INSTRUCTION_MAP)
    for kind in (ds_schedule.ForwardPass, ds_schedule.BackwardPass):
        table[kind] = timer.wrap(table[kind])
    reduce_tied = table[ds_schedule.ReduceTiedGrads]

    def mark_reduce(self, *args, **kwargs):
        timer.reduce = time.perf_counter()
        return reduce_tied(self, *args, **kwargs)

    table[ds_schedule.ReduceTiedGrads] = mark_reduce
    engine._INSTRUCTION_MAP = table
    run_schedule = engine._exec_schedule

    def exec_schedule(*args, **kwargs):
        timer.reset()
        return run_schedule(*args, **kwargs)

    engine._exec_schedule = exec_schedule


def local_numel(params) -> int:
    from torch.distributed.tensor import DTensor

    return sum(
        (p._local_tensor if isinstance(p, DTensor) else p).numel() for p in params if p is not None
    )


def worker(args) -> None:
    mode = args.worker
    kind, schedule, m = parse_mode(mode)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    rank, world = common.worker_setup(args.threads)
    global_batch = args.micro_batch * world
    n_steps = args.warmup + args.steps
    batches = global_batches(n_steps, global_batch)
    extra: dict = {"kind": kind, "m": m, "global_batch": global_batch}
    per_step: dict[str, list] = {
        "loss": [],
        "bubble": [],
        "busy_s": [],
        "window_s": [],
        "peak_live": [],
    }
    timer = PassTimer()
    faults = {}  # minor page faults at the start of the first timed step

    def count_faults(step):
        """`step`, noting the page faults of this process when the timed steps begin."""

        def counted(x, y):
            if len(per_step["loss"]) == args.warmup:
                faults["start"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            return step(x, y)

        return counted

    if kind == "dp":
        model = GPT()
        n_total = sum(p.numel() for p in model.parameters())
        lo = rank * args.micro_batch
        batches = [
            (x[lo : lo + args.micro_batch], y[lo : lo + args.micro_batch]) for x, y in batches
        ]
        if mode in ("ddp", "fsdp2"):
            if mode == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP

                module = DDP(model)
                extra["settings"] = "DistributedDataParallel(model), torch.optim.AdamW(lr=3e-4)"
            else:
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
                module = model
                extra["settings"] = (
                    "fully_shard(block) for each block, then fully_shard(model) (default "
                    "reshard_after_forward), torch.optim.AdamW(lr=3e-4)"
                )
            opt = torch.optim.AdamW(model.parameters(), lr=LR)

            def step(x, y):
                loss = module(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad(set_to_none=True)
                per_step["loss"].append(loss.detach())
                return loss

        else:
            if mode == "ours_dp":
                import shardspeed as lib
            else:
                import deepspeed as lib
            engine, _opt, _, _ = lib.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=common.ds_config(args.micro_batch, stage=0),
            )
            extra["settings"] = f"{type(engine.optimizer).__name__}"
            inner = getattr(engine.optimizer, "optimizer", None)
            if inner is not None:
                extra["settings"] += f" over {type(inner).__name__}"

            def step(x, y):
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                per_step["loss"].append(loss.detach())
                return loss

    else:
        mb = global_batch // m
        if global_batch % m:
            raise SystemExit(f"global batch {global_batch} is not a multiple of m={m}")
        if kind == "ours":
            import shardspeed
            from shardspeed import pipe
            from shardspeed.pipe.schedule import max_in_flight, train_schedule

            name, chunks = SCHEDULES[schedule]
            model = pipe.PipelineModule(
                layer_specs(pipe),
                num_stages=world,
                loss_fn=loss_fn,
                seed_layers=True,
                base_seed=BASE_SEED,
                virtual_stages=chunks,
            )
            cfg = pipe_config(global_batch, m) | {"pipeline": {"schedule": name}}
            engine, *_ = shardspeed.initialize(model=model, config=cfg)
            instrument_ours(engine, timer)
            extra["schedule_live"] = max_in_flight(train_schedule(name, world, m, chunks)[rank])
            extra["partition"] = model.partitions()
            extra["virtual_stages"] = chunks
        else:
            import deepspeed
            from deepspeed import pipe

            deepspeed.init_distributed(dist_backend="gloo")
            # seed_fn: DeepSpeed's default (random, numpy and torch seeds) fails on Python 3.11,
            # as its 'parameters' partition gives numpy integers and random.seed() refuses them.
            # torch.manual_seed is what shardspeed seeds each layer with.
            model = pipe.PipelineModule(
                layer_specs(pipe),
                num_stages=world,
                loss_fn=loss_fn,
                seed_layers=True,
                seed_fn=torch.manual_seed,
                base_seed=BASE_SEED,
            )
            # seed_layers also reseeds every layer in every forward (for dropout; this model has
            # none): off after the build, which is what it is for here.
            model.seed_layers = False
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=pipe_config(global_batch, m),
            )
            instrument_deepspeed(engine, timer)
            extra["partition"] = [int(x) for x in model.parts]
            extra["virtual_stages"] = 1
        extra["stage"] = engine.stage_id
        n_total = None

        def step(x, y):
            micro = [(x[i * mb : (i + 1) * mb], y[i * mb : (i + 1) * mb]) for i in range(m)]
            if kind == "ours":
                timer.reset()
            loss = engine.train_batch(iter(micro))
            per_step["loss"].append(loss.detach())
            per_step["busy_s"].append(timer.busy)
            per_step["window_s"].append(timer.reduce - timer.start)
            if kind == "ours":
                per_step["bubble"].append(list(engine.bubble))
                per_step["peak_live"].append(engine.peak_live_micro_batches)
            else:
                per_step["bubble"].append([1.0 - timer.busy / (timer.reduce - timer.start), None])
            return loss

    n_local = local_numel(model.parameters())
    result = common.timed_run(
        count_faults(step),
        batches,
        args,
        mode=mode,
        rank=rank,
        world=world,
        n_params=n_local,
        barrier=dist.barrier,
    )

    faults_now = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    result["page_faults_per_step"] = (faults_now - faults["start"]) / args.steps
    # Losses: the pipelines return the mean over the global batch on every stage; data
    # parallelism each rank's own, averaged here over the ranks (after the timed window).
    losses = torch.stack(per_step["loss"]).float()
    if kind == "dp":
        dist.all_reduce(losses)
        losses /= world
    result["losses"] = losses.tolist()
    result["first_loss"], result["last_loss"] = result["losses"][0], result["losses"][-1]
    result["tokens_per_s"] = args.steps * global_batch * SEQ / result["elapsed_s"]
    result["params_local"] = n_local
    result["params_total"] = n_total
    timed = slice(args.warmup, args.warmup + args.steps)
    if kind != "dp":
        result["bubble_steps"] = [b[0] for b in per_step["bubble"][timed]]
        result["theory"] = per_step["bubble"][-1][1]
        result["busy_steps"] = per_step["busy_s"][timed]
        result["window_steps"] = per_step["window_s"][timed]
        if kind == "ours":
            result["peak_live"] = max(per_step["peak_live"][timed])
            # The engine's own collective report of the last step, to check it against the
            # values gathered above (it reads the same engine.bubble).
            result["bubble_report"] = engine.bubble_report()
        else:
            result["peak_live"] = int(engine.num_pipe_buffers)  # DeepSpeed's activation buffers
    if mode.startswith("ours") or kind == "ours":
        mem = engine.memory_breakdown()
        result["model_state_bytes"] = mem["total"] - mem["buffers"]
    result.update(extra)
    result["peak_rss_mib"] = common.peak_rss_mib()
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    # Both ranks done before either tears gloo down (one smoke run of pipe_1f1b_m8, under load,
    # aborted in teardown after writing its results: "terminate called without an active
    # exception").
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


def selected_modes(args) -> list[str]:
    modes = []
    for schedule in args.schedules:
        modes += [pipe_mode(schedule, m) for m in args.ms]
    if "deepspeed" in args.baselines:
        modes += [dspipe_mode(m) for m in args.ms]
    modes += [d for d in DP_MODES if d in args.dp_modes]
    return modes


def comparisons(args) -> list:
    """The ratio rows with targets: shardspeed's 1F1B against DeepSpeed's pipeline (the same
    schedule) at each m, shardspeed's data parallelism against DDP and DeepSpeed's; the rest
    (pipeline against data parallelism) is information."""
    rows = []
    for m in args.ms:
        rows.append(
            (
                (pipe_mode("1f1b", m), WORLD),
                (dspipe_mode(m), WORLD),
                1.0,
                f"m={m}: shardspeed pipeline 1F1B vs DeepSpeed pipeline (1F1B)",
            )
        )
    best = max(args.ms)
    for other, label in (("ddp", "torch DDP"), ("fsdp2", "torch FSDP2")):
        rows.append(
            (
                (pipe_mode("1f1b", best), WORLD),
                (other, WORLD),
                None,
                f"m={best}: shardspeed pipeline 1F1B vs {label}",
            )
        )
    rows += [
        (("ours_dp", WORLD), ("ddp", WORLD), 1.0, "shardspeed DP (stage 0) vs torch DDP"),
        (("ours_dp", WORLD), ("deepspeed_dp", WORLD), 1.0, "shardspeed DP vs DeepSpeed DP"),
        (("ours_dp", WORLD), ("fsdp2", WORLD), None, "shardspeed DP vs torch FSDP2"),
    ]
    return rows


def med(results, mode: str, key: str = "tokens_per_s"):
    runs = results.get((mode, WORLD)) or []
    return statistics.median(r[key] for r in runs) if runs else None


def rank_values(results, mode: str, fn) -> list:
    """fn(rank result) for each rank, median over rounds (None where the mode has no run)."""
    runs = results.get((mode, WORLD)) or []
    if not runs:
        return [None] * WORLD
    return [statistics.median(fn(run["ranks"][r]) for run in runs) for r in range(WORLD)]


def throughput_table(results, modes) -> str:
    """Every mode's median tokens/s and its ratio to each baseline."""
    base = {b: med(results, b) for b in ("ddp", "fsdp2", "deepspeed_dp", "ours_dp")}
    lines = [
        "| mode | schedule | m x micro batch | tokens/s (median) | ms/step | / DDP | / FSDP2 "
        "| / DeepSpeed pipeline (same m) | / DeepSpeed DP | / shardspeed DP | page faults per "
        "step (rank 0 / 1) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def ratio(a, b):
        return f"{a / b:.3f}" if a and b else "-"

    for mode in modes:
        tps = med(results, mode)
        kind, schedule, m = parse_mode(mode)
        if tps is None:
            lines.append(f"| {mode} | - | - | failed | - | - | - | - | - | - | - |")
            continue
        run = results[(mode, WORLD)][0]
        gb = run["global_batch"]
        if kind == "dp":
            sched = "data parallel"
            shape = f"1 x {gb // WORLD} per rank"
        else:
            sched = "DeepSpeed 1F1B" if kind == "deepspeed" else SCHEDULES[schedule][0]
            shape = f"{m} x {gb // m}"
        ds_pipe = med(results, dspipe_mode(m)) if kind == "ours" else None
        faults = rank_values(results, mode, lambda r: r.get("page_faults_per_step", 0))
        lines.append(
            f"| {mode} | {sched} | {shape} | {tps:.0f} | {med(results, mode, 'step_ms'):.0f} | "
            f"{ratio(tps, base['ddp'])} | {ratio(tps, base['fsdp2'])} | {ratio(tps, ds_pipe)} | "
            f"{ratio(tps, base['deepspeed_dp'])} | {ratio(tps, base['ours_dp'])} | "
            + " / ".join(f"{f / 1000:.1f}k" for f in faults)
            + " |"
        )
    return "\n".join(lines)


def memory_table(results, modes) -> str:
    lines = [
        "| mode | parameters per rank (rank 0 / 1) | 16 B x parameters (MiB) | shardspeed "
        "model states, measured (MiB) | peak RSS per rank (MiB, rank 0 / 1) | micro-batches alive "
        "at once (stage 0 / 1) |",
        "|---|---|---|---|---|---|",
    ]
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if not runs:
            continue
        kind, _s, _m = parse_mode(mode)
        params = rank_values(results, mode, lambda r: r["params_local"])
        rss = [max(run["ranks"][r]["peak_rss_mib"] for run in runs) for r in range(WORLD)]
        states = rank_values(results, mode, lambda r: r.get("model_state_bytes") or 0)
        live = "-"
        if kind != "dp":
            peaks = [max(run["ranks"][r]["peak_live"] for run in runs) for r in range(WORLD)]
            live = " / ".join(str(p) for p in peaks)
            if kind == "ours":
                sched = " / ".join(str(runs[0]["ranks"][r]["schedule_live"]) for r in range(WORLD))
                live += f" (schedule: {sched})"
            else:
                live += " (buffers)"
        lines.append(
            f"| {mode} | {' / '.join(f'{p / 1e6:.2f}M' for p in params)} | "
            f"{' / '.join(f'{16 * p / MIB:.1f}' for p in params)} | "
            + (" / ".join(f"{s / MIB:.1f}" for s in states) if any(states) else "-")
            + f" | {rss[0]:.0f} / {rss[1]:.0f} | {live} |"
        )
    return "\n".join(lines)


def balance_estimate(busy: list[float], v: int, m: int) -> list[float]:
    """Each stage's idle share when only the stages' unequal work is accounted for (p = 2): the
    step lasts the busier stage's work plus one micro-batch-chunk of the other stage's (the fill
    before it and the drain after), T = B_max + B_min / (v*m); stage s idles 1 - B_s / T. With
    equal stages this is the theory 1 / (v*m + 1)."""
    t = max(busy) + min(busy) / (v * m)
    return [1.0 - b / t for b in busy]


def common_window_idle(run: dict) -> list[float]:
    """Each stage's idle share of the pipeline's whole window, mean over the timed steps: per
    step, T = the longest of the stages' windows (the last backward of the first stage ends it)
    and stage s idles 1 - busy_s / T."""
    ranks = run["ranks"]
    n = len(ranks[0]["busy_steps"])
    out = []
    for r in ranks:
        idle = []
        for i in range(n):
            t = max(x["window_steps"][i] for x in ranks)
            idle.append(1.0 - r["busy_steps"][i] / t)
        out.append(statistics.fmean(idle))
    return out


def bubble_table(results, modes) -> tuple[str, list[dict]]:
    lines = [
        "| schedule | m | v | theory (p-1)/(v*m+p-1) | engine.bubble, stage 0 / 1 | idle share of "
        "the pipeline's window, stage 0 / 1 | fwd+bwd busy per step, stage 0 / 1 (ms) | estimate "
        "from that stage balance, stage 0 / 1 |",
        "|---|---:|---:|---:|---|---|---|---|",
    ]
    rows = []
    for mode in modes:
        kind, schedule, m = parse_mode(mode)
        runs = results.get((mode, WORLD)) or []
        if kind == "dp" or not runs:
            continue
        v = runs[0]["virtual_stages"]
        own = rank_values(results, mode, lambda r: statistics.fmean(r["bubble_steps"]))
        per_run = [common_window_idle(run) for run in runs]
        window = [statistics.median(x[r] for x in per_run) for r in range(WORLD)]
        busy = rank_values(results, mode, lambda r: statistics.fmean(r["busy_steps"]))
        theory = (WORLD - 1) / (v * m + WORLD - 1)
        est = balance_estimate(busy, v, m)
        name = "DeepSpeed 1F1B" if kind == "deepspeed" else SCHEDULES[schedule][0]
        own_text = f"{own[0]:.3f} / {own[1]:.3f}"
        if kind == "deepspeed":
            own_text += " (same quantity, timed from outside)"
        lines.append(
            f"| {name} | {m} | {v} | {theory:.3f} | {own_text} | {window[0]:.3f} / "
            f"{window[1]:.3f} | {1000 * busy[0]:.0f} / {1000 * busy[1]:.0f} | "
            f"{est[0]:.3f} / {est[1]:.3f} |"
        )
        rows.append({"mode": mode, "theory": theory, "own": own, "window": window, "estimate": est})
    return "\n".join(lines), rows


def loss_checks(results, modes) -> tuple[list[str], bool]:
    """First-step loss of every mode against shardspeed DP's (same weights, same batch: within
    1e-4 relative), the largest loss difference over all steps, and whether the loss falls."""
    lines, ok = [], True
    ref_runs = results.get(("ours_dp", WORLD)) or []
    ref = ref_runs[0]["losses"] if ref_runs else None
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if not runs:
            continue
        losses = runs[0]["losses"]
        falls = losses[-1] < losses[0]
        ok &= falls
        text = f"{mode}: loss {losses[0]:.5f} -> {losses[-1]:.5f} over {len(losses)} steps"
        text += "" if falls else " (NOT falling)"
        if ref and mode != "ours_dp":
            first = abs(losses[0] - ref[0]) / abs(ref[0])
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            within = first <= 1e-4
            if parse_mode(mode)[0] in ("ours", "deepspeed"):
                ok &= within
            text += (
                f"; first-step loss vs shardspeed DP: {first:.1e} relative "
                f"({'within' if within else 'OUTSIDE'} 1e-4), largest over all steps {worst:.1e}"
            )
        lines.append(text)
    return lines, ok


def bubble_report_check(results, modes) -> str | None:
    """engine.bubble_report() (collective, last step) against the values each rank kept."""
    worst = 0.0
    seen = False
    for mode in modes:
        if parse_mode(mode)[0] != "ours":
            continue
        for run in results.get((mode, WORLD)) or []:
            report = run["ranks"][0].get("bubble_report") or []
            for entry in report:
                own = run["ranks"][entry["stage"]]["bubble_steps"][-1]
                worst = max(worst, abs(entry["measured"] - own))
                seen = True
    if not seen:
        return None
    return (
        f"`engine.bubble_report()` after the last step agrees with each stage's own "
        f"`engine.bubble` (largest difference {worst:.1e})."
    )


def findings(results, modes, bub_rows, n_params) -> list[str]:
    """What the figures say, computed from them: stage balance, the last stage's engine.bubble,
    the idle beyond the balance estimate, the pipeline against data parallelism, memory."""
    out = []
    by_mode = {r["mode"]: r for r in bub_rows}
    ours = [m for m in modes if parse_mode(m)[0] == "ours" and m in by_mode]
    if not ours:
        return out
    ratios = [
        b[1] / b[0]
        for m in ours
        if (b := rank_values(results, m, lambda r: statistics.fmean(r["busy_steps"])))[0]
    ]
    out.append(
        f"- Stage balance: stage 1 (4 blocks, final norm, the tied head and its {VOCAB}-way "
        f"softmax) is busy {min(ratios):.2f}-{max(ratios):.2f}x as long as stage 0 (embedding, "
        "4 blocks) across the shardspeed rows: the 'parameters' partition balances parameters "
        "(4.24M a stage, the tied embedding counting on both), not work. So stage 0 waits for "
        "stage 1 and idles more than the theory, stage 1 less; the estimate column accounts for "
        "that imbalance."
    )
    low = [(m, by_mode[m]) for m in ours if by_mode[m]["own"][1] < by_mode[m]["window"][1] - 0.02]
    if low:
        m, r = max(low, key=lambda x: x[1]["window"][1] - x[1]["own"][1])
        out.append(
            "- `engine.bubble` measures each stage over its own window, from the start of "
            "`train_batch` to its ReduceGrads. The last stage reaches ReduceGrads as soon as its "
            "own last backward is done, while stage 0 still runs the last backward (the drain); "
            "its wait for that happens inside the optimizer step (the tied-gradient and "
            "gradient-norm all-reduces), outside the window. So the last stage's `engine.bubble` "
            "leaves out the drain and reads low even with equal stages (for p = 2 and backward = "
            "2 x forward, about 1/(3m+1) instead of 1/(m+1)): e.g. "
            f"{m}: {r['own'][1]:.3f} against {r['window'][1]:.3f} over the pipeline's window. "
            "The 'pipeline's window' column measures both stages over the same time and is the "
            "one to set against the theory."
        )
    over = []
    for m in ours:
        r = by_mode[m]
        over.append(f"{m} {r['window'][0] - r['estimate'][0]:+.3f}")
    out.append(
        "- Idle beyond the balance estimate (stage 0, pipeline window minus estimate: the gloo "
        "transfers, loads and the engine's per-instruction work, which grow with the number of "
        "micro-batches and chunks): " + ", ".join(over) + "."
    )
    pairs, refaulted = [], []
    for m in sorted({parse_mode(x)[2] for x in ours}):
        a, b = pipe_mode("1f1b", m), dspipe_mode(m)
        if a in by_mode and b in by_mode:
            busy = [
                rank_values(results, x, lambda r: 1000 * statistics.fmean(r["busy_steps"]))
                for x in (a, b)
            ]
            faults = [
                rank_values(results, x, lambda r: r.get("page_faults_per_step", 0) / 1000)
                for x in (a, b)
            ]
            pairs.append(
                f"m={m}: {med(results, a) / med(results, b):.2f}x tokens/s, busy "
                f"{busy[0][0]:.0f}/{busy[0][1]:.0f} ms against {busy[1][0]:.0f}/{busy[1][1]:.0f}, "
                f"page faults {faults[0][0]:.1f}k/{faults[0][1]:.1f}k against "
                f"{faults[1][0]:.1f}k/{faults[1][1]:.1f}k"
            )
            if faults[0][1] > 2 * faults[1][1] + 1:
                mib = (faults[0][1] - faults[1][1]) * 1000 * 4096 / m / MIB
                logits = results[(a, WORLD)][0]["global_batch"] // m * SEQ * VOCAB * 4 / MIB
                refaulted.append(f"m={m}: {mib:.0f} MiB a micro-batch, logits {logits:.0f} MiB")
    if pairs:
        out.append(
            "- shardspeed's 1F1B against DeepSpeed's (the same schedule, partition and kernels; "
            "stage 0/stage 1 per step): "
            + "; ".join(pairs)
            + ". Busy is the time in forward and backward passes, so a gap there is in the "
            "passes themselves, not in waiting. Minor page faults count memory the allocator "
            "maps afresh (zero-filled by the kernel on first touch, 4 KiB each)"
            + (
                "; shardspeed's last stage takes many more than DeepSpeed's, i.e. it gives "
                "memory back to the OS and maps it again every micro-batch ("
                + "; ".join(refaulted)
                + "), which costs time inside the passes. A likely reason: shardspeed frees a "
                "micro-batch's activations, logits included, right after its backward, so "
                "glibc's heap top shrinks and grows again, while DeepSpeed keeps each stage's "
                "outputs (on the last stage the logits) in its pipe buffers until the slot is "
                "reused, which costs it more resident memory (its stage-1 peak RSS is higher, "
                "memory table) but keeps the pages mapped."
                if refaulted
                else "."
            )
        )
    ref = (results.get(("ours_dp", WORLD)) or [{}])[0].get("losses")
    ds_runs = [
        results[(x, WORLD)][0] for x in modes if x.startswith("dspipe") and results.get((x, WORLD))
    ]
    if ref and ds_runs:
        drift = max(abs(a - b) / abs(b) for r in ds_runs for a, b in zip(r["losses"], ref))
        rest = [
            results[(x, WORLD)][0]
            for x in modes
            if not x.startswith("dspipe") and results.get((x, WORLD))
        ]
        agree = max(abs(a - b) / abs(b) for r in rest for a, b in zip(r["losses"], ref))
        if drift > 10 * agree:
            out.append(
                f"- DeepSpeed's pipeline starts from the same loss but drifts up to {drift:.1e} "
                f"(relative) from shardspeed DP's over the run, where every other mode stays within "
                f"{agree:.0e}: its fp32 "
                "gradient clipping (`clip_grad_norm_` in deepspeed/runtime/utils.py, used at ZeRO "
                "stage 0) adds a parameter's gradient to the norm only on model-parallel rank 0 "
                "or if the parameter is marked `model_parallel`; the pipeline grid makes the "
                "stages the model-parallel group, so the last stage's gradients are left out of "
                "the norm and the clip factor differs while clipping is active. shardspeed's norm "
                "covers every stage (a tied weight once)."
            )
    dp = med(results, "ours_dp")
    if dp:
        best = max(ours, key=lambda m: med(results, m) or 0)
        out.append(
            f"- Speed: the fastest shardspeed pipeline row ({best}, "
            f"{med(results, best):.0f} tokens/s) runs at {med(results, best) / dp:.2f}x shardspeed "
            "DP. On this machine each rank has one core to itself, so a stage's idle time is "
            "lost outright, and the pipeline pays its bubble, smaller micro-batches (16/m "
            "sequences per pass) and a gloo transfer per micro-batch and direction, while data "
            "parallelism pays one all-reduce of the gradients (4 x 7.4M bytes) and a whole-model "
            "optimizer step per rank. A pipeline is for models that do not fit one device; it "
            "is not expected to beat data parallelism on speed when the model fits, as here."
        )
    pipe_p = rank_values(results, ours[0], lambda r: r["params_local"])
    rss_pipe = [
        max(run["ranks"][r]["peak_rss_mib"] for m in ours for run in results[(m, WORLD)])
        for r in range(WORLD)
    ]
    rss_pipe_min = [
        min(max(run["ranks"][r]["peak_rss_mib"] for run in results[(m, WORLD)]) for m in ours)
        for r in range(WORLD)
    ]
    dp_runs = results.get(("ours_dp", WORLD)) or []
    if dp_runs:
        rss_dp = [max(run["ranks"][r]["peak_rss_mib"] for run in dp_runs) for r in range(WORLD)]
        out.append(
            f"- Memory: a pipeline rank holds {pipe_p[0] / 1e6:.2f}M / {pipe_p[1] / 1e6:.2f}M "
            f"parameters (stage 0 / 1), {pipe_p[0] / n_params:.0%} of the model's "
            f"{n_params / 1e6:.2f}M and not half of it, as the tied embedding (1.08M) lives on "
            f"both stages; its model states are {16 * pipe_p[0] / MIB:.1f} MiB against "
            f"{16 * n_params / MIB:.1f} MiB for a data-parallel replica. Peak RSS per rank, "
            f"interpreter and imports included: shardspeed pipeline {min(rss_pipe_min):.0f}-"
            f"{max(rss_pipe):.0f} MiB depending on schedule and m (the activations of the "
            "micro-batches alive at once, see the memory table), shardspeed DP "
            f"{rss_dp[0]:.0f} / {rss_dp[1]:.0f} MiB."
        )
    return out


def orchestrate(args) -> int:
    n_params = sum(p.numel() for p in GPT().parameters())
    cmd = common.command_line("bench_pipe.py")
    modes = selected_modes(args)
    print(
        f"model: GPT, {n_params / 1e6:.2f}M params ({N_BLOCKS} blocks, d_model {D_MODEL}, "
        f"{N_HEADS} heads, seq {SEQ}, vocab {VOCAB}, tied embedding/head), global batch "
        f"{args.micro_batch * WORLD}, world size {WORLD}, {args.warmup} warm-up + {args.steps} "
        f"timed steps, {args.rounds} round(s), {len(modes)} modes, {args.threads} thread(s) per "
        "process",
        flush=True,
    )
    source = shardspeed_source()
    print(source, flush=True)
    plan = [(mode, WORLD) for mode in modes]
    results, errors, total, tmp, discarded = common.measure(
        HERE, plan, args, prefix="bench_pipe_", width=19
    )
    rows, ratio_table, mode_table = common.summarize(results, errors, comparisons(args))
    bub_table, bub_rows = bubble_table(results, modes)
    loss_lines, losses_ok = loss_checks(results, modes)
    partitions = {}
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if runs and "partition" in runs[0]:
            partitions[mode] = runs[0]["partition"]
    report = {
        "rows": rows,
        "ratio_table": ratio_table,
        "tp_table": throughput_table(results, modes),
        "mode_table": mode_table,
        "mem_table": memory_table(results, modes),
        "bub_table": bub_table,
        "loss_lines": loss_lines,
        "report_line": bubble_report_check(results, modes),
        "findings": findings(results, modes, bub_rows, n_params),
        "partitions": partitions,
        "source": source,
        "load_line": common.load_line(results, discarded, args),
        "results": results,
        "errors": errors,
    }
    for title, key in (
        ("Targets", "ratio_table"),
        ("Throughput (ratios of medians)", "tp_table"),
        ("Per mode", "mode_table"),
        ("Memory per rank", "mem_table"),
        (
            "Bubble: idle share of the step, mean over the timed steps, median over rounds",
            "bub_table",
        ),
    ):
        print(f"\n{title}:\n\n{report[key]}")
    print("\nLosses:\n" + "\n".join(f"- {line}" for line in loss_lines))
    if report["report_line"]:
        print(report["report_line"])
    print("\n".join(report["findings"]))
    print("partitions (layer boundaries):", json.dumps(partitions))
    common.print_run_end(
        total,
        tmp,
        errors,
        load_line=report["load_line"],
        losses_ok=losses_ok,
        source=source,
    )
    if args.write:
        write_section(args, n_params, cmd, total, report)
        print(f"\nupdated {BENCH_MD}")
    return 1 if errors or not losses_ok else 0


def write_section(args, n_params: int, cmd: str, total: float, report: dict) -> None:
    rows, results, errors = report["rows"], report["results"], report["errors"]
    partitions, loss_lines = report["partitions"], report["loss_lines"]
    report_line, load_line = report["report_line"], report["load_line"]
    gb = args.micro_batch * WORLD
    parts = sorted({json.dumps(p) for k, p in partitions.items() if "interleaved" not in k})
    parts_v2 = sorted({json.dumps(p) for k, p in partitions.items() if "interleaved" in k})
    notes = [
        f"- Model: GPT, {n_params / 1e6:.2f}M parameters: token + position embedding (vocab "
        f"{VOCAB}, d_model {D_MODEL}), {N_BLOCKS} pre-norm transformer blocks ({N_HEADS} heads, "
        f"seq {SEQ}, 4x MLP), final LayerNorm, output head tied to the token embedding; fp32. As "
        f"pipeline layers: `[TiedLayerSpec('embed', Embedding), {N_BLOCKS} x LayerSpec(Block), "
        "LayerSpec(LayerNorm), TiedLayerSpec('embed', Embedding, forward_fn=head)]` (11 layers), "
        f"`seed_layers=True, base_seed={BASE_SEED}`; the data-parallel model builds layer i under "
        f"`torch.manual_seed({BASE_SEED} + i)` too, so every mode starts from the same weights. "
        f"Partition method 'parameters' (both libraries' default): layer boundaries {', '.join(parts)} "
        f"on 2 stages ({', '.join(parts_v2)} for the 4 virtual stages of interleaved_1f1b; "
        "shardspeed and DeepSpeed cut alike). The tied embedding (1.08M parameters) is held by "
        "both stages.",
        f"- Same global batch in every mode: {gb} sequences of {SEQ} tokens a step (step i's batch "
        "generated from a seed, the same in every mode: arithmetic progressions over the first "
        f"{USED_VOCAB} token ids, so the loss falls visibly within the run). Pipelines: 2 stages x 1 replica, `gradient_accumulation_steps` "
        f"= m, micro batch {gb}/m, both stages reading the same micro-batches (stage 0 the inputs, "
        f"stage 1 the labels). Data parallelism: 2 replicas, micro batch {args.micro_batch} each, "
        "no accumulation.",
        "- shardspeed pipeline config: "
        f"`{json.dumps(pipe_config(gb, 2) | {'pipeline': {'schedule': '1f1b'}})}` (for m = 2; "
        "m and the micro batch change with m, the schedule per row); DeepSpeed's pipeline gets the "
        "same dict without the `pipeline` key (`deepspeed.pipe.PipelineModule`, the same layer "
        "specs, `seed_layers=True` with `seed_fn=torch.manual_seed` for the build, then "
        "`seed_layers` set to False because DeepSpeed would otherwise reseed every layer in every "
        "forward, which only matters for dropout; DeepSpeed's default seed function fails here: "
        "its 'parameters' partition yields numpy integers and Python 3.11's `random.seed` "
        "refuses them, `TypeError: The only supported seed types are: None, int, float, str, "
        "bytes, and bytearray.`). "
        "Data parallelism: shardspeed and DeepSpeed ZeRO stage 0 with "
        f"`{json.dumps(common.ds_config(args.micro_batch, 0))}`; DDP and FSDP2 (`fully_shard` on "
        "each block, then on the root, default `reshard_after_forward`) with "
        "`torch.optim.AdamW(lr=3e-4)` and `clip_grad_norm_(..., 1.0)`. Optimizers as in the "
        "sections above: shardspeed `torch.optim.AdamW(fused=True)`, DeepSpeed its C++ CPU "
        "FusedAdam, DDP/FSDP2 torch's default (per-tensor loop).",
        f"- Each run: {args.warmup} warm-up steps, then {args.steps} timed steps (barrier before and "
        f"after); tokens/s = {gb} x {SEQ} x steps / time on rank 0. {args.rounds} rounds with the "
        "modes interleaved (order rotated per round); ratios are of medians; per-round ratios "
        f"pair runs of the same round. Threads: {args.threads} per process. Every run is a fresh "
        "`torch.distributed.run --standalone` process group (gloo on CPU: pipeline activations "
        "and gradients go through gloo send/recv); start-up and `initialize` are not timed.",
        "- Bubble columns, each a mean over the timed steps (median over rounds), per stage: "
        "'engine.bubble' is what shardspeed's engine reports after every `train_batch`: 1 - (time "
        "in this stage's forward and backward passes) / (time from the start of the step to this "
        "stage's ReduceGrads, before the optimizer step). 'idle share of the pipeline's window' "
        "uses the same busy times over one window for both stages: the longer of the two stage "
        "windows of that step (each rank's window timed by the benchmark around the engine's "
        "passes and optimizer step). Anything that is not a forward or backward pass counts as "
        "idle: waiting for the other stage, the gloo transfers themselves, loading micro-batches "
        "and the engine's own work between passes. DeepSpeed's rows are the same quantities "
        "timed from outside (its ForwardPass and BackwardPass instructions; the window from the "
        "start of its schedule to its ReduceTiedGrads). The theory (p-1)/(v*m+p-1) assumes equal "
        "stages and free communication; 'estimate from that stage balance' uses the measured "
        "busy time B_s of each stage instead: the step lasts the busier stage's work plus one "
        "micro-batch (chunk) of the other's (the fill before it and the drain after), "
        "T = B_max + B_min/(v*m), and stage s idles 1 - B_s/T (the theory when B_0 = B_1).",
        "- Memory: parameters per rank are the parameters each rank holds (a pipeline stage its "
        "layers plus the tied embedding; FSDP2 its shards); '16 B x parameters' is what fp32 "
        "AdamW needs for them (parameter, gradient, two moments); shardspeed's "
        "`engine.memory_breakdown()` (minus buffers) after the run measures the same for its "
        "modes. Peak RSS is `ru_maxrss` of each rank at the end (max over rounds), interpreter "
        "and imports included (about 0.5 GiB of it). 'micro-batches alive at once': shardspeed's "
        "`engine.peak_live_micro_batches` (the most micro-batches whose activations a stage kept "
        "at one time; interleaved counts (micro-batch, chunk) pairs, a chunk being half a stage's "
        "layers), next to what the schedule's instruction list implies "
        "(`schedule.max_in_flight`); DeepSpeed's number is its activation buffer count "
        "(`num_pipe_buffers`).",
        "- Losses (mean over the global batch; data parallelism averaged over the ranks):",
        *(f"  - {line}" for line in loss_lines),
    ]
    if report_line:
        notes.append(f"- {report_line}")
    notes.extend(report["findings"])
    notes += common.closing_notes(
        load_line,
        results,
        rows,
        args,
        errors,
        with_world=True,
        markers=("Error", "terminate", "exception"),
        width=300,
    )
    blocks = [
        report["ratio_table"],
        ("Throughput, every mode (ratios of median tokens/s):", report["tp_table"]),
        ("Per mode:", report["mode_table"]),
        ("Memory per rank:", report["mem_table"]),
        (
            "Bubble (idle share of a step; mean over the timed steps, median over rounds):",
            report["bub_table"],
        ),
    ]
    section = common.section_text(SECTION_TITLE, cmd, total, blocks, notes, source=report["source"])
    common.write_markdown(section, SECTION_TITLE, BENCH_MD)


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.set_defaults(warmup=2, steps=8)
    p.add_argument(
        "--ms",
        type=int,
        nargs="+",
        default=list(MICRO_BATCH_COUNTS),
        help="micro-batch counts m for the pipelines (default 2 4 8; even, dividing the global "
        "batch = 2 x --micro-batch)",
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        choices=list(SCHEDULES),
        help="shardspeed pipeline schedules (default all)",
    )
    p.add_argument(
        "--baselines",
        nargs="*",
        default=["deepspeed"],
        choices=["deepspeed"],
        help="'deepspeed' runs DeepSpeed's PipelineEngine at each m (default); give none to skip",
    )
    p.add_argument(
        "--dp-modes",
        nargs="*",
        default=list(DP_MODES),
        choices=list(DP_MODES),
        help="data-parallel baselines (default all)",
    )
    common.add_noise_args(p, budget=700.0)
    common.add_smoke_arg(p, "every mode runs: 1 round, 1 warm-up + 2 timed steps")
    common.add_write_args(p)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    gb = args.micro_batch * WORLD
    bad = [m for m in args.ms if m < 1 or gb % m or m % WORLD]
    if bad:
        p.error(f"--ms: {bad} must be multiples of {WORLD} dividing the global batch {gb}")
    common.apply_smoke(p, args, rounds=1, warmup=1, steps=2, wait_idle=0.0, retries=0)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
