"""DeepSpeed's `deepspeed.runtime.constants`: config key names and defaults, from the config room."""

from shardspeed.config.schema import ShardSpeedConfig

TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = ShardSpeedConfig.model_fields["gradient_clipping"].default
STEPS_PER_PRINT = "steps_per_print"
STEPS_PER_PRINT_DEFAULT = ShardSpeedConfig.model_fields["steps_per_print"].default
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
TYPE = "type"
OPTIMIZER_PARAMS = "params"
SCHEDULER_PARAMS = "params"
ZERO_OPTIMIZATION = "zero_optimization"
FP16 = "fp16"
BFLOAT16 = "bf16"
DATA_PARALLEL_GROUP = "data_parallel_group"
GLOBAL_RANK = "global_rank"
ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"
ROUTE_ENCODE = "encode"
