"""Read a DeepSpeed config from a dict, a JSON file or base64 JSON, and validate it once, strictly.

The order: read (duplicate keys are errors) -> drop comment keys and the listed keys that change
nothing (`ignored.py`, a warning each) -> rewrite deprecated spellings (with a warning naming the
modern key) -> resolve or refuse "auto" -> pydantic validation (unknown keys, types, ranges) ->
refuse keys shardspeed does not honour (`refused_keys`, shared with the inference config) -> refuse
feature combinations (the table in `rules.py`) -> optimizer/scheduler params -> batch arithmetic.
Every problem found is reported together, each naming its key path.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from .base import StrictModel
from .batch import BATCH_KEYS, resolve_batch
from .errors import ConfigError, closest, key_path
from .ignored import drop_ignored
from .optimizer import OPTIMIZER_PARAMS, canonical_optimizer_name
from .rules import combination_problems
from .scheduler import SCHEDULER_PARAMS
from .schema import REMOVED_KEYS, ShardSpeedConfig

logger = logging.getLogger("shardspeed")

ConfigSource = Mapping[str, Any] | str | os.PathLike

# "auto" values the engine can fill in itself: these size knobs fall back to our defaults. Any
# other "auto" inside a section falls back to its default too, as DeepSpeed does, but with a
# warning; at the top level and in optimizer or scheduler params it is refused (DeepSpeed would
# hand the string "auto" on and fail later).
AUTO_TO_DEFAULT = {
    ("zero_optimization", "reduce_bucket_size"),
    ("zero_optimization", "allgather_bucket_size"),
    ("zero_optimization", "stage3_prefetch_bucket_size"),
    ("zero_optimization", "stage3_param_persistence_threshold"),
    ("zero_optimization", "sub_group_size"),
    ("zero_optimization", "stage3_max_live_parameters"),
    ("zero_optimization", "stage3_max_reuse_distance"),
    ("zero_optimization", "stage3_model_persistence_threshold"),
}
_PARAMS_SECTIONS = ("optimizer", "scheduler")
# Keys that only act at some stages. At another stage they change nothing: accepted with a
# warning, as real configs copied between stages carry them (DeepSpeed accepts them silently).
STAGE_ONLY_KEYS = {
    "zero_optimization.reduce_scatter": {1, 2, 3},
    "zero_optimization.allgather_partitions": {1, 2},
    "zero_optimization.allgather_bucket_size": {1, 2},
    "disable_allgather": {1, 2},
    "zero_optimization.stage3_prefetch_bucket_size": {3},
    "zero_optimization.stage3_param_persistence_threshold": {3},
    "zero_optimization.stage3_model_persistence_threshold": {3},
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": {3},
    "zero_optimization.stage3_max_live_parameters": {3},
    "zero_optimization.stage3_max_reuse_distance": {3},
    "zero_optimization.leaf_module": {3},
    "zero_optimization.offload_optimizer": {1, 2, 3},
    "zero_optimization.offload_param": {3},
    "zero_optimization.sub_group_size": {1, 2, 3},
}
STAGE3_UNPREFIXED = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
)


def read_config_source(source: ConfigSource) -> dict[str, Any]:
    """A config as a fresh dict, from a mapping, a JSON file path or a base64-encoded JSON string."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if not isinstance(source, str | os.PathLike):
        raise ConfigError(
            f"config must be a dict, a path to a JSON file or base64 JSON, not {type(source).__name__}"
        )
    path = Path(source)
    if path.is_file():
        text = path.read_text()
        origin = str(path)
    else:
        try:
            text = base64.b64decode(str(source), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise ConfigError(
                f"config file '{source}' does not exist (and it is not base64-encoded JSON)"
            ) from None
        origin = "base64 config"
    try:
        loaded = json.loads(text, object_pairs_hook=_no_duplicates(origin))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{origin} is not valid JSON: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{origin} must hold a JSON object, not {type(loaded).__name__}")
    return loaded


def _no_duplicates(origin: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(
                    f"duplicate key '{key}' in {origin}: JSON keeps only the last, so say it once"
                )
            out[key] = value
        return out

    return hook


def load_config(
    source: ConfigSource, dp_world_size: int | Callable[[ShardSpeedConfig], int]
) -> ShardSpeedConfig:
    """Validate a config for a run with `dp_world_size` data-parallel ranks; raise ConfigError.

    `dp_world_size` may be a function of the validated config, for when the config itself shapes
    the ranks (`tensor_parallel.autotp_size`); it is called once, before the batch arithmetic.
    """
    raw = read_config_source(source)
    problems: list[str] = []
    drop_ignored(raw, problems)
    _rewrite_deprecated(raw, problems)
    _refuse_removed(raw, problems)
    auto_batch = _resolve_auto(raw, problems)
    if problems:
        raise ConfigError(problems)
    try:
        config = ShardSpeedConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(validation_problems(err, ShardSpeedConfig)) from None
    problems += refused_keys(config)
    _warn_inactive_keys(config)
    problems += combination_problems(config)
    problems += _check_params(config)
    if problems:
        raise ConfigError(problems)
    if callable(dp_world_size):
        dp_world_size = dp_world_size(config)
    tbs, micro, gas = resolve_batch(
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        dp_world_size,
        auto_batch,
    )
    return config.model_copy(
        update={
            "train_batch_size": tbs,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
        }
    )


def validation_problems(
    err: ValidationError, model: type[BaseModel], prefix: tuple = ()
) -> list[str]:
    """Turn pydantic's errors into lines that name the key path, the bad value and what is allowed."""
    problems = []
    for item in err.errors():
        loc = prefix + tuple(item["loc"])
        path = key_path(*loc)
        if item["type"] == "extra_forbidden":
            problems.append(_unknown_key(path, loc[-1], _model_at(model, tuple(item["loc"])[:-1])))
        elif item["type"] == "missing":
            problems.append(f"'{path}' is required")
        elif not loc:  # a check across keys: its message names them
            problems.append(item["msg"].removeprefix("Value error, "))
        else:
            message = item["msg"].removeprefix("Value error, ")
            problems.append(f"'{path}': {message} (got {item['input']!r})")
    return problems


def _unknown_key(path: str, key: Any, owner: type[StrictModel] | None) -> str:
    if owner is None:
        return f"unknown key '{path}'"
    if key in owner.key_hints:
        return f"'{path}' is not accepted here: {owner.key_hints[key]}"
    allowed = list(owner.model_fields)
    hint = closest(str(key), allowed)
    suggestion = f" (did you mean '{hint}'?)" if hint else ""
    return f"unknown key '{path}'{suggestion}; allowed keys: {', '.join(allowed)}"


def _model_at(model: type[BaseModel], loc: tuple) -> type[StrictModel] | None:
    """The section model that owns the key at `loc` (None if it is a free-form dict)."""
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        current = _section_type(field.annotation)
        if current is None:
            return None
    return current


def _section_type(annotation: Any) -> type[StrictModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, StrictModel):
        return annotation
    for arg in get_args(annotation):
        found = _section_type(arg)
        if found is not None:
            return found
    return None


def _rewrite_deprecated(raw: dict[str, Any], problems: list[str]) -> None:
    """Accept DeepSpeed's old spellings that real configs still use, each with a one-line warning."""
    _rename(raw, (), "bfloat16", "bf16", problems)
    if isinstance(raw.get("aio"), dict):
        _rename(raw["aio"], ("aio",), "thread_count", "intra_op_parallelism", problems)
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    for short in STAGE3_UNPREFIXED:
        _rename(zero, ("zero_optimization",), short, f"stage3_{short}", problems)
    _rename(
        zero,
        ("zero_optimization",),
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
        problems,
    )
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    if pin is not None:
        _warn_deprecated(
            "zero_optimization.cpu_offload_use_pin_memory", "zero_optimization.offload_*.pin_memory"
        )
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        flag = zero.pop(old)
        _warn_deprecated(f"zero_optimization.{old}", f"zero_optimization.{new}.device")
        if new in zero:
            problems.append(
                f"both 'zero_optimization.{old}' and 'zero_optimization.{new}' are set: keep only "
                f"'{new}'"
            )
        elif flag is True:
            zero[new] = {"device": "cpu", **({"pin_memory": pin} if pin is not None else {})}
        elif flag is not False:
            problems.append(f"'zero_optimization.{old}': must be true or false (got {flag!r})")


def _rename(section: dict, where: tuple, old: str, new: str, problems: list[str]) -> None:
    if old not in section:
        return
    _warn_deprecated(key_path(*where, old), key_path(*where, new))
    if new in section:
        problems.append(
            f"both '{key_path(*where, old)}' and its modern name '{key_path(*where, new)}' are set: "
            f"keep only '{key_path(*where, new)}'"
        )
        return
    section[new] = section.pop(old)


def _warn_deprecated(old: str, new: str) -> None:
    logger.warning("config key '%s' is deprecated: use '%s' (accepted for now)", old, new)


def _refuse_removed(raw: dict[str, Any], problems: list[str]) -> None:
    for dotted, reason in REMOVED_KEYS.items():
        *parents, leaf = dotted.split(".")
        section: Any = raw
        for parent in parents:
            section = section.get(parent) if isinstance(section, dict) else None
        if isinstance(section, dict) and leaf in section:
            problems.append(f"'{dotted}' is {reason}")


def _resolve_auto(raw: dict[str, Any], problems: list[str]) -> frozenset[str]:
    """Drop "auto" where the engine decides; refuse it where only the user can know the value."""
    auto_batch = set()
    for key in BATCH_KEYS:
        if raw.get(key) == "auto":
            del raw[key]
            auto_batch.add(key)
    for loc in _auto_locations(raw, ()):
        in_section = len(loc) > 1 and loc[0] not in _PARAMS_SECTIONS
        if loc in AUTO_TO_DEFAULT or in_section:
            section = raw
            for part in loc[:-1]:
                section = section[part]
            del section[loc[-1]]
            if loc in AUTO_TO_DEFAULT:
                logger.info("config '%s' is \"auto\": using shardspeed's default", key_path(*loc))
            else:
                logger.warning(
                    "config '%s' is \"auto\" and nothing filled it in: it keeps its default, as "
                    "in DeepSpeed; set it to say what you mean",
                    key_path(*loc),
                )
        else:
            problems.append(
                f"'{key_path(*loc)}' is \"auto\", a placeholder that only the Hugging Face Trainer "
                f"fills in; set the value here{_AUTO_HINTS.get(loc[-1], '')}"
            )
    return frozenset(auto_batch)


_AUTO_HINTS = {
    "gradient_clipping": " (a number; 0 disables clipping, DeepSpeed 0.19.8's default is 1.0)",
    "enabled": " (true or false)",
    "lr": " (your learning rate)",
    "total_num_steps": " (the number of optimizer steps of the run)",
    "warmup_num_steps": " (the number of warm-up optimizer steps)",
}


def _auto_locations(node: Any, loc: tuple) -> list[tuple]:
    if node == "auto":
        return [loc]
    if isinstance(node, dict):
        return [
            found for key, value in node.items() for found in _auto_locations(value, (*loc, key))
        ]
    if isinstance(node, list):
        return [
            found for i, value in enumerate(node) for found in _auto_locations(value, (*loc, i))
        ]
    return []


# What a key shardspeed does not honour is called in the training config's messages.
NOT_SUPPORTED = "is not supported by shardspeed"


def _is_off(section: Any) -> bool:
    """Whether a section switches itself off (`enabled` false, or `device` "none"), by default or
    as written."""
    if isinstance(section, StrictModel):
        section = section.model_dump()
    return isinstance(section, dict) and (
        section.get("enabled") is False or section.get("device") == "none"
    )


def refused_keys(
    model: StrictModel,
    loc: tuple = (),
    refusal: str = NOT_SUPPORTED,
    skip: frozenset[str] = frozenset(),
) -> list[str]:
    """Every key under `model` that shardspeed does not honour and that is set away from its
    default, one message each saying `refusal` (`skip`: fields of `model` left to other checks).

    The same for the training and the inference config, and so is what "off" means: a section
    written with `enabled: false` turns its feature off, but a key shardspeed does not honour
    inside it is still refused (a written value is a request, and strict loading never drops
    one silently). Only a section that shardspeed does not offer at all is accepted while it is
    off, since off is what shardspeed does.
    """
    problems = []
    for name, field in type(model).model_fields.items():
        if name in skip:
            continue
        value = getattr(model, name)
        reason = type(model).unsupported_reason(name)
        if isinstance(value, StrictModel) and reason is None:
            problems += refused_keys(value, (*loc, name), refusal)
            continue
        default = field.get_default(call_default_factory=True)
        if reason is None or value == default:
            continue
        if _is_off(value):
            logger.info("config section '%s' is disabled; accepted as is", key_path(*loc, name))
            continue
        problems.append(
            f"'{key_path(*loc, name)}' {refusal} ({reason}); remove it or set it to its default "
            f"{default!r} (got {value!r})"
        )
    return problems


def _warn_inactive_keys(config: ShardSpeedConfig) -> None:
    """Keys that act only with other settings (a ZeRO stage, NVMe offload) change nothing
    without them: accepted with a warning, as real configs are copied between setups."""
    stage = config.zero_optimization.stage
    for path, stages in STAGE_ONLY_KEYS.items():
        *parent, name = path.split(".")
        section = config.zero_optimization if parent else config
        value = getattr(section, name)
        default = type(section).model_fields[name].get_default(call_default_factory=True)
        if stage not in stages and value != default:
            shown = (
                value.model_dump(exclude_defaults=True) if hasattr(value, "model_dump") else value
            )
            logger.warning(
                "config '%s' = %r only acts at ZeRO stage %s; at stage %d it changes nothing "
                "(accepted, as DeepSpeed does)",
                path,
                shown,
                " or ".join(map(str, sorted(stages))),
                stage,
            )
    nvme = "nvme" in (
        config.zero_optimization.offload_optimizer.device,
        config.zero_optimization.offload_param.device,
    )
    if not nvme and config.aio != type(config.aio)():
        logger.warning(
            "config 'aio' = %r only acts with an offload 'device' nvme; without one it changes "
            "nothing (accepted, as DeepSpeed does)",
            config.aio.model_dump(exclude_defaults=True),
        )


def _check_params(config: ShardSpeedConfig) -> list[str]:
    problems = []
    if config.optimizer is not None:
        name = canonical_optimizer_name(config.optimizer.type)
        if name is None:
            problems.append(_unknown_type("optimizer", config.optimizer.type, OPTIMIZER_PARAMS))
        else:
            problems += _validate_params(
                OPTIMIZER_PARAMS[name], config.optimizer.params, ("optimizer", "params")
            )
    if config.scheduler is not None:
        name = config.scheduler.type
        if name not in SCHEDULER_PARAMS:
            problems.append(_unknown_type("scheduler", name, SCHEDULER_PARAMS))
        else:
            problems += _validate_params(
                SCHEDULER_PARAMS[name], config.scheduler.params, ("scheduler", "params")
            )
    return problems


def _unknown_type(section: str, name: str, known: Mapping[str, Any]) -> str:
    by_lower = {k.lower(): k for k in known}
    hint = closest(name, known) or by_lower.get(closest(name.lower(), by_lower) or "")
    suggestion = f" (did you mean '{hint}'?)" if hint else ""
    return f"'{section}.type': unknown type {name!r}{suggestion}; allowed: {', '.join(known)}"


def _validate_params(model: type[StrictModel], params: dict, loc: tuple) -> list[str]:
    try:
        validated = model.model_validate(params)
    except ValidationError as err:
        return validation_problems(err, model, loc)
    return refused_keys(validated, loc)


def optimizer_params(config: ShardSpeedConfig) -> tuple[str, StrictModel]:
    """The optimizer's canonical name and validated params (call after `load_config`)."""
    assert config.optimizer is not None
    name = canonical_optimizer_name(config.optimizer.type)
    assert name is not None
    return name, OPTIMIZER_PARAMS[name].model_validate(config.optimizer.params)


def scheduler_params(config: ShardSpeedConfig) -> tuple[str, StrictModel]:
    """The scheduler's name and validated params (call after `load_config`)."""
    assert config.scheduler is not None
    name = config.scheduler.type
    return name, SCHEDULER_PARAMS[name].model_validate(config.scheduler.params)


def tuning_report(config: ShardSpeedConfig) -> list[str]:
    """`key = value: what shardspeed does` for every layout or speed key set away from its
    default whose intent shardspeed meets anyway (a field's `tuning_notes`), the optimizer's
    typed params included."""
    lines = _tuning(config, ())
    if config.optimizer is not None:
        _, params = optimizer_params(config)
        lines += _tuning(params, ("optimizer", "params"))
    return lines


def _tuning(model: BaseModel, loc: tuple) -> list[str]:
    lines = []
    notes = getattr(type(model), "tuning_notes", {})
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, StrictModel):
            lines += _tuning(value, (*loc, name))
        elif name in notes and value != field.get_default(call_default_factory=True):
            lines.append(f"{key_path(*loc, name)} = {value!r}: {notes[name]}")
    return lines


def non_default_settings(config: ShardSpeedConfig) -> list[str]:
    """`key = value` for every setting that differs from its default, for the start-of-run log."""
    return _diff(config, type(config)(), ())


def _diff(model: BaseModel, default: BaseModel, loc: tuple) -> list[str]:
    lines = []
    for name in type(model).model_fields:
        value, base = getattr(model, name), getattr(default, name)
        if isinstance(value, StrictModel) and type(value) is type(base):
            lines += _diff(value, base, (*loc, name))
        elif value != base:
            shown = value.model_dump() if isinstance(value, BaseModel) else value
            lines.append(f"{key_path(*loc, name)} = {shown!r} (default {base!r})")
    return lines
