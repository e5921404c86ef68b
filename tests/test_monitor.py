"""Monitoring (`shardspeed.monitor`): training events to CSV, TensorBoard and wandb from rank 0,
and per-rank Chrome traces merged into one timeline."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
import time
import types

import pytest
import torch

from shardspeed.config.schema import FileMonitorConfig, WandbConfig
from shardspeed.monitor import (
    MonitorMaster,
    NullRecorder,
    TraceRecorder,
    merge_gathered,
    merge_traces,
    training_events,
)
from shardspeed.monitor.monitor import csv_filename

OFF = FileMonitorConfig()
WANDB_OFF = WandbConfig()
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def fake_run(steps: int = 3, batch: int = 8) -> list[list[tuple[str, float, int]]]:
    """Each step's events for a short fp16 MoE run, with every kind of value filled in."""
    return [
        training_events(
            step,
            step * batch,
            loss=torch.tensor(2.0 / step),
            lr=1e-3 * step,
            loss_scale=65536.0,
            grad_norm=torch.tensor(0.5),
            samples_per_sec=100.0 + step,
            elapsed_ms={"forward": 1.5, "step": 0.25},
            memory={"allocated": 1024 * step, "max_allocated": 4096},
            expert_load={
                "layers.0.moe": {
                    "imbalance": 1.25,
                    "dropped": torch.tensor(step),
                    "tokens_per_expert": torch.tensor([3, step]),
                }
            },
        )
        for step in range(1, steps + 1)
    ]


def read_csv(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_training_events_names_and_axis():
    (events,) = fake_run(steps=1)
    assert [name for name, _, _ in events] == [
        "Train/Samples/global_step",
        "Train/Samples/train_loss",
        "Train/Samples/lr",
        "Train/Samples/loss_scale",
        "Train/Samples/grad_norm",
        "Train/Samples/samples_per_sec",
        "Train/Samples/elapsed_time_ms_forward",
        "Train/Samples/elapsed_time_ms_step",
        "Train/Samples/memory/allocated_bytes",
        "Train/Samples/memory/max_allocated_bytes",
        "Train/Samples/moe/layers.0.moe/imbalance",
        "Train/Samples/moe/layers.0.moe/dropped",
        "Train/Samples/moe/layers.0.moe/expert_0_tokens",
        "Train/Samples/moe/layers.0.moe/expert_1_tokens",
    ]
    assert {step for _, _, step in events} == {8}  # x-axis: samples, not steps
    assert all(type(value) is float for _, value, _ in events)
    # Left-out values are left out; the step is always there.
    assert training_events(4, 32) == [("Train/Samples/global_step", 4.0, 32)]


def test_csv_series(tmp_path):
    config = FileMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="job")
    monitor = MonitorMaster(OFF, config, WANDB_OFF, rank=0)
    assert monitor.enabled
    for events in fake_run():
        monitor.write_events(events)
    monitor.close()

    job = tmp_path / "job"
    assert sorted(p.name for p in job.iterdir()) == sorted(
        csv_filename(name) for name, _, _ in fake_run(steps=1)[0]
    )
    assert read_csv(job / "Train_Samples_train_loss.csv") == [
        ["step", "train_loss"],
        ["8", "2.0"],
        ["16", "1.0"],
        ["24", str(float(torch.tensor(2.0 / 3)))],  # an fp32 loss, read exactly
    ]
    assert read_csv(job / "Train_Samples_moe_layers.0.moe_expert_1_tokens.csv")[1:] == [
        ["8", "1.0"],
        ["16", "2.0"],
        ["24", "3.0"],
    ]
    assert read_csv(job / "Train_Samples_memory_allocated_bytes.csv")[0] == [
        "step",
        "allocated_bytes",
    ]

    # A resumed run appends to the same series without a second header.
    monitor = MonitorMaster(OFF, config, WANDB_OFF, rank=0)
    monitor.write_events(training_events(4, 32, loss=0.5))
    monitor.close()
    rows = read_csv(job / "Train_Samples_train_loss.csv")
    assert rows[0] == ["step", "train_loss"] and rows[1:].count(["step", "train_loss"]) == 0
    assert rows[-1] == ["32", "0.5"]


def test_csv_default_output_path_is_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monitor = MonitorMaster(OFF, FileMonitorConfig(enabled=True), WANDB_OFF, rank=0)
    monitor.write_events(training_events(1, 4))
    monitor.close()
    assert (tmp_path / "DeepSpeedJobName" / "Train_Samples_global_step.csv").exists()


def test_other_ranks_write_nothing(tmp_path):
    config = FileMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="job")
    monitor = MonitorMaster(OFF, config, WANDB_OFF, rank=1)
    assert monitor.enabled  # same on every rank, so collectives under it stay matched
    for events in fake_run():
        monitor.write_events(events)
    monitor.close()
    assert list(tmp_path.iterdir()) == []


def test_all_disabled_is_not_enabled(tmp_path):
    monitor = MonitorMaster(OFF, OFF, WANDB_OFF, rank=0)
    assert not monitor.enabled
    monitor.write_events(training_events(1, 4))
    monitor.close()


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = FileMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="tb")
    monitor = MonitorMaster(config, OFF, WANDB_OFF, rank=0)
    for events in fake_run():
        monitor.write_events(events)
    monitor.close()

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "Train/Samples/moe/layers.0.moe/imbalance" in acc.Tags()["scalars"]
    loss = acc.Scalars("Train/Samples/train_loss")
    assert [s.step for s in loss] == [8, 16, 24]
    assert [s.value for s in loss] == pytest.approx([2.0, 1.0, 2.0 / 3])


def test_tensorboard_fan_out(tmp_path, monkeypatch):
    """Scalars reach SummaryWriter under output_path/job_name (a stand-in writer, so this runs
    without the package)."""
    writers = []

    class SummaryWriter:
        def __init__(self, log_dir: str) -> None:
            self.log_dir, self.scalars, self.flushes, self.closed = log_dir, [], 0, False
            writers.append(self)

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

        def flush(self) -> None:
            self.flushes += 1

        def close(self) -> None:
            self.closed = True

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    config = FileMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="tb")
    monitor = MonitorMaster(config, OFF, WANDB_OFF, rank=0)
    run = fake_run()
    for events in run:
        monitor.write_events(events)
    monitor.close()
    (writer,) = writers
    assert writer.log_dir == str(tmp_path / "tb")
    assert writer.scalars == [e for events in run for e in events]
    assert writer.flushes == 3 and writer.closed
    assert MonitorMaster(config, OFF, WANDB_OFF, rank=1).writers == []
    assert len(writers) == 1


def test_tensorboard_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    config = FileMonitorConfig(enabled=True)
    for rank in (0, 1):  # every rank fails, not only the writer
        with pytest.raises(ImportError, match="pip install tensorboard"):
            MonitorMaster(config, OFF, WANDB_OFF, rank=rank)


def test_wandb_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, whatever this venv has
    for rank in (0, 1):
        with pytest.raises(ImportError, match="pip install wandb"):
            MonitorMaster(OFF, OFF, WandbConfig(enabled=True), rank=rank)


def test_wandb_fan_out(monkeypatch):
    """One wandb.log per step with all its events; init gets project, group and team."""
    calls = []

    class Run:
        def log(self, data: dict, step: int) -> None:
            calls.append(("log", data, step))

        def finish(self) -> None:
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    fake = types.ModuleType("wandb")
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = WandbConfig(enabled=True, group="g", team="t", project="p")
    assert MonitorMaster(OFF, OFF, config, rank=1).writers == [] and calls == []
    monitor = MonitorMaster(OFF, OFF, config, rank=0)
    run = fake_run(steps=2)
    for events in run:
        monitor.write_events(events)
    monitor.close()
    assert calls[0] == ("init", {"project": "p", "group": "g", "entity": "t"})
    assert calls[1] == ("log", {name: value for name, value, _ in run[0]}, 8)
    assert calls[2] == ("log", {name: value for name, value, _ in run[1]}, 16)
    assert calls[3:] == [("finish",)]


def traced_step(recorder: TraceRecorder | NullRecorder, micro_batches: int = 2) -> None:
    """One training step's spans: forward, backward with a nested all-reduce, optimizer step."""
    with recorder.span("train_batch", "compute"):
        for mb in range(micro_batches):
            with recorder.span("forward", "compute", args={"micro_batch": mb}):
                time.sleep(0.001)
            with recorder.span("backward", "compute"), recorder.span("allreduce", "communication"):
                pass
        recorder.instant("loss_scale_unchanged", "optimizer")
        with recorder.span("step", "optimizer"):
            pass


def spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X"]


def test_spans_nested_and_ordered():
    recorder = TraceRecorder(rank=3)
    traced_step(recorder)
    events = spans(recorder.events())
    assert [e["name"] for e in events] == [
        "train_batch",
        "forward",
        "backward",
        "allreduce",
        "forward",
        "backward",
        "allreduce",
        "step",
    ]
    assert all(e["pid"] == 3 and e["dur"] >= 0 for e in events)
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    outer, inner = events[0], events[1:]
    assert all(
        outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] for e in inner
    )
    backward, allreduce = events[2], events[3]
    assert backward["ts"] <= allreduce["ts"] <= allreduce["ts"] + allreduce["dur"]
    assert allreduce["ts"] + allreduce["dur"] <= backward["ts"] + backward["dur"]
    assert events[1]["dur"] >= 1000  # slept 1 ms: microseconds
    assert events[1]["args"] == {"micro_batch": 0}
    # One track per category.
    assert {e["cat"]: e["tid"] for e in recorder.events()} == {
        "compute": 0,
        "communication": 1,
        "optimizer": 2,
    }
    # On the wall clock, so ranks' files line up.
    assert abs(events[0]["ts"] - time.time_ns() / 1000) < 60e6


def test_open_span_is_left_out():
    recorder = TraceRecorder(rank=0)
    with recorder.span("outer"):
        assert recorder.events() == []
    assert [e["name"] for e in recorder.events()] == ["outer"]


def check_merged(path, ranks: list[int]) -> None:
    """A Chrome trace: one pid per rank named "rank N", tracks named, spans in step order."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "i"}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in ranks}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert threads[(ranks[0], 1)] == "communication"
    for e in spans(events):
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= e.keys()
        assert isinstance(e["ts"], float) and e["dur"] >= 0
    for r in ranks:
        order = [e["name"] for e in spans(events) if e["pid"] == r and e["cat"] != "communication"]
        assert order == ["train_batch", "forward", "backward", "step"]


def test_merge_rank_files(tmp_path):
    for rank in (1, 0):
        recorder = TraceRecorder(rank)
        traced_step(recorder, micro_batches=1)
        assert recorder.write_rank_file(str(tmp_path / "ranks")).endswith(f"trace_rank{rank}.json")
    out = merge_traces(str(tmp_path / "ranks"), str(tmp_path / "trace.json"))
    check_merged(out, [0, 1])
    check_merged(tmp_path / "ranks" / "trace_rank1.json", [1])  # a rank's file opens alone too


def test_merge_gathered(tmp_path):
    gathered = []
    for rank in range(3):
        recorder = TraceRecorder(rank)
        traced_step(recorder, micro_batches=1)
        gathered.append(json.loads(json.dumps(recorder.events())))  # as exchanged between ranks
    check_merged(merge_gathered(gathered, str(tmp_path / "trace.json")), [0, 1, 2])


def test_merge_traces_without_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace_rank"):
        merge_traces(str(tmp_path), str(tmp_path / "trace.json"))


def test_null_recorder():
    recorder = NullRecorder()
    traced_step(recorder)
    assert recorder.events() == []
    assert recorder.write_rank_file("unused") is None
