"""DeepSpeed's JSON config as typed, strict sections (defaults follow DeepSpeed 0.19.8).

Every DeepSpeed key has a field here, so a misspelling is always caught and a "did you mean" can be
offered. Fields a later issue implements are listed in `not_supported_until`: the loader refuses any
non-default value for them rather than accepting and ignoring it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .base import NonNegativeInt, PositiveInt, StrictModel

Section = dict[str, Any] | None

INFERENCE_ONLY = (
    "an inference setting; for serving give it to shardspeed.init_inference (docs/inference.md)"
)
NOT_PLANNED = "shardspeed does not have this feature"


class FP16Config(StrictModel):
    """`fp16`: fp16 model, fp32 master weights, static or dynamic loss scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(
        0.0, ge=0.0, description="0 means dynamic scaling; > 0 a static scale"
    )
    initial_scale_power: NonNegativeInt = Field(16, le=63)
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0.0)
    fp16_master_weights_and_grads: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        "fp16_master_weights_and_grads": "fp16 master weights and gradients are not built: "
        "master weights stay fp32"
    }

    @field_validator("loss_scale", "min_loss_scale")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class BF16Config(StrictModel):
    """`bf16` (alias `bfloat16`): bf16 model, fp32 master weights and fp32 gradient accumulation.

    `check_grad_overflow` unset means a non-finite gradient stops training with an error (there is
    no loss scale to recover with); true means DeepSpeed's behaviour of skipping that step.
    """

    enabled: bool = False
    check_grad_overflow: bool | None = None
    immediate_grad_update: bool = False
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        "immediate_grad_update": NOT_PLANNED,
        "bf16_master_weights_and_grads": "bf16 master weights and gradients are not built: "
        "master weights stay fp32",
        "bf16_optimizer_states": "bf16 optimizer states are not built: they stay fp32",
    }

    @field_validator("check_grad_overflow")
    @classmethod
    def _only_checked(cls, value: bool | None) -> bool | None:
        if value is False:
            raise ValueError(
                "false (letting NaN reach the weights) is not offered; leave it unset to stop with an "
                "error on a non-finite gradient, or set true to skip such steps"
            )
        return value


OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(StrictModel):
    """`zero_optimization.offload_optimizer`: where the optimizer states live (stages 1 to 3).

    `cpu`: fp32 masters, optimizer states and the step in (pinned) CPU memory. `nvme`: the
    optimizer states in files under `nvme_path`, stepped in `sub_group_size` pieces;
    `pipeline_read` / `pipeline_write` overlap reading the next piece and writing the last one
    with the step, `buffer_count` pieces may be in memory at once.
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: PositiveInt = 4
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    not_supported_until: ClassVar[dict[str, str]] = {
        "fast_init": "shardspeed never writes initial optimizer states, so there is nothing to skip",
        "ratio": "partial offload is not built: offload the whole optimizer step or none of it",
        "super_offload": NOT_PLANNED,
        "cpuadam_cores_perc": "the CPU step uses torch's threads (torch.set_num_threads)",
    }

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> OffloadOptimizerConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("'device' nvme needs 'nvme_path': the directory for the swap files")
        nvme_only = {
            k: getattr(self, k)
            for k in ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write")
            if getattr(self, k) != type(self).model_fields[k].default
        }
        if self.device != "nvme" and nvme_only:
            raise ValueError(
                f"{sorted(nvme_only)} act only with 'device' nvme; with {self.device!r} they would be "
                "ignored: remove them"
            )
        return self


class OffloadParamConfig(StrictModel):
    """`zero_optimization.offload_param`: where stage 3 keeps its parameter shards.

    `cpu`: the shards in (pinned) host memory; each gather copies this rank's piece to the device
    first. Without an accelerator the shards are in host memory anyway. `nvme` (fp32 models, with
    `offload_optimizer.device` nvme): the shards, which are then the fp32 masters, in swap files.
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: NonNegativeInt = 5
    buffer_size: NonNegativeInt = 100_000_000
    max_in_cpu: NonNegativeInt = 1_000_000_000
    pin_memory: bool = True

    not_supported_until: ClassVar[dict[str, str]] = {
        "buffer_count": "the NVMe parameter swap sizes its own buffers",
        "buffer_size": "the NVMe parameter swap sizes its own buffers",
        "max_in_cpu": "the NVMe parameter swap sizes its own buffers",
    }

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> OffloadParamConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("'device' nvme needs 'nvme_path': the directory for the swap files")
        if self.device != "nvme" and self.nvme_path:
            raise ValueError(f"'nvme_path' acts only with 'device' nvme, not {self.device!r}")
        return self


class AioConfig(StrictModel):
    """`aio`: how swap files are read and written (no compiled extension: a pool of threads).

    `block_size` is the size of each request a transfer is split into, `queue_depth` the requests
    in flight, `intra_op_parallelism` (old name `thread_count`) the I/O threads.
    """

    block_size: PositiveInt = 1_048_576
    queue_depth: PositiveInt = 8
    intra_op_parallelism: PositiveInt = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        "use_gds": NOT_PLANNED + " (GPUDirect Storage)",
    }


# DeepSpeed's default leaf classes: MoE blocks, whose experts run in a data-dependent order.
DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


class LeafModuleConfig(StrictModel):
    """`zero_optimization.leaf_module`: modules that become ZeRO-3 gather units of their own.

    A class is matched by its name or its qualified name (`package.module.Class`), a module by its
    name in `model.named_modules()` or a suffix of that name. A single string stands for a list.
    """

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ParallelWriteConfig(StrictModel):
    """`checkpoint.parallel_write`: pipeline stages writing their layers in parallel.

    shardspeed always does: every stage writes its own file (and every data-parallel rank its
    shard at ZeRO stages 1 and 2), so either value gives the same parallel save.
    """

    pipeline_stage: bool = False


class PipelineConfig(StrictModel):
    """`pipeline`: for a `PipelineModule`; each key is checked against the module it configures.

    `schedule` (a shardspeed key) picks the instruction lists: "1f1b" (DeepSpeed's only schedule,
    the default), "gpipe" (fill-drain) or "interleaved_1f1b" (Megatron's, for a module built with
    `virtual_stages` > 1). `pipe_partitioned` and `grad_partitioned` split, in DeepSpeed, the
    activations and gradients sent between stages across tensor-parallel ranks; shardspeed sends
    each tensor rank's whole tensor (their `false`), so an explicit `true` is refused where it
    would act (tensor and pipeline parallelism together); the default changes nothing.
    """

    stages: Literal["auto"] | PositiveInt = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: NonNegativeInt = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"


class ActivationCheckpointingConfig(StrictModel):
    """`activation_checkpointing`: how `shardspeed.checkpointing.checkpoint` keeps what it saves.

    `initialize` applies it (DeepSpeed acts on it only if the script also calls
    `checkpointing.configure`). `partition_activations` keeps 1/t of each saved input on each of
    the t tensor-parallel ranks; `cpu_checkpointing` keeps saved inputs in host memory;
    `synchronize_checkpoint_boundary` waits for the device at each checkpoint; `profile` logs
    the time of each checkpointed forward and recompute.
    """

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: PositiveInt | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    tuning_notes: ClassVar[dict[str, str]] = {
        "contiguous_memory_optimization": "saved inputs are ordinary tensors, and torch's caching "
        "allocator keeps them from fragmenting memory, which DeepSpeed's contiguous buffers do",
        "number_checkpoints": "it only sizes DeepSpeed's contiguous buffers, which shardspeed "
        "does not need (see contiguous_memory_optimization)",
    }


class TPLayerSpecConfig(StrictModel):
    """One rule of `tensor_parallel.partition_config.layer_specs`: parameters whose names match
    one of `patterns` (regular expressions) are split as `partition_type` layers."""

    patterns: list[str]
    partition_type: Literal["column", "row"]
    shape: list[int] | None = None
    partition_dim: NonNegativeInt | None = None

    not_supported_until: ClassVar[dict[str, str]] = {
        "shape": "fused weights split by sub-shape are not offered yet",
        "partition_dim": "column layers split dimension 0 and row layers dimension 1",
    }


class TPPartitionConfig(StrictModel):
    """`tensor_parallel.partition_config`: which linears automatic tensor parallelism splits.

    `use_default_specs` true adds the built-in rules (GPT-2, Llama-like, BERT-like) after the given
    ones."""

    use_default_specs: bool = True
    layer_specs: list[TPLayerSpecConfig] = Field(default_factory=list)


class TensorParallelConfig(StrictModel):
    """`tensor_parallel` (DeepSpeed's AutoTP training): `autotp_size` t > 1 splits the model's
    attention and MLP linears over t ranks at `initialize`, by name (built-in rules for GPT-2,
    Llama-like and BERT-like models, `partition_config` or `preset_model` for others)."""

    autotp_size: NonNegativeInt = 0
    partition_config: TPPartitionConfig | None = None
    preset_model: Literal["llama", "qwen2", "gpt2", "bert"] | None = None
    tp_overlap_comm: bool = False
    dtype: str | None = None
    vocab_parallel_lm_head: bool | None = None
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    tp: Section = None
    injection_policy_tuple: Any = None
    keep_module_on_host: bool = False
    kernel_inject: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        "tp_overlap_comm": "the tensor-parallel all-reduces are not overlapped yet",
        "dtype": "the model's dtype comes from the fp16 / bf16 sections",
        "vocab_parallel_lm_head": "the output head is not split by vocabulary automatically yet",
        "vocab_parallel_ce_backend": "only torch's cross-entropy is offered",
        "tp": INFERENCE_ONLY,
        "injection_policy_tuple": INFERENCE_ONLY,
        "keep_module_on_host": INFERENCE_ONLY,
        "kernel_inject": INFERENCE_ONLY,
    }


class HybridEngineConfig(StrictModel):
    """`hybrid_engine`: one model that trains and generates (DeepSpeed-Chat's actor).
    `engine.generate` builds an inference copy of the model (gathered from ZeRO-3 shards
    `tp_gather_partition_size` gather units at a time, split over `inference_tp_size` ranks), keeps
    it between generations while the weights are unchanged if `pin_parameters`, and drops the KV
    cache after each generation if `release_inference_cache`."""

    enabled: bool = False
    max_out_tokens: PositiveInt = 512
    inference_tp_size: PositiveInt = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: PositiveInt = 8
    enable_cuda_graph: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        "enable_cuda_graph": "decode steps are not captured in CUDA graphs",
    }


class FlopsProfilerConfig(StrictModel):
    """`flops_profiler`: profile one training step's forward (FLOPs, parameters, latency per
    module) and print it on rank 0."""

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0.0)
    profile_step: PositiveInt = 1
    module_depth: int = Field(-1, ge=-1)
    top_modules: PositiveInt = 1
    detailed: bool = True
    output_file: str | None = None


class CommsLoggerConfig(StrictModel):
    """`comms_logger`: per collective, count, bytes, latency and bandwidth."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False


class FileMonitorConfig(StrictModel):
    """`tensorboard` / `csv_monitor`: event files under `output_path`/`job_name`."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(StrictModel):
    """`wandb`: Weights & Biases (needs the `wandb` package)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class AutotuningModelInfo(StrictModel):
    profile: bool = False
    num_params: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    num_layers: PositiveInt | None = None
    tokens_per_sample: PositiveInt | None = Field(
        None,
        description="shardspeed's own key: tokens in one sample (the sequence length), which the "
        "step-time model needs to rank layouts before any trial",
    )


class AutotuningConfig(StrictModel):
    """`autotuning`: what `shardspeed --autotuning tune|run` explores and how it measures."""

    enabled: bool = False
    fast: bool = True
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    start_profile_step: PositiveInt = 3
    end_profile_step: PositiveInt = 5
    metric_path: str | None = None
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: PositiveInt = 5
    tuner_num_trials: PositiveInt = 50
    arg_mappings: dict[str, str] | None = None
    max_train_batch_size: PositiveInt | None = None
    min_train_batch_size: PositiveInt = 1
    max_train_micro_batch_size_per_gpu: PositiveInt = 1024
    min_train_micro_batch_size_per_gpu: PositiveInt = 1
    num_tuning_micro_batch_sizes: PositiveInt = 3
    mp_size: PositiveInt = 1
    model_info: AutotuningModelInfo | None = None
    model_info_path: str | None = None
    gpu: str | None = Field(
        None,
        description="shardspeed's own key: the GPU kind the step-time model ranks layouts for "
        "before any trial (default: this machine's accelerator, where the model knows it)",
    )

    @model_validator(mode="after")
    def _profile_window(self) -> AutotuningConfig:
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(
                f"end_profile_step {self.end_profile_step} is before start_profile_step "
                f"{self.start_profile_step}"
            )
        return self


class CheckpointConfig(StrictModel):
    """`checkpoint`: how tags are checked across ranks, and where files go.

    Every shardspeed checkpoint loads at any world size and stage, so `load_universal` has nothing
    to switch; `elastic_checkpoint` in `zero_optimization` likewise.
    """

    tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)

    not_supported_until: ClassVar[dict[str, str]] = {
        "use_node_local_storage": "every rank writes into the one save_dir, which must be shared"
    }

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalised(cls, value: Any) -> Any:
        # DeepSpeed compares these upper-cased, so "WARN" and "warn" are the same setting.
        return value.capitalize() if isinstance(value, str) else value


class ZeroConfig(StrictModel):
    """`zero_optimization`: stage 0 (plain data parallelism) to 3.

    `overlap_comm` unset means on: gradients are reduced while backward runs, at every stage
    (DeepSpeed leaves it off for stages 1 and 2; it changes speed, never results).
    `reduce_bucket_size` 0 reduces every gradient on its own as soon as it is ready, and
    `sub_group_size` 0 makes every parameter a master tensor of its own, as in DeepSpeed.
    """

    stage: Literal[0, 1, 2, 3] = 0
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None
    reduce_scatter: bool = True
    reduce_bucket_size: NonNegativeInt = 500_000_000
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: PositiveInt = 500_000_000
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    sub_group_size: NonNegativeInt = 1_000_000_000
    round_robin_gradients: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    parameter_alignment: bool = False
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    stage3_prefetch_bucket_size: NonNegativeInt = 50_000_000
    stage3_param_persistence_threshold: NonNegativeInt = 100_000
    stage3_model_persistence_threshold: NonNegativeInt = 2**63 - 1
    stage3_max_live_parameters: NonNegativeInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegativeInt = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: NonNegativeInt = 0
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    zero_hpz_partition_size: PositiveInt = 1
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    zenflow: Section = None

    not_supported_until: ClassVar[dict[str, str]] = {
        "use_multi_rank_bucket_allreduce": "shardspeed always reduces a bucket in one collective",
        "compute_grad_norm": "shardspeed always computes the norm: it is how overflow is detected",
        "legacy_stage1": NOT_PLANNED,
        "parameter_alignment": NOT_PLANNED,
        "load_from_fp32_weights": "shardspeed checkpoints always restore masters from fp32 values",
        "pipeline_loading_checkpoint": (
            "ZeRO stage 3 does not combine with pipeline parallelism (nor does it in DeepSpeed)"
        ),
        "zenflow": "ZenFlow (asynchronous offloaded optimizer updates) is not built",
        "save_muon_momentum_buffer_in_memory": NOT_PLANNED,
        "stage3_module_granularity_threshold": (
            f"{NOT_PLANNED}; choose stage 3 gather units with 'zero_optimization.leaf_module'"
        ),
        **{
            name: NOT_PLANNED
            for name in (
                "stage3_use_all_reduce_for_fetch_params",
                "stage3_allgather_sequential",
                "override_module_apply",
                "log_trace_cache_warnings",
                "enable_sanity_checks",
            )
        },
    }

    tuning_notes: ClassVar[dict[str, str]] = {
        "contiguous_gradients": "gradients always accumulate in one flat buffer (stages 0 and 1) "
        "or one flat shard (stages 2 and 3), so there is nothing to copy into a contiguous one",
        "round_robin_gradients": "each rank's gradient shard reaches host memory as one "
        "contiguous copy, so there is no per-parameter placement to balance",
        "memory_efficient_linear": "a released stage-3 unit frees its storage even while autograd "
        "holds views of its weights, and backward gathers them again, which is the memory a "
        "memory-efficient linear saves",
    }


class OptimizerSection(StrictModel):
    """`optimizer`: `type` names the algorithm; `params` are checked against that type's schema."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {"legacy_fusion": NOT_PLANNED}


class SchedulerSection(StrictModel):
    """`scheduler`: `type` names the schedule; `params` are checked against that type's schema."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class ThroughputTimerConfig(StrictModel):
    """`timers.throughput`: samples per second in the `steps_per_print` report line."""

    enabled: bool = True
    synchronized: bool = True  # wait for the device before reading the clock


class TimersConfig(StrictModel):
    """`timers`: DeepSpeed's throughput timer (`wall_clock_breakdown` times the phases)."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class CompileConfig(StrictModel):
    """`compile`: `torch.compile` of the module at `initialize` when `enabled` (or, as configs
    written for DeepSpeed 0.14 say it, `disable: false`), with `backend` and `kwargs`.

    The other keys are DeepSpeed 0.19.8's DeepCompile passes, which shardspeed does not have:
    only their defaults are accepted. `engine.compile()` compiles whatever this says.
    """

    enabled: bool = False
    disable: bool | None = None
    backend: str = "inductor"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    deepcompile: bool = False
    autoep_non_moe: bool = False
    free_activation: bool = False
    free_activation_threshold: NonNegativeInt = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    offload_parameters: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        name: "DeepSpeed's DeepCompile passes are not built; 'enabled' compiles with torch.compile"
        for name in (
            "deepcompile",
            "autoep_non_moe",
            "free_activation",
            "free_activation_threshold",
            "offload_activation",
            "offload_activation_pin_memory",
            "offload_opt_states",
            "offload_parameters",
            "double_buffer",
            "symmetric_memory",
            "debug_log",
            "sync_before_reduce",
            "sync_after_reduce",
            "sync_before_allgather",
            "sync_after_allgather",
            "keep_int_input_tensors",
            "keep_all_input_tensors",
        )
    }

    @property
    def compiles(self) -> bool:
        return self.enabled or self.disable is False


class UlyssesConfig(StrictModel):
    """`sequence_parallel.ulysses`: `degree` is the number of ranks that exchange heads (the whole
    sequence group in mode ulysses, a divisor of it in mode hybrid, 1 in mode ring).
    `seq_length_is_variable` false promises one sequence length for the whole run: a batch of
    another length is then refused instead of taken."""

    degree: PositiveInt | None = None
    seq_length_is_variable: bool = True


class SequenceTilingConfig(StrictModel):
    """`sequence_parallel.tiling`: ALST's tiled MLP. When `enabled`, every submodule named `mlp`
    (Hugging Face decoder layers name their MLP so) runs through `TiledMLP`: `chunk_size`
    positions at a time (default: as many as the hidden size), keeping one chunk's intermediate
    activations alive instead of the whole sequence's, for one extra MLP forward per step. The
    tiled head and loss (`TiledFusedLogitsLoss`) belong to the training code (see
    docs/sequence-parallel.md)."""

    enabled: bool = False
    chunk_size: PositiveInt | None = None


class SequenceMemoryConfig(StrictModel):
    """`sequence_parallel.memory_optimizations`: ALST's activation-checkpoint offload. When
    `enabled`, what activation checkpointing keeps between forward and backward (each
    checkpointed layer's inputs) waits in host memory ('activation_checkpointing.cpu_checkpointing'
    turned on), and a Hugging Face model's gradient checkpointing runs through
    `deepspeed.checkpointing.checkpoint` so that it applies there too."""

    enabled: bool = False
    pytorch_profiling: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        "pytorch_profiling": "profile with 'flops_profiler' or torch.profiler around the step",
    }


class ExpertParallelConfig(StrictModel):
    """`expert_parallel` (DeepSpeed's AutoEP): the experts of a Hugging Face MoE model spread
    over `autoep_size` ranks of each data-parallel group, tokens exchanged all-to-all, nothing
    dropped. The blocks are found by `preset_model`, by `moe_layer_pattern` / `expert_pattern`
    (`router_pattern`, `expert_w1..3`, `num_experts_attr`, `top_k_attr` and the shared-expert keys
    are checked against the model), or from the model's structure. The model's own router runs
    unchanged: the routing keys may only state what it does. `use_grouped_mm` runs the local
    experts as grouped matmuls (transformers' implementation) instead of a loop over experts.
    `disable_triton_grouped_mm`: shardspeed has no Triton kernels, so either value holds.
    `load_balance_coeff`: auxiliary-loss-free balancing, a routing bias that steers the choice of
    experts (never the gate values), moved by this much per step towards an even load.
    `hot_expert_replicas` (shardspeed's; DeepSpeed has none): each block's R most loaded experts
    of the last step are copied to every rank of their expert group for the next one, where the
    tokens routed to them are computed; their gradients are summed back to the expert's own rank
    (weights, optimizer states and checkpoints stay where they are). `rebalance_interval` N
    (shardspeed's): every N optimizer steps the experts move between the ranks of their expert
    group, with their weights and optimizer states, so that each rank's load over those steps
    evens out (ZeRO 0-2, optimizer states in memory). `validate_folding_routing`:
    under AutoTP, check at every forward that tensor-parallel peers routed their (identical)
    tokens alike (a debug check with a host sync)."""

    enabled: bool = False
    autoep_size: PositiveInt = 1
    expert_tensor_parallel_size: PositiveInt = 1
    validate_folding_routing: bool = False
    preset_model: (
        Literal[
            "mixtral",
            "qwen2_moe",
            "qwen3_moe",
            "qwen3_5_moe",
            "deepseek_v2",
            "deepseek_v3",
            "glm4_moe",
            "gpt_oss",
            "olmoe",
        ]
        | None
    ) = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    score_apply: Literal["auto", "pre", "post"] = "auto"
    combine_impl: Literal["auto", "weighted_sum"] = "auto"
    num_expert_groups: PositiveInt | None = None
    num_limited_groups: PositiveInt | None = None
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    top_k: PositiveInt | Literal["auto"] = "auto"
    load_balance_coeff: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    hot_expert_replicas: NonNegativeInt = 0
    rebalance_interval: NonNegativeInt = 0
    routed_scaling_factor: float | Literal["auto"] = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None

    not_supported_until: ClassVar[dict[str, str]] = {
        "expert_tensor_parallel_size": "experts run whole on their rank (no expert tensor "
        "parallelism)",
    }

    @model_validator(mode="after")
    def _groups_pair(self) -> ExpertParallelConfig:
        if self.num_limited_groups is not None and self.num_expert_groups is None:
            raise ValueError("'num_limited_groups' needs 'num_expert_groups'")
        if (
            self.num_expert_groups is not None
            and self.num_limited_groups is not None
            and self.num_limited_groups > self.num_expert_groups
        ):
            raise ValueError(
                f"'num_limited_groups' ({self.num_limited_groups}) must be at most "
                f"'num_expert_groups' ({self.num_expert_groups})"
            )
        return self


class SequenceParallelConfig(StrictModel):
    """`sequence_parallel` (the section LLaMA-Factory writes for ALST; DeepSpeed itself ignores
    it): how a sequence is split over the ranks of the sequence group and how its attention runs.

    `size` is 'sequence_parallel_size' (either may be given; both must agree). `mode`: ulysses
    (heads exchanged all-to-all; head counts must divide), ring (key/value blocks passed around a
    ring; any head count), hybrid (Ulysses inside runs of `ulysses.degree` ranks, a ring across
    them). `loss`: how each sequence rank's loss relates to the whole sequence's: sharded (each
    rank's loss is its slice's part, the parts add up to the whole; gradients are summed over the
    sequence ranks, as DeepSpeed does) or replicated (every rank holds the whole loss, gathered
    with a differentiable all-gather as transformers' Trainer and accelerate compute it; gradients
    are averaged over the sequence ranks). Left out, the engine reads it from the loss handed to
    the first backward (the same value on every sequence rank: replicated); given, that first
    loss must agree or the run stops naming this key. `enabled` false turns the section off."""

    enabled: bool = True
    size: PositiveInt | None = None
    mode: Literal["ulysses", "ring", "hybrid"] = "ulysses"
    ulysses: UlyssesConfig = Field(default_factory=UlyssesConfig)
    loss: Literal["sharded", "replicated"] | None = None
    tiling: SequenceTilingConfig = Field(default_factory=SequenceTilingConfig)
    memory_optimizations: SequenceMemoryConfig = Field(default_factory=SequenceMemoryConfig)

    def ulysses_degree(self, sequence_parallel_size: int) -> int:
        """The Ulysses group size for a sequence group of `sequence_parallel_size` ranks."""
        if not self.enabled or self.mode == "ulysses":
            return sequence_parallel_size
        if self.mode == "ring":
            return 1
        return self.ulysses.degree or 1

    @model_validator(mode="after")
    def _degree_fits_mode(self) -> SequenceParallelConfig:
        set_keys = sorted(self.model_fields_set - {"enabled"})
        if not self.enabled and set_keys:
            raise ValueError(
                f"'enabled' is false, so {set_keys} would change nothing: remove them, or set "
                "'enabled' true"
            )
        if self.tiling.chunk_size is not None and not self.tiling.enabled:
            raise ValueError(
                "'tiling.chunk_size' sizes the tiles of 'tiling.enabled', which is false: remove "
                "it, or enable tiling"
            )
        degree, size = self.ulysses.degree, self.size
        if self.mode == "ring" and degree not in (None, 1):
            raise ValueError(
                f"'mode' ring passes whole heads around a ring, but 'ulysses.degree' is {degree}: "
                "leave the degree out (or 1), or use mode hybrid"
            )
        if self.mode == "ulysses" and degree is not None and size is not None and degree != size:
            raise ValueError(
                f"'mode' ulysses exchanges heads over the whole sequence group of 'size' {size}, "
                f"but 'ulysses.degree' is {degree}: make them equal, or use mode hybrid for "
                "Ulysses inside groups of the degree with a ring across them"
            )
        if self.mode == "hybrid" and (degree is None or degree < 2):
            raise ValueError(
                "'mode' hybrid needs 'ulysses.degree' (at least 2): the ranks that exchange heads; "
                "a ring joins the groups of that many ranks"
            )
        return self


class DataTypesConfig(StrictModel):
    """`data_types`: `grad_accum_dtype` is the dtype gradients accumulate in (default: fp32 for
    fp32 and bf16 models, fp16 for fp16 models). `param_dtype`, if written, must be the dtype that
    `fp16` / `bf16` give the parameters. Buffers (rotary `inv_freq`, norms' running statistics)
    keep the dtype they were built with unless `buffer_dtype` names one, as in DeepSpeed."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    param_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    buffer_dtype: Literal["fp32", "fp16", "bf16"] | None = None


class ShardSpeedConfig(StrictModel):
    """The whole config. Batch keys hold the resolved triple after `load_config`."""

    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None
    managed_gradient_accumulation: bool = True
    steps_per_print: PositiveInt | None = None
    wall_clock_breakdown: bool = False
    gradient_clipping: float = Field(1.0, ge=0.0)
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    communication_data_type: Literal["fp16", "bf16", "fp32"] | None = None
    comms_timeout_s: float | None = Field(
        None,
        gt=0.0,
        le=365 * 24 * 3600.0,  # a year; torch's timedelta arithmetic overflows far above
        allow_inf_nan=False,
        description="seconds a collective may wait before the job ends with an error naming "
        "the rank, collective and call site; applied to every process group at initialize, the "
        "same on every rank or refused. Precedence: init_distributed(timeout=) > this key > the "
        "timeout of a process group other code started > DEEPSPEED_TIMEOUT (minutes) > 600 s "
        "(DeepSpeed's default). A shardspeed key: DeepSpeed has none and ignores it",
    )
    comms_same_call_check: bool = Field(
        True,
        description="on gloo, compare each collective across the ranks before it runs, so that "
        "ranks calling different collectives stop with an error naming both instead of gloo "
        "aborting the process; once the steps repeat it costs nothing per call (see "
        "docs/architecture.md, 'The same-call check'). false skips it. A shardspeed key: "
        "DeepSpeed has none and ignores it",
    )
    dataloader_drop_last: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    optimizer: OptimizerSection | None = None
    scheduler: SchedulerSection | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)

    disable_allgather: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    disable_python_gc: bool = False
    log_level: str | None = None
    sequence_parallel_size: PositiveInt = Field(
        1,
        description="ranks that split one sequence (Ulysses or ring attention), consecutive "
        "ranks as in DeepSpeed; the data-parallel size of the batch arithmetic is the world "
        "size over it, and ZeRO shards over data x sequence ranks",
    )
    data_parallel_size: PositiveInt | None = Field(
        None,
        description="must equal the world size over 'sequence_parallel_size' when given",
    )
    seq_parallel_communication_data_type: Literal["fp16", "bf16", "fp32"] = "fp32"
    use_data_before_expert_parallelism: bool = False
    vocabulary_size: PositiveInt | None = None
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    data_efficiency: Section = None
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    torch_autocast: Section = None
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    tensorboard: FileMonitorConfig = Field(default_factory=FileMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: FileMonitorConfig = Field(default_factory=FileMonitorConfig)
    comet: Section = None
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)
    sequence_parallel: SequenceParallelConfig = Field(default_factory=SequenceParallelConfig)
    weight_quantization: Section = None
    datastates: Section = None

    not_supported_until: ClassVar[dict[str, str]] = {
        "managed_gradient_accumulation": NOT_PLANNED,
        "disable_python_gc": NOT_PLANNED,
        "log_level": NOT_PLANNED,
        "seq_parallel_communication_data_type": "sequence parallelism's all-to-all and ring "
        "transfers run in the activations' own dtype; a separate communication dtype is not "
        "built (leave the key at fp32)",
        "vocabulary_size": NOT_PLANNED,
        "data_efficiency": NOT_PLANNED,
        "torch_autocast": NOT_PLANNED,
        "comet": f"{NOT_PLANNED}: use csv_monitor, tensorboard or wandb",
        "weight_quantization": NOT_PLANNED,
        "datastates": NOT_PLANNED,
    }

    tuning_notes: ClassVar[dict[str, str]] = {
        "zero_force_ds_cpu_optimizer": "an offloaded step runs any torch optimizer on the host "
        "masters, and shardspeed's DeepSpeedCPUAdam is torch's Adam, so either value trains the "
        "same way",
    }

    @model_validator(mode="before")
    @classmethod
    def _sequence_size_from_section(cls, data: Any) -> Any:
        # The section's 'size' and 'sequence_parallel_size' are one setting: either may carry it.
        if not isinstance(data, dict) or not isinstance(data.get("sequence_parallel"), dict):
            return data
        section = data["sequence_parallel"]
        size = section.get("size")
        if section.get("enabled", True) is False or size is None:
            return data
        given = data.get("sequence_parallel_size")
        if given is not None and given != size:
            raise ValueError(
                f"'sequence_parallel.size' is {size} but 'sequence_parallel_size' is {given}: "
                "they are one setting; give one of them, or make them equal"
            )
        return {**data, "sequence_parallel_size": size}

    @model_validator(mode="after")
    def _sequence_section_fits_size(self) -> ShardSpeedConfig:
        section, size = self.sequence_parallel, self.sequence_parallel_size
        degree = section.ulysses.degree
        hybrid = section.enabled and section.mode == "hybrid" and degree is not None
        if hybrid and (size % degree or degree >= size):
            raise ValueError(
                f"'sequence_parallel.ulysses.degree' {degree} must divide the "
                f"sequence-parallel size {size} and be smaller than it (hybrid: Ulysses "
                "inside groups of the degree, a ring across them)"
            )
        if section.enabled and section.mode == "ulysses" and degree not in (None, size):
            raise ValueError(
                f"'sequence_parallel.ulysses.degree' {degree} differs from the sequence-parallel "
                f"size {size} in mode ulysses: make them equal, or use mode hybrid"
            )
        return self

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinity_means_never(cls, value: Any) -> Any:
        # accelerate's DeepSpeedPlugin writes float("inf"): never print.
        if isinstance(value, float) and math.isinf(value) and value > 0:
            return None
        return value

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled:
            return "bf16"
        return "fp32"


# Keys DeepSpeed 0.19.8 removed (issue deepspeedai/DeepSpeed#8489): refused with that reason.
REMOVED_KEYS: dict[str, str] = {
    name: "removed in DeepSpeed 0.19.8 and not offered by shardspeed"
    for name in (
        "amp",
        "elasticity",
        "compression_training",
        "curriculum_learning",
        "sparse_attention",
        "quantize_training",
        "eigenvalue",
        "progressive_layer_drop",
        "graph_harvesting",
        "nebula",
        "sparse_gradients",
        "zero_optimization.mics_shard_size",
        "zero_optimization.mics_hierarchical_params_gather",
        "zero_optimization.zeropp_loco_param",
    )
}
