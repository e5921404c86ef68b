"""The training functions the hybrid-engine tests run on every rank of a `RankPool`: the example
GPT (examples/gpt.py) or a Hugging Face GPT-2 (which automatic tensor parallelism can split for
`inference_tp_size` 2) trained through `initialize` with `hybrid_engine` enabled, generating between
steps, and checked against the same weights generating as a plain, unsharded model."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import shardspeed
from gpt import GPT, GPTConfig
from shardspeed.inference.sampling import SamplingParams

SMALL = GPTConfig(vocab_size=48, block_size=32, n_layer=2, n_head=4, n_embd=32)
STEPS, MICRO, NEW = 3, 2, 6


def prompts_of(rank: int) -> list[list[int]]:
    """Two prompts of different lengths per rank, different on every rank."""
    gen = torch.Generator().manual_seed(70 + rank)
    return [torch.randint(0, SMALL.vocab_size, (n,), generator=gen).tolist() for n in (3, 7)]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + 10 * step + rank)
    tokens = torch.randint(0, SMALL.vocab_size, (MICRO, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(5)
    if kind == "gpt":
        return GPT(SMALL)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=SMALL.vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config)


def loss_of(kind: str, engine: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    if kind == "gpt":
        return engine(ids, labels)
    logits = engine(ids).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
    )


def plain_greedy(
    kind: str, state: dict[str, torch.Tensor], prompts: list[list[int]]
) -> list[list[int]]:
    """What the unsharded model with these weights generates with its own generate(), greedy."""
    model = build(kind)
    model.load_state_dict(state)
    model.eval()
    out = []
    for prompt in prompts:
        if kind == "gpt":
            ids = model.generate(torch.tensor([prompt]), NEW, temperature=0.0)
        else:
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
            )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def train(
    generate: bool, zero: int = 3, inference_tp: int = 1, kind: str = "gpt", **hybrid
) -> dict:
    """3 steps of the `kind` model at ZeRO `zero`; with `generate`, greedy generation before
    every step (and after the last), each checked against the plain model of the same weights."""
    model = build(kind)
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            # Threshold 0: even the small parameters are shards, so nothing is whole by accident.
            "zero_optimization": {"stage": zero}
            | ({"stage3_param_persistence_threshold": 0} if zero == 3 else {}),
            "hybrid_engine": {"enabled": True, "inference_tp_size": inference_tp, **hybrid},
        },
    )
    rank = torch.distributed.get_rank()
    prompts = prompts_of(rank)
    generated, expected = [], []

    def generate_and_check() -> None:
        engine.eval()
        tokens = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
        engine.train()
        generated.append(tokens)
        with torch.random.fork_rng():  # building the reference model must not move training's RNG
            expected.append(plain_greedy(kind, engine.consolidated_state_dict(), prompts))

    for step in range(STEPS):
        if generate:
            generate_and_check()
        ids, labels = batch(step, rank)
        engine.backward(loss_of(kind, engine, ids, labels))
        engine.step()
    if generate:
        generate_and_check()
    return {
        "generated": generated,
        "expected": expected,
        "params": {n: t for n, t in engine.consolidated_state_dict().items()},
        "stats": dict(engine.generation_stats),
    }
