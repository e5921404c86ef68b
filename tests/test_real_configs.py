"""Real DeepSpeed configs from public repositories (`tests/data/configs/`, sources in its README.md)
train two steps on 1 and 2 processes, or are refused only for what shardspeed lacks, named.

Configs written for Hugging Face (any "auto" in them) get the values its Trainer fills in, as
`fill_like_hugging_face` does here; a config without any batch key gets a micro-batch of 2, as a
training script must give DeepSpeed one. A config without an optimizer section gets a client AdamW
(what Trainer and most scripts pass), as a callable of the parameters. The model is a small MLP; a tensor-parallel config splits a
tiny Llama instead, on as many processes as it asks for.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.config import ConfigError
from shardspeed.testing import RankPool

ROOT = Path(__file__).with_name("data") / "configs"
CONFIGS = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.json"))
HIDDEN = 16

# Configs refused, with what the refusal must name: a capability shardspeed lacks, or something
# DeepSpeed 0.19.8 refuses as well.
REFUSED = {
    "deepspeed/model_BingBertSquad_deepspeed_bsz24_fp16_zero2_config.json": (
        "Adam without bias correction is not built"
    ),
    "deepspeedexamples/deepspeed_bsz24_config.json": "Adam without bias correction is not built",
    "deepspeedexamples/bing_bert_deepspeed_bsz64k_lamb_config_seq128.json": (
        "'sparse_attention' is removed in DeepSpeed 0.19.8"
    ),
    # Written for 4 ranks; tests/test_sequence_alst.py trains it at 2 with Ulysses.
    "llamafactory/ds_z3_alst_config.json": "sequence_parallel_size 4 must divide the world size",
    # DeepSpeed 0.19.8 refuses it too, with the same advice.
    "megatron-deepspeed/curriculum_learning_ds_zero_stage_1_config_baseline.json": (
        "'optimizer.params.max_grad_norm' is not accepted here: use the top-level "
        "'gradient_clipping'"
    ),
}


def fill_like_hugging_face(config: dict, world: int) -> dict:
    """What transformers' Trainer (and accelerate) write over "auto" for a run with micro-batches
    of 2, no accumulation, lr 1e-3, default Adam settings, fp32, a model HIDDEN wide; `world` is
    the number of data-parallel processes."""
    config = copy.deepcopy(config)
    zero3 = config.get("zero_optimization", {}).get("stage") == 3
    values = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * world,
        "gradient_clipping": 1.0,
        "optimizer.params.lr": 1e-3,
        "optimizer.params.betas": [0.9, 0.999],
        "optimizer.params.eps": 1e-8,
        "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": 1e-3,
        "scheduler.params.warmup_num_steps": 1,
        "scheduler.params.total_num_steps": 2,
        "fp16.enabled": False,
        "bf16.enabled": False,
        "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    }
    if zero3:
        values["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * HIDDEN * HIDDEN)
        values["zero_optimization.stage3_param_persistence_threshold"] = 10 * HIDDEN
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node: Any = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == "auto":
            node[leaf] = value
    return config


def prepared(name: str, world: int) -> dict:
    config = json.loads((ROOT / name).read_text())
    if "auto" in json.dumps(config):
        config = fill_like_hugging_face(config, world // tensor_parallel_size(name))
    if "train_batch_size" not in config and "train_micro_batch_size_per_gpu" not in config:
        config["train_micro_batch_size_per_gpu"] = 2
    return config


def tensor_parallel_size(name: str) -> int:
    return json.loads((ROOT / name).read_text()).get("tensor_parallel", {}).get("autotp_size", 1)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 4))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=HIDDEN * 2,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config)


def train_two_steps(name: str, config: dict) -> dict:
    """initialize, then two optimizer steps of the engine's own accumulation; or the refusal."""
    llama = tensor_parallel_size(name) > 1
    model = tiny_llama() if llama else mlp()
    # A callable, so a tensor-parallel split at initialize hands it the split parameters.
    optimizer = None if "optimizer" in config else (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    try:
        engine, *_ = shardspeed.initialize(model=model, optimizer=optimizer, config=config)
    except ConfigError as error:
        return {"refused": str(error)}
    dtype = next(engine.module.parameters()).dtype
    gen = torch.Generator().manual_seed(engine.global_rank)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for _ in range(2 * gas):
        if llama:
            ids = torch.randint(0, 32, (micro, 8), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
        else:
            x, y = torch.randn(micro, 8, generator=gen), torch.randn(micro, 4, generator=gen)
            loss = F.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "global_steps": engine.global_steps,
        "finite": all(math.isfinite(v) for v in losses),
        "compiled": engine.is_compiled,
        "stage": engine.zero_optimization_stage(),
    }


@pytest.fixture(scope="module")
def pool1():
    with RankPool(1) as pool:
        yield pool


def worlds(name: str) -> list[int]:
    tp = tensor_parallel_size(name)
    return [tp] if tp > 2 else [w for w in (1, 2) if w % tp == 0]


CASES = [(name, world) for name in CONFIGS for world in worlds(name)]


def test_the_corpus_is_large_and_named() -> None:
    assert len(CONFIGS) >= 40
    sources = (ROOT / "README.md").read_text()
    for name in CONFIGS:
        assert f"`{name}`" in sources, f"{name} has no source in tests/data/configs/README.md"


@pytest.mark.parametrize(("name", "world"), CASES, ids=[f"{n}-ws{w}" for n, w in CASES])
def test_real_config_trains_or_names_what_is_missing(pool1, pool2, pool4, name, world) -> None:
    pool = {1: pool1, 2: pool2, 4: pool4}[world]
    results = pool.run(train_two_steps, name, prepared(name, world))
    if name in REFUSED:
        for result in results:
            assert REFUSED[name] in result.get("refused", ""), result
        return
    for result in results:
        assert "refused" not in result, result["refused"]
        assert result["global_steps"] == 2 and result["finite"], result
    config = json.loads((ROOT / name).read_text())
    compiles = not config.get("compile", {}).get("disable", True) or config.get("compile", {}).get(
        "enabled", False
    )
    assert results[0]["compiled"] == compiles
