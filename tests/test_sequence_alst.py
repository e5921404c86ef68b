"""ALST as DeepSpeed's tutorial runs it, on shardspeed: a Hugging Face Llama (grouped-query
attention) with `UlyssesSPAttentionHF.register_with_transformers`, `deepspeed.initialize(mpu=...)`,
the loss aggregated over the sequence ranks with a differentiable all-gather, and LLaMA-Factory's
ALST config (its `sequence_parallel` section: tiled MLPs, activation checkpoints in host memory;
ZeRO-3 with parameters and optimizer offloaded to the host). Two ranks split each sequence.

Tolerance: parameters after 3 steps within 5e-5 relative of one process training whole sequences
without any of it; measured 4.8e-7 (summation order: chunked MLPs, blockwise exchanges).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

CONFIG = Path(__file__).parent / "data" / "configs" / "llamafactory" / "ds_z3_alst_config.json"
SEQ, MICRO, STEPS, LR = 32, 2, 3, 1e-3  # SEQ: the model's max_position_embeddings


def _model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from hf_jobs import llama_config  # the Hugging Face tests' tiny Llama: 4 heads, 2 kv heads

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def _batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (STEPS, MICRO, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    return [{"input_ids": x, "labels": x, "position_ids": positions} for x in ids]


def _config(sp: int) -> dict:
    """LLaMA-Factory's ALST config as its trainer fills it, for `sp` ranks, fp32 (bf16 is what
    the file says; fp32 keeps the comparison tight) and 8-position MLP tiles (the file's 8192
    would leave these short sequences in one tile)."""
    config = json.loads(CONFIG.read_text())
    config["sequence_parallel"]["size"] = config["sequence_parallel"]["ulysses"]["degree"] = sp
    config["sequence_parallel"]["tiling"]["chunk_size"] = 8
    config["bf16"] = {"enabled": False}
    config["zero_optimization"].update(
        reduce_bucket_size=1000, stage3_prefetch_bucket_size=1000,
        stage3_param_persistence_threshold=0,
    )  # fmt: skip
    config.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=1)
    config["gradient_clipping"] = 1.0
    config["optimizer"]["params"] = {
        "lr": LR,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0,
    }
    del config["scheduler"]  # a constant learning rate, as the reference's
    return config


def _reference(model: torch.nn.Module) -> tuple[list[float], list[torch.Tensor]]:
    """One process, whole sequences: gradient norms before clipping, and the final parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    norms = []
    for batch in _batches():
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms, [p.detach().clone() for p in model.parameters()]


def _tutorial_loss(outputs: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence's loss on every sequence rank, as DeepSpeed's ALST tutorial and
    transformers compute it: each rank's mean over its labelled tokens, weighted and gathered."""
    losses = torch.distributed.nn.functional.all_gather(outputs.loss, group=group)
    good = (shift_labels != -100).sum()
    counts = torch.distributed.nn.functional.all_gather(good, group=group)
    total = sum(loss * count for loss, count in zip(losses, counts))
    return total / sum(counts)


def _alst_run() -> dict:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import shardspeed as deepspeed  # the one line a DeepSpeed script changes
    from shardspeed import checkpointing
    from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, shard_batch

    model = _model()
    reference_norms, reference = _reference(copy.deepcopy(model))
    model.gradient_checkpointing_enable()
    model.train()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, MICRO)
    try:
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_config(2), mpu=mpu
        )
        group, rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        calls, norms = checkpointing.calls(), []
        for batch in _batches():
            piece = shard_batch(batch, rank, 2)
            outputs = engine(
                input_ids=piece["input_ids"],
                position_ids=piece["position_ids"],
                labels=piece["shift_labels"],
                shift_labels=piece["shift_labels"],
            )
            engine.backward(_tutorial_loss(outputs, piece["shift_labels"], group))
            engine.step()
            norms.append(float(engine.get_global_grad_norm()))
        checkpointed = checkpointing.calls() - calls
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            error = max(
                ((p - r).norm() / r.norm()).item() for p, r in zip(model.parameters(), reference)
            )
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]  # transformers' own again, for the pool's next test
    return {
        "error": error,
        "norms": norms,
        "reference_norms": reference_norms,
        "checkpointed": checkpointed,
        "tiled": sum(
            "forward" in vars(m) for m in model.modules() if type(m).__name__ == "LlamaMLP"
        ),
        "stage": engine.zero_optimization_stage(),
        "cpu_checkpointing": checkpointing._settings.cpu,
    }


def test_llamafactory_alst_config_trains_like_one_process(pool2) -> None:
    for run in pool2.run(_alst_run):
        assert run["stage"] == 3 and run["tiled"] == 2 and run["cpu_checkpointing"], run
        # Each step checkpoints each of the 2 layers once (the recompute does not count).
        assert run["checkpointed"] == 2 * STEPS, run
        for got, want in zip(run["norms"], run["reference_norms"], strict=True):
            assert abs(got - want) <= 1e-5 * want, run
        assert run["error"] < 5e-5, run
