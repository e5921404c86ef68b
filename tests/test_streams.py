"""The streams of stage 3's gathers and of the gradient reductions (`zero/streams.py`) on the CPU.

There the holder is chosen with the accelerator's null streams. A recording stand-in for the
streams, put into a real 2-rank stage-3 engine, shows that every wait is made and in the right
order. Whether the work really runs beside the compute stream is checked on a GPU, in
tests/test_cuda_new_paths.py.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

import shardspeed
from shardspeed.accelerator import Accelerator
from shardspeed.comm import comm_volume, reset_comm_volume
from shardspeed.zero.streams import CommStreams
from test_zero3_units import Stack

SIDE = ("gather", "reduce")
# Which collectives each side stream may issue.
ISSUES = {"gather": {"all_gather"}, "reduce": {"reduce", "reduce_scatter", "all_reduce"}}


class RecordedEvent:
    def __init__(self, stream: str, number: int) -> None:
        self.stream, self.number = stream, number


class RecordedStream:
    """A stream that writes each wait and each recorded event into its recorder's log."""

    def __init__(self, recorder: RecordingStreams, name: str) -> None:
        self.recorder, self.name = recorder, name

    def wait_stream(self, stream: RecordedStream) -> None:
        self.recorder.log.append(("wait_stream", self.name, stream.name))

    def wait_event(self, event: RecordedEvent) -> None:
        self.recorder.log.append(("wait_event", self.name, event.stream, event.number))

    def record_event(self) -> RecordedEvent:
        event = RecordedEvent(self.name, next(self.recorder.events))
        self.recorder.log.append(("record", self.name, event.number))
        return event


def _calls() -> dict[str, int]:
    return {name: counts["calls"] for name, counts in comm_volume().items()}


class RecordingStreams:
    """A stand-in for the accelerator's streams: it keeps the current stream, starting with
    "compute", and logs each switch of stream with the collectives issued inside it."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events = itertools.count()
        self._current = [RecordedStream(self, "compute")]

    def Stream(self, device: Any = None, priority: int = 0) -> RecordedStream:  # accelerator's name
        return RecordedStream(self, "unnamed")

    def current_stream(self) -> RecordedStream:
        return self._current[-1]

    @contextlib.contextmanager
    def stream(self, stream: RecordedStream) -> Iterator[None]:
        before = _calls()
        self.log.append(("enter", stream.name))
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()
            issued = {k: n - before.get(k, 0) for k, n in _calls().items() if n != before.get(k, 0)}
            self.log.append(("exit", stream.name, tuple(sorted(issued.items()))))


def test_streams_are_chosen_once_per_device_and_null_on_cpu():
    holder = CommStreams.for_device(torch.device("cpu"))
    assert holder is CommStreams.for_device(torch.device("cpu"))
    null_stream = Accelerator("cpu").Stream
    assert type(holder.gather) is null_stream and type(holder.reduce) is null_stream
    assert holder.gather is not holder.reduce
    ran = []
    with holder.side(holder.gather):
        ran.append(True)  # a null stream runs the block in program order
    assert ran == [True]


def steps_with_recorded_streams() -> dict:
    engine, *_ = shardspeed.initialize(
        model=Stack(3),
        config={
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "reduce_bucket_size": 80,  # a bucket per block: pooled buffers are reused
            },
        },
    )
    sharded, reducer = engine.optimizer.sharded_params, engine.optimizer.reducer
    chosen = CommStreams.for_device(torch.device("cpu"))
    one_holder = sharded.streams is chosen and reducer.streams is chosen
    recorder = RecordingStreams()
    holder = CommStreams(recorder)
    holder.gather.name, holder.reduce.name = SIDE
    sharded.streams = reducer.streams = holder
    gen = torch.Generator().manual_seed(3)
    rank, world = engine.global_rank, engine.dp_world_size
    volumes = []
    for step in range(2):  # the second pass follows the recorded order: it prefetches
        idx = torch.randint(0, 16, (8, 5), generator=gen)[rank * (8 // world) :][: 8 // world]
        reset_comm_volume()
        recorder.log.append(("step", step))
        logits = engine(idx[:, :-1])
        engine.backward(F.cross_entropy(logits.reshape(-1, 16), idx[:, 1:].reshape(-1)))
        recorder.log.append(("backward returned", step))
        engine.step()
        volumes.append(_calls())
    return {"one_holder": one_holder, "log": recorder.log, "volumes": volumes}


def brackets(log: list[tuple]) -> list[tuple[int, int, str, bool, dict]]:
    """Each stretch of work on a side stream: (enter index, exit index, stream, launched after
    waiting for the compute stream, collectives issued)."""
    found = []
    for i, entry in enumerate(log):
        if entry[0] == "enter":
            end = next(j for j in range(i + 1, len(log)) if log[j][:2] == ("exit", entry[1]))
            after_compute = i > 0 and log[i - 1] == ("wait_stream", entry[1], "compute")
            found.append((i, end, entry[1], after_compute, dict(log[end][2])))
    return found


def test_stage3_step_waits_for_each_stream_in_order(pool2):
    for result in pool2.run(steps_with_recorded_streams):
        # One holder, chosen for the device, serves the gathers and the reducer.
        assert result["one_holder"]
        log = result["log"]
        spans = brackets(log)
        # A side stream only ever waits for the compute stream.
        for entry in log:
            if entry[0] == "wait_stream" and entry[1] in SIDE:
                assert entry[2] == "compute", entry
        for step, volume in enumerate(result["volumes"]):
            lo = log.index(("step", step))
            hi = log.index(("step", step + 1)) if step == 0 else len(log)
            mine = [s for s in spans if lo < s[0] < hi]
            # Every collective of the gathers and reductions was issued on its own stream, right
            # after that stream waited for the compute stream.
            issued = {"all_gather": 0, "reduce": 0}
            for _, _, stream, after_compute, collectives in mine:
                assert set(collectives) <= ISSUES[stream], (stream, collectives)
                if collectives:
                    assert after_compute, (stream, collectives)
                for name in issued:
                    issued[name] += collectives.get(name, 0)
            assert issued["all_gather"] == volume["all_gather"] > 0
            assert issued["reduce"] == volume["reduce"] > 0
            for stream in SIDE:
                launched = [s for s in mine if s[2] == stream and s[3]]
                finished = [s for s in mine if s[2] == stream and not s[3]]
                # Each launch is finished on its stream (which waits for the collectives there).
                assert len(launched) == len(finished) > 0, stream
            # The compute stream waits for the gather stream after each gather is finished,
            # before the unit's parameters are used.
            for _, end, stream, after_compute, _ in mine:
                if stream == "gather" and not after_compute:
                    assert log[end + 1] == ("wait_stream", "compute", "gather")
            # A reduction ends with an event; a pooled buffer is refilled only after its event.
            recorded = {}
            for i, entry in enumerate(log[:hi]):
                if entry[0] == "record":
                    recorded[entry[2]] = i
                if entry[:3] == ("wait_event", "compute", "reduce"):
                    assert recorded.get(entry[3], len(log)) < i
            for _, end, stream, after_compute, _ in mine:
                if stream == "reduce" and not after_compute:
                    assert log[end - 1][:2] == ("record", "reduce")
            assert any(e[:3] == ("wait_event", "compute", "reduce") for e in log[lo:hi])
            # Backward returns only after the compute stream waited for the reduce stream, the
            # last thing that touches the reduce stream before the step.
            back = log.index(("backward returned", step))
            touching = [i for i in range(lo, back) if "reduce" in log[i][1:3]]
            assert log[touching[-1]] == ("wait_stream", "compute", "reduce")
