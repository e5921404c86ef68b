"""TRL's trainers, unmodified, on shardspeed through the SHARDSPEED_AS_DEEPSPEED switch, started by
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

from test_huggingface import torchrun

JOBS = Path(__file__).with_name("post_training_jobs.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return torchrun(2, tmp_path_factory.mktemp("trl"), ["trl_sft", "trl_dpo", "trl_grpo"], JOBS)


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
