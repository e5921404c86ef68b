"""ZeRO stage 3 on real model code: Hugging Face GPT-2 and Llama built from small configs (random
weights, nothing downloaded), trained on 2 ranks, equal to the same training in one process."""

from __future__ import annotations

import pytest
import torch

import shardspeed

transformers = pytest.importorskip("transformers")

from reference_training import assert_close_relative  # noqa: E402


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64,
            n_positions=16,
            n_embd=32,
            n_layer=2,
            n_head=2,
            tie_word_embeddings=True,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config)


def train_hf(kind: str, zero: dict) -> list[torch.Tensor]:
    model = build(kind)
    model.config.use_cache = False
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": 4,
            # SGD, not Adam: GPT-2's attention key bias has an exactly-zero gradient in exact
            # arithmetic, and Adam would normalise its rounding noise (1e-9) into full-size
            # steps that differ with any change of summation order, sharded or not.
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": zero,
        },
    )
    gen = torch.Generator().manual_seed(5)
    rank, world = engine.global_rank, engine.dp_world_size
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 12), generator=gen)
        mine = ids[rank * (4 // world) :][: 4 // world]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_stage3_matches_one_process(pool2, kind):
    expected = train_hf(kind, {"stage": 0})
    sharded = {"stage": 3, "stage3_param_persistence_threshold": 0}
    for params in pool2.run(train_hf, kind, sharded):
        assert_close_relative(params, expected, 1e-5)
