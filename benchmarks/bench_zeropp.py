"""ZeRO++ (qwZ, hpZ, qgZ) vs plain ZeRO-3 at world sizes 2 and 4: bytes by group size, speed,
losses; and Muon vs AdamW at ZeRO 2 on the demo corpus.

.venv/bin/python benchmarks/bench_zeropp.py [--quick] [--write]
DeepSpeed's rows: DS_ACCELERATOR=cpu /work/dsvenv/bin/python benchmarks/bench_zeropp.py
    --modes deepspeed_s3_ws2 deepspeed_hpz_ws2 deepspeed_s3_ws4 deepspeed_hpz_ws4 --merge JSON --write
"""

from __future__ import annotations

import harness as h
import render

HPZ = 2  # ranks of a hpZ "node": collectives over larger groups count as across nodes
GLOBAL_BATCH = 8  # rows per step at every world size, so that every mode sees the same batches
# ZeRO++ switches under zero_optimization, per variant.
VARIANTS = {
    "ours_s3": {},
    "qwz": {"zero_quantized_weights": True},
    "hpz": {"zero_hpz_partition_size": HPZ},
    "qgz": {"zero_quantized_gradients": True},
    "all3": {"zero_quantized_weights": True, "zero_hpz_partition_size": HPZ}
    | {"zero_quantized_gradients": True},
    "deepspeed_s3": {},
    "deepspeed_hpz": {"zero_hpz_partition_size": HPZ},
}
ZEROPP = {f"{v}_ws{w}": w for w in (2, 4) for v in VARIANTS if not v.startswith("deepspeed")}
DEEPSPEED = {f"{v}_ws{w}": w for w in (2, 4) for v in ("deepspeed_s3", "deepspeed_hpz")}
OPTIMIZERS = {
    "adamw_z2": {"type": "AdamW", "params": {"lr": h.LR}},
    "muon_z2": {"type": "Muon", "params": {"lr": h.LR, "muon_lr": 0.02, "adam_lr": h.LR}},
}
SCENARIO = h.Scenario(
    name="zeropp",
    section="## ZeRO++ and whole-tensor optimizers",
    modes=ZEROPP | DEEPSPEED | dict.fromkeys(OPTIMIZERS, 2),
    warmup=3,
    steps=10,
    rounds=1,
    quick={"warmup": 1, "steps": 2, "rounds": 1, "corpus_steps": 3},
    options={"--corpus-steps": dict(type=int, default=60, help="steps of the Muon/AdamW runs")},
)
# collective name in shardspeed.comm's counter -> the name bus_factor knows
BUS_NAMES = {"reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}


def split(mode: str) -> tuple[str, int]:
    variant, _, ws = mode.rpartition("_ws")
    return variant, int(ws)


def corpus_batches(n: int, size: int) -> list:
    """Step i's global batch: `size` windows of the demo corpus (stdlib docstrings, bytes), drawn
    by a generator seeded per step, so every optimizer sees the same tokens."""
    import torch

    from corpus import ByteDataset, build_corpus

    data = ByteDataset(build_corpus(), h.SEQ)
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(h.DATA_SEED + i)
        rows = [data[j] for j in torch.randint(0, len(data), (size,), generator=g).tolist()]
        out.append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
    return out


def wire_bytes(volume: dict) -> dict:
    """Per collective and group size: payload and bytes each rank sends (ring algorithms)."""
    from shardspeed.comm.logger import bus_factor

    out = {}
    for (op, size), v in volume.items():
        wire = v["bytes"] * bus_factor(BUS_NAMES.get(op, op), size)
        out[f"{op}@{size}"] = {"calls": v["calls"], "payload": v["bytes"], "wire": wire}
    return out


def worker(mode: str, args) -> dict:
    import torch.distributed as dist

    ours = mode not in DEEPSPEED
    counter = None if ours else h.CommCounter(dist)  # before DeepSpeed binds any collective
    rank, world = h.setup(args.threads)
    if mode in OPTIMIZERS:
        steps, micro = args.corpus_steps, GLOBAL_BATCH // world
        batches = h.rank_slice(corpus_batches(steps, GLOBAL_BATCH), rank, micro)
        cfg = h.config(micro, 2, optimizer=OPTIMIZERS[mode])
        model, lib, warmup, timed_steps = h.build_lm(vocab_size=256), "ours", 1, steps - 1
    else:
        variant, _ = split(mode)
        micro = GLOBAL_BATCH // world
        batches = h.progression_batches(args.warmup + args.steps, GLOBAL_BATCH)
        batches = h.rank_slice(batches, rank, micro)
        cfg = h.config(micro, 3)
        # Reuse distance 0: backward gathers again, as a model too large to keep whole would (the
        # default keeps this small model gathered from forward to backward, leaving hpZ nothing).
        cfg["zero_optimization"] |= {"stage3_max_reuse_distance": 0} | VARIANTS[variant]
        lib = "ours" if ours else "deepspeed"
        if not ours:
            h.library("deepspeed").init_distributed(dist_backend="gloo")
        model, warmup, timed_steps = h.build_lm(n_layer=2), args.warmup, args.steps
    import shardspeed.comm as comm

    forward, backward, update, _engine = h.trainer(lib, model, cfg)
    losses: list = []
    step = h.step_fn(forward, backward, update, losses)
    # Counting starts after the warm-up steps: the timed steps' collectives only (`timed`'s own
    # warm-up would run inside the count).
    for x, y in batches[:warmup]:
        step(x, y)
    comm.reset_comm_volume()
    if counter is not None:
        counter.active = True
    result = h.timed(step, batches[warmup:], 0, timed_steps, GLOBAL_BATCH * h.SEQ)
    volume = {} if counter else wire_bytes(comm.comm_volume(by_group=True))
    if counter is not None:
        from shardspeed.comm.logger import bus_factor

        snap = counter.snapshot()
        # The counter sees a reduce-scatter's output (one shard); payload is its whole input.
        full = {
            op: b * (world if op == "reduce_scatter_tensor" else 1)
            for op, b in snap["bytes"].items()
        }
        volume = {
            f"{op}@{world}": {
                "calls": c,
                "payload": full[op],
                "wire": full[op] * bus_factor(op, world),
            }
            for op, c in snap["calls"].items()
        }
    per_step = {k: {f: v[f] / timed_steps for f in v} for k, v in volume.items()}
    params = sum(p.numel() for p in h.build_lm(n_layer=2).parameters())
    return result | h.loss_curve(losses) | {"volume": per_step, "params": params, "counted_by": lib}


def across(volume: dict, field: str = "wire") -> float:
    """Bytes over groups larger than a hpZ node."""
    return sum(v[field] for k, v in volume.items() if int(k.rpartition("@")[2]) > HPZ)


def total(volume: dict, field: str = "wire") -> float:
    return sum(v[field] for v in volume.values())


def mib(b: float | None) -> str:
    return render.fmt(b and b / render.MIB, ".2f", "-" if b is None else "0")


def zeropp_table(results: dict) -> str:
    def vol(mode: str) -> dict:
        return render.runs(results, mode)[0]["ranks"][0]["volume"]

    def base(mode: str) -> str:
        return f"{'deepspeed' if mode in DEEPSPEED else 'ours'}_s3_ws{split(mode)[1]}"

    def reduction(fn):
        def cell(mode: str) -> str:
            ref = render.runs(results, base(mode))
            mine = fn(vol(mode))
            if not ref or not fn(ref[0]["ranks"][0]["volume"]):
                return "-"
            return f"{fn(ref[0]['ranks'][0]['volume']) / mine:.2f}x" if mine else "all local"

        return cell

    def calls(mode: str) -> str:
        v = vol(mode)
        return ", ".join(f"{v[k]['calls']:.0f} {k} ({mib(v[k]['payload'])})" for k in sorted(v))

    def across_cell(mode: str) -> str:
        return mib(across(vol(mode))) if split(mode)[1] > HPZ else "- (one node)"

    spec = [("mode", "l", str), ("world size", "r", lambda m: split(m)[1])]
    spec += [("collectives per step: calls op@group size (payload MiB)", "l", calls)]
    spec += [("payload per step per rank (MiB)", "r", lambda m: mib(total(vol(m), "payload")))]
    spec += [("on the wire per step per rank (MiB)", "r", lambda m: mib(total(vol(m))))]
    spec += [("total: fewer than stage 3 by", "r", reduction(total))]
    spec += [(f"across nodes (groups > {HPZ}), wire MiB", "r", across_cell)]
    spec += [("across nodes: fewer than stage 3 by", "r", reduction(across))]
    spec += render.speed_columns(results, {"stage 3 (same library)": base})
    spec += [
        ("loss after N steps", "r", lambda m: f"{render.runs(results, m)[0]['last_loss']:.4f}")
    ]
    present = [m for m in (*ZEROPP, *DEEPSPEED) if render.runs(results, m)]
    return render.columns(spec, present)


def optimizer_table(results: dict) -> str:
    present = [m for m in OPTIMIZERS if render.runs(results, m)]

    def loss_at(i: int):
        return lambda m: f"{render.runs(results, m)[0]['losses'][i]:.4f}"

    def tokens(m: str) -> str:
        return f"{len(render.runs(results, m)[0]['losses']) * GLOBAL_BATCH * h.SEQ:,}"

    spec = [("optimizer (ZeRO 2, ws 2)", "l", str), ("tokens seen", "r", tokens)]
    spec += [("loss, step 1", "r", loss_at(0)), ("loss after those tokens", "r", loss_at(-1))]
    spec += render.speed_columns(results, {"AdamW": "adamw_z2"})
    return render.columns(spec, present)


def failures(results: dict) -> str:
    rows = [[m, render.failure(results, m)] for m in results.get("failed", {})]
    return render.table("mode | why it has no figures", rows, "ll") if rows else "none"


def tables(results: dict) -> dict:
    out = {"bytes": zeropp_table(results), "optimizers": optimizer_table(results)}
    return out | {"failed": failures(results), "run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_zeropp.py")
