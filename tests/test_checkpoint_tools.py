"""Checkpoint tools: the consolidated state dict, its safetensors export (one file or Hugging Face
shards), DeepSpeed's zero_to_fp32 functions and script, the `shardspeed-ckpt` command, and a
Hugging Face model reading an export of a stage-3 checkpoint written by 2 ranks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, load_model
from torch import nn

import shardspeed
from shardspeed.checkpoint import CheckpointError, fp32_state_dict, write_safetensors
from shardspeed.checkpoint.cli import main as ckpt
from shardspeed.checkpoint.consolidate import parse_size
from shardspeed.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}


class Tied(nn.Module):
    """Embedding and head share one weight; one frozen layer; a saved and an unsaved buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.blocks[1].weight.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.emb(idx) * self.scale
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def train_and_save(save_dir: str) -> dict[str, torch.Tensor]:
    """Two steps at stage 3 on every rank, a save, and the engine's own gathered state dict."""
    model = Tied()
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": STAGE3,
        },
    )
    gen = torch.Generator().manual_seed(3)
    rank = engine.global_rank
    for _ in range(2):
        idx = torch.randint(0, 16, (4, 5), generator=gen)[2 * rank :][:2]
        logits = engine(idx[:, :-1])
        engine.backward(F.cross_entropy(logits.reshape(-1, 16), idx[:, 1:].reshape(-1)))
        engine.step()
    engine.save_checkpoint(save_dir)
    return engine.consolidated_state_dict()


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    save_dir = tmp_path_factory.mktemp("tied") / "ckpt"
    expected = pool2.run(train_and_save, str(save_dir))[0]
    return save_dir, expected


def test_consolidated_equals_engine_and_loads_strict(saved):
    save_dir, expected = saved
    state = fp32_state_dict(save_dir)
    assert sorted(state) == sorted(expected)
    assert "scratch" not in state
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name
    assert state["head.weight"] is state["emb.weight"]
    assert state["calls"].dtype == torch.int64 and state["calls"].item() == 2

    model = Tied()
    model.load_state_dict(state, strict=True)
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.emb.weight, expected["emb.weight"])

    # The tag directory itself, and leaving out what was saved frozen.
    tag_dir = save_dir / (save_dir / "latest").read_text()
    without = fp32_state_dict(tag_dir, exclude_frozen_parameters=True)
    assert sorted(without) == sorted(set(state) - {"blocks.1.weight"})
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        fp32_state_dict(save_dir, tag="global_step9")


def test_sharded_export_reads_back_equal(saved, tmp_path):
    save_dir, expected = saved
    state = fp32_state_dict(save_dir)
    out = tmp_path / "sharded"
    written = write_safetensors(state, out, max_shard_size=300)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and written == [*shards, "model.safetensors.index.json"]
    assert all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    assert not (out / "model.safetensors").exists()
    read: dict[str, torch.Tensor] = {}
    for shard in shards:
        read.update(load_file(out / shard))
    assert sorted(read) == sorted(index["weight_map"]) == sorted(set(state) - {"head.weight"})
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in read.values())
    for name, tensor in read.items():
        assert torch.equal(tensor, expected[name]), name

    # Rewritten as one file: the shards and index of the first export go.
    assert write_safetensors(state, out) == ["model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    model = Tied()
    missing, unexpected = load_model(model, out / "model.safetensors", strict=True)
    assert not missing and not unexpected
    assert torch.equal(model.head.weight, expected["head.weight"])
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1.5MiB") == 3 << 19
    with pytest.raises(ValueError, match="cannot read"):
        parse_size("5 parsecs")


def test_deepspeed_functions(saved, tmp_path):
    save_dir, expected = saved
    state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    assert all(torch.equal(state[n], t) for n, t in expected.items())
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), lazy_mode=True)
    assert lazy["head.weight"] is lazy["emb.weight"]
    assert torch.equal(lazy["blocks.0.weight"].contiguous(), expected["blocks.0.weight"])

    model = load_state_dict_from_zero_checkpoint(Tied(), str(save_dir))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

    convert_zero_checkpoint_to_fp32_state_dict(str(save_dir), str(tmp_path / "out"))
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(exported["blocks.1.weight"], expected["blocks.1.weight"])


def test_zero_to_fp32_script(saved, tmp_path):
    save_dir, _ = saved
    tag = (save_dir / "latest").read_text()
    result = subprocess.run(
        [
            *(sys.executable, "-m", "shardspeed.utils.zero_to_fp32", str(save_dir), str(tmp_path)),
            *("--tag", tag, "--max_shard_size", "1KB", "--exclude_frozen_parameters"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "blocks.1.weight" not in index["weight_map"]
    assert str(tmp_path / "model-00001-of-00002.safetensors") in result.stdout


def test_cli_inspect_verify_consolidate(saved, tmp_path, capsys):
    save_dir, _ = saved
    assert ckpt(["inspect", str(save_dir)]) == 0
    out = capsys.readouterr().out
    assert "world size 2" in out and "ZeRO stage 3" in out and "(latest)" in out
    assert "global_steps 2" in out and "tied names: head.weight = emb.weight" in out

    assert ckpt(["verify", str(save_dir)]) == 0
    assert ": ok" in capsys.readouterr().out

    assert ckpt(["consolidate", str(save_dir), str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert "model.safetensors" in capsys.readouterr().out

    broken = tmp_path / "broken"
    shutil.copytree(save_dir, broken)
    shard = broken / (save_dir / "latest").read_text() / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert ckpt(["verify", str(broken), "--all"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "rank00001.safetensors: checksum mismatch" in lines[0]

    assert ckpt(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "shardspeed-ckpt: error: " in capsys.readouterr().err


def train_gpt2_and_save(save_dir: str) -> dict[str, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_batch_size": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": STAGE3,
        },
    )
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(5))
    mine = ids[2 * engine.global_rank :][:2]
    engine.backward(engine(input_ids=mine, labels=mine).loss)
    engine.step()
    engine.save_checkpoint(save_dir)
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():  # the engine gathers each block for the forward, as in training
        logits = engine(input_ids=torch.arange(20).reshape(2, 10) % 64).logits
    return {"logits": logits, "params": params}


def test_hugging_face_model_reads_the_export(pool2, tmp_path):
    transformers = pytest.importorskip("transformers")
    engine_side = pool2.run(train_gpt2_and_save, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "hf"
    out.mkdir()
    # Consolidate into a directory that already holds the config, as one shares a model.
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    config.save_pretrained(out)
    assert ckpt(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, engine_side["params"][name]), name
    probe = torch.arange(20).reshape(2, 10) % 64
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    torch.testing.assert_close(logits, engine_side["logits"], rtol=1e-5, atol=1e-6)
