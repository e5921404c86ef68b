"""Tensor parallelism on 2 ranks vs data parallelism and a 2-stage pipeline, with checkpointing.

.venv/bin/python benchmarks/bench_tp.py [--quick] [--write]
"""

from __future__ import annotations

import contextlib

import harness as h
import render

GLOBAL_BATCH, PIPE_M = 16, 4
# mode -> (library, kind, checkpoint function's library or None, partition_activations)
MODES = {"ours_tp": ("ours", "tp", None, False), "ours_tp_ckpt": ("ours", "tp", "ours", False)}
MODES |= {"ours_tp_ckpt_part": ("ours", "tp", "ours", True)}
MODES |= {"deepspeed_tp": ("deepspeed", "tp", None, False), "ours_dp": ("ours", "dp", None, False)}
MODES |= {"ours_dp_ckpt": ("ours", "dp", "ours", False), "ddp": ("ddp", "dp", None, False)}
MODES |= {"ddp_ckpt": ("ddp", "dp", "torch", False), "fsdp2": ("fsdp2", "dp", None, False)}
MODES |= {"deepspeed_dp": ("deepspeed", "dp", None, False)}
MODES |= {"deepspeed_dp_ckpt": ("deepspeed", "dp", "deepspeed", False)}
MODES |= {"ours_pp": ("ours", "pp", None, False)}
SCENARIO = h.Scenario(
    name="tp",
    section="## Tensor parallelism (2 ranks) vs data and pipeline parallelism, and activation checkpointing",
    modes=dict.fromkeys(MODES, 2),
    warmup=2,
    steps=8,
    comparisons=[
        ("ours_tp", "deepspeed_tp", 1.0, "shardspeed TP2 vs DeepSpeed AutoTP 2"),
        ("ours_dp", "ddp", 1.0, "shardspeed DP2 (stage 0) vs torch DDP"),
        ("ours_dp", "deepspeed_dp", 1.0, "shardspeed DP2 vs DeepSpeed DP2 (stage 0)"),
        ("ours_dp_ckpt", "ddp_ckpt", 1.0, "checkpointed: shardspeed DP2 vs torch DDP"),
        ("ours_dp_ckpt", "deepspeed_dp_ckpt", 1.0, "checkpointed: shardspeed DP2 vs DeepSpeed DP2"),
        ("ours_tp", "ours_dp", None, "shardspeed TP2 vs shardspeed DP2"),
        ("ours_tp", "ddp", None, "shardspeed TP2 vs torch DDP"),
        ("ours_tp", "fsdp2", None, "shardspeed TP2 vs torch FSDP2"),
        ("ours_tp", "deepspeed_dp", None, "shardspeed TP2 vs DeepSpeed DP2"),
        ("ours_tp", "ours_pp", None, "shardspeed TP2 vs shardspeed PP2"),
        ("ours_pp", "ours_dp", None, "shardspeed PP2 vs shardspeed DP2"),
        ("ours_pp", "ddp", None, "shardspeed PP2 vs torch DDP"),
        ("ours_dp", "fsdp2", None, "shardspeed DP2 vs torch FSDP2"),
    ],
)
COLUMN_LAYERS = [r".*\.(q|k|v)_proj\.weight$", r".*\.mlp\.fc\.weight$"]
ROW_LAYERS = [r".*\.o_proj\.weight$", r".*\.mlp\.proj\.weight$"]
LAYER_SPECS = [{"patterns": COLUMN_LAYERS, "partition_type": "column"}]
LAYER_SPECS.append({"patterns": ROW_LAYERS, "partition_type": "row"})
CKPT_PAIRS = [("ours_dp", "ours_dp_ckpt"), ("ddp", "ddp_ckpt")]
CKPT_PAIRS += [("deepspeed_dp", "deepspeed_dp_ckpt"), ("ours_tp", "ours_tp_ckpt")]
CKPT_PAIRS += [("ours_tp_ckpt", "ours_tp_ckpt_part"), ("ours_tp", "ours_tp_ckpt_part")]
METER: list = [None]


def tp_block_class():
    """examples/gpt.py's block with q/k/v/o projections that automatic TP can split."""
    import torch.nn.functional as F
    from torch import nn

    from gpt import Block

    def copy(weight, bias) -> nn.Linear:
        layer = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
        layer.weight = nn.Parameter(weight.detach().clone())
        layer.bias = nn.Parameter(bias.detach().clone())
        return layer

    class Attention(nn.Module):
        def __init__(self, qkv: nn.Linear, proj: nn.Linear) -> None:
            super().__init__()
            d, w, b = h.D_MODEL, qkv.weight, qkv.bias
            self.q_proj, self.k_proj = copy(w[:d], b[:d]), copy(w[d : 2 * d], b[d : 2 * d])
            self.v_proj, self.o_proj = copy(w[2 * d :], b[2 * d :]), copy(proj.weight, proj.bias)

        def forward(self, x):
            b, t, _ = x.shape

            def heads(y):
                return y.view(b, t, -1, h.D_MODEL // h.N_HEADS).transpose(1, 2)

            q, k, v = (heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))

    class TPBlock(Block):
        checkpoint_fn = None

        def __init__(self) -> None:
            super().__init__(h.lm_config())
            self.attn = Attention(self.attn.qkv, self.attn.proj)

        def body(self, x):
            return super().forward(x)

        def forward(self, x):
            with h.region("blocks"):
                fn = TPBlock.checkpoint_fn
                return self.body(x) if fn is None else fn(self.body, x)

    return TPBlock


def meter_hooks():
    return METER[0].hooks() if METER[0] is not None else contextlib.nullcontext()


def checkpoint_fn(lib: str | None):
    if lib == "ours":
        import shardspeed.checkpointing

        return shardspeed.checkpointing.checkpoint
    if lib == "torch":
        from torch.utils.checkpoint import checkpoint

        return lambda fn, x: checkpoint(fn, x, use_reentrant=False)
    if lib == "deepspeed":

        def deepspeed_checkpoint(fn, x):
            if METER[0] is not None:
                METER[0].add(x)  # DeepSpeed keeps the input on its autograd context
            return h.library("deepspeed").checkpointing.checkpoint(fn, x)

        return deepspeed_checkpoint
    return None


def build(mode: str, rank: int, world: int, micro_batch: int):
    """The mode's model and step: (step(x, y) -> loss, parameters, engine or None, batches)."""
    lib, kind, ckpt, partition = MODES[mode]
    block = tp_block_class()
    block.checkpoint_fn = staticmethod(fn) if (fn := checkpoint_fn(ckpt)) else None
    batches = h.progression_batches(SCENARIO.warmup + 100, GLOBAL_BATCH)
    if kind == "pp":
        import shardspeed
        from shardspeed import pipe

        model = h.pipeline_module(pipe, world, block)
        pipeline = dict(gradient_accumulation_steps=PIPE_M, pipeline={"schedule": "1f1b"})
        cfg = h.config(GLOBAL_BATCH // PIPE_M, **pipeline)
        engine, *_ = shardspeed.initialize(model=model, config=cfg)

        def step(x, y):
            with meter_hooks():
                return engine.train_batch(h.micro_batches(x, y, PIPE_M))

        return step, list(engine.module.parameters()), engine, batches
    model = h.tied_gpt(lambda i: block())
    if kind == "dp":
        batches, cfg = h.rank_slice(batches, rank, micro_batch), h.config(micro_batch)
    else:
        partition_config = {"use_default_specs": False, "layer_specs": LAYER_SPECS}
        tp = {"autotp_size": world, "partition_config": partition_config}
        cfg = h.config(GLOBAL_BATCH, tensor_parallel=tp)
        if partition:
            cfg["activation_checkpointing"] = {"partition_activations": True}
    forward, backward, update, engine = h.trainer(lib, model, cfg)
    if ckpt == "deepspeed":
        h.library("deepspeed").checkpointing.configure(None)  # needs DeepSpeed's comm

    def step(x, y):
        with meter_hooks():
            loss = forward(x, y)
        backward(loss)
        update()
        return loss

    params = list((engine.module if lib in ("ours", "deepspeed") else model).parameters())
    return step, params, engine if lib in ("ours", "deepspeed") else None, batches


def worker(mode: str, args) -> dict:
    import torch.distributed as dist

    comm = h.CommCounter(dist)  # before shardspeed or DeepSpeed binds any collective
    rank, world = h.setup(args.threads)
    step, params, engine, batches = build(mode, rank, world, GLOBAL_BATCH // world)
    n = args.warmup + args.steps
    losses = []

    def recorded(x, y):
        loss = step(x, y)
        losses.append(loss.detach())
        return loss

    rss_init = h.current_rss_mib()
    result = h.timed(recorded, batches[:n], args.warmup, args.steps, GLOBAL_BATCH * h.SEQ)
    result |= {"rss_growth_mib": h.peak_rss_mib() - rss_init, "params_local": h.local_numel(params)}
    comm.active = True  # one more step: saved activations and collectives
    if MODES[mode][0] != "fsdp2":  # FSDP2's gathered weights are not module parameters
        METER[0] = meter = h.SavedBytes(params)
        step(*batches[n])
        METER[0] = None
        result |= {"saved_peak": meter.peak, "saved_blocks": meter.peak_by_region["blocks"]}
    else:
        step(*batches[n])
    comm.active = False
    result |= {"comm": comm.snapshot()} | h.loss_curve(losses, MODES[mode][1] == "dp")
    if MODES[mode][0] == "ours":
        mem = engine.memory_breakdown()
        result["model_state_bytes"] = mem["total"] - mem["buffers"]
    return result | {"peak_rss_mib": h.peak_rss_mib()}


def throughput_table(results: dict) -> str:
    bases = {"DDP": "ddp", "FSDP2": "fsdp2", "DeepSpeed DP": "deepspeed_dp"}
    bases |= {"DeepSpeed AutoTP": "deepspeed_tp", "shardspeed DP": "ours_dp"}
    shape = {"dp": "8 per rank, 2 replicas", "tp": "16, the same on both ranks"}
    shape["pp"] = f"{PIPE_M} x {GLOBAL_BATCH // PIPE_M}, through 2 stages"
    spec = [("mode", "l", str), ("micro batch x ranks' batches", "l", lambda m: shape[MODES[m][1]])]
    spec += render.speed_columns(results, bases)
    return render.columns(spec, [m for m in results["runs"] if render.med(results, m)])


def memory_table(results: dict) -> str:
    saved = "saved activations, peak (MiB, rank 0 / 1)"
    spec = render.model_columns(results)
    spec.append(render.mib_column(results, saved, "saved_peak", missing="not measured"))
    spec.append(render.mib_column(results, "of which in the blocks", "saved_blocks"))
    return render.columns(spec + render.rss_columns(results), render.measured(results))


def ckpt_table(results: dict) -> str:
    def pair(key, spec=".1f", scale=render.MIB):
        def cell(modes) -> str:
            values = [render.per_rank(results, m, lambda r: r.get(key))[0] for m in modes]
            return " -> ".join(render.fmt(v and v / scale, spec) for v in values)

        return cell

    def ratio(key):
        return lambda modes: render.ratio(*[key(m) for m in reversed(modes)])

    def blocks(mode):
        return render.per_rank(results, mode, lambda r: r.get("saved_blocks"))[0]

    def step_ms(mode):
        return render.med(results, mode, "step_ms")

    spec = [("without -> with", "l", " -> ".join)]
    spec += [("saved activations in the blocks (MiB, rank 0)", "l", pair("saved_blocks"))]
    spec += [("ratio", "r", ratio(blocks))]
    spec += [("all saved activations (MiB)", "l", pair("saved_peak"))]
    spec += [("peak RSS (MiB)", "l", pair("peak_rss_mib", ".0f", 1))]
    spec += [("RSS growth in training (MiB)", "l", pair("rss_growth_mib", ".0f", 1))]
    spec += [("ms/step", "l", lambda modes: " -> ".join(render.fmt(step_ms(m)) for m in modes))]
    spec += [("time ratio", "r", ratio(step_ms))]
    pairs = [p for p in CKPT_PAIRS if all(render.runs(results, m) for m in p)]
    return render.columns(spec, pairs)


def comm_table(results: dict) -> str:
    def texts(mode: str) -> list[str]:
        runs = results["runs"][mode][0]["ranks"]
        out = [render.comm_text(r["comm"]["calls"], r["comm"]["bytes"]) for r in runs]
        unseen = " (DDP's gradient all-reduce runs in C++, not seen)" * (MODES[mode][0] == "ddp")
        return [t + unseen for t in out]

    rows = [[mode, *texts(mode)] for mode in render.measured(results)]
    head = "mode | collectives and transfers in one step, rank 0 (calls, bytes) | rank 1"
    return render.table(head, rows)


def tables(results: dict) -> dict:
    own = {"memory": memory_table(results), "checkpointing": ckpt_table(results)}
    own["comm"] = comm_table(results)
    throughput = throughput_table(results)
    return render.training_tables(results, SCENARIO.comparisons, throughput, own, 1e-4)


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_tp.py")
