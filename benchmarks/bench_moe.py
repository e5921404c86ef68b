"""Mixture of experts on 2 ranks: expert parallelism (EP2) vs data parallelism (shardspeed, DDP,
FSDP2, DeepSpeed), at ZeRO stages 0 and 2: tokens/s, memory, all-to-alls, expert load, time in the
MoE layers.

    .venv/bin/python benchmarks/bench_moe.py [--quick] [--write]
"""

from __future__ import annotations

import math
import statistics

import harness as h
import render

N_BLOCKS, NUM_EXPERTS, CAPACITY_FACTOR, MIN_CAPACITY, AUX_WEIGHT = 4, 8, 1.25, 4, 0.01
GATE_SEED, EXPERT_SEED = 7000, 9000  # gate of block b; expert g of block b: + 100 b + g
# mode -> (library, ep_size, ZeRO stage or None)
MODES = {
    "ours_ep2": ("ours", 2, 0),
    "ours_ep2_s2": ("ours", 2, 2),
    "ours_dp": ("ours", 1, 0),
    "ours_dp_s2": ("ours", 1, 2),
    "ddp": ("ddp", 1, None),
    "fsdp2": ("fsdp2", 1, None),
    "deepspeed_ep2": ("deepspeed", 2, 0),
    "deepspeed_ep2_s2": ("deepspeed", 2, 2),
    "deepspeed_dp": ("deepspeed", 1, 0),
    "deepspeed_dp_s2": ("deepspeed", 1, 2),
}
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


def moe_block(lib: str, ep: int, ep_rank: int):
    """examples/gpt.py's block (same attention weights under the layer's seed) with its MLP
    replaced by an MoE layer whose gate and experts come from seeds of their own, so every mode
    at either ep_size holds the same weights; returns (x, AUX_WEIGHT x l_aux)."""
    import torch
    from torch import nn

    from gpt import Block

    MoE = (
        h.library("deepspeed").moe.layer
        if lib == "deepspeed"
        else __import__("shardspeed.moe.layer", fromlist=["MoE"])
    ).MoE
    d = h.D_MODEL

    def expert():
        return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    class MoEBlock(Block):
        def __init__(self, index: int) -> None:
            super().__init__(h.lm_config())
            self.mlp = MoE(
                d,
                expert(),
                num_experts=NUM_EXPERTS,
                ep_size=ep,
                k=1,
                capacity_factor=CAPACITY_FACTOR,
                min_capacity=MIN_CAPACITY,
                drop_tokens=True,
                use_rts=False,
            )
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
    """Seconds in the forwards of `modules`, and how much of `inner()` (a running total of
    seconds) grew inside them."""

    def __init__(self, modules, inner=lambda: 0.0) -> None:
        import time

        self.seconds = self.inner_seconds = 0.0
        self.start: dict = {}
        for m in modules:
            m.register_forward_pre_hook(
                lambda mod, _a: self.start.__setitem__(id(mod), (time.perf_counter(), inner()))
            )
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

    if lib == "ours":
        return [
            [
                v["imbalance"],
                (v["exp_counts"].float().max() / v["exp_counts"].float().mean()).item(),
                float(v["dropped"]),
            ]
            for v in engine.expert_load(over_data_parallel=True).values()
        ]
    if lib == "deepspeed":
        capacity = max(math.ceil(tokens / NUM_EXPERTS * CAPACITY_FACTOR), MIN_CAPACITY)
        pairs = [
            (m.deepspeed_moe.exp_counts, m.deepspeed_moe.exp_counts.clamp(max=capacity))
            for m in layers
        ]
    else:
        pairs = [
            (g["exp_counts"], g["tokens_per_expert"]) for g in (m.expert_load() for m in layers)
        ]
    counts = torch.stack([torch.stack([a, b]) for a, b in pairs]).to(torch.int64)
    dist.all_reduce(counts)
    return [
        [
            (k.float().max() / k.float().mean()).item(),
            (d.float().max() / d.float().mean()).item(),
            (d.sum() - k.sum()).item(),
        ]
        for d, k in counts
    ]


def census(lib: str, stage, handle, model, params) -> dict:
    """Model states after backward: shardspeed's memory_breakdown(), FSDP2's and DeepSpeed
    stage 2's census, else parameters, gradients and the torch optimizer's state."""
    if lib == "ours":
        mem = handle.memory_breakdown()
        return {k: mem[k] for k in h.STATE_KINDS} | {"breakdown_total": mem["total"]}
    if lib == "fsdp2":
        return h.census_fsdp2(model, handle)
    if lib == "deepspeed" and stage == 2:
        return h.census_deepspeed(handle)
    opt = getattr(handle, "optimizer", handle)
    c = h.Census().add("parameters", params).add("gradients", [p.grad for p in params])
    return c.add("optimizer_states", h.optimizer_state(opt)).result()


def worker(mode: str, args) -> dict:
    import torch
    import torch.distributed as dist

    lib, ep, stage = MODES[mode]
    comm = h.CommCounter(dist)  # before shardspeed or DeepSpeed binds any collective
    rank, world = h.setup(args.threads)
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

    def step(x, y):
        t0 = (
            moe_t.seconds,
            expert_t.seconds,
            comm.seconds["all_to_all_single"],
            moe_t.inner_seconds,
        )
        loss = forward(x, y)
        backward(loss)
        update()
        t1 = (
            moe_t.seconds,
            expert_t.seconds,
            comm.seconds["all_to_all_single"],
            moe_t.inner_seconds,
        )
        rec["times"].append([1000 * (b - a) for a, b in zip(t0, t1)])
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
    losses = torch.stack(rec["losses"][:n]).float()
    dist.all_reduce(losses)
    losses /= world
    expert_local = h.local_numel(
        p for name, p in model.named_parameters() if "deepspeed_experts" in name
    )
    return result | {
        "comm": comm.snapshot(),
        "losses": losses.tolist(),
        "first_loss": losses[0].item(),
        "last_loss": losses[-1].item(),
        "model_states": states,
        "params_local": h.local_numel(params),
        "expert_params_local": expert_local,
        "loads": rec["loads"][:n],
        "loads_timed": rec["loads"][args.warmup : n],
        "times_timed": rec["times"][args.warmup : n],
        "peak_rss_mib": h.peak_rss_mib(),
        "comm_volume": comm_volume() if lib == "ours" else None,
    }


def twin(mode: str) -> str | None:
    return mode.replace("ours", "deepspeed") if mode.startswith("ours") else None


def throughput_table(results: dict) -> str:
    base = {b: render.med(results, b) for b in ("ddp", "fsdp2", "ours_dp")}
    rows = [
        [
            mode,
            render.fmt(tps),
            render.fmt(render.med(results, mode, "step_ms")),
            *(render.ratio(tps, base[b]) for b in base),
            render.ratio(tps, twin(mode) and render.med(results, twin(mode))),
        ]
        for mode in results["runs"]
        if (tps := render.med(results, mode))
    ]
    return render.table(
        [
            "mode",
            "tokens/s (median)",
            "ms/step",
            "/ DDP",
            "/ FSDP2",
            "/ shardspeed DP",
            "/ DeepSpeed (same ep, stage)",
        ],
        rows,
        "lrrrrrr",
    )


def memory_table(results: dict) -> str:
    rows, mib = [], render.MIB
    for mode in results["runs"]:
        if not render.runs(results, mode):
            continue

        def vals(fn, mode=mode):
            return render.per_rank(results, mode, fn)

        params = vals(lambda r: r["params_local"])
        parts = [
            render.slash([v / mib for v in vals(lambda r, k=k: r["model_states"][k])])
            for k in h.STATE_KINDS
        ]
        total = [
            sum(r["model_states"][k] for k in h.STATE_KINDS)
            for r in render.runs(results, mode)[0]["ranks"]
        ]
        breakdown = vals(lambda r: r["model_states"].get("breakdown_total", 0))
        rows.append(
            [
                mode,
                " / ".join(f"{p / 1e6:.2f}M" for p in params),
                " / ".join(f"{p / 1e6:.2f}M" for p in vals(lambda r: r["expert_params_local"])),
                render.slash([4 * p / mib for p in params]),
                f"{render.slash([t / mib for t in total])} ({' + '.join(parts)})",
                render.slash([b / mib for b in breakdown]) if any(breakdown) else "-",
                render.slash(
                    render.per_rank(results, mode, lambda r: r["peak_rss_mib"], max), ".0f"
                ),
                render.slash(vals(lambda r: r["rss_growth_mib"]), ".0f"),
            ]
        )
    return render.table(
        [
            "mode",
            "parameters per rank (rank 0 / 1)",
            "of which expert parameters",
            "parameter bytes (MiB)",
            "model states (MiB, rank 0 / 1): total "
            "(parameters + gradients + fp32 master copies + optimizer states)",
            "`memory_breakdown()` total (MiB)",
            "peak RSS per rank (MiB)",
            "RSS growth in training (MiB)",
        ],
        rows,
    )


def comm_load_table(results: dict) -> str:
    rows, mib = [], render.MIB
    for mode, rs in results["runs"].items():
        if not rs:
            continue
        r0 = rs[0]["ranks"][0]
        calls, nbytes = r0["comm"]["calls"], r0["comm"]["bytes"]
        vol = (r0.get("comm_volume") or {}).get("all_to_all")
        a2a = (
            f"{vol['calls']} x, {vol['bytes'] / mib:.1f} (comm_volume)"
            if vol is not None
            else f"{calls.get('all_to_all_single', 0)} x, {nbytes.get('all_to_all_single', 0) / mib:.1f}"
        )
        red = f"{sum(nbytes.get(n, 0) for n in REDUCTIONS) / mib:.1f} ({sum(calls.get(n, 0) for n in REDUCTIONS)} calls)"
        alone = [n for n in calls if n.endswith("@1")]
        if alone:
            red += (
                f"; plus {sum(nbytes[n] for n in alone) / mib:.1f} MiB in "
                f"{sum(calls[n] for n in alone)} calls over 1-rank groups"
            )
        if MODES[mode][0] == "ddp":
            red = f"{4 * r0['params_local'] / mib:.1f} (computed: DDP reduces in C++, not seen)"
        rest = {
            n: calls[n]
            for n in calls
            if n not in (*REDUCTIONS, "all_to_all_single") and n not in alone
        }
        stats = [
            [
                statistics.fmean(
                    max(layer[i] for layer in s) if i < 2 else sum(layer[2] for layer in s)
                    for s in run["ranks"][0]["loads_timed"]
                )
                for i in range(3)
            ]
            for run in rs
        ]
        rows.append(
            [
                mode,
                a2a,
                red,
                render.comm_text(rest, {n: nbytes[n] for n in rest}) if rest else "-",
                *(
                    f"{statistics.median(s[i] for s in stats):{f}}"
                    for i, f in enumerate((".2f", ".2f", ".0f"))
                ),
                f"{rs[0]['first_loss']:.6f}",
            ]
        )
    return render.table(
        [
            "mode",
            "all-to-all per step (calls, MiB, per rank)",
            "gradient reduction per step (all-reduce, reduce-scatter, reduce; MiB per rank)",
            "other collectives",
            "imbalance, max over layers (mean over steps)",
            "router demand imbalance",
            f"tokens dropped per step (of {N_BLOCKS} x 2048)",
            "first-step loss",
        ],
        rows,
        "llllrrrr",
    )


def time_table(results: dict) -> str:
    rows = []
    for mode, rs in results["runs"].items():
        if rs:
            moe, experts, a2a, a2a_fwd = (
                statistics.median(
                    statistics.fmean(t[i] for t in run["ranks"][0]["times_timed"]) for run in rs
                )
                for i in range(4)
            )
            rows.append(
                [
                    mode,
                    render.fmt(render.med(results, mode, "step_ms")),
                    f"{moe:.0f}",
                    f"{experts:.0f}",
                    f"{a2a_fwd:.0f}",
                    f"{moe - experts - a2a_fwd:.0f}",
                    f"{a2a - a2a_fwd:.0f}",
                ]
            )
    return render.table(
        [
            "mode",
            "ms/step",
            f"MoE layers' forward ({N_BLOCKS} layers)",
            "of which experts",
            "of which all-to-alls",
            "of which the rest (gate, dispatch, combine)",
            "all-to-alls in the backward",
        ],
        rows,
        "lrrrrrr",
    )


def tables(results: dict) -> dict:
    return {
        "ratios": render.ratio_table(results, SCENARIO.comparisons),
        "throughput": throughput_table(results),
        "modes": render.mode_table(results),
        "memory": memory_table(results),
        "comm": comm_load_table(results),
        "time": time_table(results),
        "losses": render.loss_lines(results, "ours_dp", 1e-5),
        "run": render.run_line(results),
    }


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_moe.py")
