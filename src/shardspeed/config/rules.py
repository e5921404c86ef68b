"""Which features combine: one table of rules, each a predicate and the message that refuses it.

`load_config` runs the table on the config alone; `initialize` runs it again once the model is
seen, with the facts only the model and the topology can tell (`RunFacts`). A rule that reads a
fact not known yet is skipped, so each refusal is decided in exactly one place: here. Rooms that
can be used directly (the engine's `compile()`, a client's compressed optimizer) call
`refuse_combinations` with what they know; the rest only assert what initialize guarantees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError
from .schema import ShardSpeedConfig


@dataclass(frozen=True)
class RunFacts:
    """What the rules may need beyond the config; None is "not known yet"."""

    pipeline_module: bool | None = None  # the model is a PipelineModule
    pipeline_stages: int | None = None
    tensor_parallel_size: int | None = None
    # Automatic tensor parallelism asked for ('tensor_parallel.autotp_size' or tp_model_init).
    autotp_size: int | None = None
    moe_ep_sizes: tuple[int, ...] | None = None  # ep_size of every MoE layer of the model
    compressed_optimizer: str | None = None  # the class of an optimizer compressing its exchange
    compiling: bool | None = None  # engine.compile() was called
    zero_group_size: int | None = None  # ranks ZeRO shards over (data x sequence parallel)


Check = Callable[[ShardSpeedConfig, RunFacts], bool]
Message = Callable[[ShardSpeedConfig, RunFacts], str]


@dataclass(frozen=True)
class Rule:
    """A combination shardspeed refuses: `applies` says whether the run is one, `message` says
    what is wrong and what to do, naming `key` (a config key path, or the model feature that
    has none). `needs`: the `RunFacts` fields `applies` reads (the rule waits for them)."""

    name: str
    key: str
    applies: Check
    message: Message
    needs: tuple[str, ...] = ()


def _stage(config: ShardSpeedConfig) -> int:
    return config.zero_optimization.stage


def _expert_sizes(config: ShardSpeedConfig, facts: RunFacts) -> list[int]:
    """The expert-parallel sizes above 1: the model's MoE layers' and the config's section's."""
    section = config.expert_parallel
    sizes = {*(facts.moe_ep_sizes or ()), section.autoep_size if section.enabled else 1}
    return sorted(size for size in sizes if size > 1)


def _layer_sizes(facts: RunFacts) -> list[int]:
    return sorted({size for size in facts.moe_ep_sizes or () if size > 1})


def _experts_refused(with_: str, layers_only: bool = False) -> Message:
    def message(config: ShardSpeedConfig, facts: RunFacts) -> str:
        sizes = _layer_sizes(facts) if layers_only else _expert_sizes(config, facts)
        return (
            f"expert parallelism of size {sizes} ("
            + ("MoE layers' ep_size" if layers_only else "MoE layers' ep_size, or "
               "'expert_parallel.autoep_size'")
            + f") does not combine with {with_} yet: use data parallelism with ZeRO stage 0, 1 "
            "or 2, or an expert-parallel size of 1"
        )  # fmt: skip

    return message


def _sequence_parallel(config: ShardSpeedConfig) -> bool:
    return config.sequence_parallel_size > 1


def _sequence_refused(with_: str, instead: str) -> Message:
    return lambda config, facts: (
        f"'sequence_parallel_size' {config.sequence_parallel_size} does not combine with "
        f"{with_} yet: {instead}"
    )


def _zero_plus_plus_below_stage_3(key: str, default: object) -> Rule:
    """DeepSpeed applies ZeRO++'s `key` only at stage 3 (its parameter gathers): below, refuse it
    rather than accept a setting that changes nothing."""
    return Rule(
        f"{key} only at stage 3",
        f"zero_optimization.{key}",
        lambda config, facts: (
            _stage(config) < 3 and getattr(config.zero_optimization, key) != default
        ),
        lambda config, facts: (
            f"'zero_optimization.{key}' is a ZeRO++ setting of ZeRO stage 3 (it compresses or "
            f"localizes stage 3's parameter and gradient exchange), and the config asks for stage "
            f"{_stage(config)}: set 'zero_optimization.stage' 3 or remove the key"
        ),
    )


# Compressing optimizers whose arithmetic also runs at ZeRO stages 1-3: on whole tensors, each on
# its owner, with ZeRO averaging the gradients (no 1-bit exchange there).
_STEPS_ON_OWNERS = frozenset({"OneBitLamb"})


RULES: tuple[Rule, ...] = (
    _zero_plus_plus_below_stage_3("zero_quantized_weights", False),
    _zero_plus_plus_below_stage_3("zero_quantized_nontrainable_weights", False),
    _zero_plus_plus_below_stage_3("zero_quantized_gradients", False),
    _zero_plus_plus_below_stage_3("zero_hpz_partition_size", 1),
    Rule(
        "qgZ replaces the gradient reduce-scatter",
        "zero_optimization.zero_quantized_gradients",
        lambda config, facts: (
            config.zero_optimization.zero_quantized_gradients
            and (
                not config.zero_optimization.reduce_scatter
                or config.communication_data_type is not None
            )
        ),
        lambda config, facts: (
            "'zero_optimization.zero_quantized_gradients' sends each gradient piece to its owner "
            "as int4 blocks in place of the reduce-scatter, so "
            + (
                "'zero_optimization.reduce_scatter' false (whole buckets all-reduced) "
                if not config.zero_optimization.reduce_scatter
                else f"'communication_data_type' {config.communication_data_type!r} "
            )
            + "would change nothing: remove one of the two keys"
        ),
    ),
    Rule(
        "hpZ nodes divide the ZeRO group",
        "zero_optimization.zero_hpz_partition_size",
        lambda config, facts: (
            facts.zero_group_size % config.zero_optimization.zero_hpz_partition_size != 0
        ),
        lambda config, facts: (
            f"'zero_optimization.zero_hpz_partition_size' is "
            f"{config.zero_optimization.zero_hpz_partition_size}, which does not divide the "
            f"{facts.zero_group_size} data-parallel ranks ZeRO shards over: give the number of "
            "ranks per node (a divisor of the data-parallel size), or 1 to turn hpZ off"
        ),
        needs=("zero_group_size",),
    ),
    Rule(
        "one precision",
        "bf16.enabled",
        lambda config, facts: config.fp16.enabled and config.bf16.enabled,
        lambda config, facts: (
            "'fp16.enabled' and 'bf16.enabled' are both true: choose one precision"
        ),
    ),
    Rule(
        "param dtype is the precision",
        "data_types.param_dtype",
        lambda config, facts: config.data_types.param_dtype not in (None, config.precision),
        lambda config, facts: (
            f"'data_types.param_dtype' is {config.data_types.param_dtype!r} but the config trains "
            f"in {config.precision!r} (set by 'fp16.enabled' / 'bf16.enabled'): make them agree "
            "or remove 'data_types.param_dtype'"
        ),
    ),
    Rule(
        "NVMe parameters are the fp32 masters",
        "zero_optimization.offload_param.device",
        lambda config, facts: (
            config.zero_optimization.offload_param.device == "nvme"
            and (
                config.zero_optimization.offload_optimizer.device != "nvme"
                or config.precision != "fp32"
            )
        ),
        lambda config, facts: (
            "'zero_optimization.offload_param.device' nvme needs an fp32 model and "
            "'zero_optimization.offload_optimizer.device' nvme: the parameters' swap files are "
            "the fp32 masters themselves, stepped piece by piece with the optimizer states, and "
            "a 16-bit model would need a second copy of every shard on NVMe, which shardspeed "
            "does not keep. Train in fp32 with NVMe parameters, or keep fp16/bf16 parameters "
            "in host memory ('offload_param.device': 'cpu')"
        ),
    ),
    Rule(
        "torch.compile without stage 3",
        "compile",
        lambda config, facts: (
            (config.compile.compiles or bool(facts.compiling)) and _stage(config) == 3
        ),
        lambda config, facts: (
            "'compile' (torch.compile, also engine.compile()) does not combine with ZeRO stage 3: "
            "the parameter gathers run in module hooks that torch.compile cannot trace; use "
            "'zero_optimization.stage' 0, 1 or 2 to compile"
        ),
    ),
    Rule(
        "stage 3 without a pipeline",
        "zero_optimization.stage",
        lambda config, facts: bool(facts.pipeline_module) and _stage(config) == 3,
        lambda config, facts: (
            "'zero_optimization.stage' is 3, and ZeRO stage 3 does not combine with pipeline "
            "parallelism (a PipelineModule): use stage 1 or 2, which shard optimizer states (and "
            "gradients) across each stage's replicas"
        ),
        needs=("pipeline_module",),
    ),
    Rule(
        "pipeline section for a PipelineModule",
        "pipeline",
        lambda config, facts: (
            not facts.pipeline_module and config.pipeline != type(config.pipeline)()
        ),
        lambda config, facts: (
            "the 'pipeline' section configures a PipelineModule (shardspeed.pipe), and the model "
            "is not one: remove the section or build a PipelineModule"
        ),
        needs=("pipeline_module",),
    ),
    Rule(
        "automatic tensor parallelism without a pipeline",
        "tensor_parallel.autotp_size",
        lambda config, facts: bool(facts.pipeline_module) and (facts.autotp_size or 0) > 1,
        lambda config, facts: (
            "'tensor_parallel.autotp_size' (or tp_model_init) splits a plain model and does not "
            "combine with a PipelineModule: give the module a PipeModelDataParallelTopology and "
            "tensor-parallel layers instead"
        ),
        needs=("pipeline_module", "autotp_size"),
    ),
    Rule(
        "hybrid engine without a pipeline",
        "hybrid_engine.enabled",
        lambda config, facts: bool(facts.pipeline_module) and config.hybrid_engine.enabled,
        lambda config, facts: (
            "'hybrid_engine.enabled' does not combine with a PipelineModule: generation runs the "
            "whole model on each rank, and a pipeline stage holds only its layers; train the "
            "model without stages or disable the hybrid engine"
        ),
        needs=("pipeline_module",),
    ),
    Rule(
        "MoE layers without tensor parallelism",
        "tensor_parallel.autotp_size",
        lambda config, facts: bool(_layer_sizes(facts)) and facts.tensor_parallel_size > 1,
        _experts_refused(
            "tensor parallelism ('tensor_parallel.autotp_size', or an mpu)", layers_only=True
        ),
        needs=("moe_ep_sizes", "tensor_parallel_size"),
    ),
    Rule(
        "the expert_parallel section with an mpu's tensor parallelism",
        "expert_parallel.enabled",
        # Folding spreads experts over AutoTP's peers, which shardspeed lays out itself.
        lambda config, facts: (
            config.expert_parallel.enabled
            and facts.tensor_parallel_size > 1
            and not (facts.autotp_size or 0) > 1
        ),
        lambda config, facts: (
            "'expert_parallel.enabled': the section combines with tensor parallelism through "
            "'tensor_parallel.autotp_size' (attention split, experts spread over the "
            "tensor-parallel peers too), not with an mpu's tensor-parallel groups: drop the "
            "mpu and set 'tensor_parallel.autotp_size', or disable the section"
        ),
        needs=("tensor_parallel_size", "autotp_size"),
    ),
    Rule(
        "experts without a pipeline",
        "PipelineModule",
        lambda config, facts: bool(_expert_sizes(config, facts)) and facts.pipeline_stages > 1,
        _experts_refused("pipeline parallelism (a PipelineModule of several stages)"),
        needs=("moe_ep_sizes", "pipeline_stages"),
    ),
    Rule(
        "experts without stage 3",
        "zero_optimization.stage",
        # The expert_parallel section's experts are stage-3 units of their own; the MoE layer
        # gathers its experts itself.
        lambda config, facts: bool(_layer_sizes(facts)) and _stage(config) == 3,
        _experts_refused("ZeRO stage 3 ('zero_optimization.stage')", layers_only=True),
        needs=("moe_ep_sizes",),
    ),
    Rule(
        "moving experts at stage 0-2 with states in memory",
        "expert_parallel.rebalance_interval",
        lambda config, facts: (
            config.expert_parallel.enabled
            and config.expert_parallel.rebalance_interval > 0
            and (_stage(config) == 3 or config.zero_optimization.offload_optimizer.device != "none")
        ),
        lambda config, facts: (
            "'expert_parallel.rebalance_interval' moves experts with their optimizer states, "
            "which it does at ZeRO stages 0-2 with the states in memory: not with "
            f"'zero_optimization.stage' {_stage(config)} and 'zero_optimization.offload_optimizer' "
            f"'{config.zero_optimization.offload_optimizer.device}'; remove the key (or use "
            "'hot_expert_replicas', which moves nothing)"
        ),
    ),
    Rule(
        "experts without hpZ",
        "zero_optimization.zero_hpz_partition_size",
        lambda config, facts: (
            bool(_expert_sizes(config, facts))
            and config.zero_optimization.zero_hpz_partition_size > 1
        ),
        _experts_refused(
            "ZeRO++'s hierarchical partitioning ('zero_optimization.zero_hpz_partition_size')"
        ),
        needs=("moe_ep_sizes",),
    ),
    Rule(
        "sequence parallelism without a pipeline",
        "sequence_parallel_size",
        lambda config, facts: _sequence_parallel(config) and bool(facts.pipeline_module),
        _sequence_refused(
            "pipeline parallelism (a PipelineModule)",
            "train a plain model with sequence parallelism, or set 'sequence_parallel_size' 1",
        ),
        needs=("pipeline_module",),
    ),
    Rule(
        "sequence parallelism without tensor parallelism",
        "sequence_parallel_size",
        lambda config, facts: _sequence_parallel(config) and config.tensor_parallel.autotp_size > 1,
        _sequence_refused(
            "tensor parallelism ('tensor_parallel.autotp_size')",
            "choose one of the two (each splits attention over its heads)",
        ),
    ),
    Rule(
        "experts without sequence parallelism",
        "sequence_parallel_size",
        # The expert_parallel section spreads experts over data x sequence ranks.
        lambda config, facts: _sequence_parallel(config) and bool(_layer_sizes(facts)),
        _experts_refused("sequence parallelism ('sequence_parallel_size')", layers_only=True),
        needs=("moe_ep_sizes",),
    ),
    Rule(
        "hybrid engine without sequence parallelism",
        "sequence_parallel_size",
        lambda config, facts: _sequence_parallel(config) and config.hybrid_engine.enabled,
        _sequence_refused(
            "the hybrid engine ('hybrid_engine.enabled'), whose generation runs whole sequences",
            "disable the hybrid engine or set 'sequence_parallel_size' 1",
        ),
    ),
    Rule(
        "compressed optimizers on plain data parallelism",
        "zero_optimization.stage",
        lambda config, facts: (
            (_stage(config) > 0 and facts.compressed_optimizer not in _STEPS_ON_OWNERS)
            or _sequence_parallel(config)
            or facts.pipeline_stages > 1
            or facts.tensor_parallel_size > 1
            or bool(facts.moe_ep_sizes)
            or bool(_expert_sizes(config, facts))
        ),
        lambda config, facts: (
            f"{facts.compressed_optimizer} compresses the data-parallel gradient exchange itself: "
            "it works with plain data parallelism only (as in DeepSpeed), not with pipeline, "
            "tensor, sequence or expert parallelism"
            + (
                ""
                if facts.compressed_optimizer in _STEPS_ON_OWNERS
                else ", and with ZeRO stage 0 only (OneBitLamb also runs at stages 1-3)"
            )
            + ": set 'zero_optimization.stage' 0, or choose another optimizer"
        ),
        needs=("compressed_optimizer", "pipeline_stages", "tensor_parallel_size", "moe_ep_sizes"),
    ),
)


def combination_problems(config: ShardSpeedConfig, facts: RunFacts | None = None) -> list[str]:
    """The message of every rule that refuses `config` with `facts` (rules needing a fact that
    is not known yet are skipped)."""
    facts = facts or RunFacts()
    return [
        rule.message(config, facts)
        for rule in RULES
        if all(getattr(facts, need) is not None for need in rule.needs)
        and rule.applies(config, facts)
    ]


def refuse_combinations(config: ShardSpeedConfig, facts: RunFacts | None = None) -> None:
    """Raise ConfigError listing every combination the table refuses."""
    problems = combination_problems(config, facts)
    if problems:
        raise ConfigError(problems)
