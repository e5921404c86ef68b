"""A job that finished ends every rank with status 0, whatever started it; one whose peer was
killed before the end still ends, within SHARDSPEED_EXIT_TIMEOUT, naming the rank that did not
come (`shardspeed.comm.teardown`; the cause of the old aborts is in docs/architecture.md, "Ending a
job").

The job (`exit_job.py train`) trains at ZeRO 1, saves and loads a checkpoint, trains at ZeRO 3 and
returns right after leaving an all-reduce of a temporary in flight: without the teardown about a
third of such runs aborted at exit (SIGABRT, "terminate called without an active exception").
The suite starts it a few times per launcher; `benchmarks/bench_exit.py` starts it hundreds of
times. `accelerate launch` ending with 0 is `test_huggingface.py::test_accelerate_launch_use_deepspeed`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

from shardspeed.comm import free_port

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "exit_job.py"
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
ABORT = "terminate called"
TORCHRUN_RUNS = 3


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for key in RENDEZVOUS:
        env.pop(key, None)
    return env


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def test_finished_torchrun_jobs_exit_0(tmp_path: Path) -> None:
    for attempt in range(TORCHRUN_RUNS):
        directory = tmp_path / f"run{attempt}"
        command = _torchrun("--nproc_per_node", "2", "--master_port", str(free_port()))
        proc = subprocess.run(
            [*command, str(JOB), "train", "--dir", str(directory)],
            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert out.count("returned") == 2 and ABORT not in out, out


def test_the_shardspeed_launcher_job_exits_0(tmp_path: Path) -> None:
    launcher = Path(sys.executable).with_name("shardspeed")
    proc = subprocess.run(
        [str(launcher), "--num_procs", "2", "--master_port", str(free_port()),
         str(JOB), "train", "--dir", str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("returned") == 2 and ABORT not in out, out


def _spawned(rank: int, port: int, directory: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    sys.argv = [str(JOB), "train", "--dir", directory]
    sys.path.insert(0, str(JOB.parent))
    import exit_job

    exit_job.main()


def test_an_mp_spawn_job_exits_0(tmp_path: Path) -> None:
    # mp.spawn raises ProcessExitedException for a child that exits otherwise than with 0.
    mp.spawn(_spawned, args=(free_port(), str(tmp_path)), nprocs=2, join=True)


def test_a_peer_killed_before_the_end_is_named_and_the_rest_ends(tmp_path: Path) -> None:
    # The two ranks as plain processes with the rendezvous variables (as a cluster's own starter
    # gives them; rank 0 serves the store): under one torchrun, rank 1's death would make the
    # agent stop rank 0, and under two, the agent of rank 0 waits for the other's at its own
    # exit barrier. Here rank 0 must end by itself.
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = _env(SHARDSPEED_EXIT_TIMEOUT="3")
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )  # fmt: skip
        command = [sys.executable, str(JOB), "killed", "--dir", str(tmp_path)]
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, **output))
    start = time.monotonic()
    out0, _ = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=120)
    assert procs[1].returncode == -9  # killed
    assert procs[0].returncode == 0, out0
    assert time.monotonic() - start < 60
    assert "rank 0: returned" in out0 and ABORT not in out0
    assert "rank 0 reached the end of its script, but rank(s) 1 did not within 3 s" in out0, out0
    assert "set SHARDSPEED_EXIT_TIMEOUT to wait longer" in out0
