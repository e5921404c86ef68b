"""Training metrics to CSV files, TensorBoard and Weights & Biases (DeepSpeed's `MonitorMaster`).

An event is DeepSpeed's `(name, value, step)` tuple; the engine builds a step's events with
`training_events` and hands them to `MonitorMaster.write_events`. Only global rank 0 writes, as in
DeepSpeed, so every rank may call it unconditionally.

Where this differs from DeepSpeed 0.19.8:
- a missing `tensorboard` or `wandb` package is an `ImportError` on every rank at construction
  (DeepSpeed raises on rank 0 only, leaving the other ranks to hang in their next collective);
- a CSV file gets its header only when it is new, so a resumed run keeps appending to the same
  series (DeepSpeed writes the header again in the middle of the file);
- wandb gets one `log` call per step rather than one per event, and the run is finished on
  `close()`.
"""

from __future__ import annotations

import csv
import importlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..config.schema import FileMonitorConfig, WandbConfig

__all__ = ["Event", "MonitorMaster", "csv_filename", "log_dir", "training_events"]

Event = tuple[str, float, int]
"""(name, value, x-axis step): DeepSpeed's event tuple; shardspeed's x-axis is samples seen."""

PREFIX = "Train/Samples/"


def log_dir(config: FileMonitorConfig) -> str:
    """`output_path`/`job_name`, absolute. DeepSpeed joins them as given, so the default
    `output_path` "" puts files in `./<job_name>`; resolving it now keeps a later `chdir` from
    moving the rest of the run's files elsewhere."""
    return os.path.abspath(os.path.join(config.output_path, config.job_name))


def csv_filename(name: str) -> str:
    """DeepSpeed's CSV file name for an event: '/' and ' ' become '_' (no directories)."""
    return name.replace("/", "_").replace(" ", "_") + ".csv"


def _require(module: str, package: str, extra: str = "") -> None:
    """Fail with the install command, on every rank, before any training time is spent."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"`{package}` is enabled in the config but importing {module} failed ({e}): "
            f"`pip install {package}`{extra}, or disable `{package}`"
        ) from e


class _CsvWriter:
    """One CSV file per event name under `log_dir`, header `step,<last name component>`.

    Files are opened per `write_events` call rather than held open: a model with many MoE layers
    and experts has thousands of series, more than a process may keep open."""

    def __init__(self, config: FileMonitorConfig) -> None:
        self.dir = log_dir(config)
        os.makedirs(self.dir, exist_ok=True)

    def write_events(self, events: Sequence[Event]) -> None:
        rows: dict[str, list[Event]] = {}
        for event in events:
            rows.setdefault(event[0], []).append(event)
        for name, series in rows.items():
            path = os.path.join(self.dir, csv_filename(name))
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if f.tell() == 0:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerows([step, value] for _, value, step in series)

    def close(self) -> None:
        """Nothing is held open between writes."""


class _TensorBoardWriter:
    """`torch.utils.tensorboard.SummaryWriter` under `log_dir`, flushed after every batch."""

    def __init__(self, config: FileMonitorConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir(config))

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbWriter:
    """A wandb run (`project`, `group`, entity `team`); one `log` per step so wandb's
    monotonically increasing step accepts every event of a step."""

    def __init__(self, config: WandbConfig) -> None:
        import wandb

        self.run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: Sequence[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step, data in by_step.items():
            self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class MonitorMaster:
    """Fans events out to every enabled backend; writes only on global rank 0.

    `enabled` is the same on every rank (any backend enabled), so the engine can compute values
    that need a collective (a loss averaged over data-parallel ranks) under it without diverging.
    """

    def __init__(
        self,
        tensorboard: FileMonitorConfig,
        csv: FileMonitorConfig,
        wandb: WandbConfig,
        rank: int,
    ) -> None:
        self.enabled = tensorboard.enabled or csv.enabled or wandb.enabled
        if tensorboard.enabled:
            _require("torch.utils.tensorboard", "tensorboard")
        if wandb.enabled:
            _require("wandb", "wandb", " (then `wandb login`)")
        self.writers: list[_CsvWriter | _TensorBoardWriter | _WandbWriter] = []
        if rank != 0:
            return
        if csv.enabled:
            self.writers.append(_CsvWriter(csv))
        if tensorboard.enabled:
            self.writers.append(_TensorBoardWriter(tensorboard))
        if wandb.enabled:
            self.writers.append(_WandbWriter(wandb))

    def write_events(self, events: Sequence[Event]) -> None:
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def _values(values: Any) -> list[float]:
    """A list of floats from a sequence or 1-dim tensor."""
    return [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def training_events(
    step: int,
    samples: int,
    *,
    loss: Any = None,
    lr: float | None = None,
    loss_scale: float | None = None,
    grad_norm: Any = None,
    samples_per_sec: float | None = None,
    elapsed_ms: Mapping[str, float] | None = None,
    memory: Mapping[str, int] | None = None,
    expert_load: Mapping[Any, Mapping[str, Any]] | None = None,
    comm: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Event]:
    """One optimizer step's events, x-axis `samples` (DeepSpeed's `global_samples`).

    DeepSpeed's names: `train_loss` (its pipeline engine's), `lr`, `loss_scale` (DeepSpeed logs it
    under fp16 only: pass None otherwise) and `elapsed_time_ms_<kind>` for `elapsed_ms`'s kinds
    (DeepSpeed's are forward, backward, backward_inner, backward_allreduce, step). shardspeed's:
    `global_step` (so a samples axis maps back to steps), `grad_norm`, `samples_per_sec`,
    `memory/<kind>_bytes` and per MoE layer `moe/<layer>/imbalance`, `moe/<layer>/dropped`,
    `moe/<layer>/expert_<i>_tokens`, and per collective of the comms logger's step summary
    (`comm`) `comm/<op>/bytes`, `comm/<op>/latency_ms`, `comm/<op>/busbw_gbps`. `loss`,
    `grad_norm` and `expert_load`'s values may be tensors; an `expert_load` entry may be any
    subset of `MoE.expert_load()`'s keys.
    """
    out: list[tuple[str, Any]] = [("global_step", step)]
    for name, value in (
        ("train_loss", loss),
        ("lr", lr),
        ("loss_scale", loss_scale),
        ("grad_norm", grad_norm),
        ("samples_per_sec", samples_per_sec),
    ):
        if value is not None:
            out.append((name, value))
    out.extend((f"elapsed_time_ms_{kind}", ms) for kind, ms in (elapsed_ms or {}).items())
    out.extend((f"memory/{kind}_bytes", n) for kind, n in (memory or {}).items())
    for layer, load in (expert_load or {}).items():
        out.extend(_moe_events(f"moe/{layer}/", load))
    for op, stats in (comm or {}).items():
        out.extend(
            (f"comm/{op}/{field}", stats[field])
            for field in ("bytes", "latency_ms", "busbw_gbps")
            if field in stats
        )
    # float() reads a 0-dim tensor too (a device tensor syncs here, once per logged step).
    return [(PREFIX + name, float(value), samples) for name, value in out]


def _moe_events(prefix: str, load: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    if "imbalance" in load:
        yield prefix + "imbalance", load["imbalance"]
    if "dropped" in load:
        yield prefix + "dropped", load["dropped"]
    if "tokens_per_expert" in load:
        for i, n in enumerate(_values(load["tokens_per_expert"])):
            yield f"{prefix}expert_{i}_tokens", n
