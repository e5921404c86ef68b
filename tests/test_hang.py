"""A rank that raises in forward, skips a collective, calls collectives in another order or of
other sizes ends the job within the collective timeout, with an error that says which rank stopped
where; and that timeout comes from init_distributed(timeout=), the config or DEEPSPEED_TIMEOUT.

Each job case is a 2-rank torchrun job (`hang_job.py`, ZeRO on gloo) whose config sets
'comms_timeout_s' to 4 s, with DEEPSPEED_TIMEOUT unset: without the key a hang would last the
default 10 minutes and the case would time out. The jobs run two at a time, once per module.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
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
from shardspeed.comm.topology import subgroup
from shardspeed.utils.net import free_port

ROOT = Path(__file__).resolve().parent.parent
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
ABORTED = ("SIGABRT", "Received data size")  # gloo's own end for mismatched sizes


TIMEOUT = "4"  # the config's 'comms_timeout_s' in every job: a hang ends in seconds
JOBS = [  # every job the tests below read, launched once by the module's `launched` fixture
    ("raise",),
    *(("skip", "--stage", str(stage)) for stage in (0, 2, 3)),
    *(("size", "--stage", str(stage)) for stage in (0, 2, 3)),
    ("order", "--stage", "0"),
    *(("size", "--stage", str(stage), "--steps", "5") for stage in (0, 3)),
    ("order", "--stage", "0", "--steps", "5"),
    *(("aside", "--stage", "3", "--steps", str(steps)) for steps in (2, 5)),
    ("disagree",),
]


def torchrun(*job_args: str) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in (*RENDEZVOUS, "DEEPSPEED_TIMEOUT"):  # torchrun sets its own; the config sets ours
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), "tests/hang_job.py", *job_args]
    cmd += ["--timeout", TIMEOUT]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def launched() -> dict[tuple[str, ...], tuple[int, str, float]]:
    """Every job of JOBS, two at a time: most of a job's time is waiting for a timeout or a
    peer's report, with the cores idle. Each job's seconds are its own, start to end."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(JOBS, pool.map(lambda job: torchrun(*job), JOBS)))


def trained_until(out: str) -> int:
    """The last collective number of the good steps (the same on both ranks)."""
    numbers = set(re.findall(r"trained \d+ steps, collective #(\d+)", out))
    assert len(numbers) == 1, out
    return int(numbers.pop())


def test_rank_raising_in_forward_ends_the_job(launched):
    rc, out, seconds = launched[("raise",)]
    assert rc != 0, out
    assert seconds < 60
    assert "RuntimeError: boom in forward" in out
    # torchrun's summary names the rank that failed first.
    assert re.search(r"Root Cause.*?rank\s*: 1 ", out, re.S), out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_rank_skipping_a_collective_is_named_by_the_waiting_rank(launched, stage):
    rc, out, seconds = launched[("skip", "--stage", str(stage))]
    assert rc != 0, out
    assert seconds < 60  # 4 s timeout + 4 s grace + start-up, not the default 10 minutes
    assert "timeout 0:00:04" in out  # what each rank applied
    found = re.search(r"CollectiveError: rank 0 stopped in (\w+) #(\d+) at \S+:\d+ in \S+", out)
    assert found, out
    assert int(found[2]) > trained_until(out)
    assert "(group of 2 ranks)" in out and "group timeout 4 s" in out
    assert "rank 1 did not report within 4 s: it is not inside a shardspeed collective" in out
    assert "skipped the collective this rank waits in" in out
    assert not any(text in out for text in ABORTED), out


@pytest.mark.parametrize(
    ("stage", "other"), [(0, "all_reduce"), (2, "reduce"), (3, "all_gather_into_tensor")]
)
def test_ranks_calling_collectives_of_other_sizes_are_named(launched, stage, other):
    # At stage 0 both ranks are in an all-reduce, which gloo used to end with SIGABRT.
    rc, out, seconds = launched[("size", "--stage", str(stage))]
    assert rc != 0, out
    assert seconds < 60
    assert not any(text in out for text in ABORTED), out
    n = trained_until(out) + 1
    assert re.search(
        rf"the ranks called different collectives: rank 0: all_reduce of 1 float32 element "
        rf"\(collective \d+ in this group\); rank 1: {other} of \d+ float32 elements",
        out,
    ), out
    # Each rank's error names where both stopped: rank 0 in the job, rank 1 inside the engine.
    assert f"rank 0 stopped in all_reduce #{n} at tests/hang_job.py:" in out
    assert re.search(rf"rank 1 stopped in {other} #{n} at src/shardspeed/\S+:\d+ in \S+", out)


def test_ranks_calling_collectives_in_different_orders_see_each_other(launched):
    rc, out, seconds = launched[("order", "--stage", "0")]
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
    assert not any(text in out for text in ABORTED), out


# From the fourth step on the ranks follow the steps' agreed sequence of collectives, comparing
# nothing across ranks; a rank that departs from it compares notes through the store.


@pytest.mark.parametrize("stage", [0, 3])
def test_a_rank_departing_from_the_agreed_steps_is_named(launched, stage):
    rc, out, seconds = launched[("size", "--stage", str(stage), "--steps", "5")]
    assert rc != 0, out
    assert seconds < 60
    assert not any(text in out for text in ABORTED), out
    n = trained_until(out) + 1
    assert f"rank 0 stopped in all_reduce #{n} at tests/hang_job.py:" in out
    assert re.search(
        r"this rank called all_reduce of 1 float32 element \(collective \d+ in this group\) "
        r"where the earlier steps, agreed by every rank, call \w+ of \d+ float32 elements "
        r"\(collective \d+ in this group\); rank 1 did not reach this call within 4 s",
        out,
    ), out


def test_ranks_departing_differently_from_the_agreed_steps_see_each_other(launched):
    rc, out, seconds = launched[("order", "--stage", "0", "--steps", "5")]
    assert rc != 0, out
    assert seconds < 60
    assert not any(text in out for text in ABORTED), out
    assert re.search(
        r"the ranks called different collectives: rank 0: all_reduce of 4 float32 elements "
        r"\(collective \d+ in this group\); rank 1: all_gather_into_tensor of 4 float32 elements",
        out,
    ), out


@pytest.mark.parametrize("steps", [2, 5])
def test_ranks_stepping_aside_together_carry_on(launched, steps):
    rc, out, _ = launched[("aside", "--stage", "3", "--steps", str(steps))]
    assert rc == 0, out
    assert out.count(f"following the agreed steps: {steps > 3}") == 2, out
    assert out.count("done, [2.0, 2.0, 2.0]") == 2, out


def test_ranks_with_different_timeouts_are_refused_at_initialize(launched):
    rc, out, _ = launched[("disagree",)]  # rank r sets 4 + r seconds
    assert rc != 0, out
    assert (
        "'comms_timeout_s': the ranks disagree on the collective timeout (rank 0: 4 s (config "
        "'comms_timeout_s'); rank 1: 5 s (config 'comms_timeout_s')): give every rank the same "
        "value" in out
    ), out
    assert "trained 2 steps" not in out


# --- in one process -------------------------------------------------------------------------------


@pytest.fixture
def one_rank(monkeypatch):
    """Rendezvous variables for a one-rank group (undone after the test); the test starts the
    group and this closes it. A group an earlier in-process test left is closed first: these
    tests are about how a group starts."""
    if dist.is_initialized():
        dist.destroy_process_group()
    port = str(free_port())
    for key, value in zip(RENDEZVOUS, ("0", "1", "0", "127.0.0.1", port)):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def group_timeout(group=None) -> datetime.timedelta:
    group = dist.group.WORLD if group is None else group
    return group._get_backend(torch.device("cpu")).options._timeout


def test_wrappers_number_collectives_in_one_process(one_rank):
    comm.init_distributed(dist_backend="gloo")
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


def test_timeout_defaults_to_ten_minutes_and_follows_deepspeed_timeout(one_rank, monkeypatch):
    comm.init_distributed(dist_backend="gloo")
    assert comm.collective_timeout() == group_timeout() == datetime.timedelta(minutes=10)
    dist.destroy_process_group()
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "0.5")  # minutes
    comm.init_distributed(dist_backend="gloo")
    assert comm.collective_timeout() == group_timeout() == datetime.timedelta(seconds=30)
    assert comm.use_collective_timeout(None) == datetime.timedelta(seconds=30)


def test_config_timeout_replaces_the_started_one_in_every_group(one_rank):
    comm.init_distributed(dist_backend="gloo")
    before = subgroup([[0]])  # made before initialize, with the start-up timeout
    assert comm.use_collective_timeout(12.0) == datetime.timedelta(seconds=12)
    after = subgroup([[0]])
    for group in (None, before, after):
        assert group_timeout(group) == datetime.timedelta(seconds=12)
    assert dist.distributed_c10d._get_default_store().timeout == datetime.timedelta(seconds=12)
    assert comm.collective_timeout() == datetime.timedelta(seconds=12)
    # A later initialize without the key goes back to what the group started with.
    assert comm.use_collective_timeout(None) == datetime.timedelta(minutes=10)
    assert group_timeout(after) == datetime.timedelta(minutes=10)


def test_explicit_init_timeout_takes_precedence_over_the_config(one_rank, caplog):
    comm.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=7))
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        assert comm.use_collective_timeout(12.0) == datetime.timedelta(seconds=7)
    assert "'comms_timeout_s': 12 is not applied: init_distributed(timeout=7 s)" in caplog.text
    assert group_timeout() == datetime.timedelta(seconds=7)


def test_config_timeout_applies_to_a_group_other_code_started(one_rank):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=40))
    assert comm.collective_timeout() is None  # shardspeed did not start it
    assert comm.use_collective_timeout(None) == datetime.timedelta(seconds=40)
    assert comm.use_collective_timeout(9.0) == datetime.timedelta(seconds=9)
    assert group_timeout() == datetime.timedelta(seconds=9)


def test_bad_deepspeed_timeout_is_named(one_rank, monkeypatch):
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="DEEPSPEED_TIMEOUT='ten': expected the collective"):
        comm.init_distributed(dist_backend="gloo")


def _check_switch(disagree: bool) -> dict:
    """initialize with 'comms_same_call_check' false (on rank 1 only, with `disagree`), then
    count the call-by-call checks two all-reduces make."""
    import shardspeed
    from shardspeed.comm import comm as impl

    rank = comm.get_rank()
    check = rank == 0 if disagree else False
    config = {"train_batch_size": 2, "comms_same_call_check": check}
    try:
        shardspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    except shardspeed.ConfigError as error:
        return {"error": str(error)}
    checks = []
    original = impl._check_same_call
    impl._check_same_call = lambda *args: checks.append(args)
    try:
        comm.all_reduce(torch.ones(2))
        comm.all_reduce(torch.ones(3))
    finally:
        impl._check_same_call = original
        comm.set_same_call_check(True)  # the pool's later tests expect the default
    return {"checks": len(checks)}


def test_the_same_call_check_can_be_switched_off(pool2):
    assert pool2.run(_check_switch, False) == [{"checks": 0}, {"checks": 0}]
    for result in pool2.run(_check_switch, True):
        assert "'comms_same_call_check': the ranks disagree (rank 0: true" in result["error"]
