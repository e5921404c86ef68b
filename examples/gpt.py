"""A small byte-level GPT (after nanoGPT): token + position embeddings, pre-norm transformer blocks
with causal self-attention, a final LayerNorm and a linear output head. The head is not tied to the
token embedding by default (`tie_head=False`), so `state_dict()` has no shared tensors and saves
as-is with safetensors.

The benchmarks (benchmarks/harness.py) build their models from this file too: `init="torch"` keeps
PyTorch's default initialisation of every layer, and `tie_head=True` shares the token embedding's
weight with the output head.

`model(idx)` returns logits of shape (B, T, vocab_size); `model(idx, targets)` returns the mean
cross-entropy loss (a scalar), so a training loop can write `loss = engine(x, y)`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128  # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    init: str = "gpt2"  # "gpt2": N(0, 0.02), scaled residual projections; "torch": torch's defaults
    tie_head: bool = False  # the output head shares the token embedding's weight

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        return cls(**d)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None, **overrides):
        super().__init__()
        config = config or GPTConfig()
        if overrides:
            config = GPTConfig(**{**config.to_dict(), **overrides})
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_head:
            self.lm_head.weight = self.wte.weight
        if config.init not in ("gpt2", "torch"):
            raise ValueError(f"init must be 'gpt2' or 'torch', got {config.init!r}")
        if config.init == "gpt2":
            self.apply(self._init_weights)
            # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
            for name, p in self.named_parameters():
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab_size) when `targets` is None, else the mean cross-entropy loss."""
        seq_len = idx.size(1)
        if seq_len > self.config.block_size:
            raise ValueError(
                f"sequence of length {seq_len} exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(seq_len, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend `idx` (B, T) by `max_new_tokens` sampled tokens; returns (B, T + max_new_tokens).
        temperature 0 means greedy decoding."""
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                ctx = idx[:, -self.config.block_size :]
                logits = self(ctx)[:, -1, :].float()
                if temperature <= 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.size(-1):
                        kth = torch.topk(logits, top_k).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    nxt = torch.multinomial(probs, num_samples=1, generator=generator)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx
