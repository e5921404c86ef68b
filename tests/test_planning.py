"""Dry runs (`shardspeed.planning`) against real runs: the same model and config run as every rank
of a world on torch's fake process group with meta tensors, and as real gloo ranks training on real
values, report the same bytes per rank and the same collectives and bytes per step (exactly), so a
dry run is the real code path, not a second model of it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import shardspeed
from shardspeed.planning import Cluster, build_model, dry_run, measure_rank
from shardspeed.planning.models import causal_lm_batch

SEQ = 16
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    # The same attention code on both sides: on the meta device a dry run runs SDPA as a GPU's
    # flash kernel, where a CPU run takes its own kernel.
    "attn_implementation": "eager",
}


def ds_config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        # Small enough that stage 3 shards some of the tiny model's weights and keeps others.
        "zero_optimization": {"stage": stage}
        | ({"stage3_param_persistence_threshold": 100} if stage == 3 else {}),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }


CASES = {
    "zero0": (LLAMA, ds_config(0)),
    "zero1": (LLAMA, ds_config(1)),
    "zero2": (LLAMA, ds_config(2)),
    "zero3": (LLAMA, ds_config(3)),
    "tensor": (LLAMA, ds_config(1, tensor_parallel={"autotp_size": 2})),
}


def real_rank(case: str, world: int) -> dict:
    """One gloo rank of a real run: the model on the CPU with values, trained the dry run's way."""
    source, config = CASES[case]
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=build_model(source, "cpu"), config=config)
    return dataclasses.asdict(measure_rank(engine, Cluster(1, world), causal_lm_batch, SEQ))


def comparable(plan: dict) -> dict:
    """What must agree. Memory by kind in all places: a CPU run has no host beside its device,
    while a dry run, like a GPU run, keeps the optimizer's step counters on the host."""
    memory = {kind: sum(where.values()) for kind, where in plan["memory"].items()}
    keys = ("rank", "collectives", "startup", "coordinates", "activations_per_micro_batch")
    return {"memory": memory, **{key: plan[key] for key in keys}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_dry_run_reports_what_real_ranks_hold_and_send(pool2, pool4, case):
    for pool, world in ((pool2, 2), (pool4, 4)):
        if case == "tensor" and world == 2:
            continue  # tensor x data needs 4 ranks to have both
        real = pool.run(real_rank, case, world)
        source, config = CASES[case]
        dry = dry_run(
            source, config, Cluster(1, world), ranks=range(world), seq_len=SEQ, backend="gloo"
        )
        for want, got in zip(real, dry.ranks):
            assert comparable(dataclasses.asdict(got)) == comparable(want), (case, world)
            assert got.flops_per_step == want["flops_per_step"]
