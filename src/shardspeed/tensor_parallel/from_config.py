"""The `tensor_parallel` config section applied to a model at `initialize` (DeepSpeed's AutoTP)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config.schema import TensorParallelConfig
from .autotp import BUILTIN_POLICY, FAMILIES, auto_tensor_parallel

_PRESETS = {"llama": "llama", "qwen2": "llama", "gpt2": "gpt2", "bert": "bert"}


def apply_autotp(model: nn.Module, group: Any, section: TensorParallelConfig) -> None:
    """Split `model` over `group`: by `partition_config`'s layer specs, followed (with
    `use_default_specs`) by the built-in rules, those of `preset_model`'s family alone if set."""
    defaults = FAMILIES[_PRESETS[section.preset_model]] if section.preset_model else BUILTIN_POLICY
    partition = section.partition_config
    if partition is None:
        auto_tensor_parallel(model, group, policy=defaults)
        return
    # A list of specs: the first that matches a layer decides, so the user's come first.
    specs = [spec.model_dump() for spec in partition.layer_specs]
    if partition.use_default_specs:
        specs += [{"patterns": defaults[k], "partition_type": k} for k in ("column", "row")]
    auto_tensor_parallel(model, group, policy=specs)
