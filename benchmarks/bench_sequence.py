"""Ulysses sequence parallelism on a small Llama-like model (RMSNorm, SwiGLU, rotary positions,
grouped-query attention through `DistributedAttention` around causal SDPA): sp 1, 2, 4 and
DeepSpeed's Ulysses at sp 4 on the same tokens per step (saved activations per rank, tokens/s,
losses), and the longest sequence each sp size trains under a fixed activation cap, with and
without tiled MLP and tiled head+loss.

    .venv/bin/python benchmarks/bench_sequence.py [--quick] [--write]
    DS_ACCELERATOR=cpu /work/dsvenv/bin/python benchmarks/bench_sequence.py --write  (with DeepSpeed)
"""

from __future__ import annotations

import argparse
import importlib
import math

import harness as h
import render

DIM, LAYERS, HEADS, KV_HEADS, FFN = 256, 4, 8, 4, 688
HEAD_DIM = DIM // HEADS
TILE = 256  # most tokens in a chunk of the tiled MLP and head+loss
GRAIN, CAP_LENGTH, MAX_LENGTH = 256, 1024, 65536  # search: step, sp 1's length for the cap, bound
SPEED = {"ours_sp1": 1, "ours_sp2": 2, "ours_sp4": 4, "deepspeed_sp4": 4}
SEARCH = {"longest_sp1": 1, "longest_sp2": 2, "longest_sp4": 4}
SCENARIO = h.Scenario(
    name="sequence",
    section="## Sequence parallelism (Ulysses): activation memory and longest sequence",
    modes=SPEED | SEARCH,
    warmup=2,
    steps=6,
    rounds=2,
    micro_batch=1,
    quick={"warmup": 1, "steps": 1, "rounds": 1, "seq_len": 512, "max_trials": 5},
    options={
        "--seq-len": dict(type=int, default=2048, help="global sequence length of the speed runs"),
        "--max-trials": dict(type=int, default=12, help="most trial steps per search"),
    },
    timeout=600,
)


def model_class():
    """The Llama-like model; `model(input_ids, position_ids, shift_labels)` is this rank's summed
    token loss. Attention is plain SDPA until `use_sequence_group` makes it Ulysses."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from shardspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    def causal(q, k, v):  # [batch, seq, heads, head_dim]; fewer key/value heads (GQA)
        qkv = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True).transpose(1, 2)

    def rotate(x, cos, sin):
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    def summed_loss(head, x, labels):
        logits = head(x).float()
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")

    def chunks(x) -> int:
        return math.ceil(x.shape[0] * x.shape[1] / TILE)

    def linear(n_in: int, n_out: int) -> nn.Linear:
        return nn.Linear(n_in, n_out, bias=False)

    class SwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up, self.down = linear(DIM, FFN), linear(DIM, FFN), linear(FFN, DIM)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
            self.q, self.kv = linear(DIM, DIM), linear(DIM, 2 * KV_HEADS * HEAD_DIM)
            self.o, self.mlp = linear(DIM, DIM), SwiGLU()
            self.ulysses = None  # DistributedAttention over the sequence group, if any

        def forward(self, x, cos, sin, tiled: bool):
            b, s, _ = x.shape
            y = self.attn_norm(x)
            q = rotate(self.q(y).view(b, s, HEADS, HEAD_DIM), cos, sin)
            k, v = self.kv(y).view(b, s, 2, KV_HEADS, HEAD_DIM).unbind(2)
            k = rotate(k, cos, sin)
            attn = causal(q, k, v) if self.ulysses is None else self.ulysses(q, k, v, 0)
            x = x + self.o(attn.reshape(b, s, DIM))
            y = self.mlp_norm(x)
            return x + (
                TiledMLP.apply(SwiGLU.forward, self.mlp, y, chunks(y)) if tiled else self.mlp(y)
            )

    class Llama(nn.Module):
        tiled = False

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(h.MODEL_SEED)
            self.embed = nn.Embedding(h.VOCAB, DIM)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
            self.norm, self.head = nn.RMSNorm(DIM), linear(DIM, h.VOCAB)
            inverse = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
            self.register_buffer("inv_freq", inverse, persistent=False)

        def use_sequence_group(self, attention_class, group) -> None:
            for layer in self.layers:
                layer.ulysses = attention_class(causal, group)

        def forward(self, input_ids, position_ids, shift_labels):
            angles = position_ids[..., None].float() * self.inv_freq
            angles = torch.cat((angles, angles), dim=-1)[:, :, None]  # [batch, seq, 1, head_dim]
            x = self.embed(input_ids)
            cos, sin = angles.cos(), angles.sin()
            for layer in self.layers:
                x = layer(x, cos, sin, self.tiled)
            x, y = self.norm(x), shift_labels
            if not self.tiled:
                return summed_loss(self.head, x, y)
            return TiledFusedLogitsLoss.apply(
                summed_loss, self.head, x, y, None, chunks(x), None, "sum"
            )

    return Llama


def batches(n: int, length: int, micro_batch: int, sp_rank: int, sp: int) -> tuple[list, int]:
    """This rank's slices of `n` global batches of `length` tokens as ((ids, positions), labels),
    and the labelled tokens of a global batch (labels are shifted before the cut)."""
    import torch

    from shardspeed.runtime.sequence_parallel.ulysses_sp import shard_batch

    out = []
    for ids, _ in h.progression_batches(n, micro_batch, seq=length):
        positions = torch.arange(length).expand(micro_batch, length)
        s = shard_batch({"input_ids": ids, "labels": ids, "position_ids": positions}, sp_rank, sp)
        out.append(((s["input_ids"], s["position_ids"]), s["shift_labels"]))
    return out, micro_batch * (length - 1)


def engine_for(lib: str, sp: int, micro_batch: int):
    """The model under `lib`'s engine (or "torch": a plain loop) at sequence-parallel size `sp`
    (one replica), its attention `lib`'s Ulysses over the engine's sequence group when sp > 1;
    and a training step `step(inputs, labels, labelled tokens) -> loss`."""
    model = model_class()()
    cfg = h.config(micro_batch, sequence_parallel_size=sp, data_parallel_size=1)
    if lib == "deepspeed" and sp > 1:
        # DeepSpeed sums gradients over the sequence ranks only when an mpu gives the groups
        # (ALST's parallel_state_sp); with mesh_param or the config's sizes it leaves them
        # unreduced at stage 0, so the ranks' weights drift apart.
        h.library(lib).init_distributed()
        mpu = importlib.import_module("deepspeed.runtime.sequence_parallel.parallel_state_sp")
        mpu.initialize_sequence_parallel(sp)
        engine, *_ = h.library(lib).initialize(model=model, config=h.config(micro_batch), mpu=mpu)
        forward, backward, update = engine, engine.backward, engine.step
    else:
        forward, backward, update, engine = h.trainer(lib, model, cfg)
    if sp > 1:
        layer = importlib.import_module(f"{h.library(lib).__name__}.sequence.layer")
        model.use_sequence_group(layer.DistributedAttention, engine.get_sequence_parallel_group())

    def step(x, y, labelled: int):
        loss = forward(*x, y) / labelled
        backward(loss)
        update()
        return loss.detach()

    return model, step


def saved_peak(model, step, batch, labelled: int) -> int:
    """One step; the most bytes of saved activations alive at once in it (parameters left out),
    the largest over the ranks."""
    import torch
    import torch.distributed as dist

    meter = h.SavedBytes(model.parameters())
    with meter.hooks():
        step(*batch, labelled)
    peak = torch.tensor(meter.peak)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def speed(lib: str, rank: int, sp: int, args) -> dict:
    import torch
    import torch.distributed as dist

    model, step = engine_for(lib, sp, args.micro_batch)
    n, losses = args.warmup + args.steps, []
    data, labelled = batches(n + 1, args.seq_len, args.micro_batch, rank, sp)
    rss_init = h.current_rss_mib()

    def recorded(x, y):
        losses.append(step(x, y, labelled))
        return losses[-1]

    result = h.timed(recorded, data[:n], args.warmup, args.steps, args.micro_batch * args.seq_len)
    result["rss_growth_mib"] = h.peak_rss_mib() - rss_init
    whole = torch.stack(losses)
    dist.all_reduce(whole)  # a rank's loss is its slice's part of the whole sequence's
    result |= dict(losses=whole.tolist(), first_loss=whole[0].item(), last_loss=whole[-1].item())
    result["saved_peak"] = saved_peak(model, step, data[n], labelled)
    return result | {"tokens_per_rank": args.seq_len // sp}


def search(saved: dict, trial, cap: int, max_trials: int) -> tuple[int, bool]:
    """The longest multiple of GRAIN whose `trial(length)` (saved bytes, kept in `saved`) is at
    most `cap`, and whether trials confirm it (it fits, one GRAIN more does not). Saved bytes grow
    about linearly with the length: the line through the two latest trials predicts it until it
    predicts a length already tried, then single steps confirm it."""

    def fits(length: int) -> bool:
        saved[length] = saved[length] if length in saved else trial(length)
        return saved[length] <= cap

    latest = [2 * GRAIN, 4 * GRAIN]
    fits(latest[0]), fits(latest[1])
    length = latest[1]
    while len(saved) < max_trials:
        (a, b), (sa, sb) = latest[-2:], (saved[n] for n in latest[-2:])
        guess = b + (cap - sb) * (b - a) / max(sb - sa, 1)
        length = min(max(GRAIN, int(guess) // GRAIN * GRAIN), MAX_LENGTH)
        if length in saved:
            break
        latest.append(length)
        fits(length)
    while length > GRAIN and len(saved) < max_trials and not fits(length):
        length -= GRAIN
    while length < MAX_LENGTH and len(saved) < max_trials and fits(length + GRAIN):
        length += GRAIN
    above = saved.get(length + GRAIN, cap + 1 if length == MAX_LENGTH else None)
    return length, saved.get(length, cap + 1) <= cap and above is not None and above > cap


def longest(rank: int, sp: int, args) -> dict:
    """The longest sequence under the cap (sp 1's saved activations at CAP_LENGTH, measured here
    on the plain model), untiled and with tiled MLP and head+loss."""
    data, labelled = batches(1, CAP_LENGTH, args.micro_batch, 0, 1)
    cap = saved_peak(*engine_for("torch", 1, args.micro_batch), data[0], labelled)
    model, step = engine_for("ours", sp, args.micro_batch)

    def trial(length: int) -> int:
        data, labelled = batches(1, length, args.micro_batch, rank, sp)
        return saved_peak(model, step, data[0], labelled)

    result = {"cap": cap}
    for key, model.tiled in (("plain", False), ("tiled", True)):
        saved: dict[int, int] = {}
        length, confirmed = search(saved, trial, cap, args.max_trials)
        result[key] = {"length": length, "confirmed": confirmed, "saved": saved}
    return result | {"peak_rss_mib": h.peak_rss_mib()}


def worker(mode: str, args) -> dict:
    rank, world = h.setup(args.threads)
    if mode in SEARCH:
        return longest(rank, world, args)
    return speed(mode.split("_")[0], rank, world, args)


def orchestrate(scenario: h.Scenario, args) -> dict:
    """The speed modes over rounds, then each search once (its figures are byte counts)."""
    parts = []
    for family, rounds in ((SPEED, args.rounds), (SEARCH, 1)):
        if modes := [m for m in family if m in args.modes]:
            part = argparse.Namespace(**vars(args) | {"modes": modes, "rounds": rounds})
            parts.append(h.run_rounds(scenario, part, "bench_sequence.py"))
    results = parts[0]
    for part in parts[1:]:
        results["runs"] |= part["runs"]
        results["failed"] |= part["failed"]
        for key in ("total_s", "discarded", "noisy"):
            results["meta"][key] += part["meta"][key]
    return results


def first(results: dict, mode: str, *keys: str):
    """A value of the mode's first run (keys descend into it), or None."""
    value = (render.runs(results, mode) or [None])[0]
    for key in keys:
        value = value and value.get(key)
    return value


def mib(value) -> str:
    return render.fmt(value and value / render.MIB, ".1f")


def speed_table(results: dict) -> str:
    def saved(mode: str):
        return first(results, mode, "saved_peak")  # bytes: the same every round

    spec = [("mode", "l", str), ("sequence ranks", "r", SPEED.get)]
    spec += [("tokens per rank", "r", lambda m: first(results, m, "tokens_per_rank") or "-")]
    spec += [
        (
            "saved activations per rank (MiB)",
            "r",
            lambda m: mib(saved(m)) if saved(m) else render.failure(results, m),
        )
    ]
    spec += [("/ sp 1", "r", lambda m: render.ratio(saved(m), saved("ours_sp1")))]
    spec += render.rss_columns(results)[1:] + render.speed_columns(results, {"sp 1": "ours_sp1"})
    return render.columns(spec, [m for m in SPEED if m in results["runs"]])


def longest_table(results: dict) -> str:
    def cell(key: str):
        def text(mode: str) -> str:
            r = first(results, mode, key)
            if r is None:
                return render.failure(results, mode)
            unsure = "" if r["confirmed"] else ", unconfirmed"
            peak = r["saved"].get(str(r["length"]))  # JSON keys are strings
            return f"{r['length']} ({mib(peak)} MiB{unsure}), {len(r['saved'])} trials"

        return text

    spec = [("mode", "l", str), ("cap (MiB)", "r", lambda m: mib(first(results, m, "cap")))]
    spec += [("longest untiled: tokens (saved)", "r", cell("plain"))]
    spec += [("longest with tiled MLP and head+loss", "r", cell("tiled"))]
    return render.columns(spec, [m for m in SEARCH if m in results["runs"]])


SP4, SP1 = "longest sequence, sp 4", "sp 1"
TARGETS = [  # label, measured and baseline ("mode/key/key"), target ("<" or ">=" a ratio)
    (
        "saved activations per rank, sp 4 / sp 1",
        "ours_sp4/saved_peak",
        "ours_sp1/saved_peak",
        "< 0.30",
    ),
    (f"{SP4} / {SP1}, untiled", "longest_sp4/plain/length", "longest_sp1/plain/length", ">= 3.50"),
    (
        f"{SP4} / {SP1}, both tiled",
        "longest_sp4/tiled/length",
        "longest_sp1/tiled/length",
        ">= 3.50",
    ),
    (f"{SP4} tiled / {SP1} untiled", "longest_sp4/tiled/length", "longest_sp1/plain/length", "-"),
]


def targets_table(results: dict) -> str:
    rows = []
    for label, measured, baseline, target in TARGETS:
        a, b = (first(results, *path.split("/")) for path in (measured, baseline))
        r = a / b if a and b else None
        verdict = "not measured" if r is None else "info only" if target == "-" else None
        if verdict is None:
            below, bound = target.startswith("<"), float(target.split()[1])
            verdict = "met" if (r < bound if below else r >= bound) else "MISSED"
        rows.append([label, render.fmt(r, ".3f"), target, verdict])
    return render.table("comparison | ratio | target | result", rows, "lrrl")


def tables(results: dict) -> dict:
    speed_only = dict(results, runs={m: rs for m, rs in results["runs"].items() if m in SPEED})
    tried = [m for m in SPEED if m in results["runs"] or m in results["failed"]]
    return {
        "targets": targets_table(results),
        "speed": speed_table(results),
        "longest": longest_table(results),
        "losses": render.loss_lines(speed_only, "ours_sp1", 1e-4),
        "modes": render.mode_table(results, tried),
        "run": render.run_line(results),
    }


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_sequence.py", orchestrate)
