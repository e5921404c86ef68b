"""Launching the Hugging Face jobs (`hf_jobs.py`, `post_training_jobs.py`) under the
SHARDSPEED_AS_DEEPSPEED switch, and the one 2-process launch that the Trainer, accelerate, TRL and
PEFT tests share (starting processes and importing transformers, TRL and PEFT costs far more than a
case; see conftest's `hf2`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

JOBS = Path(__file__).with_name("hf_jobs.py")
TWO_PROCESS_CASES = [
    "trainer_stages",
    "trainer_zero3_pretrained",
    "trainer_zero3_from_config",
    "trainer_gradient_accumulation",
    "trainer_resume",
    "trainer_zero3_save_without_gathering",
    "trainer_evaluate_first",
    "trainer_bf16",
    "trainer_cpu_offload",
    "trainer_resume_deepspeed_run",
    "accelerate_plugin",
    "trainer_expert_parallel",
]
POST_TRAINING_CASES = ["trl_sft", "trl_dpo", "trl_grpo", "peft_lora"]  # post_training_jobs.py
# Last: registering sequence parallelism replaces transformers' sdpa attention for the process.
SEQUENCE_CASES = ["accelerate_sequence_parallel", "trainer_sequence_parallel"]
SHARED_TWO_PROCESS_CASES = TWO_PROCESS_CASES + POST_TRAINING_CASES + SEQUENCE_CASES
ONE_PROCESS_CASES = ["trainer_zero3_from_config", "trainer_zero3_pretrained"]


def switched_on() -> dict[str, str]:
    env = {**os.environ, "SHARDSPEED_AS_DEEPSPEED": "1", "OMP_NUM_THREADS": "1"}
    for name in ("ACCELERATE_USE_DEEPSPEED", "HF_DEEPSPEED_CONFIG"):
        env.pop(name, None)
    return env


def launch(command: list[str], out: Path) -> None:
    result = subprocess.run(
        command, env=switched_on(), capture_output=True, text=True, timeout=900, cwd=out
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def torchrun(processes: int, out: Path, cases: list[str], jobs: Path = JOBS) -> Path:
    launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            str(jobs),
            str(out),
            *cases,
        ],
        out,
    )
    return out
