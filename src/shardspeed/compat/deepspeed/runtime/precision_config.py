"""DeepSpeed's `deepspeed.runtime.precision_config`: the fp16 and bf16 sections of a config dict."""

from __future__ import annotations

from typing import Any

from shardspeed.config.schema import BF16Config, FP16Config

DeepSpeedBF16Config = BF16Config
DeepSpeedFP16Config = FP16Config


def get_bfloat16_config(param_dict: dict[str, Any]) -> BF16Config:
    """The validated `bf16` section (DeepSpeed's older spelling `bfloat16` too)."""
    return BF16Config.model_validate(param_dict.get("bf16", param_dict.get("bfloat16", {})))


def get_float16_config(param_dict: dict[str, Any]) -> FP16Config:
    """The validated `fp16` section."""
    return FP16Config.model_validate(param_dict.get("fp16", {}))
