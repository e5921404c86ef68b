"""Mixture of experts on 2 ranks: expert parallelism vs data parallelism, ZeRO stages 0 and 2.

.venv/bin/python benchmarks/bench_moe.py [--quick] [--write]
"""

from __future__ import annotations

import functools
import math
import statistics

import harness as h
import render

N_BLOCKS, NUM_EXPERTS, CAPACITY_FACTOR, MIN_CAPACITY, AUX_WEIGHT = 4, 8, 1.25, 4, 0.01
GATE_SEED, EXPERT_SEED = 7000, 9000  # gate of block b; expert g of block b: + 100 b + g
# mode -> (library, ep_size, ZeRO stage or None)
MODES = {"ours_ep2": ("ours", 2, 0), "ours_ep2_s2": ("ours", 2, 2), "ours_dp": ("ours", 1, 0)}
MODES |= {"ours_dp_s2": ("ours", 1, 2), "ddp": ("ddp", 1, None), "fsdp2": ("fsdp2", 1, None)}
MODES |= {"deepspeed_ep2": ("deepspeed", 2, 0), "deepspeed_ep2_s2": ("deepspeed", 2, 2)}
MODES |= {"deepspeed_dp": ("deepspeed", 1, 0), "deepspeed_dp_s2": ("deepspeed", 1, 2)}
SCENARIO = h.Scenario(
    name="moe",
    section="## Mixture of experts: expert parallelism (EP2) vs data parallelism",
    modes=dict.fromkeys(MODES, 2),
    warmup=2,
    steps=6,
    comparisons=[
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
    ],
)
REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce")
STATES_HEADER = "model states (MiB, rank 0 / 1): total (parameters + gradients + fp32 master copies"
STATES_HEADER += " + optimizer states)"


def moe_block(lib: str, ep: int, ep_rank: int):
    """examples/gpt.py's block with its MLP an MoE layer; returns (x, AUX_WEIGHT x l_aux)."""
    import torch
    from torch import nn

    from gpt import Block

    if lib == "deepspeed":
        MoE = h.library("deepspeed").moe.layer.MoE
    else:
        from shardspeed.moe.layer import MoE
    d = h.D_MODEL
    options = dict(num_experts=NUM_EXPERTS, ep_size=ep, k=1, capacity_factor=CAPACITY_FACTOR)
    options |= dict(min_capacity=MIN_CAPACITY, drop_tokens=True, use_rts=False)

    def expert():
        return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    class MoEBlock(Block):
        def __init__(self, index: int) -> None:
            super().__init__(h.lm_config())
            self.mlp = MoE(d, expert(), **options)
            layer, local = self.mlp.deepspeed_moe, NUM_EXPERTS // ep
            with torch.no_grad():
                torch.manual_seed(GATE_SEED + index)
                layer.gate.wg.weight.copy_(nn.Linear(d, NUM_EXPERTS, bias=False).weight)
                for i, e in enumerate(layer.experts.deepspeed_experts):
                    torch.manual_seed(EXPERT_SEED + 100 * index + ep_rank * local + i)
                    e.load_state_dict(expert().state_dict())

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            out, l_aux, _ = self.mlp(self.ln_2(x))
            return x + out, AUX_WEIGHT * l_aux

    return MoEBlock


class ForwardTimer:
    """Seconds in the forwards of `modules`, and how much of `inner()` grew inside them."""

    def __init__(self, modules, inner=lambda: 0.0) -> None:
        import time

        self.seconds = self.inner_seconds = 0.0
        self.start: dict = {}

        def begin(mod, _args) -> None:
            self.start[id(mod)] = (time.perf_counter(), inner())

        for m in modules:
            m.register_forward_pre_hook(begin)
            m.register_forward_hook(
                lambda mod, _a, _o: self.stop(mod, time.perf_counter(), inner())
            )

    def stop(self, module, now: float, inner_now: float) -> None:
        t0, i0 = self.start.pop(id(module))
        self.seconds += now - t0
        self.inner_seconds += inner_now - i0


def expert_load(lib: str, engine, layers, tokens: int) -> list:
    """Per layer [imbalance, router demand imbalance, dropped] summed over both ranks."""
    import torch
    import torch.distributed as dist

    def imbalance(counts) -> float:
        return (counts.float().max() / counts.float().mean()).item()

    if lib == "ours":
        loads = engine.expert_load(over_data_parallel=True).values()
        return [[v["imbalance"], imbalance(v["exp_counts"]), float(v["dropped"])] for v in loads]
    if lib == "deepspeed":
        capacity = max(math.ceil(tokens / NUM_EXPERTS * CAPACITY_FACTOR), MIN_CAPACITY)
        counted = [m.deepspeed_moe.exp_counts for m in layers]
        pairs = [(c, c.clamp(max=capacity)) for c in counted]
    else:
        loads = [m.expert_load() for m in layers]
        pairs = [(g["exp_counts"], g["tokens_per_expert"]) for g in loads]
    counts = torch.stack([torch.stack([a, b]) for a, b in pairs]).to(torch.int64)
    dist.all_reduce(counts)
    return [[imbalance(k), imbalance(d), (d.sum() - k.sum()).item()] for d, k in counts]


def census(lib: str, stage, handle, model, params) -> dict:
    """Model states after backward, per framework."""
    if lib == "ours":
        mem = handle.memory_breakdown()
        return {k: mem[k] for k in h.STATE_KINDS} | {"breakdown_total": mem["total"]}
    if lib == "fsdp2":
        return h.census_fsdp2(model, handle)
    if lib == "deepspeed" and stage == 2:
        return h.census_deepspeed(handle)
    return h.census_torch(params, getattr(handle, "optimizer", handle))


def worker(mode: str, args) -> dict:
    import torch.distributed as dist

    lib, ep, stage = MODES[mode]
    comm = h.CommCounter(dist)  # before shardspeed or DeepSpeed binds any collective
    rank, _world = h.setup(args.threads)
    if lib == "deepspeed":
        h.library("deepspeed").init_distributed(dist_backend="gloo")
    n = args.warmup + args.steps
    batches = h.rank_slice(h.progression_batches(n + 1, 16), rank, 8)
    model = h.tied_gpt(moe_block(lib, ep, rank % ep), N_BLOCKS)
    layers = [b.mlp for b in model.blocks]
    forward, backward, update, engine = h.trainer(lib, model, h.config(8, stage or 0))
    params = list((engine.module if lib in ("ours", "deepspeed") else model).parameters())
    moe_t = ForwardTimer(layers, inner=lambda: comm.seconds["all_to_all_single"])
    expert_t = ForwardTimer(m.deepspeed_moe.experts for m in layers)
    rec = {"times": [], "loads": [], "losses": []}

    def clocks() -> tuple:
        a2a = comm.seconds["all_to_all_single"]
        return moe_t.seconds, expert_t.seconds, a2a, moe_t.inner_seconds

    def step(x, y):
        t0 = clocks()
        loss = forward(x, y)
        backward(loss)
        update()
        rec["times"].append([1000 * (b - a) for a, b in zip(t0, clocks())])
        rec["loads"].append(expert_load(lib, engine, layers, 8 * h.SEQ))
        rec["losses"].append(loss.detach())
        return loss

    rss_init = h.current_rss_mib()
    result = h.timed(step, batches[:n], args.warmup, args.steps, 16 * h.SEQ)
    result["rss_growth_mib"] = h.peak_rss_mib() - rss_init
    if lib == "ours":
        from shardspeed.comm import comm_volume, reset_comm_volume

        reset_comm_volume()
    comm.active = True  # one more step: collectives, and the model states after backward
    loss = forward(*batches[n])
    backward(loss)
    states = census(lib, stage, engine, model, params)
    update()
    comm.active = False
    experts = [p for name, p in model.named_parameters() if "deepspeed_experts" in name]
    result |= {"comm": comm.snapshot(), **h.loss_curve(rec["losses"][:n]), "model_states": states}
    result |= {"params_local": h.local_numel(params), "expert_params_local": h.local_numel(experts)}
    result |= {"loads": rec["loads"][:n], "loads_timed": rec["loads"][args.warmup : n]}
    result |= {"times_timed": rec["times"][args.warmup : n], "peak_rss_mib": h.peak_rss_mib()}
    return result | {"comm_volume": comm_volume() if lib == "ours" else None}


def twin(mode: str) -> str | None:
    return mode.replace("ours", "deepspeed") if mode.startswith("ours") else None


def throughput_table(results: dict) -> str:
    bases = {"DDP": "ddp", "FSDP2": "fsdp2", "shardspeed DP": "ours_dp"}
    bases["DeepSpeed (same ep, stage)"] = twin
    spec = [("mode", "l", str), *render.speed_columns(results, bases)]
    return render.columns(spec, [m for m in results["runs"] if render.med(results, m)])


def memory_table(results: dict) -> str:
    mib = render.MIB

    def ranks(mode, fn):
        return render.per_rank(results, mode, fn)

    def states(mode: str) -> str:
        kinds = [ranks(mode, lambda r, k=k: r["model_states"][k]) for k in h.STATE_KINDS]
        parts = [render.slash([v / mib for v in values]) for values in kinds]
        first = render.runs(results, mode)[0]["ranks"]
        total = [sum(r["model_states"][k] for k in h.STATE_KINDS) for r in first]
        return f"{render.slash([t / mib for t in total])} ({' + '.join(parts)})"

    def breakdown(mode: str) -> str:
        values = ranks(mode, lambda r: r["model_states"].get("breakdown_total", 0))
        return render.slash([b / mib for b in values]) if any(values) else "-"

    spec = [("mode", "l", str)]
    millions = functools.partial(render.millions, results)
    spec.append(("parameters per rank (rank 0 / 1)", "l", millions))
    spec.append(("of which expert parameters", "l", lambda m: millions(m, "expert_params_local")))
    spec.append(render.mib_column(results, "parameter bytes (MiB)", "params_local", 4))
    spec += [(STATES_HEADER, "l", states), ("`memory_breakdown()` total (MiB)", "l", breakdown)]
    return render.columns(spec + render.rss_columns(results), render.measured(results))


def comm_load_table(results: dict) -> str:
    mib = render.MIB

    def row(mode: str, rs: list) -> list:
        r0 = rs[0]["ranks"][0]
        calls, nbytes = r0["comm"]["calls"], r0["comm"]["bytes"]
        vol = (r0.get("comm_volume") or {}).get("all_to_all")
        a2a = calls.get("all_to_all_single", 0), nbytes.get("all_to_all_single", 0) / mib
        a2a = f"{a2a[0]} x, {a2a[1]:.1f}"
        if vol is not None:
            a2a = f"{vol['calls']} x, {vol['bytes'] / mib:.1f} (comm_volume)"
        reduced = sum(nbytes.get(n, 0) for n in REDUCTIONS) / mib
        red = f"{reduced:.1f} ({sum(calls.get(n, 0) for n in REDUCTIONS)} calls)"
        alone = [n for n in calls if n.endswith("@1")]
        if alone:
            red += f"; plus {sum(nbytes[n] for n in alone) / mib:.1f} MiB in "
            red += f"{sum(calls[n] for n in alone)} calls over 1-rank groups"
        if MODES[mode][0] == "ddp":
            red = f"{4 * r0['params_local'] / mib:.1f} (computed: DDP reduces in C++, not seen)"
        seen = (*REDUCTIONS, "all_to_all_single", *alone)
        rest = {n: calls[n] for n in calls if n not in seen}
        other = render.comm_text(rest, {n: nbytes[n] for n in rest}) if rest else "-"

        # Per run, the mean over timed steps of: the largest imbalance and router demand
        # imbalance over layers, and the tokens dropped in all layers; then the median over runs.
        def step_stat(s: list, i: int) -> float:
            return max(layer[i] for layer in s) if i < 2 else sum(layer[2] for layer in s)

        timed = [run["ranks"][0]["loads_timed"] for run in rs]
        stats = [[statistics.fmean(step_stat(s, i) for s in t) for i in range(3)] for t in timed]
        loads = [statistics.median(s[i] for s in stats) for i in range(3)]
        load_cells = [f"{v:{f}}" for v, f in zip(loads, (".2f", ".2f", ".0f"))]
        return [mode, a2a, red, other, *load_cells, f"{rs[0]['first_loss']:.6f}"]

    rows = [row(mode, rs) for mode, rs in results["runs"].items() if rs]
    head = "mode | all-to-all per step (calls, MiB, per rank) | gradient reduction per step"
    head += " (all-reduce, reduce-scatter, reduce; MiB per rank) | other collectives | imbalance,"
    head += " max over layers (mean over steps) | router demand imbalance | tokens dropped per step"
    head += f" (of {N_BLOCKS} x 2048) | first-step loss"
    return render.table(head, rows, "llllrrrr")


def time_table(results: dict) -> str:
    def row(mode: str, rs: list) -> list:
        timed = [run["ranks"][0]["times_timed"] for run in rs]
        means = [[statistics.fmean(t[i] for t in steps) for steps in timed] for i in range(4)]
        moe, experts, a2a, a2a_fwd = (statistics.median(m) for m in means)
        parts = [moe, experts, a2a_fwd, moe - experts - a2a_fwd, a2a - a2a_fwd]
        step_ms = render.fmt(render.med(results, mode, "step_ms"))
        return [mode, step_ms, *(f"{v:.0f}" for v in parts)]

    head = f"mode | ms/step | MoE layers' forward ({N_BLOCKS} layers) | of which experts"
    head += " | of which all-to-alls | of which the rest (gate, dispatch, combine)"
    head += " | all-to-alls in the backward"
    rows = [row(mode, rs) for mode, rs in results["runs"].items() if rs]
    return render.table(head, rows, "lrrrrrr")


def tables(results: dict) -> dict:
    own = {"memory": memory_table(results), "comm": comm_load_table(results)}
    own["time"] = time_table(results)
    throughput = throughput_table(results)
    return render.training_tables(results, SCENARIO.comparisons, throughput, own, 1e-5)


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_moe.py")
