"""Monitors and traces through the engine: a short 2-rank run writes the expected CSV series (rank 0
only; the comms logger's per-step collectives among them), and `start_trace` / `save_trace` give one valid Chrome trace with a track group per rank,
its spans in order (forward, backward, reduce, step), and a pipeline's instructions per stage."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch
from torch import nn

import pipe_model as pm
import shardspeed

STEPS, MICRO = 3, 2


def _train_with_monitor(directory: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "csv_monitor": {"enabled": True, "output_path": directory, "job_name": "run"},
            "comms_logger": {"enabled": True},
        },
    )
    engine.start_trace()
    losses = []
    for _ in range(STEPS * 2):
        x = torch.randn(MICRO, 8)
        loss = engine(x).square().mean()
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()
    path = engine.save_trace(str(Path(directory) / "trace.json"))
    engine.destroy()
    return {"losses": losses, "trace": path, "samples": engine.global_samples}


def test_csv_series_and_merged_trace(pool2, tmp_path):
    results = pool2.run(_train_with_monitor, str(tmp_path))
    run = tmp_path / "run"
    names = {p.name for p in run.iterdir()}
    for series in ("train_loss", "lr", "grad_norm", "global_step", "memory_total_bytes"):
        assert f"Train_Samples_{series}.csv" in names, names
    with open(run / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    # One row per optimizer step, x-axis in samples (2 ranks x 2 micro x 2 accumulation = 8).
    assert [int(r[0]) for r in rows[1:]] == [8, 16, 24]
    # Rank 0's window mean of its two micro-batch losses.
    own = results[0]["losses"]
    expected = [(own[2 * i] + own[2 * i + 1]) / 2 for i in range(STEPS)]
    # fp32 on the engine side, float64 here: equal to fp32 rounding.
    assert all(abs(float(r[1]) - e) <= 1e-6 * abs(e) for r, e in zip(rows[1:], expected))
    # The comms logger's step summary: the gradient all-reduce of 161 fp32 parameters a step.
    with open(run / "Train_Samples_comm_all_reduce_bytes.csv") as f:
        assert [float(r[1]) for r in list(csv.reader(f))[1:]] == [161 * 4.0] * STEPS
    with open(run / "Train_Samples_samples_per_sec.csv") as f:
        assert len(list(csv.reader(f))) == STEPS  # header + all steps but the first

    assert results[1]["trace"] is None
    trace = json.loads(Path(results[0]["trace"]).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    names_by_rank = {
        pid: [e["name"] for e in sorted(spans, key=lambda e: e["ts"]) if e["pid"] == pid]
        for pid in (0, 1)
    }
    for sequence in names_by_rank.values():
        assert sequence.count("forward") == STEPS * 2 and sequence.count("step") == STEPS
        first = [sequence.index(n) for n in ("forward", "backward", "reduce", "step")]
        assert first == sorted(first)
    labels = {
        e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
    }
    assert labels == {"rank 0", "rank 1"}


def _pipeline_trace(path: str) -> str | None:
    model = pm.build(2)
    engine, *_ = shardspeed.initialize(model=model, config=pm.config(2, 4, 1))
    engine.start_trace()
    engine.train_batch(pm.micro_batches(0, 2, 4, 0, 1))
    return engine.save_trace(path)


def test_pipeline_schedule_timeline(pool2, tmp_path):
    path = pool2.run(_pipeline_trace, str(tmp_path / "pipe.json"))[0]
    events = json.loads(Path(path).read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    pipeline = [e for e in events if e.get("ph") == "X" and e.get("cat") == "pipeline"]
    for stage in (0, 1):
        names = [e["name"] for e in sorted(pipeline, key=lambda e: e["ts"]) if e["pid"] == stage]
        forwards = [n for n in names if n.startswith("ForwardPass")]
        backwards = [n for n in names if n.startswith("BackwardPass")]
        assert len(forwards) == 4 and len(backwards) == 4, names
        assert names.index(forwards[0]) < names.index(backwards[0])
