"""Closing the process groups when a script ends, so that a finished job exits with status 0.

Why a finished job could abort: a gloo worker thread releases each collective's work object
after marking it complete. When that release drops the last reference to a tensor whose Python
object the script no longer holds, the thread takes the GIL to free the Python object. If the
interpreter has begun finalizing by then (the script returned a moment after its last
collective), Python ends that thread with `pthread_exit`, whose unwinding through the work's
`noexcept` destructor calls `std::terminate`: "terminate called without an active exception",
SIGABRT, a failed job. Found in a core dump of an aborted rank: the gloo worker
(`ProcessGroupGloo::runLoop`) in `~AsyncAllgatherWork` -> `TensorImpl::decref_pyobject` ->
`take_gil` -> `PyThread_exit_thread`. Any script that ends without `destroy_process_group` can hit
it; more collectives near the end make it likelier.

`close` runs before the interpreter finalizes (at exit, or called by the `shardspeed` launcher's
worker when the script returns):

1. every rank says it reached the end, through the default group's store, and waits for the others
   for at most `SHARDSPEED_EXIT_TIMEOUT` seconds (default 60, never above the collective timeout);
   a rank that does not come is named in a warning and the rest leave without it. A rank whose
   script ended with an exception does not wait: the job has failed, and torchrun should hear it;
2. the groups are destroyed (NCCL's communicators aborted instead when a peer is missing), which
   frees every group that only torch's registry held: its destructor joins the worker threads
   with the GIL released, so their last releases finish first;
3. for groups that the script's own objects still hold, it waits with the GIL released until no
   thread outside Python's own is runnable (read from /proc; a short pause elsewhere), so a
   release in progress finishes while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

_logger = logging.getLogger("shardspeed")

EXIT_TIMEOUT_ENV = "SHARDSPEED_EXIT_TIMEOUT"
_DEFAULT_EXIT_TIMEOUT = 60.0
_LEAVE_TIMEOUT = 5.0  # how long the store's host waits for the others to finish reading it
_SETTLE_BOUND = 2.0  # longest wait for native threads to go idle
_SETTLE_POLL = 0.002
_TASKS = "/proc/self/task"

_installed = False
_closings = 0  # closes in this process: keys of a later group never meet an earlier one's


def close_at_exit() -> None:
    """Have `close` run at interpreter exit (once per process, however often it is asked)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    # A script ended by an exception has failed: waiting for the other ranks would only hold
    # back torchrun's report of it (their collectives fail or time out once this rank is gone).
    close(failed=getattr(sys, "last_value", None) is not None)


def close(timeout: float | None = None, failed: bool = False) -> None:
    """Wait (bounded by `timeout` seconds, default `SHARDSPEED_EXIT_TIMEOUT`) for every rank to
    reach this point, unless this one `failed`; destroy the process groups; let the communication
    threads go idle. Safe to call more than once, and without a process group."""
    global _closings
    if dist.is_available() and dist.is_initialized():
        _closings += 1
        # On torch's fake group (a dry run) the other ranks exist only in name: nothing to meet.
        alone = failed or dist.get_backend() == "fake"
        missing = [] if alone else _exit_barrier(_exit_timeout(timeout))
        _destroy(abort=failed or bool(missing))
    _settle()


def _exit_timeout(timeout: float | None) -> float:
    if timeout is None:
        text = os.environ.get(EXIT_TIMEOUT_ENV)
        try:
            timeout = float(text) if text else _DEFAULT_EXIT_TIMEOUT
        except ValueError:
            timeout = -1.0
        if not timeout >= 0:
            _logger.warning(
                "%s=%r is not a number of seconds >= 0; waiting at most %g s for the other "
                "ranks at exit",
                EXIT_TIMEOUT_ENV,
                text,
                _DEFAULT_EXIT_TIMEOUT,
            )
            timeout = _DEFAULT_EXIT_TIMEOUT
    from .comm import collective_timeout  # comm.py imports this module

    limit = collective_timeout()
    return min(timeout, limit.total_seconds()) if limit is not None else timeout


def _exit_barrier(timeout: float) -> list[int]:
    """Meet the other ranks through the store; return the ranks that did not come in time."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return []
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"shardspeed/exit/{attempt}/{_closings}"
    store = None
    try:
        store = dist.distributed_c10d._get_default_store().clone()
        store.set_timeout(datetime.timedelta(seconds=max(timeout, 1.0)))
        store.set(f"{prefix}/rank{rank}", "1")
        if store.add(f"{prefix}/arrived", 1) == world:
            store.set(f"{prefix}/all", "1")
        store.wait([f"{prefix}/all"], datetime.timedelta(seconds=max(timeout, 0.001)))
    except Exception as exc:  # the wait timed out, or the store's host is gone
        return _report_missing(store, prefix, world, timeout, exc)
    left = store.add(f"{prefix}/left", 1)
    if _hosts_store(rank):  # rank 0's process serves the store: the others still read from it
        deadline = time.monotonic() + _LEAVE_TIMEOUT
        while left < world and time.monotonic() < deadline:
            time.sleep(0.005)
            left = store.add(f"{prefix}/left", 0)
    return []


def _hosts_store(rank: int) -> bool:
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _report_missing(
    store: Any, prefix: str, world: int, timeout: float, exc: BaseException
) -> list[int]:
    """Name the ranks that did not reach the end (all others, if the store cannot be read)."""
    rank = dist.get_rank()
    others = [r for r in range(world) if r != rank]
    missing = others
    if store is not None:
        try:
            missing = [r for r in others if not store.check([f"{prefix}/rank{r}"])]
        except Exception:
            missing = others
    names = ", ".join(map(str, missing))
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    _logger.warning(
        "rank %d reached the end of its script, but rank(s) %s did not within %g s (%s): "
        "closing the process group without them. A rank that failed reports its own error; if "
        "they were still working, set %s to wait longer.",
        rank,
        names or "?",
        timeout,
        reason,
        EXIT_TIMEOUT_ENV,
    )
    return missing or others


def _destroy(abort: bool) -> None:
    """Destroy every group; with a peer missing, abort NCCL communicators rather than wait on
    them (torch's destroy may block in a collective teardown that the missing rank never joins)."""
    uses_nccl = any(_is_nccl(group) for group in list(dist.distributed_c10d._world.pg_map))
    aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort and uses_nccl and aborter is not None:
        aborter()
        return
    dist.destroy_process_group()


def _is_nccl(group: Any) -> bool:
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except Exception:  # not a member, or already gone
        return False


def _settle() -> None:
    """Wait, with the GIL released, until no native thread (one Python does not run) is runnable:
    a communication thread between finishing a collective and releasing it completes now."""
    if not os.path.isdir(_TASKS):
        time.sleep(0.05)
        return
    python_threads = {t.native_id for t in threading.enumerate()}
    deadline = time.monotonic() + _SETTLE_BOUND
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(_SETTLE_POLL)
        quiet = quiet + 1 if not _runnable_native_threads(python_threads) else 0


def _runnable_native_threads(python_threads: set[int | None]) -> bool:
    for name in os.listdir(_TASKS):
        tid = int(name)
        if tid in python_threads:
            continue
        try:
            with open(f"{_TASKS}/{name}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended
        if state == "R":
            return True
    return False
