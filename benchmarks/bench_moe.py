"""Mixture of experts on 2 ranks: expert parallelism (EP2) against pure data parallelism.

One invocation measures, on the same MoE GPT (4 transformer blocks whose MLP is an MoE layer of
8 experts, each a 2-layer GELU MLP 256 -> 512 -> 256; top-1 gating, capacity factor 1.25, tokens
over capacity dropped, no random token selection; loss = LM loss + 0.01 x the sum of the layers'
l_aux) and the same global batch (16 sequences a step), at world size 2 (gloo on CPU), fp32,
AdamW, gradient clipping 1.0:

  shardspeed EP2: `MoE(ep_size=2)`, 4 experts a rank, data parallel over the rest, at ZeRO
  stage 0 and 2; shardspeed DP: `MoE(ep_size=1)`, every rank all 8 experts, at ZeRO stage 0 and 2;
  torch DDP and torch FSDP2 (fully_shard) on the ep_size=1 model (shardspeed's MoE module);
  DeepSpeed (`deepspeed.moe.layer.MoE`) at ep_size 2 and 1, ZeRO stage 0 and 2;

and reports tokens/s with ratios, ms/step, per rank the parameters held, the model-state bytes
and the peak RSS, the all-to-all and gradient-reduction bytes of a step, the expert load
(imbalance: busiest expert's tokens over the mean, per layer; tokens dropped) and the first-step
loss of every mode against shardspeed DP's. The script is both the orchestrator and the worker:
every measured run is ``python -m torch.distributed.run ... bench_moe.py --worker MODE``.

    .venv/bin/python benchmarks/bench_moe.py --smoke      # every mode once, 1+2 steps
    .venv/bin/python benchmarks/bench_moe.py              # measure, print the tables
    .venv/bin/python benchmarks/bench_moe.py --write      # ... and update BENCHMARKS.md

See benchmarks/README.md.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import common
from bench_pipe import BASE_SEED, MIB, Embedding, global_batches, head, loss_fn, med
from bench_tp import CommCounter, current_rss_mib, local_numel, pair, rank_values
from bench_zero import KINDS, Census, census_deepspeed, census_fsdp2
from common import BENCH_MD, CLIP, D_MODEL, LR, N_HEADS, SEQ, VOCAB, ratio_text, shardspeed_source

HERE = Path(__file__).resolve()
SECTION_TITLE = "## Mixture of experts: expert parallelism (EP2) vs data parallelism"
WORLD = 2
N_BLOCKS = 4
NUM_EXPERTS = 8
EXPERT_HIDDEN = 2 * D_MODEL
TOP_K = 1
CAPACITY_FACTOR = 1.25
MIN_CAPACITY = 4
AUX_WEIGHT = 0.01
GATE_SEED = 7000  # block b's gate weight: torch.manual_seed(GATE_SEED + b)
EXPERT_SEED = 9000  # expert g of block b: torch.manual_seed(EXPERT_SEED + 100 * b + g)
MOE_KWARGS = dict(
    num_experts=NUM_EXPERTS,
    k=TOP_K,
    capacity_factor=CAPACITY_FACTOR,
    min_capacity=MIN_CAPACITY,
    drop_tokens=True,
    use_rts=False,
)


@dataclass(frozen=True)
class Mode:
    lib: str  # "ours", "deepspeed", "ddp", "fsdp2"
    ep: int  # expert-parallel size of the MoE layers
    stage: int | None  # ZeRO stage (None: torch)
    what: str = ""


MODES: dict[str, Mode] = {
    "ours_ep2": Mode("ours", 2, 0, "shardspeed EP2 (ep_size 2, 4 experts a rank), ZeRO stage 0"),
    "ours_ep2_s2": Mode("ours", 2, 2, "shardspeed EP2, ZeRO stage 2"),
    "ours_dp": Mode("ours", 1, 0, "shardspeed DP (ep_size 1, all 8 experts a rank), stage 0"),
    "ours_dp_s2": Mode("ours", 1, 2, "shardspeed DP, ZeRO stage 2"),
    "ddp": Mode("ddp", 1, None, "torch DDP, ep_size 1 model"),
    "fsdp2": Mode("fsdp2", 1, None, "torch FSDP2 (fully_shard per block and root), ep_size 1"),
    "deepspeed_ep2": Mode("deepspeed", 2, 0, "DeepSpeed MoE ep_size 2, ZeRO stage 0"),
    "deepspeed_ep2_s2": Mode("deepspeed", 2, 2, "DeepSpeed MoE ep_size 2, ZeRO stage 2"),
    "deepspeed_dp": Mode("deepspeed", 1, 0, "DeepSpeed MoE ep_size 1, ZeRO stage 0"),
    "deepspeed_dp_s2": Mode("deepspeed", 1, 2, "DeepSpeed MoE ep_size 1, ZeRO stage 2"),
}


class A2ACounter(CommCounter):
    """bench_tp's collective counter, all-to-all included; a collective over a group of one rank
    (which moves nothing) is counted under its name + "@1" (e.g. "all_reduce@1")."""

    NAMES = (*CommCounter.NAMES, "all_to_all_single", "reduce")
    a2a_seconds = 0.0  # time inside all_to_all_single, counted whether active or not

    def _wrap(self, name: str, fn):
        import torch.distributed as dist

        counted = super()._wrap(name, fn)
        alone = super()._wrap(f"{name}@1", fn)

        def by_group(*args, **kwargs):
            group = kwargs.get("group")
            one = group is not None and dist.get_world_size(group) == 1
            if name != "all_to_all_single":
                return (alone if one else counted)(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return (alone if one else counted)(*args, **kwargs)
            finally:
                self.a2a_seconds += time.perf_counter() - t0

        return by_group


class ForwardTimer:
    """Seconds spent in the forward of the given modules (forward pre-hook to forward hook) and,
    with `inner` (a function returning a running total of seconds), how much of `inner`'s
    total grew inside those forwards."""

    def __init__(self, modules, inner=None) -> None:
        self.seconds = self.inner_seconds = 0.0
        self.inner = inner or (lambda: 0.0)
        self._start: dict[int, tuple[float, float]] = {}
        for m in modules:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    def _pre(self, module, _args) -> None:
        self._start[id(module)] = (time.perf_counter(), self.inner())

    def _post(self, module, _args, _out) -> None:
        t0, i0 = self._start.pop(id(module))
        self.seconds += time.perf_counter() - t0
        self.inner_seconds += self.inner() - i0


# --------------------------------------------------------------------------------------------
# The model: bench_pipe's GPT with 4 blocks whose MLP is an MoE layer
# --------------------------------------------------------------------------------------------


def make_expert() -> nn.Module:
    return nn.Sequential(
        nn.Linear(D_MODEL, EXPERT_HIDDEN), nn.GELU(), nn.Linear(EXPERT_HIDDEN, D_MODEL)
    )


def moe_class(lib: str):
    if lib == "deepspeed":
        from deepspeed.moe.layer import MoE
    else:
        from shardspeed.moe.layer import MoE
    return MoE


class MoEBlock(nn.Module):
    """bench_pipe's pre-norm block (same draws for its norms and attention under the same seed)
    with the 4x MLP replaced by an MoE layer. The gate and every expert are set from seeds of
    their own (expert g of block b from EXPERT_SEED + 100 b + g, g the global expert index), so
    both libraries' layers at any ep_size hold the same weights."""

    def __init__(self, index: int, moe_cls, ep: int, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED + 1 + index)
        d = D_MODEL
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.moe = moe_cls(d, make_expert(), ep_size=ep, **MOE_KWARGS)
        layer = self.moe.deepspeed_moe
        local = NUM_EXPERTS // ep
        with torch.no_grad():
            torch.manual_seed(GATE_SEED + index)
            layer.gate.wg.weight.copy_(nn.Linear(d, NUM_EXPERTS, bias=False).weight)
            for i, expert in enumerate(layer.experts.deepspeed_experts):
                torch.manual_seed(EXPERT_SEED + 100 * index + ep_rank * local + i)
                expert.load_state_dict(make_expert().state_dict())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, N_HEADS, d // N_HEADS).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out, l_aux, _counts = self.moe(self.ln2(x))
        return x + out, l_aux


class MoEGPT(nn.Module):
    """Embedding (tied head), N_BLOCKS MoE blocks, final norm; loss = LM loss + AUX_WEIGHT x sum
    of l_aux. `ep_rank` says which global experts this rank's local ones are (ep > 1)."""

    def __init__(self, lib: str, ep: int, ep_rank: int) -> None:
        super().__init__()
        moe_cls = moe_class(lib)
        torch.manual_seed(BASE_SEED + 0)
        self.embed = Embedding()
        self.blocks = nn.ModuleList(MoEBlock(i, moe_cls, ep, ep_rank) for i in range(N_BLOCKS))
        torch.manual_seed(BASE_SEED + 1 + N_BLOCKS)
        self.ln_f = nn.LayerNorm(D_MODEL)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return loss_fn(head(self.embed, self.ln_f(x)), labels) + AUX_WEIGHT * aux


def ds_capacity(tokens: int) -> int:
    """Slots per expert with drop_tokens: ceil(tokens / experts x factor x k), at least
    min_capacity (both libraries' formula; exact for these numbers)."""
    return max(math.ceil(tokens / NUM_EXPERTS * CAPACITY_FACTOR * TOP_K), MIN_CAPACITY)


def config(micro_batch: int, stage: int) -> dict:
    """The config given verbatim to shardspeed and DeepSpeed (ep_size lives in the model)."""
    return common.ds_config(micro_batch, stage=stage)


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def census_plain(params, opt) -> dict:
    """Parameters (local shards), gradients and optimizer state of a torch optimizer (or of
    DeepSpeed's at stage 0, where `engine.optimizer` is the basic optimizer itself)."""
    c = Census()
    params = list(params)
    c.add("parameters", params)
    c.add("gradients", [p.grad for p in params])
    c.add("master_weights", [])
    inner = getattr(opt, "optimizer", opt)
    states = [v for s in inner.state.values() for v in s.values()]
    c.add("optimizer_states", [v for v in states if hasattr(v, "untyped_storage")])
    return {k: c.bytes.get(k, 0) for k in KINDS}


def worker(args) -> None:
    mode = args.worker
    spec = MODES[mode]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    comm = A2ACounter(dist)  # before shardspeed or DeepSpeed binds any collective
    rank, world = common.worker_setup(args.threads)
    global_batch = args.micro_batch * world
    n_steps = args.warmup + args.steps
    lo = rank * args.micro_batch
    batches = [
        (x[lo : lo + args.micro_batch], y[lo : lo + args.micro_batch])
        for x, y in global_batches(n_steps + 1, global_batch)  # + 1: the measured step
    ]
    extra: dict = {"lib": spec.lib, "ep": spec.ep, "stage": spec.stage}
    extra["global_batch"] = global_batch
    losses: list[torch.Tensor] = []
    loads: list[list[list[float]]] = []  # per step, per layer: [imbalance, demand imb., dropped]

    ep_rank = rank % spec.ep
    model = MoEGPT(spec.lib, spec.ep, ep_rank)
    moe_layers = [b.moe for b in model.blocks]
    extra["params_total_built"] = sum(p.numel() for p in model.parameters())
    tokens = args.micro_batch * SEQ

    def summed_load(demand: list, kept: list) -> None:
        """Per layer: this rank's [demand, kept] counts summed over the ranks (one all-reduce)."""
        counts = torch.stack([torch.stack([d, k]) for d, k in zip(demand, kept)]).to(torch.int64)
        dist.all_reduce(counts)
        row = []
        for layer in counts:
            d, k = layer[0].float(), layer[1].float()
            row.append(
                [
                    (k.max() / k.mean()).item(),
                    (d.max() / d.mean()).item(),
                    (d.sum() - k.sum()).item(),
                ]
            )
        loads.append(row)

    if spec.lib in ("ddp", "fsdp2"):
        if spec.lib == "ddp":
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
                "fully_shard(block) per block, then fully_shard(model) (default "
                "reshard_after_forward), torch.optim.AdamW(lr=3e-4)"
            )
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        params = list(model.parameters())

        def forward(x, y):
            return module(x, y)

        def backward(loss):
            loss.backward()

        def update():
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def telemetry():
            got = [m.expert_load() for m in moe_layers]
            summed_load([g["exp_counts"] for g in got], [g["tokens_per_expert"] for g in got])

        def census():
            if spec.lib == "fsdp2":
                return {k: v for k, v in census_fsdp2(model, opt).items() if k in KINDS}
            return census_plain(params, opt)

    else:
        if spec.lib == "ours":
            import shardspeed as lib
            from shardspeed.comm import comm_volume, reset_comm_volume
        else:
            import deepspeed as lib

            lib.init_distributed(dist_backend="gloo")
        cfg = config(args.micro_batch, spec.stage)
        extra["config"] = cfg
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        params = list(engine.module.parameters())
        # Which global experts this rank holds, as the library placed them (the model was
        # built assuming ep_rank = rank % ep).
        if spec.lib == "ours":
            placed = moe_layers[0].global_expert_index(0)
        else:
            from deepspeed.utils import groups

            name = moe_layers[0].expert_group_name
            placed = groups._get_expert_parallel_rank(name) * (NUM_EXPERTS // spec.ep)
        if placed != ep_rank * (NUM_EXPERTS // spec.ep):
            raise SystemExit(
                f"rank {rank}: local expert 0 is global expert {placed}, the model was built "
                f"for {ep_rank * (NUM_EXPERTS // spec.ep)}"
            )
        opt = engine.optimizer
        inner = getattr(opt, "optimizer", None)
        extra["settings"] = type(opt).__name__ + (
            f" over {type(inner).__name__}" if inner is not None else ""
        )

        def forward(x, y):
            return engine(x, y)

        def backward(loss):
            engine.backward(loss)

        def update():
            engine.step()

        if spec.lib == "ours":

            def telemetry():
                report = engine.expert_load(over_data_parallel=True)
                row = []
                for load in report.values():
                    d = load["exp_counts"].float()
                    row.append(
                        [load["imbalance"], (d.max() / d.mean()).item(), float(load["dropped"])]
                    )
                loads.append(row)

            def census():
                mem = engine.memory_breakdown()
                return {k: mem[k] for k in KINDS} | {"breakdown_total": mem["total"]}

        else:
            capacity = ds_capacity(tokens)

            def telemetry():
                demand = [m.deepspeed_moe.exp_counts for m in moe_layers]
                summed_load(demand, [d.clamp(max=capacity) for d in demand])

            def census():
                if spec.stage == 0:
                    return census_plain(params, opt)
                return {k: v for k, v in census_deepspeed(engine).items() if k in KINDS}

    moe_timer = ForwardTimer(moe_layers, inner=lambda: comm.a2a_seconds)
    expert_timer = ForwardTimer(m.deepspeed_moe.experts for m in moe_layers)
    # Per step (s): MoE forward, experts' forward, all-to-all (all), all-to-all in the forward.
    times: list[list[float]] = []

    def clocks():
        return (
            moe_timer.seconds,
            expert_timer.seconds,
            comm.a2a_seconds,
            moe_timer.inner_seconds,
        )

    def step(x, y):
        start = clocks()
        loss = forward(x, y)
        backward(loss)
        update()
        end = clocks()
        times.append([b - a for a, b in zip(start, end)])
        telemetry()
        losses.append(loss.detach())
        return loss

    n_local = local_numel(params)
    expert_local = local_numel(p for n, p in model.named_parameters() if "deepspeed_experts" in n)
    rss_init = current_rss_mib()
    result = common.timed_run(
        step,
        batches[:n_steps],
        args,
        mode=mode,
        rank=rank,
        world=world,
        n_params=n_local,
        barrier=dist.barrier,
    )
    peak_train = common.peak_rss_mib()

    # One more step, outside the timed window: the collectives it makes (counted at the
    # torch.distributed calls; shardspeed's own count too) and the model states after backward.
    dist.barrier()
    if spec.lib == "ours":
        reset_comm_volume()
    comm.active = True
    x, y = batches[n_steps]
    loss = forward(x, y)
    backward(loss)
    comm.active = False
    states = census()
    comm.active = True
    update()
    comm.active = False
    result["comm_calls"], result["comm_bytes"] = dict(comm.calls), dict(comm.bytes)
    if spec.lib == "ours":
        result["comm_volume"] = comm_volume()

    loss_t = torch.stack(losses[:n_steps]).float()
    dist.all_reduce(loss_t)
    loss_t /= world
    result["losses"] = loss_t.tolist()
    result["first_loss"], result["last_loss"] = result["losses"][0], result["losses"][-1]
    result["tokens_per_s"] = args.steps * global_batch * SEQ / result["elapsed_s"]
    result["params_local"] = n_local
    result["expert_params_local"] = expert_local
    result["param_bytes_local"] = 4 * n_local
    result["model_states"] = states
    timed = slice(args.warmup, n_steps)
    result["loads"] = loads[:n_steps]
    result["loads_timed"] = loads[timed]
    result["times_timed"] = times[timed]
    result.update(extra)
    result["rss_after_init_mib"] = rss_init
    result["peak_rss_train_mib"] = peak_train
    result["peak_rss_mib"] = common.peak_rss_mib()
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------

# A mode's DeepSpeed counterpart (same ep_size and ZeRO stage).
DS_TWIN = {
    "ours_ep2": "deepspeed_ep2",
    "ours_ep2_s2": "deepspeed_ep2_s2",
    "ours_dp": "deepspeed_dp",
    "ours_dp_s2": "deepspeed_dp_s2",
}


def comparisons(modes) -> list:
    """Targets where both sides run the same thing (shardspeed against DeepSpeed at the same
    ep_size and stage, shardspeed DP against DDP); EP against DP is information."""
    rows = [
        ("ours_dp", "ddp", 1.0, "shardspeed DP (stage 0) vs torch DDP"),
        ("ours_dp", "deepspeed_dp", 1.0, "shardspeed DP vs DeepSpeed DP (ep 1, stage 0)"),
        ("ours_ep2", "deepspeed_ep2", 1.0, "shardspeed EP2 vs DeepSpeed EP2 (stage 0)"),
        ("ours_dp_s2", "deepspeed_dp_s2", 1.0, "shardspeed DP vs DeepSpeed DP (stage 2)"),
        ("ours_ep2_s2", "deepspeed_ep2_s2", 1.0, "shardspeed EP2 vs DeepSpeed EP2 (stage 2)"),
        ("ours_ep2", "ours_dp", None, "shardspeed EP2 vs shardspeed DP (stage 0)"),
        ("ours_ep2_s2", "ours_dp_s2", None, "shardspeed EP2 vs shardspeed DP (stage 2)"),
        ("ours_ep2", "ddp", None, "shardspeed EP2 vs torch DDP"),
        ("ours_ep2", "fsdp2", None, "shardspeed EP2 vs torch FSDP2"),
        ("ours_dp", "fsdp2", None, "shardspeed DP vs torch FSDP2"),
        ("deepspeed_ep2", "deepspeed_dp", None, "DeepSpeed EP2 vs DeepSpeed DP (stage 0)"),
    ]
    return common.comparisons_among(rows, modes, WORLD)


def throughput_table(results, modes) -> str:
    base = {b: med(results, b) for b in ("ddp", "fsdp2", "ours_dp")}
    lines = [
        "| mode | what runs | tokens/s (median) | ms/step | / DDP | / FSDP2 | / shardspeed DP "
        "| / DeepSpeed (same ep, stage) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        tps = med(results, mode)
        if tps is None:
            lines.append(f"| {mode} | {MODES[mode].what} | failed | - | - | - | - | - |")
            continue
        twin = med(results, DS_TWIN[mode]) if mode in DS_TWIN else None
        lines.append(
            f"| {mode} | {MODES[mode].what} | {tps:.0f} | {med(results, mode, 'step_ms'):.0f} | "
            f"{ratio_text(tps, base['ddp'])} | {ratio_text(tps, base['fsdp2'])} | "
            f"{ratio_text(tps, base['ours_dp'])} | {ratio_text(tps, twin)} |"
        )
    return "\n".join(lines)


def states_total(r: dict) -> int:
    return sum(r["model_states"][k] for k in KINDS)


def memory_table(results, modes) -> str:
    lines = [
        "| mode | parameters per rank (rank 0 / 1) | of which expert parameters | parameter "
        "bytes (MiB) | model states (MiB, rank 0 / 1): total (parameters + gradients + fp32 "
        "master copies + optimizer states) | "
        "`memory_breakdown()` total (MiB) | peak RSS per rank (MiB) | RSS growth in training "
        "(MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if not runs:
            continue
        params = rank_values(results, mode, lambda r: r["params_local"])
        experts = rank_values(results, mode, lambda r: r["expert_params_local"])
        states = rank_values(results, mode, states_total)
        parts = [
            pair(rank_values(results, mode, lambda r, k=k: r["model_states"][k]), scale=MIB)
            for k in KINDS
        ]
        total = rank_values(results, mode, lambda r: r["model_states"].get("breakdown_total", 0))
        rss = [max(run["ranks"][r]["peak_rss_mib"] for run in runs) for r in range(WORLD)]
        growth = rank_values(
            results, mode, lambda r: r["peak_rss_train_mib"] - r["rss_after_init_mib"]
        )
        lines.append(
            f"| {mode} | {pair(params, '{:.2f}M', 1e6)} | {pair(experts, '{:.2f}M', 1e6)} | "
            f"{pair(params, scale=MIB / 4)} | {pair(states, scale=MIB)} ({' + '.join(parts)}) | "
            + (pair(total, scale=MIB) if any(total) else "-")
            + f" | {pair(rss, '{:.0f}')} | {pair(growth, '{:.0f}')} |"
        )
    return "\n".join(lines)


GRAD_REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce")


def comm_summary(r: dict) -> dict:
    """One step's collectives on one rank: all-to-all (shardspeed: its comm_volume; others: the
    torch.distributed counter), gradient reductions, the rest."""
    calls, nbytes = r.get("comm_calls") or {}, r.get("comm_bytes") or {}
    vol = r.get("comm_volume")
    if vol is not None:
        a2a = vol.get("all_to_all", {"calls": 0, "bytes": 0})
        a2a_calls, a2a_bytes = a2a["calls"], a2a["bytes"]
    else:
        a2a_calls, a2a_bytes = calls.get("all_to_all_single", 0), nbytes.get("all_to_all_single", 0)
    alone = [f"{n}@1" for n in GRAD_REDUCTIONS]
    rest = {
        n: (calls[n], nbytes.get(n, 0))
        for n in sorted(calls)
        if n not in (*GRAD_REDUCTIONS, *alone, "all_to_all_single")
    }
    return {
        "a2a_calls": a2a_calls,
        "a2a_bytes": a2a_bytes,
        "a2a_seen": (calls.get("all_to_all_single", 0), nbytes.get("all_to_all_single", 0)),
        "red_calls": sum(calls.get(n, 0) for n in GRAD_REDUCTIONS),
        "red_bytes": sum(nbytes.get(n, 0) for n in GRAD_REDUCTIONS),
        "alone_calls": sum(calls.get(n, 0) for n in alone),
        "alone_bytes": sum(nbytes.get(n, 0) for n in alone),
        "rest": rest,
    }


def load_stats(r: dict) -> dict:
    """Mean over the timed steps of: the largest per-layer imbalance, the largest per-layer
    demand imbalance, tokens dropped (all layers, both ranks)."""
    steps = r["loads_timed"]
    return {
        "imbalance": statistics.fmean(max(layer[0] for layer in s) for s in steps),
        "demand": statistics.fmean(max(layer[1] for layer in s) for s in steps),
        "dropped": statistics.fmean(sum(layer[2] for layer in s) for s in steps),
        "first_imbalance": max(layer[0] for layer in r["loads"][0]),
        "first_dropped": sum(layer[2] for layer in r["loads"][0]),
    }


def moe_table(results, modes) -> str:
    lines = [
        "| mode | all-to-all per step (calls, MiB, per rank) | gradient reduction per step "
        "(all-reduce, reduce-scatter, reduce; MiB per rank) | other collectives | imbalance, max over "
        "layers (mean over steps) | router demand imbalance | tokens dropped per step (of "
        f"{N_BLOCKS} x 2048) | first-step loss |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if not runs:
            continue
        r0 = runs[0]["ranks"][0]
        c = comm_summary(r0)
        a2a = f"{c['a2a_calls']} x, {c['a2a_bytes'] / MIB:.1f}"
        if r0.get("comm_volume") is not None:
            a2a += " (comm_volume)"
        if MODES[mode].lib == "ddp":
            red = f"{4 * r0['params_local'] / MIB:.1f} (computed: DDP reduces in C++, not seen)"
        else:
            red = f"{c['red_bytes'] / MIB:.1f} ({c['red_calls']} calls)"
            if c["alone_calls"]:
                red += (
                    f"; plus {c['alone_bytes'] / MIB:.1f} MiB in {c['alone_calls']} calls over "
                    "1-rank groups"
                )
        rest = ", ".join(f"{n} {k} x ({b / MIB:.1f} MiB)" for n, (k, b) in c["rest"].items())
        stats = [load_stats(run["ranks"][0]) for run in runs]
        lines.append(
            f"| {mode} | {a2a} | {red} | {rest or '-'} | "
            f"{statistics.median(s['imbalance'] for s in stats):.2f} | "
            f"{statistics.median(s['demand'] for s in stats):.2f} | "
            f"{statistics.median(s['dropped'] for s in stats):.0f} | "
            f"{runs[0]['first_loss']:.6f} |"
        )
    return "\n".join(lines)


def time_table(results, modes) -> str:
    lines = [
        f"| mode | ms/step | MoE layers' forward ({N_BLOCKS} layers) | of which experts | of "
        "which all-to-alls | of which the rest (gate, dispatch, combine) | all-to-alls in the "
        "backward |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        t = step_times(results, mode)
        if t is None:
            continue
        moe, experts, a2a, a2a_fwd = t
        lines.append(
            f"| {mode} | {med(results, mode, 'step_ms'):.0f} | {moe:.0f} | {experts:.0f} | "
            f"{a2a_fwd:.0f} | {moe - experts - a2a_fwd:.0f} | {a2a - a2a_fwd:.0f} |"
        )
    return "\n".join(lines)


def loss_checks(results, modes) -> tuple[list[str], bool]:
    """First-step loss of every mode against shardspeed DP's (same weights, batch and routing
    code: within 1e-5 relative for shardspeed, DDP and FSDP2), DeepSpeed's EP2 against its DP,
    and whether every loss falls."""
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
        text = f"{mode}: loss {losses[0]:.6f} -> {losses[-1]:.6f} over {len(losses)} steps"
        text += "" if falls else " (NOT falling)"
        if ref and mode != "ours_dp":
            first = abs(losses[0] - ref[0]) / abs(ref[0])
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            strict = MODES[mode].lib != "deepspeed"
            within = first <= 1e-5
            if strict:
                ok &= within
            text += (
                f"; first-step loss vs shardspeed DP: {first:.1e} relative"
                + (f" ({'within' if within else 'OUTSIDE'} 1e-5)" if strict else "")
                + f", largest over all steps {worst:.1e}"
            )
        lines.append(text)
    ds = [results.get((m, WORLD)) for m in ("deepspeed_ep2", "deepspeed_dp")]
    if all(ds):
        a, b = ds[0][0]["losses"], ds[1][0]["losses"]
        first = abs(a[0] - b[0]) / abs(b[0])
        ok &= first <= 1e-5
        lines.append(
            f"DeepSpeed EP2 vs DeepSpeed DP: first-step loss {first:.1e} relative "
            f"({'within' if first <= 1e-5 else 'OUTSIDE'} 1e-5), largest over all steps "
            f"{max(abs(x - y) / abs(y) for x, y in zip(a, b)):.1e}"
        )
    return lines, ok


def step_times(results, mode: str) -> list[float] | None:
    """Rank 0's [MoE forward, experts' forward, all-to-all, all-to-all in the MoE forward] ms per
    step (mean over the timed steps, median over rounds)."""
    if not results.get((mode, WORLD)):
        return None
    return [
        rank_values(
            results, mode, lambda r, i=i: 1000 * statistics.fmean(s[i] for s in r["times_timed"])
        )[0]
        for i in range(4)
    ]


def findings(results, modes, n_params: int, n_expert: int) -> list[str]:
    """What the figures say, computed from them."""
    out = []

    def first(mode):
        runs = results.get((mode, WORLD)) or []
        return runs[0]["ranks"][0] if runs else None

    ep, dp = first("ours_ep2"), first("ours_dp")
    if ep and dp:
        s_ep, s_dp = states_total(ep), states_total(dp)
        out.append(
            f"- Memory: at ep 2 a rank holds {ep['params_local'] / 1e6:.2f}M parameters "
            f"({ep['expert_params_local'] / 1e6:.2f}M of them expert weights) against "
            f"{dp['params_local'] / 1e6:.2f}M ({dp['expert_params_local'] / 1e6:.2f}M) at ep 1: "
            f"the experts are {n_expert / n_params:.0%} of this model and EP2 keeps half of them "
            f"a rank. Model states (parameters, gradients, AdamW's two moments) fall from "
            f"{s_dp / MIB:.1f} to {s_ep / MIB:.1f} MiB a rank ({s_ep / s_dp:.2f}x) at stage 0."
        )
        ep2, dp2 = first("ours_ep2_s2"), first("ours_dp_s2")
        if ep2 and dp2:
            s_ep2, s_dp2 = states_total(ep2), states_total(dp2)
            out.append(
                f"- ZeRO stage 2 and EP: at stage 2 EP2 holds {s_ep2 / MIB:.1f} MiB of model "
                f"states a rank and DP {s_dp2 / MIB:.1f} MiB. Stage 2 shards the gradients and "
                "optimizer states of each weight over the ranks that hold it: the shared weights "
                "over both ranks in either mode, every expert at ep 1 over both ranks too, while "
                "at ep 2 an expert lives on one rank (its expert-data group has one rank), so its "
                "gradient and moments stay whole there. Against DP at stage 0 "
                f"({s_dp / MIB:.1f} MiB), stage 2 alone saves {(s_dp - s_dp2) / MIB:.1f} MiB, "
                f"EP2 alone {(s_dp - s_ep) / MIB:.1f} MiB (it also drops the expert parameters "
                f"themselves, which stage 2 keeps whole), both {(s_dp - s_ep2) / MIB:.1f} MiB."
            )
        c_ep, c_dp = comm_summary(ep), comm_summary(dp)
        ds = first("deepspeed_ep2")
        ds_alone = comm_summary(ds) if ds else None
        out.append(
            f"- Communication per step and rank: EP2 makes {c_ep['a2a_calls']} all-to-alls "
            f"({c_ep['a2a_bytes'] / MIB:.1f} MiB payload: per MoE layer 2 in forward, tokens to "
            "their expert's rank and the results back, and 2 in backward, each a [8 experts, "
            f"{ds_capacity(ep['global_batch'] // WORLD * SEQ)} slots, 256] fp32 tensor, padding "
            "slots included; a rank keeps half of each payload, its own chunk) and reduces "
            f"{c_ep['red_bytes'] / MIB:.1f} MiB of gradients over both ranks (the shared "
            f"weights), against DP's {c_dp['red_bytes'] / MIB:.1f} MiB all-reduce of every "
            "gradient and no all-to-all. The expert gradients' reduction runs over the "
            "expert-data group, which has one rank here, and moves nothing, but both libraries "
            f"still call it: shardspeed {c_ep['alone_calls']} all-reduces "
            f"({c_ep['alone_bytes'] / MIB:.1f} MiB) a step"
            + (
                f", DeepSpeed {ds_alone['alone_calls']} ({ds_alone['alone_bytes'] / MIB:.1f} MiB)"
                if ds_alone
                else ""
            )
            + "; the tables count them apart."
        )
    tp_ep, tp_dp = med(results, "ours_ep2"), med(results, "ours_dp")
    t_ep, t_dp = step_times(results, "ours_ep2"), step_times(results, "ours_dp")
    if tp_ep and tp_dp:
        tp_ep2, tp_dp2 = med(results, "ours_ep2_s2"), med(results, "ours_dp_s2")
        out.append(
            f"- Speed, EP2 against DP: shardspeed EP2 runs at {tp_ep / tp_dp:.2f}x shardspeed "
            "DP at stage 0"
            + (f" ({tp_ep2 / tp_dp2:.2f}x at stage 2)" if tp_ep2 and tp_dp2 else "")
            + ". Each rank does the same expert work either way (k = 1 and a fixed capacity: at "
            "ep 2 a rank runs its 4 experts on the slots of both ranks, at ep 1 all 8 on its own "
            f"slots; experts' forward {t_ep[1]:.0f} against {t_dp[1]:.0f} ms a step), so on 2 "
            "CPU cores EP cannot win compute. It saves the expert part of the gradient "
            "all-reduce and half of the optimizer step, and pays the all-to-alls, "
            f"{t_ep[2]:.0f} ms a step on rank 0 (forward and backward; wall time inside the calls, "
            "waiting for the other rank included), which sit on the critical path: every MoE "
            "layer waits for its tokens (gloo over one host copies them through the loopback), "
            "where DP's gradient all-reduce is a single call at the end. What EP "
            "buys is the memory above, which lets the expert count grow past what one rank holds."
        )
    ds_ep, ds_dp = med(results, "deepspeed_ep2"), med(results, "deepspeed_dp")
    t_ds, t_dd = step_times(results, "deepspeed_ep2"), step_times(results, "deepspeed_dp")
    if tp_ep and ds_ep and t_ep and t_ds:
        out.append(
            f"- Against DeepSpeed: shardspeed EP2 runs at {tp_ep / ds_ep:.2f}x DeepSpeed EP2"
            + (f", shardspeed DP at {tp_dp / ds_dp:.2f}x DeepSpeed DP" if tp_dp and ds_dp else "")
            + ". Per step on rank 0 at ep 2, shardspeed against DeepSpeed: the experts' forward "
            f"{t_ep[1]:.0f} against {t_ds[1]:.0f} ms, the all-to-alls {t_ep[2]:.0f} against "
            f"{t_ds[2]:.0f} ms (forward and backward), and the rest of the MoE forward (gate, "
            f"dispatch, combine) {t_ep[0] - t_ep[1] - t_ep[3]:.0f} against "
            f"{t_ds[0] - t_ds[1] - t_ds[3]:.0f} ms"
            + (
                f"; at ep 1 that rest is {t_dp[0] - t_dp[1]:.0f} against {t_dd[0] - t_dd[1]:.0f} ms"
                if t_dp and t_dd
                else ""
            )
            + ". Both libraries move tokens into the [experts, capacity, 256] buffer by index "
            "and back (DeepSpeed's `_sparse_encode` / `_sparse_decode` in "
            "deepspeed/moe/sharded_moe.py; shardspeed's `index_copy` / `index_add` over the kept "
            "assignments), so the layers cost about the same; the step-time differences are the "
            "optimizers and the gradient reduction (see the sections above). DDP and FSDP2 run "
            "shardspeed's layer."
        )
    ref, dsr = first("ours_dp"), first("deepspeed_dp")
    if ref and dsr:
        same = 0
        for a, b in zip(ref["loads"][0], dsr["loads"][0]):
            if [round(v, 4) for v in a] != [round(v, 4) for v in b]:
                break
            same += 1
        rel = abs(dsr["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
        layers = "the first MoE layer routes" if same == 1 else f"the first {same} MoE layers route"
        agree_text = (
            f" and {layers} identically on step 1 (the same demand, imbalance and dropped count)"
            if same
            else ""
        )
        worst_same = max(
            abs(r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
            for m in modes
            if MODES[m].lib != "deepspeed" and (r := first(m))
        )
        out.append(
            f"- DeepSpeed's first-step loss is {rel:.1e} (relative) off shardspeed's. Both start "
            f"from the same weights{agree_text}" + ". But when an expert "
            "is over capacity the two keep different tokens: shardspeed the first in position "
            "order, DeepSpeed whatever `torch.topk` over the routing mask returns among equal "
            "values (its gate with use_rts=False); the outputs of the dropped tokens differ, and "
            "with them the later layers' inputs and routing. shardspeed at ep 2 and ep 1, DDP and "
            "FSDP2 (the same layer code) agree on step 1 "
            + ("exactly" if worst_same == 0 else f"within {worst_same:.0e} (relative)")
            + ", "
            "and DeepSpeed's ep 2 and ep 1 agree with each other (see the losses above)."
        )
    if ref:
        st = load_stats(ref)
        total = N_BLOCKS * ref["global_batch"] * SEQ
        out.append(
            f"- Expert load: at initialization the router is far from balanced. Over the timed "
            f"steps the busiest expert of the worst layer was asked for {st['demand']:.1f}x the "
            f"mean number of tokens and received {st['imbalance']:.1f}x the mean (capacity cuts "
            f"it), and {st['dropped']:.0f} of {total} token-layer assignments a step "
            f"({st['dropped'] / total:.0%}) were dropped (step 1: {st['first_dropped']:.0f}); "
            f"l_aux (weight {AUX_WEIGHT}) has only a few steps to act. The fixed capacity keeps "
            "every expert's slot count, and so each rank's expert compute, the same whatever the "
            "routing: the imbalance costs dropped tokens, not time, and the all-to-alls always "
            "move the whole buffers, empty slots included."
        )
    return out


def orchestrate(args) -> int:
    probe = MoEGPT("ours", 1, 0)
    n_params = sum(p.numel() for p in probe.parameters())
    n_expert = sum(p.numel() for n, p in probe.named_parameters() if "deepspeed_experts" in n)
    del probe
    cmd = common.command_line("bench_moe.py")
    modes = list(args.modes)
    print(
        f"model: MoE GPT, {n_params / 1e6:.2f}M params at ep 1 ({n_expert / 1e6:.2f}M in experts; "
        f"{N_BLOCKS} blocks, {NUM_EXPERTS} experts {D_MODEL}->{EXPERT_HIDDEN}->{D_MODEL}, top-"
        f"{TOP_K}, capacity factor {CAPACITY_FACTOR}, d_model {D_MODEL}, {N_HEADS} heads, seq "
        f"{SEQ}, vocab {VOCAB}), global batch {args.micro_batch * WORLD}, world size {WORLD}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} round(s), "
        f"{len(modes)} modes, {args.threads} thread(s) per process",
        flush=True,
    )
    source = shardspeed_source()
    print(source, flush=True)
    plan = [(mode, WORLD) for mode in modes]
    results, errors, total, tmp, discarded = common.measure(
        HERE, plan, args, prefix="bench_moe_", width=16
    )
    rows, ratio_table, mode_table = common.summarize(results, errors, comparisons(modes))
    loss_lines, losses_ok = loss_checks(results, modes)
    report = {
        "rows": rows,
        "ratio_table": ratio_table,
        "tp_table": throughput_table(results, modes),
        "mode_table": mode_table,
        "mem_table": memory_table(results, modes),
        "moe_table": moe_table(results, modes),
        "time_table": time_table(results, modes),
        "loss_lines": loss_lines,
        "findings": findings(results, modes, n_params, n_expert),
        "source": source,
        "load_line": common.load_line(results, discarded, args),
        "results": results,
        "errors": errors,
    }
    for title, key in (
        ("Targets and ratios", "ratio_table"),
        ("Throughput (ratios of medians)", "tp_table"),
        ("Per mode", "mode_table"),
        ("Memory per rank", "mem_table"),
        ("Communication and expert load", "moe_table"),
        ("Time in the MoE layers (rank 0, ms per step)", "time_table"),
    ):
        print(f"\n{title}:\n\n{report[key]}")
    print("\nLosses:\n" + "\n".join(f"- {line}" for line in loss_lines))
    print("\n".join(report["findings"]))
    common.print_run_end(
        total,
        tmp,
        errors,
        load_line=report["load_line"],
        losses_ok=losses_ok,
        source=source,
    )
    if args.write:
        write_section(args, n_params, n_expert, cmd, total, report)
        print(f"\nupdated {BENCH_MD}")
    ours_failed = [m for (m, _w) in errors if MODES[m].lib == "ours"]
    return 1 if ours_failed or not losses_ok else 0


def write_section(args, n_params: int, n_expert: int, cmd: str, total: float, report) -> None:
    rows, results, errors = report["rows"], report["results"], report["errors"]
    gb = args.micro_batch * WORLD
    tokens = args.micro_batch * SEQ
    notes = [
        f"- Model: bench_pipe.py's GPT cut to {N_BLOCKS} pre-norm blocks (token + position "
        f"embedding, vocab {VOCAB}, d_model {D_MODEL}, {N_HEADS} heads, seq {SEQ}, final "
        "LayerNorm, head tied to the token embedding; fp32), each block's MLP replaced by "
        f"`MoE(hidden_size={D_MODEL}, expert, num_experts={NUM_EXPERTS}, ep_size=1 or 2, "
        f"k={TOP_K}, capacity_factor={CAPACITY_FACTOR}, min_capacity={MIN_CAPACITY}, "
        "drop_tokens=True, use_rts=False)` with expert `Sequential(Linear(256, 512), GELU(), "
        f"Linear(512, 256))`: {n_params / 1e6:.2f}M parameters, {n_expert / 1e6:.2f}M of them in "
        f"experts. Loss = LM cross-entropy + {AUX_WEIGHT} x the sum of the layers' l_aux. "
        "shardspeed modes, DDP and FSDP2 use `shardspeed.moe.layer.MoE`, the DeepSpeed modes "
        "`deepspeed.moe.layer.MoE`. Norms and attention are built as bench_pipe builds them, "
        "the gate of block b from a seed of its own and expert g of block b (g its global "
        "index) from another, so every mode at either ep_size starts from the same weights.",
        f"- Same global batch in every mode: {gb} sequences of {SEQ} tokens a step "
        f"(bench_pipe's batches), {args.micro_batch} a rank; every rank gates its own "
        f"{tokens} tokens, capacity {ds_capacity(tokens)} slots per expert.",
        "- Configs, shardspeed and DeepSpeed alike (ep_size lives in the model): "
        f"`{json.dumps(config(args.micro_batch, 0))}`, and the same with stage 2 for the `_s2` "
        "modes; both get `model.parameters()` and split the expert weights into groups of "
        'their own. DeepSpeed is set up with `deepspeed.init_distributed(dist_backend="gloo")` '
        "and `DS_ACCELERATOR=cpu`. DDP and FSDP2 (`fully_shard` per block, then on the root, "
        "default `reshard_after_forward`): `torch.optim.AdamW(lr=3e-4)`, "
        "`clip_grad_norm_(..., 1.0)`. Optimizers as in the sections above: shardspeed "
        "`torch.optim.AdamW(fused=True)`, DeepSpeed its C++ CPU FusedAdam, DDP/FSDP2 torch's "
        "default (per-tensor loop).",
        common.each_run_note(args, gb),
        "- Expert load: after every step (inside the timed window, in every mode) the benchmark "
        "reads the routing of that step summed over both ranks: shardspeed modes through "
        "`engine.expert_load(over_data_parallel=True)` (one small all-reduce per layer), DDP "
        "and FSDP2 from each layer's `expert_load()` and DeepSpeed from each layer's "
        "`exp_counts` (the tokens kept being min(count, capacity) for top-1 without random "
        "token selection), summed with one all-reduce. 'imbalance' is the busiest expert's "
        "tokens over the mean (of the tokens experts received), per layer; the table gives its "
        "largest value over the layers, averaged over the timed steps (median over rounds). "
        "'router demand imbalance' is the same for the tokens the router asked of each expert "
        "before capacity dropped any.",
        "- Communication: after the timed steps each rank runs one more step with "
        "torch.distributed's collectives wrapped (before shardspeed or DeepSpeed is imported), "
        "counting calls and payload bytes (an all-to-all's payload is its whole input, of which "
        "a rank keeps its own chunk). For the shardspeed modes the all-to-all figures are "
        "`shardspeed.comm.comm_volume()['all_to_all']` after `reset_comm_volume()` (the counter "
        "saw the same). DDP's reducer calls its all-reduces from C++: its figure is computed "
        "(4 bytes x parameters).",
        "- Time in the MoE layers: forward pre- and post-hooks on each MoE layer and on its "
        "experts module time their forwards; the wrapped `all_to_all_single` times each call "
        "(wall time inside it, waiting for the other rank included), those inside an MoE "
        "layer's forward counting as forward, the rest as backward. The backward of the gate, "
        "dispatch and combine is not timed apart (it is in ms/step).",
        "- Memory: parameters per rank as held (FSDP2 its shards); model states after the "
        "backward of that extra step: parameters, gradients and optimizer states, each storage "
        "once (shardspeed: `engine.memory_breakdown()`; DeepSpeed stage 0 and DDP: parameters, "
        "`.grad` and the optimizer's state; DeepSpeed stage 2 and FSDP2: as bench_zero.py counts "
        "them, fp32 master partitions included). Peak RSS is `ru_maxrss` per rank (max over "
        "rounds), interpreter and imports included; 'RSS growth in training' is it after the "
        "timed steps minus the resident size before the first step (median over rounds).",
        "- Losses (mean over the global batch; shardspeed DP is the reference):",
        *(f"  - {line}" for line in report["loss_lines"]),
    ]
    notes.extend(report["findings"])
    notes += common.closing_notes(report["load_line"], results, rows, args, errors)
    blocks = [
        report["ratio_table"],
        ("Throughput, every mode (ratios of median tokens/s):", report["tp_table"]),
        ("Per mode:", report["mode_table"]),
        ("Memory per rank:", report["mem_table"]),
        ("Communication (one step, rank 0) and expert load:", report["moe_table"]),
        (
            "Time in the MoE layers (rank 0, ms per step: mean over the timed steps, median over "
            "rounds):",
            report["time_table"],
        ),
    ]
    section = common.section_text(SECTION_TITLE, cmd, total, blocks, notes, source=report["source"])
    common.write_markdown(section, SECTION_TITLE, BENCH_MD)


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.set_defaults(warmup=2, steps=6)
    common.add_modes_arg(p, MODES)
    common.add_noise_args(p, budget=300.0)
    common.add_smoke_arg(p, "every mode runs: 1 round, 1 warm-up + 2 timed steps")
    common.add_write_args(p)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    common.apply_smoke(p, args, rounds=1, warmup=1, steps=2, wait_idle=0.0, retries=0)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
