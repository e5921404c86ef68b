"""`shardspeed.tensor_parallel`: Megatron-style layers split across a tensor-parallel group, their
communication as autograd Functions, and automatic tensor parallelism of an existing model
(DeepSpeed's AutoTP). The group comes from the engine's topology (`comm.Topology.tp_group`);
this room makes none."""

from .autotp import BUILTIN_POLICY, FAMILIES, auto_tensor_parallel, policy_from_layer_specs
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    enter_tensor_region,
    mark_sequence_parallel,
    sequence_parallel_parameters,
    tensor_parallel_parameters,
    vocab_parallel_cross_entropy,
)
from .mappings import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
)

__all__ = [
    "BUILTIN_POLICY",
    "FAMILIES",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "auto_tensor_parallel",
    "copy_to_tensor_region",
    "enter_tensor_region",
    "gather_from_sequence_region",
    "gather_from_tensor_region",
    "mark_sequence_parallel",
    "policy_from_layer_specs",
    "reduce_from_tensor_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tensor_region",
    "sequence_parallel_parameters",
    "tensor_parallel_parameters",
    "vocab_parallel_cross_entropy",
]
