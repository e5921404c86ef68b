"""Run a function on N gloo ranks and get each rank's result back: the harness for distributed tests.

Starting a process and importing torch costs seconds on a small machine, so a `RankPool` keeps its
ranks alive and runs many functions on them, one after another. The function and its arguments must
be picklable (a module-level function). A rank that raises reports its traceback; a run that exceeds
its time limit kills the pool, which restarts on its next use.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from ..comm import free_port


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def _serve(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share a few cores; more threads only contend
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    # A forked rank ends with os._exit, which skips the exit handlers that a job's process runs
    # (checkpoint locks released, swap files removed): run them, as a job's end would.
    atexit._run_exitfuncs()


# Modules every rank imports, loaded once into the fork server that starts the ranks: a new pool's
# ranks are then forked in milliseconds instead of importing torch for seconds each. Nothing in
# them starts a thread or touches an accelerator at import, so forking after them is safe.
_PRELOAD = ["torch", "torch.distributed", "shardspeed.runtime", "shardspeed.testing"]


def _context() -> Any:
    """Where ranks come from: a fork server with `_PRELOAD` loaded (spawn where there is none)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RankPool:
    """`world_size` live ranks with a gloo process group; `run(fn, ...)` returns results by rank."""

    def __init__(self, world_size: int, timeout: float = 120.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[Any] = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(rank, self.world_size, port, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Call `fn(*args, **kwargs)` on every rank; return the results ordered by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        limit = timeout or self.timeout
        while len(results) + len(failures) < self.world_size:
            try:
                # After a failure the others may be stuck in a collective: wait briefly for them.
                rank, ok, value = self._results.get(timeout=10.0 if failures else limit)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
                self.close()
                if failures:
                    break
                raise TimeoutError(
                    f"{fn.__name__} did not finish on ranks {missing} within {limit:.0f} s"
                ) from None
            (results if ok else failures)[rank] = value
        if failures:
            self.close()
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise RankFailure(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{detail}")
        return [results[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (politely if they are idle, by force otherwise)."""
        for proc, tasks in zip(self._procs, getattr(self, "_tasks", [])):
            if proc.is_alive():
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []


def run_on_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list:
    """One-off: start `world_size` ranks, run `fn` on each, stop them, return results by rank."""
    with RankPool(world_size, timeout) as pool:
        return pool.run(fn, *args, **kwargs)


class HostSyncCounter(TorchDispatchMode):
    """Counts, while active, the operators that make the host wait for the device: a scalar read
    (`item()`, `int()`, `bool()` of a tensor) or an output whose shape depends on the data
    (`nonzero`, `masked_select`, `unique`, tensor-valued `repeat_interleave`).

    On a CPU these cost nothing, so only counting finds a sync that would stall a GPU's stream.
    `places` names each, with where it happened (the innermost shardspeed frame).
    """

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique")

    def __init__(self) -> None:
        super().__init__()
        self.places: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name.startswith(self.SYNCING) or str(func) == "aten.repeat_interleave.Tensor":
            frames = [
                f
                for f in traceback.extract_stack()
                if f"{os.sep}shardspeed{os.sep}" in f.filename and f.filename != __file__
            ]
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "outside shardspeed"
            self.places.append(f"{func} at {where}")
        return func(*args, **(kwargs or {}))
