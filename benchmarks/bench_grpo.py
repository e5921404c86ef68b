"""Post-training at ZeRO-3: a GRPO-style loop (generate completions, score them, one policy-
gradient step on them) on 2 ranks, fp32: three ways of getting the training weights into a
generator, against generating through the ZeRO-3 hooks.

    .venv/bin/python benchmarks/bench_grpo.py [--quick] [--write]

Model: a Hugging Face `LlamaForCausalLM` from a config (width 256, 4 layers, 8 query and 4
key/value heads, SwiGLU 688, vocabulary 4096, untied head, no EOS token so that every completion
runs to its length), the same weights in every mode (MODEL_SEED). An iteration on each rank:
PROMPTS random prompts of PROMPT_LEN tokens, NEW greedy tokens each (greedy, so that the modes'
tokens can be compared), reward = the fraction of a completion's tokens below VOCAB / 8, advantages
= rewards normalised over the rank's batch (one group per rank: greedy gives one completion per
prompt), loss = -mean(advantage x summed log-probability of the completion) (on-policy, no KL:
GRPO's clipped ratio is 1), one AdamW step. Modes:

- naive: `engine.module.generate` through the ZeRO-3 hooks, `stage3_max_reuse_distance` 0 so that
  every forward of every decoding step gathers every unit;
- naive_default: the same with the default reuse distance (1e9): once the order of units is
  recorded, units used again soon stay whole, so later generations gather far less;
- trl_path: as TRL generates at ZeRO-3: `GatheredParameters` over all parameters, hooks off via
  `engine.optimizer.parameter_offload` (trl.models.utils' remove_hooks / add_hooks), then
  `module.generate`;
- hybrid: `hybrid_engine.enabled`, `engine.generate` (its inference copy rebuilt after each step);
- stream: a separate plain copy of the model as the generator (vLLM's place), its parameters
  overwritten from `engine.stream_weights(bucket_bytes=BUCKET)` before each generation.

Each iteration's time is split into transfer (gathering, building the copy, streaming), generation,
scoring and training; `--warmup` iterations first, then `--steps` timed ones.
"""

from __future__ import annotations

import time

import torch

import harness as h
import render

SCENARIO = h.Scenario(
    name="grpo",
    section="## Post-training: a GRPO-style loop at ZeRO-3 (generation paths)",
    modes={"naive": 2, "naive_default": 2, "trl_path": 2, "hybrid": 2, "stream": 2},
    warmup=1,
    steps=5,
    rounds=2,
    quick={"warmup": 1, "steps": 1, "rounds": 1},
    timeout=600,
)
PROMPTS, PROMPT_LEN, NEW, PROMPT_SEED = 8, 16, 32, 700
BUCKET = 4 * 2**20  # stream_weights' bucket (bytes)
LIKED = h.VOCAB // 8  # the reward counts tokens below this
PARTS = ("transfer", "generation", "scoring", "training")
GENERATE_KWARGS = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0}


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4)
    sizes |= dict(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    tokens = dict(vocab_size=h.VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(h.MODEL_SEED)
    return LlamaForCausalLM(LlamaConfig(**sizes, **tokens))


def hf_generate(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **GENERATE_KWARGS)


def prompts(rank: int, iteration: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(PROMPT_SEED + 1000 * iteration + rank)
    return torch.randint(0, h.VOCAB, (PROMPTS, PROMPT_LEN), generator=gen)


def score(completions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, advantages): the liked fraction of each completion, normalised over the batch."""
    rewards = (completions < LIKED).float().mean(1)
    return rewards, (rewards - rewards.mean()) / (rewards.std() + 1e-4)


def policy_loss(engine, sequences: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    logits = engine(input_ids=sequences).logits[:, PROMPT_LEN - 1 : -1]
    chosen = sequences[:, PROMPT_LEN:, None]
    logp = torch.log_softmax(logits, -1).gather(-1, chosen).squeeze(-1).sum(1)
    return -(advantages * logp).mean() / NEW


def generation_path(mode: str, engine):
    """generate(ids) -> (sequences, transfer seconds) for the mode."""
    import shardspeed

    def naive(ids):
        return hf_generate(engine.module, ids), 0.0

    def hybrid(ids):
        before = engine.generation_stats["gather_s"]
        out = engine.generate(ids, **GENERATE_KWARGS)
        return out, engine.generation_stats["gather_s"] - before

    if mode == "trl_path":
        from trl.models.utils import add_hooks, remove_hooks

        def trl_path(ids):
            t0 = time.perf_counter()
            gathered = shardspeed.zero.GatheredParameters(list(engine.module.parameters()))
            gathered.__enter__()
            remove_hooks(engine)
            t1 = time.perf_counter()
            out = hf_generate(engine.module, ids)
            t2 = time.perf_counter()
            add_hooks(engine)
            gathered.__exit__(None, None, None)
            return out, (t1 - t0) + (time.perf_counter() - t2)

        return trl_path
    if mode == "stream":
        generator = build_model().eval()
        targets = dict(generator.named_parameters())

        def stream(ids):
            t0 = time.perf_counter()
            with torch.no_grad():
                for item in engine.stream_weights(bucket_bytes=BUCKET):
                    for name, tensor in item:  # what vLLM's load_weights does per tensor
                        targets[name].copy_(tensor)
            t1 = time.perf_counter()
            return hf_generate(generator, ids), t1 - t0

        return stream
    return {"naive": naive, "naive_default": naive, "hybrid": hybrid}[mode]


def gathered_mib(volume: dict) -> float:
    """MiB all-gathered, from a `shardspeed.comm.comm_volume()`."""
    return sum(v["bytes"] for k, v in volume.items() if k.startswith("all_gather")) / 2**20


def worker(mode: str, args) -> dict:
    import shardspeed
    from shardspeed.comm import comm_volume, reset_comm_volume

    rank, world = h.setup(args.threads)
    model = build_model()
    params = sum(p.numel() for p in model.parameters())
    cfg = h.config(PROMPTS, stage=3)
    if mode == "hybrid":
        cfg["hybrid_engine"] = {"enabled": True}
    if mode == "naive":
        cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    generate = generation_path(mode, engine)
    window, iterations, tokens, losses, rewards = h.Window(), [], [], [], []
    for it in range(args.warmup + args.steps):
        if it == args.warmup:
            window.start()
        ids, parts = prompts(rank, it), {}
        engine.eval()
        h.barrier()
        reset_comm_volume()
        t0 = time.perf_counter()
        sequences, parts["transfer"] = generate(ids)
        h.barrier()
        t1 = time.perf_counter()
        parts["gathered_mib"] = gathered_mib(comm_volume())
        parts["generation"] = t1 - t0 - parts["transfer"]
        reward, advantages = score(sequences[:, PROMPT_LEN:])
        t2 = time.perf_counter()
        engine.train()
        loss = policy_loss(engine, sequences, advantages)
        engine.backward(loss)
        engine.step()
        h.barrier()
        parts |= {"scoring": t2 - t1, "training": time.perf_counter() - t2}
        iterations.append(parts)
        tokens.append(sequences[:, PROMPT_LEN:].tolist())
        losses.append(loss.detach())
        rewards.append(reward.mean().item())
    window.stop()
    timed = iterations[args.warmup :]
    total = {p: sum(t[p] for t in timed) for p in PARTS}
    new_tokens = world * PROMPTS * NEW * len(timed)
    out = {"iterations": iterations, "tokens": tokens, "rewards": rewards, "seconds": total}
    out["gathered_mib"] = sum(t["gathered_mib"] for t in timed) / len(timed)
    out["tokens_per_s"] = new_tokens / total["generation"]
    out["tokens_per_s_with_transfer"] = new_tokens / (total["generation"] + total["transfer"])
    out |= {"timed_iterations": len(timed), "params": params, "peak_rss_mib": h.peak_rss_mib()}
    out["generation_stats"] = dict(getattr(engine, "generation_stats", {}))
    return window.result() | h.loss_curve(losses) | out


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def seconds(results: dict, mode: str, parts=PARTS, run: dict | None = None) -> float | None:
    """Seconds of `parts` per timed iteration: of `run`, else the median over the mode's rounds."""
    if run is not None:
        return sum(run["seconds"][p] for p in parts) / run["timed_iterations"]
    return render.med(results, mode, lambda r: seconds(results, mode, parts, r))


def parts_table(results: dict) -> str:
    def cell(parts, spec=".3f"):
        return lambda m: render.fmt(seconds(results, m, parts), spec)

    def tps(key):
        return lambda m: render.fmt(render.med(results, m, key), ".1f")

    def load(m):
        loads = [(r.get("other_load"), "*" * bool(r.get("noisy"))) for r in render.runs(results, m)]
        return ", ".join(render.fmt(x, ".2f") + star for x, star in loads)

    def gathered(m):
        return render.fmt(render.med(results, m, lambda r: r["gathered_mib"]), ".0f")

    spec = [("mode", "l", str), *[(f"{p} (s)", "r", cell((p,))) for p in PARTS]]
    spec += [("iteration (s)", "r", cell(PARTS)), ("generated tok/s", "r", tps("tokens_per_s"))]
    spec.append(("tok/s counting the transfer", "r", tps("tokens_per_s_with_transfer")))
    spec.append(("MiB all-gathered in transfer and generation", "r", gathered))
    spec += [*render.rss_columns(results, growth=False), ("other load (cores)", "l", load)]
    return render.columns(spec, render.measured(results))


RATIOS = {"generation": ("generation",), "generation + transfer": ("generation", "transfer")}
BASES = ("naive", "naive_default")


def ratio_table(results: dict) -> str:
    """A base's seconds per iteration over each other mode's: generation, with the transfer,
    whole iterations; the median over rounds, then each round's ratio."""

    def cell(base: str, other: str, parts) -> str:
        pairs = list(zip(render.runs(results, base), render.runs(results, other)))
        if not pairs:
            return "-"
        r = seconds(results, base, parts) / seconds(results, other, parts)
        rounds = ", ".join(
            f"{seconds(results, '', parts, a) / seconds(results, '', parts, b):.2f}"
            for a, b in pairs
        )
        return f"{r:.2f} ({rounds})"

    rows = []
    for other in ("hybrid", "trl_path", "stream"):
        for label, parts in {**RATIOS, "whole iteration": PARTS}.items():
            cells = [cell(base, other, parts) for base in BASES]
            verdict = "-"
            if other == "hybrid" and label in RATIOS and render.runs(results, "naive"):
                r = seconds(results, "naive", parts) / seconds(results, other, parts)
                verdict = f"{'met' if r >= 5 else 'MISSED'} (target >= 5 against naive)"
            rows.append([f"{label}: {other}", *cells, verdict])
    head = ["seconds per iteration", *(f"{b} / this mode (per round)" for b in BASES), "result"]
    return render.table(head, rows, "lrrl")


def flat_tokens(run: dict) -> list[int]:
    return [t for rank in run["ranks"] for it in rank["tokens"] for row in it for t in row]


def agreement_table(results: dict) -> str:
    """Each mode's tokens and losses against naive's (first rounds), and its rounds' agreement."""
    base, rows = render.runs(results, "naive"), []
    for mode in render.measured(results):
        rs = render.runs(results, mode)
        tokens, same, worst = flat_tokens(rs[0]), "-", None
        if base and mode != "naive":
            ref = flat_tokens(base[0])
            agree = sum(a == b for a, b in zip(tokens, ref)) / len(ref)
            same = "yes" if tokens == ref else f"NO ({100 * agree:.1f}% of tokens)"
            worst = max(abs(a - b) / abs(b) for a, b in zip(rs[0]["losses"], base[0]["losses"]))
        repeat = "yes" if all(flat_tokens(r) == tokens for r in rs) else "NO"
        losses, rewards = rs[0]["losses"], rs[0]["rewards"]
        cells = [same, render.fmt(worst, ".1e"), repeat, f"{losses[0]:.5f} -> {losses[-1]:.5f}"]
        rows.append([mode, *cells, f"{rewards[0]:.3f} -> {rewards[-1]:.3f}"])
    head = "mode | tokens identical to naive's (all iterations, both ranks) | losses: largest "
    head += "relative difference to naive's | same tokens every round | loss first -> last"
    return render.table(head + " | mean reward first -> last (rank 0)", rows, "lllll")


def tables(results: dict) -> dict:
    out = {"run": render.run_line(results)}
    if any(results["runs"].values()):
        out = {"ratios": ratio_table(results), "parts": parts_table(results)} | out
        out["agreement"] = agreement_table(results)
    return out


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_grpo.py")
