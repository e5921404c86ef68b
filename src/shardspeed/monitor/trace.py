"""A timeline of what each rank did, as a Chrome trace (Trace Event Format JSON) that Perfetto
(ui.perfetto.dev) and chrome://tracing open.

Every rank records its own spans (`TraceRecorder.span`): a complete event ("ph": "X") with pid =
rank and one track (tid) per category (compute, communication, optimizer, pipeline, ...). At the
end the ranks' events are merged into one file, either through per-rank files on a shared
directory (`write_rank_file` then `merge_traces`) or gathered over torch.distributed
(`merge_gathered`), with "rank N" process names so each rank is one group of tracks.

Timestamps are microseconds since the Unix epoch: a monotonic clock anchored once to the wall
clock, so that durations never go negative when the wall clock is stepped, and ranks on one host
(and on hosts whose clocks are synchronised) line up.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import time
from typing import Any

__all__ = ["NullRecorder", "TraceRecorder", "merge_gathered", "merge_traces", "rank_file"]

# Known categories get fixed tracks, in this order from the top; others follow as first seen.
CATEGORIES = ("compute", "communication", "optimizer", "pipeline")


def rank_file(directory: str, rank: int) -> str:
    """Where `write_rank_file` puts a rank's trace."""
    return os.path.join(directory, f"trace_rank{rank}.json")


class _Span:
    """Context manager filling in one complete event; a class, not a generator, to stay cheap."""

    __slots__ = ("event", "recorder")

    def __init__(self, recorder: TraceRecorder, event: dict[str, Any]) -> None:
        self.recorder = recorder
        self.event = event

    def __enter__(self) -> dict[str, Any]:
        self.event["ts"] = self.recorder.now_us()
        return self.event

    def __exit__(self, *exc: object) -> None:
        self.event["dur"] = self.recorder.now_us() - self.event["ts"]


class TraceRecorder:
    """This rank's trace events, in the order their spans started."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {c: i for i, c in enumerate(CATEGORIES)}
        self._anchor_ns = time.time_ns() - time.perf_counter_ns()

    def now_us(self) -> float:
        """Microseconds since the epoch on this recorder's monotonic, wall-anchored clock."""
        return (time.perf_counter_ns() + self._anchor_ns) / 1000

    def _event(
        self, ph: str, name: str, category: str, args: dict[str, Any] | None
    ) -> dict[str, Any]:
        tid = self._tracks.setdefault(category, len(self._tracks))
        event: dict[str, Any] = {
            "name": name,
            "cat": category,
            "ph": ph,
            "pid": self.rank,
            "tid": tid,
        }
        if args:
            event["args"] = args
        self._events.append(event)
        return event

    def span(
        self, name: str, category: str = "compute", args: dict[str, Any] | None = None
    ) -> _Span:
        """`with recorder.span("forward"):` records the block as one complete event; `args`
        (JSON-serialisable) show in the viewer's details pane, e.g. a micro-batch id."""
        return _Span(self, self._event("X", name, category, args))

    def instant(
        self, name: str, category: str = "compute", args: dict[str, Any] | None = None
    ) -> None:
        """A point in time on the category's track (a skipped step, a loss-scale change)."""
        event = self._event("i", name, category, args)
        event["ts"] = self.now_us()
        event["s"] = "t"

    def events(self) -> list[dict[str, Any]]:
        """The recorded events (JSON-serialisable dicts), for `merge_gathered`. A span still
        open has no "dur" yet and is left out."""
        return [e for e in self._events if e["ph"] != "X" or "dur" in e]

    def write_rank_file(self, directory: str) -> str:
        """Write this rank's trace (a complete trace on its own) and return its path."""
        os.makedirs(directory, exist_ok=True)
        path = rank_file(directory, self.rank)
        _write(path, self.events())
        return path


class NullRecorder:
    """TraceRecorder's interface, recording nothing: what the engine holds when tracing is off."""

    def span(
        self, name: str, category: str = "compute", args: dict[str, Any] | None = None
    ) -> contextlib.nullcontext[None]:
        return _NO_SPAN

    def instant(
        self, name: str, category: str = "compute", args: dict[str, Any] | None = None
    ) -> None:
        return None

    def events(self) -> list[dict[str, Any]]:
        return []

    def write_rank_file(self, directory: str) -> None:
        return None


_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()  # stateless, so shared


def _metadata(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Names and order for every rank ("rank N") and track (its category) the events use."""
    meta: list[dict[str, Any]] = []
    for pid in sorted({e["pid"] for e in events}):
        common = {"ph": "M", "pid": pid}
        meta.append({"name": "process_name", **common, "args": {"name": f"rank {pid}"}})
        meta.append({"name": "process_sort_index", **common, "args": {"sort_index": pid}})
    for pid, tid, cat in sorted({(e["pid"], e["tid"], e["cat"]) for e in events}):
        common = {"ph": "M", "pid": pid, "tid": tid}
        meta.append({"name": "thread_name", **common, "args": {"name": cat}})
        meta.append({"name": "thread_sort_index", **common, "args": {"sort_index": tid}})
    return meta


def _write(path: str, events: list[dict[str, Any]]) -> None:
    """A JSON-object-format trace: metadata first, then events by rank and time."""
    ordered = sorted(events, key=lambda e: (e["pid"], e["ts"]))
    trace = {"traceEvents": _metadata(ordered) + ordered, "displayTimeUnit": "ms"}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(trace, f)
    os.replace(tmp, path)


def merge_traces(directory: str, out_path: str) -> str:
    """Merge every `trace_rank<N>.json` in `directory` into one trace at `out_path`."""
    paths = glob.glob(os.path.join(directory, "trace_rank*.json"))
    paths = [p for p in paths if re.fullmatch(r"trace_rank\d+\.json", os.path.basename(p))]
    if not paths:
        raise FileNotFoundError(f"no trace_rank<N>.json files in {directory}")
    events: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            events.extend(e for e in json.load(f)["traceEvents"] if e["ph"] != "M")
    _write(out_path, events)
    return out_path


def merge_gathered(all_events: list[list[dict[str, Any]]], path: str) -> str:
    """Merge ranks' `events()` lists (as gathered by `torch.distributed.gather_object`) into one
    trace at `path`. Each event carries its rank as pid, so the lists' order does not matter."""
    _write(path, [e for events in all_events for e in events])
    return path
