"""DeepSpeed's `deepspeed.module_inject.layers`, over the tensor-parallel room."""

from ....tensor_parallel.layers import GatherReplacedLayerParams

__all__ = ["GatherReplacedLayerParams"]
