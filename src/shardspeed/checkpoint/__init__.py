"""The checkpoint room: a pickle-free format (safetensors plus a JSON manifest) that any world size
and ZeRO stage can read, crash-safe saves, and consolidation into one state dict."""

from .consolidate import consolidate, fp32_state_dict, lazy_state_dict, write_safetensors
from .engine_state import load_engine, load_parameters, open_checkpoint, resolve_tag, save_engine
from .format import CheckpointError, verify_files
from .hf import hf_source, load_hf_weights

__all__ = [
    "CheckpointError",
    "consolidate",
    "fp32_state_dict",
    "hf_source",
    "lazy_state_dict",
    "load_engine",
    "load_hf_weights",
    "load_parameters",
    "open_checkpoint",
    "resolve_tag",
    "save_engine",
    "verify_files",
    "write_safetensors",
]
