"""TRL's trainers and PEFT's LoRA, unmodified, on shardspeed through the SHARDSPEED_AS_DEEPSPEED switch, started by
torchrun on 2 CPU processes (the jobs are in `post_training_jobs.py`): SFTTrainer and DPOTrainer at
ZeRO 2 and 3, GRPOTrainer with in-process generation at ZeRO 3 (TRL takes the stage-3 hooks off
through `optimizer.parameter_offload` while it generates). Each against the same trainer without
DeepSpeed: every logged loss within 1e-5 relative (GRPO's rewards exactly: the sampled completions
must be the same), the trained weights within 5e-5 relative (measured up to 3e-8), and the saved
model equal to the trained weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def runs(hf2: Path) -> Path:
    """The launch the Hugging Face tests share runs these cases too (hf_launch.py)."""
    return hf2


@pytest.mark.parametrize(
    ("name", "stages"), [("trl_sft", (2, 3)), ("trl_dpo", (2, 3)), ("trl_grpo", (3,))]
)
def test_trl_trainer_equals_the_run_without_deepspeed(runs: Path, name: str, stages: tuple) -> None:
    result = json.loads((runs / f"{name}-ws2.json").read_text())
    assert len(result["reference_losses"]) == 5
    for stage in stages:
        ours = result[f"zero{stage}"]
        assert ours["engine"] == "shardspeed.runtime.engine.ShardSpeedEngine"
        for got, want in zip(ours["losses"], result["reference_losses"], strict=True):
            assert abs(got - want) <= 1e-5 * max(abs(want), 1e-6), (stage, ours["losses"])
        assert ours["rewards"] == result["reference_rewards"]
        assert ours["relative_difference"] < 5e-5, ours
        assert ours["saved_vs_trained"] == 0.0, ours


def test_peft_lora_trains_only_the_adapters(runs: Path) -> None:
    """PEFT LoRA through Trainer at ZeRO 2 and 3: losses within 1e-5 relative of the run without
    DeepSpeed, adapters and the merged model within 1e-6 (measured 7e-9), the frozen base never
    moves; save_model writes the adapters only; at ZeRO 3 a checkpoint holds no frozen weight
    (Trainer saves with exclude_frozen_parameters) and a resumed run ends where the uninterrupted
    one ends, exactly."""
    result = json.loads((runs / "peft_lora-ws2.json").read_text())
    for stage in (2, 3):
        ours = result[f"zero{stage}"]
        for got, want in zip(ours["losses"], result["reference_losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (stage, ours["losses"])
        assert ours["trainable"] and ours["base_moved"] == 0.0, ours
        assert ours["adapters"] < 1e-6 and ours["merged"] < 1e-6, ours
        assert "adapter_model.safetensors" in ours["saved_files"], ours
        assert "model.safetensors" not in ours["saved_files"], ours
    zero3 = result["zero3"]
    assert zero3["resumed_vs_uninterrupted"] == 0.0, zero3
    # Masters and Adam moments of the adapters, and the RNG states: far below one copy of the base.
    assert zero3["checkpoint_bytes"] < zero3["base_bytes"] / 2, zero3
