"""One job at a time saves into a checkpoint directory: the lock file `<save_dir>/.lock`.

Rank 0 takes the lock at its first save into a directory (created with O_CREAT|O_EXCL, so of two
jobs starting together one wins) and holds it until the process exits or `release_all` (the
engine's `destroy`). The file is JSON naming the holder: `host`, `pid`, `started` (when it took the
lock) and `job`. While held, a daemon thread touches the file every `REFRESH_SECONDS`.

A lock that is there when a save starts is
- re-taken when its `job` is this job: a later save, another engine in the same process, or a rank
  0 restarted by torchrun (`TORCHELASTIC_RUN_ID` is stable across restarts; with torchrun's default
  id "none", the job is the torchrun agent process, which outlives its workers);
- taken over when its holder is gone: on this host its PID no longer runs, or, on any host, it was
  not refreshed for `STALE_SECONDS` (a live holder refreshes it every `REFRESH_SECONDS`; hosts'
  clocks must agree to within the difference);
- otherwise a `CheckpointError` naming the holder and what to do.

Loading needs no lock.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .format import CheckpointError

LOCK = ".lock"
REFRESH_SECONDS = 60.0
STALE_SECONDS = 600.0

_held: set[Path] = set()  # lock files this process holds
_guard = threading.Lock()
_heartbeat: threading.Thread | None = None


def job_id() -> str:
    """What names this job alike in all its processes and across torchrun's restarts of them."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return f"torchrun run {run}"
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # under torchrun, whose agent is our parent
        return f"torchrun agent {socket.gethostname()}:{os.getppid()}"
    return f"process {socket.gethostname()}:{os.getpid()}"


def acquire(root: Path) -> None:
    """Lock checkpoint directory `root` (created if missing) for this job, or raise a
    `CheckpointError` naming the job that holds it. Called by rank 0 before each save."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    mine = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "job": job_id(),
    }
    for _ in range(5):  # a lock that vanishes or is taken over between two looks: look again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
                f.flush()
                os.fsync(f.fileno())
            return _hold(path)
        holder, age = _read(path)
        if holder is None and age is None:
            continue  # released just now
        if holder is not None and holder.get("job") == mine["job"]:
            if holder.get("pid") != mine["pid"] or holder.get("host") != mine["host"]:
                _write_over(path, mine)  # a restarted rank 0 of this job: name the live process
            return _hold(path)
        if _stale(holder, age):
            _remove_stale(path, holder)
            continue
        raise CheckpointError(_refusal(path, holder))
    raise CheckpointError(f"{path}: could not take the checkpoint lock (it kept changing)")


def release_all() -> None:
    """Remove the lock files this process holds (those still naming it)."""
    with _guard:
        held = list(_held)
        _held.clear()
    for path in held:
        holder, _ = _read(path)
        if holder is not None and holder.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _hold(path: Path) -> None:
    global _heartbeat
    with _guard:
        if not _held and _heartbeat is None:
            atexit.register(release_all)
        _held.add(path)
        if _heartbeat is None or not _heartbeat.is_alive():
            _heartbeat = threading.Thread(target=_refresh, name="shardspeed-ckpt-lock", daemon=True)
            _heartbeat.start()
    os.utime(path)


def _refresh() -> None:
    """Touch every held lock file while the process lives (a deleted directory drops its lock)."""
    while True:
        time.sleep(REFRESH_SECONDS)
        with _guard:
            held = list(_held)
        for path in held:
            try:
                os.utime(path)
            except OSError:
                with _guard:
                    _held.discard(path)


def _read(path: Path) -> tuple[dict[str, Any] | None, float | None]:
    """(the holder, or None when the file cannot be parsed; seconds since its last refresh, or
    None when there is no file)."""
    try:
        age = time.time() - path.stat().st_mtime
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        return None, age
    return (holder if isinstance(holder, dict) else None), age


def _stale(holder: dict[str, Any] | None, age: float | None) -> bool:
    if age is not None and age > STALE_SECONDS:
        return True
    if holder is None or holder.get("host") != socket.gethostname():
        return False  # unreadable (being written) or elsewhere: only the age can tell
    return not _running(holder.get("pid"))


def _running(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")  # a killed process not yet reaped by its parent is gone
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _remove_stale(path: Path, holder: dict[str, Any] | None) -> None:
    """Remove the stale lock `holder` without removing one another job took in its place: move it
    to a name of ours first, and put it back if it is not the one judged stale."""
    claim = path.with_name(f"{LOCK}.{socket.gethostname()}.{os.getpid()}.stale")
    try:
        os.rename(path, claim)
    except FileNotFoundError:
        return
    moved, _ = _read(claim)
    if moved != holder:
        # Not the lock judged stale: put it back, unless a third job locked the directory
        # meanwhile (then the job whose lock was moved finds out at its next save).
        with contextlib.suppress(OSError):
            os.link(claim, path)
    claim.unlink()


def _write_over(path: Path, holder: dict[str, Any]) -> None:
    tmp = path.with_name(f"{LOCK}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(holder, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _refusal(path: Path, holder: dict[str, Any] | None) -> str:
    if holder is None:
        who = "a job whose lock file cannot be read"
    else:
        who = (
            f"another job (host {holder.get('host')}, pid {holder.get('pid')}, since "
            f"{holder.get('started')}, job {holder.get('job')!r})"
        )
    return (
        f"{path.parent} is locked for saving by {who}: two jobs saving into one checkpoint "
        f"directory overwrite each other's checkpoints. Wait for that job to end, or save into "
        f"another directory; if that job is gone, delete {path} (a lock not refreshed for "
        f"{STALE_SECONDS / 60:.0f} minutes, or whose process on this host has ended, is taken "
        "over by itself)"
    )
