"""Hugging Face Trainer on shardspeed against DeepSpeed 0.19.8 and the plain Trainer (DDP).

    .venv/bin/python benchmarks/bench_hf.py            # measure, print the table
    .venv/bin/python benchmarks/bench_hf.py --write    # ... and update BENCHMARKS.md
    .venv/bin/python benchmarks/bench_hf.py --smoke    # 1 round, few steps

Every run is the same unmodified Trainer script (`--worker`), started by torchrun on 2 CPU
processes (gloo, 1 thread each) and given Hugging Face's documented config `examples/hf_zero2.json`
or `hf_zero3.json` ("auto" everywhere): `shardspeed` runs it with SHARDSPEED_AS_DEEPSPEED=1,
`deepspeed` without (DeepSpeed itself, `DS_ACCELERATOR=cpu`; it must be installed in the same
virtualenv: `.venv/bin/pip install deepspeed==0.19.8`), `plain` without any DeepSpeed config. The
model is a Llama built from a config (no download), the data fixed random token ids, the same in
every mode. Tokens per second count the timed steps only (after the warm-up steps), per job; peak
memory is each rank's peak resident set (the process: Python, torch and transformers included), the
largest over the ranks. Rounds alternate the modes; the table shows medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, command_line, machine_desc, shardspeed_commit, versions, write_markdown

TITLE = "## Hugging Face Trainer"
MODES = ("plain", "shardspeed_z2", "deepspeed_z2", "shardspeed_z3", "deepspeed_z3")
WORLD = 2
VOCAB, SEQ, MICRO = 4096, 128, 8
MODEL = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": SEQ,
}


def worker(mode: str, warmup: int, steps: int, out: str) -> None:
    """One Trainer run as a user writes it (nothing names shardspeed); rank 0 writes the result."""
    import torch
    from accelerate import PartialState
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.set_num_threads(1)
    PartialState(backend="gloo")
    config = None if mode == "plain" else str(REPO / "examples" / f"hf_zero{mode[-1]}.json")
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        deepspeed=config,
        per_device_train_batch_size=MICRO,
        max_steps=warmup + steps,
        learning_rate=3e-4,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, ((warmup + steps) * MICRO * WORLD, SEQ), generator=gen)
    data = [{"input_ids": x, "labels": x} for x in ids]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.start: float | None = None
            self.end = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                self.start = time.perf_counter()
            self.end = time.perf_counter()

    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock])
    trainer.train()
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    final_loss = trainer.state.log_history[-1].get("train_loss")
    if torch.distributed.get_rank() == 0:
        seconds = clock.end - clock.start
        result = {
            "mode": mode,
            "tokens_per_s": steps * MICRO * WORLD * SEQ / seconds,
            "peak_rss_mib": peak.item(),
            "train_loss": final_loss,
            "engine": type(trainer.model_wrapped).__module__,
        }
        Path(out).write_text(json.dumps(result))


def run(mode: str, warmup: int, steps: int) -> dict:
    # ACCELERATE_USE_DEEPSPEED: without it DeepSpeed's zero.Init, run by from_config before
    # initialize, sees a world of one process on a CPU-only machine (docs/huggingface.md).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("SHARDSPEED_AS_DEEPSPEED", None)
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    if mode != "plain":
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
    if mode.startswith("shardspeed"):
        env["SHARDSPEED_AS_DEEPSPEED"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={WORLD}",
            __file__,
            "--worker",
            mode,
            "--warmup",
            str(warmup),
            "--steps",
            str(steps),
            "--out",
            str(out),
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0 or not out.exists():
            lines = (done.stdout + done.stderr).strip().splitlines()
            tail = [line for line in lines if "Error" in line][-5:] + lines[-5:]
            raise RuntimeError(f"{mode} failed:\n" + "\n".join(tail))
        result = json.loads(out.read_text())
    expected = "deepspeed" if mode.startswith("deepspeed") else "shardspeed"
    if mode == "plain":
        expected = "torch.nn.parallel"  # DistributedDataParallel
    if not result["engine"].startswith(expected):
        raise RuntimeError(f"{mode} ran on {result['engine']}, not {expected}")
    return result


def table(results: dict[str, list[dict]]) -> str:
    medians = {
        mode: {
            key: statistics.median(r[key] for r in runs)
            for key in ("tokens_per_s", "peak_rss_mib", "train_loss")
        }
        for mode, runs in results.items()
    }
    rows = [
        "| mode | tokens/s | peak RSS per rank (MiB) | train loss | vs plain Trainer | vs DeepSpeed |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, m in medians.items():
        plain = medians["plain"]["tokens_per_s"] if "plain" in medians else None
        rival = (
            medians.get("deepspeed_" + mode.split("_")[-1]) if mode.startswith("shard") else None
        )
        vs_plain = f"{m['tokens_per_s'] / plain:.2f}x" if plain and mode != "plain" else ""
        vs_ds = f"{m['tokens_per_s'] / rival['tokens_per_s']:.2f}x" if rival else ""
        rows.append(
            f"| {mode} | {m['tokens_per_s']:.0f} | {m['peak_rss_mib']:.0f} | "
            f"{m['train_loss']:.4f} | {vs_plain} | {vs_ds} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=MODES)
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--smoke", action="store_true", help="1 round of 2 + 3 steps")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.warmup, args.steps, args.out)
        return
    if args.smoke:
        args.rounds, args.warmup, args.steps = 1, 2, 3
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for round_ in range(args.rounds):
        for mode in args.modes:
            result = run(mode, args.warmup, args.steps)
            results[mode].append(result)
            print(f"round {round_ + 1} {mode}: {result['tokens_per_s']:.0f} tokens/s, "
                  f"{result['peak_rss_mib']:.0f} MiB", flush=True)  # fmt: skip
    text = table(results)
    print(text)
    if args.write:
        section = "\n".join(
            [
                TITLE,
                "",
                f"Command: `{command_line('bench_hf.py')}`",
                "",
                f"Machine: {machine_desc()}; {versions()}; {shardspeed_commit()}.",
                "",
                f"Each run: `torchrun --nproc_per_node {WORLD}` of one unmodified Trainer script "
                f"(Llama {MODEL['hidden_size']} wide, {MODEL['num_hidden_layers']} layers, GQA "
                f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']} heads, vocab {VOCAB},"
                f" sequence {SEQ}, micro-batch {MICRO} per rank, fp32), Hugging Face's documented "
                "ZeRO configs from `examples/`; shardspeed through `SHARDSPEED_AS_DEEPSPEED=1`. "
                f"{args.warmup} warm-up steps, then {args.steps} timed; medians of {args.rounds} "
                "rounds, modes alternating. Peak RSS is the whole process's, the largest rank's.",
                "",
                text,
                "",
            ]
        )
        write_markdown(section, TITLE)


if __name__ == "__main__":
    main()
