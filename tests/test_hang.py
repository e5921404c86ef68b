"""A rank that raises in forward, skips a collective, or calls collectives in another order ends the
job within the group timeout, with an error that says which rank stopped where.

Each case is a 2-rank torchrun job (`hang_job.py`, ZeRO stage 3 on gloo) with a 6 s timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.utils.net import free_port

ROOT = Path(__file__).resolve().parent.parent
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun(mode: str) -> tuple[int, str, float]:
    env = {**os.environ, "DEEPSPEED_TIMEOUT": "0.1", "OMP_NUM_THREADS": "1"}  # 0.1 min = 6 s
    for key in RENDEZVOUS:  # torchrun sets its own
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), "tests/hang_job.py", mode]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def trained_until(out: str) -> int:
    """The last collective number of the 2 good steps (the same on both ranks)."""
    numbers = set(re.findall(r"trained 2 steps, collective #(\d+)", out))
    assert len(numbers) == 1, out
    return int(numbers.pop())


def test_rank_raising_in_forward_ends_the_job():
    rc, out, seconds = torchrun("raise")
    assert rc != 0, out
    assert seconds < 60
    assert "RuntimeError: boom in forward" in out
    # torchrun's summary names the rank that failed first.
    assert re.search(r"Root Cause.*?rank\s*: 1 ", out, re.S), out


def test_rank_skipping_a_collective_is_named_by_the_waiting_rank():
    rc, out, seconds = torchrun("skip")
    assert rc != 0, out
    assert seconds < 60
    found = re.search(r"CollectiveError: rank 0 stopped in (\w+) #(\d+) at \S+:\d+ in \w+", out)
    assert found, out
    assert int(found[2]) > trained_until(out)
    assert "(group of 2 ranks)" in out
    assert "rank 1 did not report within 5 s: it is not inside a shardspeed collective" in out
    assert "skipped the collective this rank waits in" in out


def test_ranks_calling_collectives_in_different_orders_see_each_other():
    rc, out, seconds = torchrun("order")
    assert rc != 0, out
    assert seconds < 60
    n = trained_until(out) + 1
    # Whichever rank's error comes out, it carries both ranks' records.
    assert f"rank 0 stopped in all_reduce #{n} at tests/hang_job.py:" in out
    assert f"rank 1 stopped in all_gather_into_tensor #{n} at tests/hang_job.py:" in out
    assert "the ranks called collectives in different orders" in out
    assert re.search(
        rf"rank [01] is in (all_reduce|all_gather_into_tensor) #{n} while this rank is in "
        rf"(all_reduce|all_gather_into_tensor) #{n}",
        out,
    )


def test_wrappers_number_collectives_in_one_process(monkeypatch):
    port = str(free_port())
    for key, value in zip(RENDEZVOUS, ("0", "1", "0", "127.0.0.1", port)):
        monkeypatch.setenv(key, value)  # undone after the test
    started = not dist.is_initialized()
    comm.init_distributed(dist_backend="gloo")
    try:
        before = comm.collective_sequence()
        tensor = torch.ones(3)
        comm.all_reduce(tensor)
        assert comm.collective_sequence() == before + 1
        work = comm.all_reduce(tensor, async_op=True)
        work.wait()
        assert work.is_completed()  # delegated to the real Work
        comm.barrier()
        assert comm.collective_sequence() == before + 3
        with pytest.raises(comm.CollectiveError) as err:
            comm.all_gather_into_tensor(torch.empty(3), torch.ones(2))  # wrong output size
        assert isinstance(err.value.__cause__, RuntimeError)
        text = str(err.value)
        assert text.startswith(f"rank 0 stopped in all_gather_into_tensor #{before + 4} at ")
        assert "test_hang.py:" in text and "in test_wrappers_number_collectives" in text
        assert "(group of 1 rank)" in text and "error: " in text
        assert "report" not in text  # no peers to ask
    finally:
        if started:
            dist.destroy_process_group()
