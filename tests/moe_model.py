"""A tiny mixture-of-experts GPT (attention, then an MoE MLP of 4 experts, in each of 2 blocks), its
single-process fp32 reference, and the training function the expert-parallel tests run on every
rank of a `RankPool`.

Routing is deterministic (no noise, no random token selection, no second-expert sampling), so every
run sends every token to the same experts. The gate sees one micro-batch at a time, as on a rank: the
reference runs the global batch micro-batch by micro-batch and averages their losses, which is what
data parallelism with gradient accumulation computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from pipe_model import merged_params
from shardspeed.moe.layer import MoE
from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

VOCAB, DIM, SEQ, HEADS, BLOCKS, EXPERTS = 32, 16, 8, 4, 2, 4
LR, STEPS, MICRO, AUX = 0.01, 5, 2, 0.01
# (k, drop_tokens, capacity_factor): top-1 with a capacity that drops tokens; top-2 without dropping.
ROUTINGS = {"top1-drop": (1, True, 1.0), "top2-nodrop": (2, False, 1.0)}


class Block(nn.Module):
    def __init__(self, ep: int, routing: str) -> None:
        super().__init__()
        k, drop, factor = ROUTINGS[routing]
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.moe = MoE(
            DIM,
            expert,
            num_experts=EXPERTS,
            ep_size=ep,
            k=k,
            capacity_factor=factor,
            min_capacity=1,
            drop_tokens=drop,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = (
            y.view(b, t, HEADS, -1).transpose(1, 2) for y in self.qkv(self.norm1(x)).chunk(3, -1)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, DIM))
        out, l_aux, _ = self.moe(self.norm2(x))
        return x + out, l_aux


class MoEGPT(nn.Module):
    """Built with every expert distinct (a seeded value per global expert index), whatever
    `ep`: with ep > 1, `ep_rank` says which experts this rank's local ones are."""

    def __init__(self, ep: int = 1, ep_rank: int = 0, routing: str = "top1-drop") -> None:
        super().__init__()
        torch.manual_seed(7)
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(ep, routing) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        local = EXPERTS // ep
        with torch.no_grad():
            for b, block in enumerate(self.blocks):
                for i, expert in enumerate(block.moe.deepspeed_moe.experts.deepspeed_experts):
                    gen = torch.Generator().manual_seed(1000 * b + ep_rank * local + i)
                    for p in expert.parameters():
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tokens(ids)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return self.norm(x) @ self.tokens.weight.t(), aux


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    logits, aux = output
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1)) + AUX * aux


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def reference(global_size: int, routing: str = "top1-drop") -> dict[str, torch.Tensor]:
    """fp32, one process: each step's loss is the mean of its micro-batches' losses."""
    model = MoEGPT(routing=routing)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    chunks = global_size // MICRO
    for step in range(STEPS):
        ids, labels = global_batch(step, global_size)
        for c in range(chunks):
            rows = slice(c * MICRO, (c + 1) * MICRO)
            (loss_fn(model(ids[rows]), labels[rows]) / chunks).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(
    ep: int,
    zero: int = 0,
    global_size: int | None = None,
    save: str | None = None,
    load: str | None = None,
    routing: str = "top1-drop",
    keep_engine: bool = False,
    split_groups: bool = False,
    zero_extra: dict | None = None,
    **extra: Any,
) -> Any:
    """The MoE GPT through `initialize`, experts spread over `ep` ranks, data parallel over
    all; global batches of `global_size` sequences (default one micro-batch per rank). `save`
    checkpoints after step 3; `load` resumes from one. Returns this rank's parameters by their
    checkpoint (global) names, its local expert weights by module name, and the expert load
    (or the engine itself, with `keep_engine`). `split_groups` gives the optimizer DeepSpeed's
    split param groups; `zero_extra` adds `zero_optimization` keys."""
    dist = torch.distributed
    dp = dist.get_world_size()
    gas = (global_size or MICRO * dp) // (MICRO * dp)
    rank = dist.get_rank()
    # Which experts this rank holds: DeepSpeed's layouts (see comm/topology.py).
    ep_rank = rank // (dp // ep) if extra.get("use_data_before_expert_parallelism") else rank % ep
    model = MoEGPT(ep, ep_rank, routing)
    params = model.parameters()
    if split_groups:  # DeepSpeed's recipe: expert weights in param groups of their own
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "shared"}
        )
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=params,
        config={
            "train_batch_size": MICRO * dp * gas,
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": zero, **(zero_extra or {})},
            **extra,
        },
    )
    if load is not None:
        engine.load_checkpoint(load)
    for step in range(engine.global_steps, STEPS):
        ids, labels = global_batch(step, MICRO * dp * gas)
        for m in range(gas):
            rows = slice((m * dp + rank) * MICRO, (m * dp + rank + 1) * MICRO)
            engine.backward(loss_fn(engine(ids[rows]), labels[rows]))
            engine.step()
        if save is not None and step == 2:
            engine.save_checkpoint(save)
    if keep_engine:
        return engine
    zopt = engine.optimizer
    return {
        "params": {n: p.detach().clone() for n, p in zip(zopt.param_names, zopt.params)},
        "experts": {
            n: p.detach().clone() for n, p in model.named_parameters() if "deepspeed_experts" in n
        },
        "load": engine.expert_load(over_data_parallel=True),
        "norm": engine.get_global_grad_norm(),
    }


def train_and_export(ep: int, directory: str) -> None:
    """Train with ZeRO stage 1, then write the whole model with `save_16bit_model`."""
    engine = train(ep, 1, keep_engine=True)
    engine.save_16bit_model(directory)


join = merged_params  # every parameter by global name; holders must agree exactly
