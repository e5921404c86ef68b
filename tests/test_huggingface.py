"""Hugging Face Trainer and accelerate, unmodified, on shardspeed through the SHARDSPEED_AS_DEEPSPEED
switch, started by the real launchers (torchrun, `accelerate launch`) on 1 and 2 CPU processes.

The jobs themselves are in `hf_jobs.py`; each launch runs several cases and this module checks what
they wrote. Tolerances: losses within 1e-5 relative of the reference, since the same arithmetic is
done in a different order (flat buffers, sharded steps); accumulated micro-batches against one
larger batch within 1e-5 absolute on the weights (Adam turns rounding noise in near-zero gradients
into steps of up to lr = 1e-3 times a small factor); bf16 losses within 5e-3 relative of fp32 ones
(bf16 keeps 8 bits of mantissa). Save / resume and loading are compared exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hf_launch import JOBS, ONE_PROCESS_CASES, launch, switched_on, torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def two(hf2: Path) -> Path:
    return hf2


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return torchrun(1, tmp_path_factory.mktemp("hf1"), ONE_PROCESS_CASES)


def result(out: Path, name: str, world: int = 2) -> dict[str, Any]:
    return json.loads((out / f"{name}-ws{world}.json").read_text())


def assert_losses_match(run: dict[str, Any], tolerance: float = 1e-5) -> None:
    assert len(run["losses"]) == len(run["reference_losses"]) == 4
    for ours, reference in zip(run["losses"], run["reference_losses"]):
        assert abs(ours - reference) <= tolerance * abs(reference), run


def assert_shardspeed(run: dict[str, Any], stage: int) -> None:
    assert run["engine"] == "shardspeed.runtime.engine.ShardSpeedEngine"
    assert run["zero_stage"] == stage
    assert run["global_steps"] == 4  # one optimizer step per Trainer step


# -- Trainer --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_trainer_stages_match_plain_trainer(two: Path, stage: int) -> None:
    run = result(two, f"trainer_zero{stage}")
    assert_shardspeed(run, stage)
    assert_losses_match(run)


def test_trainer_with_the_expert_parallel_section(two: Path) -> None:
    """Trainer handed a config with DeepSpeed's `expert_parallel` section trains a Qwen3-MoE
    model with its experts spread over the 2 ranks: every loss within 1e-5 relative and the
    weights within 5e-5 of the Trainer without DeepSpeed (measured in the result)."""
    run = result(two, "trainer_expert_parallel")
    assert_shardspeed(run, 2)
    assert run["local_experts"] == 2  # of 4
    assert_losses_match(run)
    assert run["relative_difference"] < 5e-5, run
    # save_model read model.state_dict() on both ranks: every expert whole, so from_pretrained
    # loads the trained weights into the plain model.
    from transformers import AutoModelForCausalLM

    reloaded = dict(AutoModelForCausalLM.from_pretrained(two / "moe_ep_saved").named_parameters())
    trained = load_file(two / "moe_ep_trained.safetensors")
    assert reloaded.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(reloaded[name].detach(), value), name


def test_trainer_zero3_from_pretrained(two: Path) -> None:
    run = result(two, "trainer_zero3_pretrained")
    assert_shardspeed(run, 3)
    assert run["sliced_by_zero_init"], "from_pretrained under ZeRO-3 must build under zero.Init"
    assert run["loaded_vs_saved"] == 0.0
    assert_losses_match(run)
    assert abs(run["eval_loss"] - run["reference_eval_loss"]) <= 1e-5 * run["reference_eval_loss"]
    # save_model gathered the 16-bit (here fp32) weights: from_pretrained gives the trained ones.
    from transformers import AutoModelForCausalLM

    reloaded = dict(AutoModelForCausalLM.from_pretrained(two / "z3_saved").named_parameters())
    trained = load_file(two / "z3_trained.safetensors")
    assert reloaded.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(reloaded[name].detach(), value), name


def test_trainer_zero3_from_config(two: Path) -> None:
    run = result(two, "trainer_zero3_from_config")
    assert_shardspeed(run, 3)
    assert run["sliced_by_zero_init"] and run["finite"] and run["ranks_agree"]
    assert_losses_match(run)


@pytest.mark.parametrize("case", ONE_PROCESS_CASES)
def test_trainer_zero3_on_one_process(one: Path, case: str) -> None:
    run = result(one, case, world=1)
    assert_shardspeed(run, 3)
    assert run["sliced_by_zero_init"]
    assert_losses_match(run)


def test_trainer_gradient_accumulation_takes_every_step(two: Path) -> None:
    run = result(two, "trainer_gradient_accumulation")
    assert_shardspeed(run, 2)
    assert run["engine_gas"] == 2
    assert run["micro_steps"] == 4  # accelerate calls step() once per window
    assert_losses_match(run)  # against micro-batches of 2 without accumulation


def test_trainer_resume_from_checkpoint(two: Path) -> None:
    run = result(two, "trainer_resume")
    assert run["resumed_vs_uninterrupted"] == 0.0
    assert run["losses"][2:] == run["reference_losses"][2:]
    assert {"global_step2", "latest", "zero_to_fp32.py"} <= set(run["checkpoint_files"])


def test_trainer_save_model_without_gathering_writes_a_checkpoint(two: Path) -> None:
    run = result(two, "trainer_zero3_save_without_gathering")
    saved = two / "nogather_saved"
    assert "model.safetensors" not in run["saved_files"]
    assert {"latest", "zero_to_fp32.py", "config.json"} <= set(run["saved_files"])
    # What the Trainer's message tells users to run, from the checkpoint folder.
    consolidated = two / "nogather_fp32"
    command = [sys.executable, "zero_to_fp32.py", ".", str(consolidated)]
    done = subprocess.run(command, cwd=saved, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    weights = load_file(consolidated / "model.safetensors")
    trained = load_file(two / "nogather_trained.safetensors")
    assert weights.keys() == trained.keys()
    for name in trained:
        assert (weights[name] == trained[name]).all(), name


def test_trainer_evaluate_before_training(two: Path) -> None:
    run = result(two, "trainer_evaluate_first")
    assert abs(run["eval_loss"] - run["reference_eval_loss"]) <= 1e-6 * run["reference_eval_loss"]


def test_trainer_bf16(two: Path) -> None:
    run = result(two, "trainer_bf16")
    assert run["bf16"] and run["dtype"] == "torch.bfloat16"
    assert_losses_match(run, tolerance=5e-3)


def test_trainer_cpu_optimizer_offload(two: Path) -> None:
    run = result(two, "trainer_cpu_offload")
    assert_shardspeed(run, 2)
    assert_losses_match(run)


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_resumes_a_folder_deepspeed_wrote(two: Path, stage: int) -> None:
    run = result(two, "trainer_resume_deepspeed_run")[f"zero{stage}"]
    assert run["global_steps"] == 4
    assert run["final_vs_deepspeed"] <= 1e-6  # DeepSpeed 0.19.8's own uninterrupted run
    assert run["losses"] == pytest.approx(run["deepspeed_losses"], rel=1e-6)


# -- accelerate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_plugin_loop(two: Path, stage: int) -> None:
    run = result(two, "accelerate_plugin")
    ds = run[f"zero{stage}"]
    assert ds["gas1"] == pytest.approx(run["ddp"], rel=1e-5)
    assert ds["gas1_vs_ddp"] <= 1e-6
    assert ds["steps_gas1"] == ds["steps_gas2"] == 4  # every window ends in an update
    assert ds["gas2_vs_gas1"] <= 1e-5
    assert ds["resumed"] == ds["gas2"]  # load_state resumed the second half exactly


@pytest.mark.parametrize("world", [2, 4])
def test_accelerate_sequence_parallel_trains_like_one_process(
    hf2: Path, tmp_path: Path, world: int
) -> None:
    """accelerate's DeepSpeed sequence parallelism (ParallelismConfig(sp_size=...,
    sp_backend="deepspeed")) on a tiny GQA Llama (4 heads, 2 key/value heads): at 2 processes
    Ulysses over 2 at ZeRO 1 and 3 with transformers' own loss aggregation over the sequence
    ranks; at 4 processes Ulysses over 2 x data parallel 2 at ZeRO 1 and 3, hybrid (Ulysses 2 x
    ring 2) at ZeRO 3, the ring over 4 at ZeRO 1, chosen by the config's sequence_parallel
    section, and Ulysses over 4 at ZeRO 1 (2 key/value heads repeated up to 4, as DeepSpeed does). Every loss and gradient norm (before clipping at 1.0; 1e-5 relative) and, after 8
    steps, every parameter (5e-5 relative) equal one process training whole sequences. The norm
    would be twice the reference's if gradients were summed over two sequence ranks under
    transformers' loss, which puts the whole loss on each rank (DeepSpeed sums them)."""
    # At 2 processes the case runs in the launch the Hugging Face tests share.
    out = hf2 if world == 2 else torchrun(world, tmp_path, ["accelerate_sequence_parallel"])
    runs = result(out, "accelerate_sequence_parallel", world)
    assert len(runs) == {2: 2, 4: 5}[world]
    for name, run in runs.items():
        assert run["engine"] == "shardspeed.runtime.engine"
        assert run["global_steps"] == 8 and run["sequence_parallel_size"] in (2, 4)
        for got, want in zip(run["losses"], run["reference_losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (name, run["losses"])
        for got, want in zip(run["norms"], run["reference_norms"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (name, run["norms"], run["reference_norms"])
        assert run["relative_difference"] < 5e-5, (name, run)


def test_trainer_sequence_parallel_trains_like_one_process(hf2: Path) -> None:
    """Trainer with TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2,
    sp_backend="deepspeed")) and Hugging Face's ZeRO-3 example config: its own loader adapter
    and loss aggregation; every loss (1e-5 relative) and the final parameters (5e-5 relative)
    equal one process on whole sequences stepping through the batches the Trainer drew."""
    run = result(hf2, "trainer_sequence_parallel")
    assert run["engine"] == "shardspeed.runtime.engine"
    assert run["sequence_parallel_size"] == 2 and run["global_steps"] == 4
    for got, want in zip(run["losses"], run["reference_losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), run
    assert run["relative_difference"] < 5e-5, run


def test_accelerate_launch_use_deepspeed(tmp_path: Path) -> None:
    launch(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--use_deepspeed",
            "--num_processes=2",
            "--num_machines=1",
            "--zero_stage=2",
            "--gradient_accumulation_steps=2",
            "--mixed_precision=no",
            "--main_process_port=0",
            str(JOBS),
            str(tmp_path),
            "accelerate_launched",
        ],
        tmp_path,
    )
    run = result(tmp_path, "accelerate_launched")
    assert run["engine"] == "shardspeed.runtime.engine"
    assert (run["world"], run["stage"], run["gas"]) == (2, 2, 2)
    assert run["global_steps"] == 4 and len(run["losses"]) == 8


# -- the switch -----------------------------------------------------------------------------------


PROBE = """
import importlib.metadata, importlib.util, json, sys
found = importlib.util.find_spec("deepspeed")
try:
    version = importlib.metadata.version("deepspeed")
except importlib.metadata.PackageNotFoundError:
    version = None
out = {"found": found is not None, "version": version}
if found is not None:
    import deepspeed
    out.update(module=deepspeed.__name__, dunder=deepspeed.__version__,
               own=getattr(deepspeed, "shardspeed_version", None))
print(json.dumps(out))
"""


def probe(env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_switch_makes_deepspeed_shardspeed_in_a_new_process() -> None:
    import shardspeed
    from shardspeed.compat import DEEPSPEED_VERSION

    seen = probe(switched_on())
    assert seen == {
        "found": True,
        "version": DEEPSPEED_VERSION,
        "module": "shardspeed",
        "dunder": DEEPSPEED_VERSION,
        "own": shardspeed.shardspeed_version,
    }


def test_without_the_switch_deepspeed_is_not_shardspeed() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SHARDSPEED_AS_DEEPSPEED"}
    seen = probe(env)
    # A real DeepSpeed may be installed beside shardspeed; it must then be the one found.
    assert seen.get("module") != "shardspeed"
    if not seen["found"]:
        assert seen["version"] is None


def test_worked_example_trains_saves_and_samples(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(example),
        "--out",
        str(tmp_path),
        "--max-steps",
        "4",
        "--batch",
        "2",
    ]
    done = subprocess.run(
        command, env=switched_on(), capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "sample: def " in done.stdout
    assert (tmp_path / "model" / "model.safetensors").exists()
