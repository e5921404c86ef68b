"""A tiny GPT as pipeline layers (tied embedding and head), its single-process fp32 reference, and
the training function the pipeline tests run on every rank of a `RankPool`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, DIM, SEQ, BLOCKS = 32, 16, 8, 6
BASE_SEED = 1234
LR = 0.01
STEPS = 5


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP (two heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # No qkv bias: the key bias gets a zero gradient in exact arithmetic, so Adam would turn
        # rounding noise into full-size steps and no two summation orders would agree.
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x))


def head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.tokens.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs() -> list[Any]:
    return [
        TiedLayerSpec("embed", Embedding, tied_weight_attr="tokens.weight"),
        *[LayerSpec(Block) for _ in range(BLOCKS)],
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", Embedding, forward_fn=head, tied_weight_attr="tokens.weight"),
    ]


def reference_modules() -> nn.ModuleDict:
    """The same layers, each built under the seed the pipeline gives it, named alike."""
    modules = {}
    for index, spec in enumerate(layer_specs()):
        if isinstance(spec, TiedLayerSpec) and index > 0:
            continue  # the head reuses layer 0
        torch.manual_seed(BASE_SEED + index)
        modules[str(index)] = spec.build()
    return nn.ModuleDict(modules)


def reference_forward(modules: nn.ModuleDict, ids: torch.Tensor) -> torch.Tensor:
    x = modules["0"](ids)
    for index in range(1, BLOCKS + 2):
        x = modules[str(index)](x)
    return head(modules["0"], x)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def reference(global_size: int, clip: float = 1.0) -> tuple[dict[str, torch.Tensor], list[float]]:
    modules = reference_modules()
    opt = torch.optim.AdamW(modules.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        ids, labels = global_batch(step, global_size)
        loss = loss_fn(reference_forward(modules, ids), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(modules.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in modules.named_parameters()}, losses


def micro_batches(step: int, micro: int, gas: int, dp_rank: int, dp: int):
    """This replica's micro-batches of the step's global batch (as DeepSpeed's loader splits)."""
    ids, labels = global_batch(step, micro * gas * dp)
    for m in range(gas):
        start = (m * dp + dp_rank) * micro
        yield ids[start : start + micro], labels[start : start + micro]


def config(micro: int, gas: int, dp: int, **extra: Any) -> dict:
    return {
        "train_batch_size": micro * gas * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        **extra,
    }


def build(stages: int, virtual_stages: int = 1, **kwargs: Any) -> PipelineModule:
    return PipelineModule(
        layer_specs(),
        num_stages=stages,
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=BASE_SEED,
        partition_method="uniform",
        virtual_stages=virtual_stages,
        **kwargs,
    )


def train(
    stages: int,
    micro: int = 2,
    gas: int = 4,
    virtual_stages: int = 1,
    module_kwargs: dict | None = None,
    **extra: Any,
) -> dict:
    """STEPS train_batch calls on every rank; each stage's parameters (fp32) and the losses."""
    model = build(stages, virtual_stages, **(module_kwargs or {}))
    dp = torch.distributed.get_world_size() // stages
    engine, *_ = shardspeed.initialize(model=model, config=config(micro, gas, dp, **extra))
    losses = []
    for step in range(STEPS):
        data = micro_batches(step, micro, gas, engine.topology.dp_rank, dp)
        losses.append(float(engine.train_batch(data)))
    return {
        "stage": engine.stage_id,
        "dp_rank": engine.topology.dp_rank,
        "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        "losses": losses,
        "global_steps": engine.global_steps,
        "bubble": engine.bubble,
    }


def merged_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every stage's parameters under one dict; the copies of the tied embedding on several
    stages must agree exactly."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, value in result["params"].items():
            if name in merged:
                assert torch.equal(merged[name], value), f"copies of {name} differ"
            merged[name] = value
    return merged
