"""Hugging Face Trainer on shardspeed against DeepSpeed 0.19.8 and the plain Trainer (DDP).

.venv/bin/python benchmarks/bench_hf.py [--quick] [--write]
"""

from __future__ import annotations

import tempfile
import time

import harness as h
import render

LIBS = ("shardspeed", "deepspeed")
SCENARIO = h.Scenario(
    name="hf",
    section="## Hugging Face Trainer",
    modes=dict.fromkeys(["plain", *(f"{lib}_z{s}" for s in (2, 3) for lib in LIBS)], 2),
    warmup=3,
    steps=20,
    # ACCELERATE_USE_DEEPSPEED: without it DeepSpeed's zero.Init, run by from_config before
    # initialize, sees a world of one process on a CPU-only machine (docs/huggingface.md).
    env=lambda mode, _args: {
        "ACCELERATE_USE_DEEPSPEED": "" if mode == "plain" else "true",
        "SHARDSPEED_AS_DEEPSPEED": "1" if mode.startswith("shardspeed") else "",
    },
    quick={"warmup": 2, "steps": 3, "rounds": 1},
)
LLAMA = dict(vocab_size=h.VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4)
LLAMA |= dict(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=h.SEQ)


def worker(mode: str, args) -> dict:
    """One Trainer run as a user writes it (nothing names shardspeed)."""
    import torch
    import transformers as tf
    from accelerate import PartialState

    if mode.startswith("deepspeed"):
        h.library("deepspeed")  # Skip where it is not installed
    torch.set_num_threads(args.threads)
    PartialState(backend="gloo")
    world, n = torch.distributed.get_world_size(), args.warmup + args.steps
    config = None if mode == "plain" else str(h.REPO / "examples" / f"hf_zero{mode[-1]}.json")
    options = dict(per_device_train_batch_size=args.micro_batch, max_steps=n, learning_rate=h.LR)
    options |= dict(logging_steps=10_000, save_strategy="no", report_to=[], disable_tqdm=True)
    options |= dict(deepspeed=config, use_cpu=True, seed=0)
    targs = tf.TrainingArguments(output_dir=tempfile.mkdtemp(), **options)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**LLAMA))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, h.VOCAB, (n * args.micro_batch * world, h.SEQ), generator=gen)
    times: dict[int, float] = {}

    class Clock(tf.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times[state.global_step] = time.perf_counter()

    data = [{"input_ids": x, "labels": x} for x in ids]
    trainer = tf.Trainer(model=model, args=targs, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    engine = type(trainer.model_wrapped).__module__
    expected = {"plain": "torch.nn.parallel", "deepspeed": "deepspeed"}
    expected = expected.get(mode.split("_")[0], "shardspeed")
    if not engine.startswith(expected):
        raise RuntimeError(f"{mode} ran on {engine}, not {expected}")
    seconds = times[n] - times[args.warmup]
    result = {"tokens_per_s": args.steps * args.micro_batch * world * h.SEQ / seconds}
    result["train_loss"] = trainer.state.log_history[-1].get("train_loss")
    return result | {"peak_rss_mib": h.peak_rss_mib(), "engine": engine}


def tables(results: dict) -> dict:
    rows = []
    for mode in results["runs"]:
        tps = render.med(results, mode)
        if tps is None:
            rows.append([mode, render.failure(results, mode), "-", "-", "-", "-"])
            continue
        rival = render.med(results, "deepspeed_" + mode[-2:]) if mode.startswith("shard") else None
        plain = render.med(results, "plain") if mode != "plain" else None
        rss = max(r["peak_rss_mib"] for r in render.runs(results, mode))
        cells = [render.fmt(tps), render.fmt(rss)]
        cells.append(render.fmt(render.med(results, mode, "train_loss"), ".4f"))
        rows.append(
            [mode, *cells, render.ratio(tps, plain, ".2f"), render.ratio(tps, rival, ".2f")]
        )
    headers = ["mode", "tokens/s", "peak RSS per rank (MiB)", "train loss"]
    headers += ["vs plain Trainer", "vs DeepSpeed"]
    return {"modes": render.table(headers, rows, "lrrrrr"), "run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_hf.py")
