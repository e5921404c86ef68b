"""The comms logger (DeepSpeed's `comms_logger`): per collective, its count, message size, latency,
algorithmic and bus bandwidth.

The wrappers in `comm.py` ask `comms_logger.enabled` once per collective; everything else here runs
only when it is set. Records are per process: each rank times its own calls.

* Operation: the wrapper's name (`all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`,
  `broadcast`, `reduce`, `all_to_all_single`, `all_gather`, `barrier`), which is also the name
  `prof_ops` selects by. With `debug`, rows are split by caller: `all_reduce | engine.py:120 in step`.
* Message size: the payload `comm_volume()` counts, the full tensor the collective acts on (an
  all-gather's output, a reduce-scatter's input, an all-to-all's input); 0 for a barrier.
* Latency: for a blocking call, its wall time; for an async one, from launch until `wait()` returns
  on its Work, so it includes whatever the caller overlapped with it (a Work never waited on is not
  recorded). On CUDA the device is synchronized before the launch and at the end, as DeepSpeed
  does, so that the time is the collective's own: profiling serializes compute and communication.
* Bandwidth, as nccl-tests defines it, in Gbps (1e9 bits/s) like DeepSpeed: algbw = size / latency;
  busbw = algbw * 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all,
  1 for the rest, n being the group's size. DeepSpeed's all-reduce `tput` is twice this algbw.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import zlib
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..config.schema import CommsLoggerConfig

logger = logging.getLogger("shardspeed")

_COMM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TRIM = 0.1  # share of latencies cut from each end before averaging, as DeepSpeed does
_COLUMN = 20


def bus_factor(op: str, group_size: int) -> float:
    """busbw / algbw for `op` over `group_size` ranks: the share of the payload that has to cross
    the slowest link (nccl-tests' PERFORMANCE.md). Ops without a collective pattern get 1."""
    n = group_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return (n - 1) / n
    return 1.0


@dataclass(slots=True)
class _Pending:
    """A profiled collective in flight, from `start` to `finish`."""

    label: str
    op: str
    nbytes: int
    group: Any
    t0: float


@dataclass(slots=True)
class _Entry:
    """The calls of one (label, message size): latencies kept compact, for the trimmed mean and the
    straggler exchange."""

    latencies: array = field(default_factory=lambda: array("d"))
    factor_sum: float = 0.0  # sum of bus factors; groups of different sizes may share a row


@dataclass(slots=True)
class _StepTotals:
    count: int = 0
    nbytes: int = 0
    bus_bytes: float = 0.0
    seconds: float = 0.0


class CommsLogger:
    """Times the collectives the `comm` wrappers run; `comms_logger` is the process's instance."""

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self.prof_ops: frozenset[str] = frozenset()
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._step: dict[str, _StepTotals] = {}

    def configure(self, config: CommsLoggerConfig) -> None:
        self.enabled = config.enabled
        self.verbose = config.verbose
        self.debug = config.debug
        self.prof_all = config.prof_all
        self.prof_ops = frozenset(config.prof_ops)

    def start_profiling_comms(self) -> None:
        """Time every collective from now on (`prof_all`), not only those `prof_ops` names."""
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        """Time only the collectives `prof_ops` names from now on."""
        self.prof_all = False

    def start(self, op: str, nbytes: int, group: Any) -> _Pending | None:
        """Begin timing `op`, or None when `prof_all` is off and `prof_ops` does not name it."""
        if not (self.prof_all or op in self.prof_ops):
            return None
        label = f"{op} | {_caller()}" if self.debug else op
        _synchronize()
        return _Pending(label, op, nbytes, group, time.perf_counter())

    def finish(self, pending: _Pending) -> None:
        _synchronize()
        seconds = time.perf_counter() - pending.t0
        n = dist.get_world_size(pending.group) if dist.is_initialized() else 1
        factor = bus_factor(pending.op, n)
        entry = self._entries.get((pending.label, pending.nbytes))
        if entry is None:
            entry = self._entries[pending.label, pending.nbytes] = _Entry()
        entry.latencies.append(seconds)
        entry.factor_sum += factor
        step = self._step.get(pending.label)
        if step is None:
            step = self._step[pending.label] = _StepTotals()
        step.count += 1
        step.nbytes += pending.nbytes
        step.bus_bytes += pending.nbytes * factor
        step.seconds += seconds
        if self.verbose and _rank() == 0:  # DeepSpeed logs each op on rank 0 only
            algbw = _gbps(pending.nbytes, seconds)
            logger.info(
                "comm op: %s | time (ms): %.3f | msg size: %s | group: %d | algbw (Gbps): %.2f | "
                "busbw (Gbps): %.2f",
                pending.label,
                seconds * 1e3,
                _human(pending.nbytes),
                n,
                algbw,
                algbw * factor,
            )

    def step_summary(self) -> dict[str, dict[str, float]]:
        """Per operation, what ran since the last `step_summary` or `reset`, then start anew.

        Local and cheap (no collective), for every step boundary: count, bytes, latency_ms (summed)
        and algbw_gbps / busbw_gbps over the step's total bytes and time.
        """
        out = {
            label: {
                "count": t.count,
                "bytes": t.nbytes,
                "latency_ms": t.seconds * 1e3,
                "algbw_gbps": _gbps(t.nbytes, t.seconds),
                "busbw_gbps": _gbps(t.bus_bytes, t.seconds),
            }
            for label, t in sorted(self._step.items())
        }
        self._step = {}
        return out

    def reset(self) -> None:
        """Forget every record (DeepSpeed's `reset_log`)."""
        self._entries = {}
        self._step = {}

    def log_summary(self, show_straggler: bool = False) -> dict[str, Any]:
        """Print the table of all records since the last `reset` on rank 0 and return its data on
        every rank: {"summary": {label: {size: row}}, "straggler_analysis": ... or None,
        "metadata": {"rank", "world_size"}}.

        Averages are means with the top and bottom 10 % of latencies cut, and the bandwidths come
        from that mean latency. `show_straggler` is a collective over the default group (every rank
        must call it, with the same records): per call, the smallest latency over the ranks is the
        collective's own time, and the rest is this rank waiting for the slowest one.
        """
        entries = sorted(self._entries.items())
        rank = _rank()
        summary: dict[str, dict[int, dict[str, Any]]] = {}
        for (label, nbytes), entry in entries:
            lat = list(entry.latencies)
            avg = _trimmed_mean(lat)
            algbw = _gbps(nbytes, avg)
            summary.setdefault(label, {})[nbytes] = {
                "count": len(lat),
                "total_latency_ms": sum(lat) * 1e3,
                "avg_latency_ms": avg * 1e3,
                "algbw_avg_gbps": algbw,
                "busbw_avg_gbps": algbw * entry.factor_sum / len(lat),
                "msg_size_bytes": nbytes,
                "msg_size_str": _human(nbytes),
            }
        columns = ("Total Latency(ms)", "Avg Latency(ms)", "algbw (Gbps)", "busbw (Gbps)")
        keys = ("total_latency_ms", "avg_latency_ms", "algbw_avg_gbps", "busbw_avg_gbps")
        lines = _table(summary, columns, keys)
        stragglers = _straggler_analysis(entries) if show_straggler else None
        if stragglers is not None:
            lines += ["", "Breakdown with straggler effect"]
            columns = ("Total comm(ms)", "Total straggler(ms)", "Avg comm(ms)", "Avg straggler(ms)")
            keys = (
                "total_comm_lat_ms",
                "total_straggler_ms",
                "avg_comm_lat_ms",
                "avg_straggler_ms",
            )
            lines += _table(stragglers, columns, keys)
        if rank == 0:
            print("\n".join(lines), flush=True)
        world = dist.get_world_size() if dist.is_initialized() else 1
        return {
            "summary": summary,
            "straggler_analysis": stragglers,
            "metadata": {"rank": rank, "world_size": world},
        }


comms_logger = CommsLogger()


def configure_comms_logger(config: CommsLoggerConfig) -> CommsLogger:
    """Apply the `comms_logger` config section to this process's logger (records are kept)."""
    comms_logger.configure(config)
    return comms_logger


def log_summary(show_straggler: bool = False) -> dict[str, Any]:
    """`deepspeed.comm.log_summary`: see `CommsLogger.log_summary`."""
    return comms_logger.log_summary(show_straggler)


def reset_log() -> None:
    """`deepspeed.comm.reset_log`: forget every record."""
    comms_logger.reset()


def _synchronize() -> None:
    # Only a process that uses CUDA has queued work to wait for; is_initialized() is cheap.
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _caller() -> str:
    """The innermost frame outside `shardspeed.comm`: who asked for the collective."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_COMM_DIR):
        frame = frame.f_back
    if frame is None:
        return "unknown caller"
    name = os.path.basename(frame.f_code.co_filename)
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def _trimmed_mean(values: list[float]) -> float:
    ordered = sorted(values)
    cut = round(len(ordered) * _TRIM)
    kept = ordered[cut : len(ordered) - cut]
    return sum(kept) / len(kept)


def _human(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    power = min(int(math.log(nbytes, 1024)), 4)
    return f"{nbytes / 1024**power:.2f} {('KB', 'MB', 'GB', 'TB')[power - 1]}"


def _table(
    data: dict[str, dict[int, dict[str, Any]]], columns: tuple[str, ...], keys: tuple[str, ...]
) -> list[str]:
    """DeepSpeed's layout: a header, then per operation its name and one line per message size."""
    header = ("Comm. Op", "Message Size", "Count", *columns)
    lines = ["".join(f"{h:<{_COLUMN}}" for h in header).rstrip()]
    for label, rows in data.items():
        lines.append(label)
        for row in rows.values():
            cells = [f"{'':<{_COLUMN}}{row['msg_size_str']:<{_COLUMN}}{row['count']:<{_COLUMN}}"]
            cells += [f"{row[key]:<{_COLUMN}.3f}" for key in keys]
            lines.append("".join(cells).rstrip())
    return lines


def _straggler_analysis(
    entries: list[tuple[tuple[str, int], _Entry]],
) -> dict[str, dict[int, dict[str, Any]]]:
    """Trade latencies with the other ranks (torch.distributed directly: not counted or logged)."""
    lat = torch.tensor([x for _, entry in entries for x in entry.latencies], dtype=torch.float64)
    shape = ";".join(f"{label}|{nbytes}|{len(e.latencies)}" for (label, nbytes), e in entries)
    if dist.is_initialized():
        # Ranks in different subgroups log different calls; pairing them up would be meaningless.
        crc = zlib.crc32(shape.encode())
        check = torch.tensor([crc, -crc], dtype=torch.int64)
        dist.all_reduce(check, op=dist.ReduceOp.MAX)  # the largest and minus the smallest
        if check[0].item() != -check[1].item():
            raise ValueError(
                "show_straggler needs the same collectives logged on every rank; these ranks "
                "logged different ones (subgroups?)"
            )
        fastest = lat.clone()
        dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
    else:
        fastest = lat
    out: dict[str, dict[int, dict[str, Any]]] = {}
    offset = 0
    for (label, nbytes), entry in entries:
        count = len(entry.latencies)
        own = fastest[offset : offset + count].tolist()
        waited = (lat[offset : offset + count] - fastest[offset : offset + count]).tolist()
        offset += count
        out.setdefault(label, {})[nbytes] = {
            "count": count,
            "total_comm_lat_ms": sum(own) * 1e3,
            "total_straggler_ms": sum(waited) * 1e3,
            "avg_comm_lat_ms": _trimmed_mean(own) * 1e3,
            "avg_straggler_ms": _trimmed_mean(waited) * 1e3,
            "msg_size_bytes": nbytes,
            "msg_size_str": _human(nbytes),
        }
    return out
