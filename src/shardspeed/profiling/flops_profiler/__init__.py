"""`shardspeed.profiling.flops_profiler` (DeepSpeed's `deepspeed.profiling.flops_profiler`): per-module
parameters, FLOPs, MACs, latency and MFU of a model, counted by torch's FLOP counter."""

from .profiler import (
    PEAK_FLOPS_ENV,
    FlopsProfiler,
    ModuleProfile,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "PEAK_FLOPS_ENV",
    "FlopsProfiler",
    "ModuleProfile",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
