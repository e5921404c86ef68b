"""A small RLHF-style loop on the hybrid engine: generate, score, train, repeat.

One model is the actor: each iteration it generates completions for a set of prompts (greedy
decoding is not exploration, so it samples), a toy reward scores them (the share of completion bytes
that are lowercase vowels), and a policy-gradient step (REINFORCE with the batch's mean reward as
baseline) makes high-reward completions more likely. Training uses ZeRO stage 3; generation uses the
hybrid engine's inference copy, gathered once per iteration rather than once per token. Each
iteration prints the mean reward and where the time went (building the copy, generating, training).

    shardspeed --num_procs 2 examples/rlhf.py                 # 2 processes, ZeRO-3
    python examples/rlhf.py                                   # one process

The actor starts untrained (random weights), so the reward starts at chance level (5 vowels of
256 byte values: about 2%) and rises within a few dozen iterations.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import shardspeed as deepspeed
from shardspeed.inference.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPT, GPTConfig

VOWELS = torch.tensor([ord(c) for c in "aeiou"])
PROMPTS = ["def ", "The ", "class ", "import ", "Return ", "# ", "if x", "for i in "]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher's
    return parser.parse_args()


def reward(completion: list[int]) -> float:
    """Share of the completion's bytes that are lowercase vowels."""
    if not completion:
        return 0.0
    return float(torch.isin(torch.tensor(completion), VOWELS).float().mean())


def policy_loss(
    engine: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], rewards
) -> torch.Tensor:
    """REINFORCE: -(reward - mean reward) x log-probability of each completion, averaged."""
    advantages = torch.tensor(rewards) - sum(rewards) / len(rewards)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width - 1)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0  # positions that predict the completion
    logits = engine(ids[:, :-1])
    logp = -F.cross_entropy(logits.transpose(1, 2).float(), ids[:, 1:], reduction="none")
    per_sequence = (logp * mask).sum(dim=1)
    return -(advantages * per_sequence).mean()


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64))
    engine, *_ = deepspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": len(PROMPTS),
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": args.zero_stage},
            "hybrid_engine": {"enabled": True},
        },
    )
    prompts = [list(p.encode()) for p in PROMPTS]
    if rank == 0:
        print(f"{world} process(es), ZeRO stage {args.zero_stage}")
        print("iter  reward  copy_s  generate_s  train_s  sample")
    for it in range(args.iterations):
        stats_before = dict(engine.generation_stats)
        engine.eval()
        params = [
            SamplingParams(
                args.new_tokens,
                temperature=1.0,
                seed=args.seed * 100_003 + it * 1009 + rank * 97 + i,
            )
            for i in range(len(prompts))
        ]
        completions = engine.generate(prompts, params)
        engine.train()
        rewards = [reward(c) for c in completions]
        start = time.perf_counter()
        engine.backward(policy_loss(engine, prompts, completions, rewards))
        engine.step()
        train_s = time.perf_counter() - start
        copy_s = engine.generation_stats["gather_s"] - stats_before["gather_s"]
        gen_s = engine.generation_stats["generate_s"] - stats_before["generate_s"]
        mean = torch.tensor([sum(rewards) / len(rewards)])
        torch.distributed.all_reduce(mean)
        if rank == 0:
            sample = bytes(prompts[0] + completions[0]).decode("utf-8", "replace")
            print(
                f"{it:4d}  {float(mean) / world:.3f}  {copy_s:6.3f}  {gen_s:10.3f}  "
                f"{train_s:7.3f}  {sample!r}"
            )


if __name__ == "__main__":
    main()
