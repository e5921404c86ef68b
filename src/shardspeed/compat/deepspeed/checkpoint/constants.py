"""DeepSpeed's `deepspeed.checkpoint.constants`: the names of DeepSpeed's checkpoint files and of the
keys in them, as the DeepSpeed-checkpoint reader (`shardspeed.checkpoint.deepspeed`) knows them.

Only the names shardspeed reads are here; those for tensor-parallel universal conversion
(AutoTP / AutoEP metadata, vocabulary padding, sub-parameter shapes) belong to DeepSpeed's
`ds_to_universal`, which shardspeed does not have.
"""

from shardspeed.checkpoint.deepspeed import (
    BASE_OPTIMIZER_STATE,
    BF16_ZERO_FILE_PREFIX,
    BUFFER_NAMES,
    CHECKPOINT_PARALLEL_DIMS,
    DS_VERSION,
    FP32_FLAT_GROUPS,
    FP32_WEIGHT_KEY,
    FROZEN_PARAM_FRAGMENTS,
    FROZEN_PARAM_SHAPES,
    LAYER_FILE_PREFIX,
    LOSS_SCALER,
    MODEL_FILE_PREFIX,
    MODEL_FILE_SUFFIX,
    OPTIM_FILE_SUFFIX,
    OPTIMIZER_STATE_DICT,
    PARAM,
    PARAM_ALIGNMENT_PADDINGS,
    PARAM_GROUPS,
    PARAM_SHAPES,
    PARAM_SLICE_MAPPINGS,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    UNIVERSAL_CHECKPOINT_INFO,
    ZERO_FILE_PREFIX,
    ZERO_STAGE,
)

__all__ = [
    "BASE_OPTIMIZER_STATE",
    "BF16_ZERO_FILE_PREFIX",
    "BUFFER_NAMES",
    "CHECKPOINT_PARALLEL_DIMS",
    "DS_VERSION",
    "FP32_FLAT_GROUPS",
    "FP32_WEIGHT_KEY",
    "FROZEN_PARAM_FRAGMENTS",
    "FROZEN_PARAM_SHAPES",
    "LAYER_FILE_PREFIX",
    "LOSS_SCALER",
    "MODEL_FILE_PREFIX",
    "MODEL_FILE_SUFFIX",
    "OPTIMIZER_STATE_DICT",
    "OPTIM_FILE_SUFFIX",
    "PARAM",
    "PARAM_ALIGNMENT_PADDINGS",
    "PARAM_GROUPS",
    "PARAM_SHAPES",
    "PARAM_SLICE_MAPPINGS",
    "SINGLE_PARTITION_OF_FP32_GROUPS",
    "UNIVERSAL_CHECKPOINT_INFO",
    "ZERO_FILE_PREFIX",
    "ZERO_STAGE",
]
