"""`shardspeed.pipe` (DeepSpeed's `deepspeed.pipe`): pipeline parallelism.

`PipelineModule` cuts a list of layers into stages; `initialize` then returns a `PipelineEngine`
whose `train_batch` runs a schedule (1F1B by default, GPipe, or interleaved 1F1B) over the stages.
"""

from ..comm.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from .engine import PipelineEngine, PipelineError
from .module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]
