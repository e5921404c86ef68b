"""ZeRO stage 3 partitions the parameters no optimizer steps, as DeepSpeed does: a frozen base
under trained adapters, and every parameter of an engine built without an optimizer (an
evaluation or reference model). They are sharded over the data-parallel ranks, gathered by unit
for their forward and backward and released after, and saved as each rank's shards."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import shardspeed
from reference_training import assert_close_relative
from shardspeed.checkpoint.consolidate import fp32_state_dict
from shardspeed.zero.init import ZeroParamStatus

BLOCK = 8 * 8 + 8  # one Linear(8, 8): 72 elements, even, so 2 ranks hold 36 each, no padding
FROZEN = 3  # blocks 0-2 are frozen, block 3, the embedding and the head train


class Adapted(nn.Module):
    """Embedding, four blocks (one gather unit each), head; the first `FROZEN` blocks frozen."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)
        for block in self.blocks[:FROZEN]:
            block.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def frozen_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for block in model.blocks[:FROZEN] for p in block.parameters()]


def reads_partitioned(p: nn.Parameter) -> bool:
    return p.shape == (0,) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE


def engine_for(model: nn.Module, zero: dict, optimizer: bool = True) -> object:
    config = {"train_batch_size": 8, "zero_optimization": zero}
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}
    engine, *_ = shardspeed.initialize(model=model, config=config)
    return engine


def train_adapted(zero: dict, save_dir: str | None = None, model: nn.Module | None = None) -> dict:
    """Four steps on global batches of 8 (each rank its part); the whole parameters after."""
    model = model or Adapted()
    engine = engine_for(model, zero)
    partitioned_at_start = all(map(reads_partitioned, frozen_params(model)))
    gen = torch.Generator().manual_seed(3)
    rank, world = engine.global_rank, engine.dp_world_size
    part = 8 // world
    for _ in range(4):
        idx = torch.randint(0, 16, (8, 5), generator=gen)
        target = torch.randint(0, 16, (8, 5), generator=gen)
        logits = engine(idx[rank * part :][:part])
        engine.backward(
            F.cross_entropy(logits.reshape(-1, 16), target[rank * part :][:part].flatten())
        )
        engine.step()
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="t")
    untrained = [store.sharded_params for store in engine.untrained_shards]
    result = {
        "partitioned_at_start": partitioned_at_start,
        "partitioned_after": all(map(reads_partitioned, frozen_params(model))),
        "gathered_after_step": sum(s.live_elements() for s in untrained),
        "peak_frozen_elements": sum(s.peak_gathered_bytes for s in untrained) // 4,
        "parameter_bytes": engine.memory_breakdown()["parameters"],
    }
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        return {**result, "params": [p.detach().clone() for p in model.parameters()]}


def test_frozen_weights_are_partitioned_and_train_to_the_reference(pool2):
    """Parity with one process within 1e-5 relative (fp32, sums in another order); the frozen
    blocks read as DeepSpeed's partitioned parameters, each rank holds half of every weight,
    and with no reuse a frozen block is whole only around its own forward and backward."""
    expected = train_adapted({"stage": 0})["params"]
    keys = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    initial = [p.detach().clone() for p in Adapted().parameters()]
    for result in pool2.run(train_adapted, keys):
        assert_close_relative(result["params"], expected, 1e-5)
        for i in range(1, 1 + 2 * FROZEN):  # after emb.weight: the frozen blocks, unchanged
            assert result["params"][i].equal(initial[i])
        assert result["partitioned_at_start"] and result["partitioned_after"]
        assert result["gathered_after_step"] == 0
        # One frozen block computing and at most one prefetched, never the three at once.
        assert result["peak_frozen_elements"] <= 2 * BLOCK
        whole = sum(p.numel() for p in initial) * 4
        assert result["parameter_bytes"] == whole // 2


def test_frozen_shards_save_as_pieces_and_load_at_another_stage(pool2, tmp_path: Path):
    """Each rank writes its own shard of the frozen blocks; the checkpoint consolidates to the
    whole weights offline and loads into a ZeRO 2 engine."""
    keys = {"stage": 3, "stage3_param_persistence_threshold": 0}
    trained = pool2.run(train_adapted, keys, str(tmp_path))[0]["params"]
    names = [n for n, _ in Adapted().named_parameters()]
    consolidated = fp32_state_dict(tmp_path / "t")
    for name, value in zip(names, trained):
        assert consolidated[name].equal(value), name
    for loaded in pool2.run(load_into_stage2, str(tmp_path)):
        for got, want in zip(loaded, trained):
            assert got.equal(want)


def load_into_stage2(save_dir: str) -> list[torch.Tensor]:
    model = Adapted()
    for block in model.blocks[:FROZEN]:
        nn.init.zeros_(block.weight)  # what a load must overwrite
    engine = engine_for(model, {"stage": 2})
    engine.load_checkpoint(save_dir, tag="t")
    return [p.detach().clone() for p in model.parameters()]


def evaluate_without_optimizer() -> dict:
    model = Adapted()
    idx = torch.arange(10).view(2, 5)
    with torch.no_grad():
        want = model(idx)
    engine = engine_for(model, {"stage": 3, "stage3_param_persistence_threshold": 0}, False)
    partitioned = all(map(reads_partitioned, model.parameters()))
    with torch.no_grad():
        got = engine(idx)
    return {
        "partitioned": partitioned,
        "released": all(map(reads_partitioned, model.parameters())),
        "equal": got.equal(want),
        "parameter_bytes": engine.memory_breakdown()["parameters"],
        "whole_bytes": sum(p.ds_numel for p in model.parameters()) * 4,
    }


def test_an_engine_without_an_optimizer_keeps_its_weights_partitioned(pool2):
    for result in pool2.run(evaluate_without_optimizer):
        assert result["partitioned"] and result["released"] and result["equal"]
        assert result["parameter_bytes"] == result["whole_bytes"] // 2


def test_peft_sees_partitioned_adapters_under_zero_init(tmp_path: Path):
    """PEFT's own check: at ZeRO 3 on one process, an engine built without an optimizer keeps
    zero.Init's LoRA weights partitioned, so saving them ungathered warns; gathered, the saved
    adapter is 2-D."""
    from peft import LoraConfig, get_peft_model

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(100, 32)
            self.linear = nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(self.embedding(x))

    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    with shardspeed.zero.Init(config_dict_or_path=config):
        model = get_peft_model(Small(), LoraConfig(target_modules=["linear"], r=4))
    engine, *_ = shardspeed.initialize(model=model, config=config)
    lora = [p for n, p in engine.module.named_parameters() if "lora_" in n]
    assert len(lora) == 2 and all(map(reads_partitioned, lora))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.module.save_pretrained(tmp_path / "ungathered")
    assert any("invalid shape" in str(w.message) for w in caught), [str(w.message) for w in caught]
    with shardspeed.zero.GatheredParameters(lora, modifier_rank=0):
        engine.module.save_pretrained(tmp_path / "gathered")
    saved = load_file(tmp_path / "gathered" / "adapter_model.safetensors")
    assert sorted(tuple(v.shape) for v in saved.values()) == [(4, 32), (16, 4)]


def train_lora_llama(zero: dict) -> dict:
    """A tiny Llama with PEFT LoRA adapters on q_proj and v_proj (the base frozen), gradient
    checkpointing on: three steps on global batches of 4, each rank its part."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
    )  # fmt: skip
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    for name, p in model.named_parameters():  # B starts at zero; make every adapter matter
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = engine_for(model, zero)
    gen = torch.Generator().manual_seed(5)
    rank, world = engine.global_rank, engine.dp_world_size
    part = 4 // world
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 12), generator=gen)[rank * part :][:part]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    partitioned = all(map(reads_partitioned, base)) if zero["stage"] == 3 else None
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": whole, "partitioned": partitioned}


def test_lora_with_gradient_checkpointing_trains_to_the_reference(pool2):
    """Recomputed forwards gather the frozen base again inside backward; every weight after
    three steps equals one process's within 1e-5 relative (fp32, reductions in another order)."""
    want = train_lora_llama({"stage": 0})
    keys = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    for got in pool2.run(train_lora_llama, keys):
        assert got["partitioned"]
        names = sorted(want["params"])
        assert_close_relative(
            [got["params"][n] for n in names], [want["params"][n] for n in names], 1e-5
        )


def train_quantized_frozen() -> dict:
    """`train_adapted` at ZeRO 3 with the frozen blocks stored int8 (ZeRO++'s
    zero_quantized_nontrainable_weights); also the frozen values training sees, gathered."""
    keys = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "zero_quantized_nontrainable_weights": True}  # fmt: skip
    model = Adapted()
    engine = engine_for(model, keys)
    with shardspeed.zero.GatheredParameters(frozen_params(model)):
        seen = [p.detach().clone() for p in frozen_params(model)]
    store = engine.untrained_shards[0].sharded_params.store
    del engine, model
    return {**train_adapted(keys), "seen": seen, "stored": sum(t.numel() for t in store.tensors())}


def test_frozen_weights_stored_quantized_train_on_their_dequantized_values(pool2):
    """Frozen blocks kept as int8 payloads: what training computes with is each weight within
    its block's quantization step of the original (and not the original); the trained weights
    equal one process's trained with those frozen values, within 1e-5 relative; the payload is
    the int8 values and one fp32 scale per 256, about a quarter of the fp32 shard."""
    from shardspeed.zero.quantize import error_bound, payload_bytes

    original = frozen_params(Adapted())
    for result in pool2.run(train_quantized_frozen):
        seen = result["seen"]
        # A block of 256 covers a rank's whole piece of a unit (weight and bias): the unit's
        # largest magnitude bounds the step.
        for i in range(0, len(original), 2):
            unit = torch.cat([original[i].reshape(-1), original[i + 1]])
            bound = error_bound(unit, 8).max()
            for got, want in zip(seen[i : i + 2], original[i : i + 2]):
                assert (got - want).abs().max() <= bound
        assert any(not got.equal(want) for got, want in zip(seen, original))
        # Each of the 3 frozen units holds 72 elements; 36 on each rank.
        assert result["stored"] == FROZEN * payload_bytes(BLOCK // 2, 8)
        reference = Adapted()
        with torch.no_grad():
            for p, value in zip(frozen_params(reference), seen):
                p.copy_(value)
        expected = train_adapted({"stage": 0}, model=reference)["params"]
        assert_close_relative(result["params"], expected, 1e-5)
