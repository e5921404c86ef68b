"""`shardspeed.monitor` (DeepSpeed's `deepspeed.monitor`): training metrics and timelines.

`monitor.MonitorMaster` writes `(name, value, samples)` events, built by
`monitor.training_events`, to CSV files, TensorBoard and wandb from rank 0; `trace.TraceRecorder`
records each rank's spans and merges them into one Chrome trace for Perfetto.
"""

from . import monitor, trace
from .monitor import MonitorMaster, training_events
from .trace import NullRecorder, TraceRecorder, merge_gathered, merge_traces

__all__ = [
    "MonitorMaster",
    "NullRecorder",
    "TraceRecorder",
    "merge_gathered",
    "merge_traces",
    "monitor",
    "trace",
    "training_events",
]
