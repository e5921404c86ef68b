"""Keys real configs carry that change nothing: accepted, each with one warning saying why.

This is the whole list; any other unknown key is an error. Each entry names a config that ships
it, so the list stays tied to what the ecosystem writes rather than growing into "allow unknown".
Comment keys (any key starting with `_`, at any depth outside optimizer and scheduler `params`)
are accepted too and shown once in the start-up log. So are top-level keys named with dots
("zero_optimization.reduce_bucket_size": TRL's prepare_deepspeed adds three such for its frozen
reference model), each with a warning: DeepSpeed reads none of them, and the nested settings they
name keep their values.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("shardspeed")

_BF16_SCALER = (
    "bf16 needs no loss scaling, so the fp16 scaler's keys mean nothing in the bf16 section "
    "(DeepSpeed 0.19.8 refuses them there; earlier releases ignored them)"
)

# Key path -> (why it changes nothing, a public config that carries it).
IGNORED_KEYS: dict[str, tuple[str, str]] = {
    "cuda_visible_devices": (
        "DeepSpeed takes the devices from the launcher and ignores this top-level key",
        "deepspeedai/DeepSpeedExamples training/imagenet/config/ds_fp16_z1_config.json",
    ),
    "comms_config": (
        "LLaMA-Factory writes it; DeepSpeed ignores unknown top-level keys and nothing reads it "
        "(the comms logger is 'comms_logger')",
        "hiyouga/LLaMA-Factory examples/deepspeed/ds_z3_fp8_config.json",
    ),
    "monitor_config": (
        "LLaMA-Factory writes it; DeepSpeed ignores unknown top-level keys and nothing reads it "
        "(monitors are 'tensorboard', 'csv_monitor' and 'wandb')",
        "hiyouga/LLaMA-Factory examples/deepspeed/ds_z3_fp8_config.json",
    ),
    "fp16.fp16": (
        "a nested repeat of 'fp16.enabled' that older DeepSpeed releases read past; "
        "'fp16.enabled' decides",
        "configs written for DeepSpeed 0.14 and earlier",
    ),
    **{
        f"bf16.{key}": (
            _BF16_SCALER,
            "hiyouga/LLaMA-Factory examples/deepspeed/ds_z3_alst_config.json",
        )
        for key in (
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
        )
    },
}

# Ignored only with this value (another would ask for something shardspeed does not do).
IGNORED_ONLY_AS = {
    "bf16.auto_cast": (
        False,
        "false is what bf16 training does anyway (inputs keep their dtype); DeepSpeed 0.19.8 "
        "refuses the key, earlier releases ignored it",
        "hiyouga/LLaMA-Factory examples/deepspeed/ds_z3_alst_config.json",
    ),
}

# Where comment keys are not looked for: these hold an optimizer's or a schedule's own keywords.
_PARAMS = {("optimizer", "params"), ("scheduler", "params")}


def drop_ignored(raw: dict[str, Any], problems: list[str]) -> None:
    """Remove comment keys and the listed keys from `raw` in place, saying so once each; an
    ignored-only-as key with another value is left for validation (and its refusal)."""
    comments = _drop_comments(raw, ())
    if comments:
        logger.info("config comment keys, ignored: %s", ", ".join(comments))
    # TRL's prepare_deepspeed writes bucket sizes as top-level keys named by their path
    # ("zero_optimization.reduce_bucket_size"); DeepSpeed reads none of them.
    for dotted in [key for key in raw if isinstance(key, str) and "." in key]:
        del raw[dotted]
        logger.warning(
            "config key '%s' is accepted and changes nothing: a top-level key named with dots is "
            "not the nested setting (DeepSpeed ignores it too); to set it, write it inside its "
            "section",
            dotted,
        )
    for path, (why, _source) in IGNORED_KEYS.items():
        if _pop(raw, path):
            logger.warning("config key '%s' is accepted and changes nothing: %s", path, why)
    for path, (value, why, _source) in IGNORED_ONLY_AS.items():
        parent, leaf = _parent(raw, path)
        if parent is None or leaf not in parent:
            continue
        if parent[leaf] is value:  # the listed values are booleans: no 0 for False
            del parent[leaf]
            logger.warning(
                "config key '%s' = %r is accepted and changes nothing: %s", path, value, why
            )
        else:
            problems.append(
                f"'{path}' = {parent[leaf]!r} is not offered ({why.split(';')[0]}): set it to "
                f"{value!r} or remove it"
            )
            del parent[leaf]


def _drop_comments(node: Any, loc: tuple) -> list[str]:
    if not isinstance(node, dict) or loc in _PARAMS:
        return []
    found = []
    for key in list(node):
        if isinstance(key, str) and key.startswith("_"):
            del node[key]
            found.append(".".join((*map(str, loc), key)))
        else:
            found += _drop_comments(node[key], (*loc, key))
    return found


def _parent(raw: dict[str, Any], path: str) -> tuple[dict | None, str]:
    *parents, leaf = path.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _pop(raw: dict[str, Any], path: str) -> bool:
    parent, leaf = _parent(raw, path)
    if parent is None or leaf not in parent:
        return False
    del parent[leaf]
    return True
