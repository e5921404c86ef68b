"""DeepSpeed 0.19.8's inference config (`deepspeed.init_inference`) as strict, typed sections.

Every key DeepSpeed's `DeepSpeedInferenceConfig` knows has a field here with DeepSpeed's default,
so a misspelled key is an error naming its path (with a "did you mean"). Keys shardspeed does not
act on are listed in each section's `not_supported_until` with the reason: they may be written
only with their default value, never accepted and silently ignored. The training config's loader
does this work for both (`read_config_source`, `validation_problems`, `refused_keys`), so
`enabled: false` means the same in both: the feature is off, and a key shardspeed does not honour
inside the section is still refused.

`load_inference_config(config, **kwargs)` follows DeepSpeed's order: read the dict or JSON file,
merge the keyword arguments (the same key with different values in both is an error), rewrite the
deprecated keys (`mp_size` -> `tensor_parallel.tp_size` and the MoE ones) with a warning, take the
aliases (`tp`, `kernel_inject`, `max_tokens`, ...), then validate everything at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from ..config.base import PositiveInt, StrictModel
from ..config.errors import ConfigError, key_path
from ..config.loader import read_config_source, refused_keys, validation_problems

logger = logging.getLogger("shardspeed")

NO_KERNELS = "shardspeed injects no DeepSpeed kernels: the model's own modules run"
# What a key shardspeed does not act on is called in this config's messages.
NOT_HONOURED = "is a DeepSpeed inference key that shardspeed does not honour"

# DeepSpeed's DtypeEnum spellings; torch dtypes are matched by identity.
DTYPE_NAMES: dict[str, tuple[object, ...]] = {
    "fp16": (torch.float16, "torch.float16", "fp16", "float16", "half"),
    "fp32": (torch.float32, "torch.float32", "fp32", "float32", "float"),
    "bf16": (torch.bfloat16, "torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    "int8": (torch.int8, "torch.int8", "int8"),
}
TORCH_DTYPES = {
    "fp16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}


def _dtype_name(value: Any) -> Any:
    for name, spellings in DTYPE_NAMES.items():
        if any(value is s if isinstance(s, torch.dtype) else value == s for s in spellings):
            return name
    if isinstance(value, torch.dtype | str):
        allowed = sorted({str(s) for spellings in DTYPE_NAMES.values() for s in spellings})
        raise ValueError(f"not a supported dtype; one of {', '.join(allowed)}")
    return value  # the Literal check reports the wrong type


InferenceDtype = Annotated[Literal["fp16", "fp32", "bf16", "int8"], BeforeValidator(_dtype_name)]


class TensorParallelSection(StrictModel):
    """`tensor_parallel` (alias `tp`): `tp_size` ranks split each layer (consecutive ranks form a
    group; the world size must be a multiple). `tp_group` (a process group) or `mpu` (an object
    with `get_model_parallel_group()`) give the group instead. `enabled` false means no split."""

    enabled: bool = True
    tp_size: PositiveInt = 1
    tp_grain_size: PositiveInt = 64
    mpu: Any = None
    tp_group: Any = None

    not_supported_until: ClassVar[dict[str, str]] = {
        "tp_grain_size": (
            "it sizes DeepSpeed's uneven shards; shardspeed splits only into equal pieces"
        ),
    }

    @model_validator(mode="after")
    def _one_source(self) -> TensorParallelSection:
        if self.mpu is not None and self.tp_group is not None:
            raise ValueError("give 'mpu' or 'tp_group', not both: each names the group")
        return self


class MoESection(StrictModel):
    """`moe`: expert parallelism at inference. Not offered: every value other than the default
    is refused (`moe: false` and `enabled: false` are accepted: they turn it off)."""

    enabled: bool = True
    ep_size: PositiveInt = 1
    moe_experts: list[int] = Field(default_factory=lambda: [1])
    type: Literal["standard", "residual"] = "standard"
    ep_mp_group: Any = None
    ep_group: Any = None

    not_supported_until: ClassVar[dict[str, str]] = {
        name: "expert-parallel inference is not offered; MoE layers run whole on every rank"
        for name in ("ep_size", "moe_experts", "type", "ep_mp_group", "ep_group")
    }


class QuantBits(StrictModel):
    """Shared by `quant.weight` and `quant.activation`."""

    enabled: bool = True
    num_bits: PositiveInt = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: PositiveInt = 1


class WeightQuantSection(QuantBits):
    """`quant.weight`: with `dtype` int8, linear weights are stored in int8 with one symmetric
    scale per output channel and per `q_groups` group of input columns."""

    quantized_initialization: dict[str, Any] = Field(default_factory=dict)
    post_init_quant: dict[str, Any] = Field(default_factory=dict)

    not_supported_until: ClassVar[dict[str, str]] = {
        "num_bits": "only 8-bit weights are offered",
        "q_type": "only symmetric scales (no zero points) are offered",
        "quantized_initialization": "DeepSpeed's FP6/INT4 layer-pattern quantizers are not offered",
        "post_init_quant": "DeepSpeed's FP6/INT4 layer-pattern quantizers are not offered",
    }


class ActivationQuantSection(QuantBits):
    """`quant.activation`: activations stay in the compute dtype (weight-only quantization);
    DeepSpeed applies these settings only inside its injected kernels."""

    not_supported_until: ClassVar[dict[str, str]] = {
        name: "activations are not quantized: shardspeed's int8 is weight-only"
        for name in ("num_bits", "q_type", "q_groups")
    }


class QKVQuantSection(StrictModel):
    """`quant.qkv`: the q, k, v projections are quantized like every other linear."""

    enabled: bool = True

    not_supported_until: ClassVar[dict[str, str]] = {
        "enabled": "the attention projections cannot be left out of int8 on their own",
    }


class QuantSection(StrictModel):
    """`quant`: how `dtype` int8 quantizes (DeepSpeed: "only works for int8 dtype")."""

    enabled: bool = True
    activation: ActivationQuantSection = Field(default_factory=ActivationQuantSection)
    weight: WeightQuantSection = Field(default_factory=WeightQuantSection)
    qkv: QKVQuantSection = Field(default_factory=QKVQuantSection)


class CheckpointSection(StrictModel):
    """`checkpoint_config` (alias `ckpt_config`): a "to do" in DeepSpeed 0.19.8, read by nothing
    there; use `checkpoint` and `base_dir`."""

    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None

    not_supported_until: ClassVar[dict[str, str]] = {
        name: "DeepSpeed reads nothing from this section; use the top-level 'checkpoint' and "
        "'base_dir'"
        for name in ("checkpoint_dir", "save_mp_checkpoint_path", "base_dir")
    }


def _moe_flag(value: Any) -> Any:
    # DeepSpeed's backward compatibility: `moe: true/false` is `moe: {enabled: ...}`.
    return {"enabled": value} if isinstance(value, bool) else value


def _path(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class InferenceConfig(StrictModel):
    """The whole `init_inference` config (defaults are DeepSpeed 0.19.8's)."""

    replace_with_kernel_inject: bool = False
    dtype: InferenceDtype = "fp16"
    tensor_parallel: TensorParallelSection = Field(default_factory=TensorParallelSection)
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    zero: dict[str, Any] = Field(default_factory=dict)
    triangular_masking: bool = True
    moe: Annotated[MoESection, BeforeValidator(_moe_flag)] = Field(default_factory=MoESection)
    keep_module_on_host: bool = False
    quant: QuantSection = Field(default_factory=QuantSection)
    checkpoint: Annotated[str | None, BeforeValidator(_path)] = None
    base_dir: Annotated[str, BeforeValidator(_path)] = ""
    set_empty_params: bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: CheckpointSection = Field(default_factory=CheckpointSection)
    return_tuple: bool = True
    training_mp_size: PositiveInt = 1
    injection_policy: dict[Any, tuple[str, ...]] | None = None
    injection_policy_tuple: Any = None
    config: dict[str, Any] | None = None
    max_out_tokens: PositiveInt = 1024
    min_out_tokens: PositiveInt = 1
    transposed_mode: bool = False

    not_supported_until: ClassVar[dict[str, str]] = {
        "use_triton": NO_KERNELS,
        "triton_autotune": NO_KERNELS,
        "triangular_masking": f"{NO_KERNELS}, with their own attention masks",
        "return_tuple": f"{NO_KERNELS}, returning what they return",
        "transposed_mode": f"{NO_KERNELS}, with their own weight layout",
        "config": f"{NO_KERNELS}; the model's own config describes it",
        "injection_policy_tuple": "DeepSpeed sets it internally; use 'injection_policy'",
        "zero": "ZeRO-Inference (partitioned or offloaded weights) is not offered; use "
        "'tensor_parallel' to split a model that does not fit",
        "set_empty_params": "the model must come with real tensors (they are split, then "
        "overwritten by 'checkpoint')",
        "save_mp_checkpoint_path": "saving the split model is not offered; shardspeed "
        "checkpoints load at any tensor-parallel size already",
        "training_mp_size": "shardspeed checkpoints record how they were split, and Hugging Face "
        "ones are whole, so there is nothing to tell",
    }

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _checkpoint_path(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            raise ValueError(
                "DeepSpeed's checkpoint description (a dict of Megatron / ds_model shard files) is "
                "not supported; give the path of a shardspeed checkpoint (a tag directory or a save "
                "directory with 'latest') or of Hugging Face safetensors (a file, an index or a "
                "directory)"
            )
        return value

    @field_validator("injection_policy", mode="before")
    @classmethod
    def _injection_policy(cls, value: Any) -> Any:
        """{module class (or class or module name): row-parallel linear names} with a single name
        accepted for a tuple, as DeepSpeed does."""
        if value is None or not isinstance(value, Mapping):
            return value
        out = {}
        for module, names in value.items():
            if not (isinstance(module, str) or _is_module_class(module)):
                raise ValueError(
                    f"keys are nn.Module subclasses (or class or module names), got {module!r}"
                )
            names = (names,) if isinstance(names, str) else names
            if (
                not isinstance(names, Sequence)
                or not names
                or not all(isinstance(n, str) for n in names)
            ):
                raise ValueError(
                    f"{_label(module)}: give the names of its row-parallel output linears, such as "
                    f"('attn.c_proj', 'mlp.c_proj'), got {names!r}"
                )
            out[module] = tuple(names)
        return out

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype `dtype` names (torch.int8 for weight-only int8)."""
        return TORCH_DTYPES[self.dtype]


def _is_module_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, torch.nn.Module)


def _label(module: Any) -> str:
    return module.__name__ if isinstance(module, type) else str(module)


# -- reading --------------------------------------------------------------------------------------

ALIASES: dict[tuple[str, ...], dict[str, str]] = {
    (): {
        "kernel_inject": "replace_with_kernel_inject",
        "tp": "tensor_parallel",
        "tm": "triangular_masking",
        "ckpt_config": "checkpoint_config",
        "injection_dict": "injection_policy",
        "args": "config",
        "max_tokens": "max_out_tokens",
        "min_tokens": "min_out_tokens",
    },
    ("moe",): {"num_experts": "moe_experts", "expert_group": "ep_group"},
}
# Deprecated top-level keys and the key DeepSpeed moves each value to (None: no longer read).
DEPRECATED: dict[str, tuple[str, ...] | None] = {
    "mp_size": ("tensor_parallel", "tp_size"),
    "mpu": ("tensor_parallel", "mpu"),
    "ep_size": ("moe", "ep_size"),
    "ep_group": ("moe", "ep_group"),
    "expert_group": ("moe", "ep_group"),
    "ep_mp_group": ("moe", "ep_mp_group"),
    "expert_mp_group": ("moe", "ep_mp_group"),
    "moe_experts": ("moe", "moe_experts"),
    "moe_type": ("moe", "type"),
    "replace_method": None,
}


def load_inference_config(
    config: Mapping[str, Any] | str | os.PathLike | None = None, **kwargs: Any
) -> InferenceConfig:
    """Validate `init_inference`'s `config` (a dict, or a JSON file path) merged with `kwargs`.

    Raises ConfigError (a ValueError) listing every problem, each naming its key path.
    """
    if config is None:
        raw: dict[str, Any] = {}
    elif isinstance(config, Mapping):
        # Shallow: values may be process groups, mpu objects and module classes.
        raw = dict(config)
    else:
        raw = read_config_source(config)
    for key in sorted(set(raw) & set(kwargs)):
        if not _same(key, raw[key], kwargs[key]):
            raise ConfigError(
                f"conflicting argument '{key}': {raw[key]!r} in 'config' and {kwargs[key]!r} in "
                "the keyword arguments"
            )
    raw.update(kwargs)
    problems: list[str] = []
    for key in [k for k, v in raw.items() if isinstance(v, str) and v == "auto"]:
        # DeepSpeed drops top-level "auto" values (left by the Hugging Face integration), but
        # for `replace_method`, whose only value is "auto" and which earns its warning below.
        if key == "replace_method":
            continue
        logger.info("inference config '%s' is \"auto\": using the default", key)
        del raw[key]
    _take_aliases(raw, (), problems)
    _migrate_deprecated(raw, problems)
    if isinstance(raw.get("moe"), dict):
        raw["moe"] = dict(raw["moe"])
        _take_aliases(raw["moe"], ("moe",), problems)
    if problems:
        raise ConfigError(problems)
    try:
        validated = InferenceConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(validation_problems(err, InferenceConfig)) from None
    # Without int8, `quant` is reported as a whole by `_cross_checks`.
    problems = refused_keys(
        validated,
        refusal=NOT_HONOURED,
        skip=frozenset({"quant"} if validated.dtype != "int8" else ()),
    )
    problems += _cross_checks(validated)
    if problems:
        raise ConfigError(problems)
    return validated


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "dtype":  # torch.half and "fp16" are one value spelled two ways
        with contextlib.suppress(ValueError):
            a, b = _dtype_name(a), _dtype_name(b)
    try:
        return bool(a == b)
    except Exception:  # tensors and other objects without a plain truth value
        return a is b


def _take_aliases(raw: dict[str, Any], where: tuple[str, ...], problems: list[str]) -> None:
    for alias, name in ALIASES[where].items():
        if alias not in raw:
            continue
        if name in raw:
            problems.append(
                f"both '{key_path(*where, alias)}' and '{key_path(*where, name)}' are set: they "
                f"are the same key, keep one"
            )
            continue
        raw[name] = raw.pop(alias)


def _migrate_deprecated(raw: dict[str, Any], problems: list[str]) -> None:
    """DeepSpeed's deprecated keys: moved to their new place with a warning, as DeepSpeed does."""
    for old, new in DEPRECATED.items():
        if old not in raw:
            continue
        value = raw.pop(old)
        if new is None:
            logger.warning(
                "inference config key '%s' is deprecated and no longer needed: remove it", old
            )
            continue
        section, leaf = new
        logger.warning(
            "inference config key '%s' is deprecated: use '%s' (moved there)", old, key_path(*new)
        )
        current = raw.get(section)
        if isinstance(current, bool):  # `moe: true`
            current = {"enabled": current}
        current = dict(current) if isinstance(current, Mapping) else {}
        if leaf in current:
            problems.append(
                f"both the deprecated '{old}' and '{key_path(*new)}' are set: keep only "
                f"'{key_path(*new)}'"
            )
            continue
        current[leaf] = value
        raw[section] = current


def _cross_checks(config: InferenceConfig) -> list[str]:
    problems = []
    if config.min_out_tokens > config.max_out_tokens:
        problems.append(
            f"'min_out_tokens' {config.min_out_tokens} is above 'max_out_tokens' "
            f"{config.max_out_tokens}: no request could ever be served"
        )
    if config.injection_policy and config.replace_with_kernel_inject:
        problems.append(
            "'injection_policy' and 'replace_with_kernel_inject' do not combine (nor do they in "
            "DeepSpeed): choose one"
        )
    tp = config.tensor_parallel
    if not tp.enabled and (tp.tp_size > 1 or tp.mpu is not None or tp.tp_group is not None):
        problems.append(
            "'tensor_parallel.enabled' is false but 'tensor_parallel' also names a split "
            f"(tp_size {tp.tp_size}, mpu or tp_group): set one or the other"
        )
    quant = config.quant
    if config.dtype == "int8":
        if not (quant.enabled and quant.weight.enabled):
            problems.append(
                "'dtype' int8 quantizes the weights, so 'quant.enabled' and "
                "'quant.weight.enabled' must stay true (for no quantization choose dtype fp16, "
                "bf16 or fp32)"
            )
    elif quant.enabled and quant != QuantSection():
        problems.append(
            "'quant' acts only with 'dtype' int8 (as in DeepSpeed); with "
            f"{config.dtype!r} it would be ignored: remove it "
            f"(got {quant.model_dump(exclude_defaults=True)!r})"
        )
    return problems
