"""Tiny Hugging Face MoE models of each family the `expert_parallel` section covers, built from
configs (nothing downloaded), for `test_auto_ep.py`, with the batches and the one-process run
they are compared with."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

VOCAB, SEQ, MICRO = 64, 8, 2
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    head_dim=8,
)


def family_config(family: str, experts: int = 4) -> object:
    """A transformers config of `family` with `experts` routed experts, top 2."""
    import transformers as tf

    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **_COMMON, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16,
            intermediate_size=48, norm_topk_prob=True,
        )  # fmt: skip
    if family == "qwen2_moe":  # with its shared expert and the shared expert's gate
        return tf.Qwen2MoeConfig(
            **_COMMON, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16,
            intermediate_size=48, shared_expert_intermediate_size=24,
        )  # fmt: skip
    if family == "mixtral":
        return tf.MixtralConfig(
            **_COMMON, num_local_experts=experts, num_experts_per_tok=2, intermediate_size=16
        )
    if family == "deepseek_v3":  # a dense first layer, a shared expert, group-limited sigmoid
        return tf.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, n_routed_experts=experts,
            num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True, rope_scaling=None,
        )  # fmt: skip
    if family == "gpt_oss":  # biased experts, clamped SwiGLU, router named "router"
        return tf.GptOssConfig(
            **_COMMON, num_local_experts=experts, num_experts_per_tok=2, intermediate_size=16,
            layer_types=["full_attention", "sliding_attention"], sliding_window=8,
        )  # fmt: skip
    if family == "olmoe":
        return tf.OlmoeConfig(
            **_COMMON, num_experts=experts, num_experts_per_tok=2, intermediate_size=16
        )
    raise ValueError(family)


FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe")


def build(family: str, experts: int = 4) -> nn.Module:
    """The family's tiny causal LM, the same weights on every call (and every rank)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, experts))
    with torch.no_grad():  # routers and biases some families start at zero: make routing real
        for name, p in model.named_parameters():
            if "router" in name or name.endswith("gate.weight") or name.endswith("_bias"):
                p.normal_(0.0, 0.5)
    return model.float()


def global_batch(step: int, ranks: int) -> torch.Tensor:
    """Token ids of step `step`'s global batch: `ranks` micro-batches of MICRO sequences."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (ranks * MICRO, SEQ), generator=gen)


def reference(
    family: str, steps: int, ranks: int, lr: float, make: Callable[[str], nn.Module] | None = None
) -> tuple[list[float], dict]:
    """One process, no expert parallelism, AdamW on each step's global batch: the mean token
    loss of every step and the final weights. `make`: the model's builder (default `build`)."""
    model = (make or build)(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        ids = global_batch(step, ranks)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_norms(
    family: str, steps: int, ranks: int, lr: float, make: Callable[[str], nn.Module] | None = None
) -> list[float]:
    """`reference`'s gradient norm at every step (the scale AdamW's weights would hide)."""
    model = (make or build)(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    norms = []
    for step in range(steps):
        ids = global_batch(step, ranks)
        model(input_ids=ids, labels=ids).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms
