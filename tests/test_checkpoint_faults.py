"""Checkpoints under real faults: a process SIGKILLed in the middle of a save, and a 2-rank job whose
rank dies and is restarted by the launcher's `--max_restarts`.

Every job is `fault_job.py` in its own processes (plain `python` for one rank, the `shardspeed`
launcher for two), so a kill takes down a real process and nothing survives in memory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reference_training import assert_named_close
from shardspeed.utils.net import free_port

HERE = Path(__file__).resolve().parent
JOB = HERE / "fault_job.py"
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "1"}  # a hang fails in 1 min
    for key in (*RENDEZVOUS, "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(key, None)
    return env


def run_alone(*args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python fault_job.py ARGS`: one process, no launcher."""
    command = [sys.executable, str(JOB), *map(str, args)]
    return subprocess.run(
        command, cwd=HERE, env=environment(), capture_output=True, text=True, timeout=timeout
    )


def launch(
    *args: object, procs: int = 2, restarts: int | None = None
) -> subprocess.CompletedProcess:
    """`shardspeed --num_procs N [--max_restarts R] fault_job.py ARGS`."""
    command = [sys.executable, "-m", "shardspeed.launcher.runner", "--num_procs", str(procs)]
    command += ["--master_port", str(free_port())]
    if restarts is not None:
        command += ["--max_restarts", str(restarts)]
    command += [str(JOB), *map(str, args)]
    return subprocess.run(
        command, cwd=HERE, env=environment(), capture_output=True, text=True, timeout=60
    )


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def params(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def listing(root: Path) -> list[str]:
    """The checkpoint directory's entries, less the dumps and the lock (which the job holding it
    leaves when it is killed, or ends by `os._exit`)."""
    return sorted(p.name for p in root.iterdir() if p.name not in ("dumps", ".lock"))


# --- a save killed part-way ----------------------------------------------------------------------

FAULTS = {
    # fault: what the directory holds after the kill, besides global_step2 and latest
    "write": [".global_step4.partial"],  # half of rank 0's tensor file written
    "manifest": [".global_step4.partial"],  # every tensor file, half a manifest
    "rename": [".global_step4.partial"],  # complete, not yet renamed into place
    "latest": ["global_step4", ".latest.tmp"],  # renamed into place, `latest` not replaced yet
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_killed_save_keeps_the_previous_checkpoint(tmp_path, fault):
    ckpt = tmp_path / "ckpt"
    # Save at step 2 (tag A = global_step2), then die inside the save at step 4 (tag B).
    killed = run_alone(
        "--dir", ckpt, "--steps", 4, "--every", 2, "--dump", 4, "--dumps", tmp_path / "killed",
        "--fault", fault, "--fault_at", 4,
    )  # fmt: skip
    assert killed.returncode == -9, output(killed)
    assert (ckpt / "latest").read_text() == "global_step2"
    assert listing(ckpt) == sorted(["global_step2", "latest", "zero_to_fp32.py", *FAULTS[fault]])
    if fault in ("write", "manifest"):  # not a loadable checkpoint even by its own name
        assert not (ckpt / ".global_step4.partial" / "manifest.json").exists()

    # A fresh process resumes from A (the partial B is ignored), trains on and saves B properly.
    resumed = run_alone(
        "--dir", ckpt, "--steps", 4, "--every", 2, "--dump", 4, "--dumps", tmp_path / "resumed"
    )  # fmt: skip
    assert resumed.returncode == 0, output(resumed)
    assert f"resumed from {ckpt / 'global_step2'} at step 2" in resumed.stdout
    # B again: a new directory when the killed save had already renamed its copy into place (the
    # old copy goes once `latest` names the new one); the partial B is gone.
    saved_as = "global_step4@1" if fault == "latest" else "global_step4"
    assert (ckpt / "latest").read_text() == saved_as
    assert listing(ckpt) == ["global_step2", saved_as, "latest", "zero_to_fp32.py"]
    # Steps 3 and 4 after the resume give exactly what the killed process had before its save.
    assert_bit_equal(
        params(tmp_path / "resumed" / "step4.safetensors"),
        params(tmp_path / "killed" / "step4.safetensors"),
    )


# --- a rank killed in a 2-rank job, restarted by the launcher -------------------------------------

# Saves every 3 steps; rank 1 dies before step 7 on the first attempt, so the restart resumes from
# global_step6 and trains to 10. The reference never stops and goes on to 14.
KILL = ["--every", 3, "--kill_at", 7]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("restart")
    reference = launch("--dir", root / "reference", "--steps", 14, "--every", 3, "--dump", 10, 14)
    assert reference.returncode == 0, output(reference)
    restarted = launch("--dir", root / "restarted", "--steps", 10, *KILL, "--dump", 10, restarts=1)
    assert restarted.returncode == 0, output(restarted)
    return {"root": root, "reference": root / "reference", "restarted": root / "restarted",
            "log": output(restarted)}  # fmt: skip


def test_restarted_job_ends_bit_equal_to_an_uninterrupted_one(runs):
    log = runs["log"]
    assert "rank 1: killing myself before step 7" in log
    assert "attempt 1" not in log.split("killing myself")[0]  # the kill happened on attempt 0
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank}/2 attempt 1: resumed from \S+global_step6 at step 6", log
        ), log
        assert f"rank {rank} attempt 1: finished at step 10" in log
    assert (runs["restarted"] / "latest").read_text() == "global_step10"
    assert_bit_equal(
        params(runs["restarted"] / "dumps" / "step10.safetensors"),
        params(runs["reference"] / "dumps" / "step10.safetensors"),
    )


def test_resume_on_fewer_processes_continues_the_run(runs):
    # The 2-rank ZeRO-2 checkpoint at step 10, continued on 1 process at ZeRO stage 3 (micro-batch
    # 4, accumulating 2, so the global batch of 8 is the same): the same samples, summed in another
    # order.
    alone = run_alone(
        "--dir", runs["restarted"], "--steps", 14, "--every", 3, "--dump", 14, "--stage", 3
    )
    assert alone.returncode == 0, output(alone)
    assert re.search(r"rank 0/1 attempt 0: resumed from \S+global_step10 at step 10", alone.stdout)
    assert (runs["restarted"] / "latest").read_text() == "global_step14"
    resumed = params(runs["restarted"] / "dumps" / "step14.safetensors")
    reference = params(runs["reference"] / "dumps" / "step14.safetensors")
    assert_named_close(resumed, reference, 1e-5)
    # And training did move the parameters: the comparison is not between two copies of step 10.
    at_10 = params(runs["reference"] / "dumps" / "step10.safetensors")
    assert all(not torch.equal(resumed[n], at_10[n]) for n in resumed)
