"""DeepSpeed's `deepspeed.runtime.pipe.topology`: meshes and the pipeline grid, from the comm room."""

from shardspeed.comm.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "_prime_factors",
]
