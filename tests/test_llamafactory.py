"""LlamaFactory's own command line on shardspeed: `llamafactory-cli train` with the ZeRO 2 and ZeRO 3
configs LlamaFactory ships, on 2 processes, with the SHARDSPEED_AS_DEEPSPEED switch, against the same
command without DeepSpeed (DDP); and what it saved, loaded back.

It runs in LlamaFactory's own environment (its pins of transformers, accelerate, PEFT and TRL, torch
2.9), which `scripts/llamafactory_env.sh` builds once under .cache/; `scripts/test.sh` runs this
module after the core suite. The other shipped configs (ZeRO 0, the offload ones) and both methods
for each: `benchmarks/llamafactory_cli.py`.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from llamafactory_jobs import LOSS_RTOL, losses

ROOT = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).with_name("llamafactory_jobs.py")
# Saved results compared by their outputs on one prompt (measured: 2e-7 apart, while training moved
# them by 0.5 or more); outputs rather than single weights, because Adam can turn a last-bit gradient
# difference on a near-zero gradient into a full step for that one weight.
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def python() -> Path:
    """The environment's Python; built here if missing (skipped only where the registry is out)."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "llamafactory_env.sh")], capture_output=True, text=True
    )
    if done.returncode == 75:
        pytest.skip(f"LlamaFactory's environment cannot be built here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-4000:]
    return Path(done.stdout.split()[-1]) / "bin" / "python"


@pytest.fixture(scope="module")
def trained(python: Path, tmp_path_factory) -> Callable[[str, str], Path]:
    """Runs `llamafactory-cli train` for (config, method) once; the folder all runs share."""
    root = tmp_path_factory.mktemp("llamafactory")
    job(python, "inputs", root)
    done: set[tuple[str, str]] = set()

    def train(config: str, method: str) -> Path:
        if (config, method) not in done:
            job(python, "train", root, config, method)
            done.add((config, method))
        return root

    return train


def job(python: Path, *args) -> str:
    result = subprocess.run(
        [str(python), str(JOBS), *map(str, args)], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return result.stdout


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("config", ["z2", "z3"])
def test_shipped_config_trains_as_ddp(trained, config: str, method: str) -> None:
    trained("ddp", method)
    root = trained(config, method)
    reference, ours = losses(root, "ddp", method), losses(root, config, method)
    assert len(ours) == len(reference) == 4
    assert ours == pytest.approx(reference, rel=LOSS_RTOL)
    assert reference[-1] < reference[0]  # it trained


@pytest.mark.parametrize("method", ["full", "lora"])
def test_zero3_save_loads_back(trained, python: Path, method: str) -> None:
    """ZeRO 3 gathers the partitioned weights to save them: the model (full) or the adapter (LoRA)
    loads with from_pretrained / PeftModel and answers as the one DDP saved."""
    trained("ddp", method)
    root = trained("z3", method)
    found = json.loads(job(python, "compare", root, "z3", "ddp", method).splitlines()[-1])
    assert found["logits"] < LOGITS_ATOL
    assert found["trained"] > 100 * LOGITS_ATOL  # the saved weights are the trained ones
