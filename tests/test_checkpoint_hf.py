"""Hugging Face safetensors weights loaded straight into a ZeRO-3 engine: logits equal to the
original model's, single-file and sharded (indexed) checkpoints, a model built under zero.Init, and
each rank reading only the bytes of its own shards."""

from __future__ import annotations

import pytest
import torch

import shardspeed

transformers = pytest.importorskip("transformers")

from test_zero3_hf import build  # noqa: E402

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(9))


def original_logits(kind: str, directory: str, max_shard_size: str | None = None) -> torch.Tensor:
    model = build(kind)
    model.config.use_cache = False
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    with torch.no_grad():
        return model(IDS).logits


def load_into_stage3(kind: str, directory: str, under_init: bool) -> dict:
    with shardspeed.zero.Init(enabled=under_init):
        model = build(kind)
    with torch.no_grad():  # different weights: everything must come from the files
        for p in model.parameters():
            (p.ds_tensor if hasattr(p, "ds_tensor") else p).add_(0.5)
    model.config.use_cache = False
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    engine.eval()
    with torch.no_grad():
        before = engine(IDS).logits
    read = 0
    original = shardspeed.checkpoint.format.ByteReader.read

    def counting(self, name: str, offset: int, length: int) -> bytes:
        nonlocal read
        read += length
        return original(self, name, offset, length)

    shardspeed.checkpoint.format.ByteReader.read = counting
    try:
        shardspeed.checkpoint.load_hf_weights(engine, directory)
    finally:
        shardspeed.checkpoint.format.ByteReader.read = original
    with torch.no_grad():
        logits = engine(IDS).logits
    total = 4 * sum(p.numel() for p in engine.optimizer.masters) * engine.dp_world_size
    return {"before": before, "logits": logits, "read": read, "total": total}


@pytest.mark.parametrize(
    ("kind", "shard_size", "under_init"),
    [("gpt2", None, False), ("gpt2", "20KB", True), ("llama", None, True)],
    ids=["gpt2-single-file", "gpt2-sharded-under-init", "llama-under-init"],
)
def test_hf_weights_load_into_stage3(pool2, tmp_path, kind, shard_size, under_init):
    expected = original_logits(kind, str(tmp_path), shard_size)
    if shard_size:
        assert (tmp_path / "model.safetensors.index.json").exists()
    for result in pool2.run(load_into_stage3, kind, str(tmp_path), under_init):
        assert not torch.allclose(result["before"], expected, atol=1e-3)
        torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-6)
        # Each rank reads its half of every parameter (padding aside), not the whole model.
        assert result["read"] <= result["total"] / 2 + 4 * 64


def test_unknown_hf_weight_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"not.a.parameter": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    model = torch.nn.Linear(2, 2)
    engine, *_ = shardspeed.initialize(
        model=model,
        config={"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    with pytest.raises(
        shardspeed.checkpoint.CheckpointError, match=r"missing \['bias', 'weight'\]"
    ):
        shardspeed.checkpoint.load_hf_weights(engine, str(tmp_path))
